"""Shared test setup: the ``gpu`` skip, random paged MLA inputs, and the interpreter runner.

Test modules import the builders with ``from conftest import paged_mla_inputs``: ``tests/`` has no
``__init__.py``, so pytest puts it on ``sys.path`` and registers this file as ``conftest``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _paged_cache(context_lens, g, *, page_size, latent_dim, spare_blocks, extra_columns,
                 pad_block, dtype, device):
    # Request r owns ceil(context_lens[r] / page_size) blocks, in a random order over the cache;
    # spare_blocks more are owned by nobody (what a poisoned "unused page" test writes to).
    blocks = [-(-c // page_size) for c in context_lens]
    used = sum(blocks)
    num_blocks = used + spare_blocks
    perm = torch.randperm(num_blocks, generator=g, device=device).to(torch.int32)
    width = max(max(blocks, default=0), 1) + extra_columns
    table = torch.full((len(blocks), width), pad_block, dtype=torch.int32, device=device)
    owned = torch.arange(width)[None, :] < torch.tensor(blocks)[:, None]  # [num_reqs, width]
    table[owned.to(device)] = perm[:used]  # row-major: request 0's blocks first
    cache = torch.randn(num_blocks, page_size, latent_dim, generator=g, device=device)
    return cache.to(dtype), table


def paged_cache(context_lens, *, page_size, latent_dim, spare_blocks=1, extra_columns=0,
                pad_block=0, dtype=torch.float32, device="cpu", seed=0):
    """A random paged cache and the block table that holds ``context_lens`` tokens in it.

    Returns ``(kv_cache [num_blocks, page_size, latent_dim] dtype, block_table int32 [num_reqs,
    max(1, max_blocks) + extra_columns])``, both on ``device``. Blocks are handed out in a random
    permutation; ``num_blocks = sum(ceil(context_lens / page_size)) + spare_blocks``. Table entries
    past a request's blocks (also every entry of a zero-context request) hold ``pad_block``.
    """
    g = torch.Generator(device=device).manual_seed(seed)
    return _paged_cache(context_lens, g, page_size=page_size, latent_dim=latent_dim,
                        spare_blocks=spare_blocks, extra_columns=extra_columns,
                        pad_block=pad_block, dtype=dtype, device=device)


def paged_mla_inputs(query_lens, context_lens, *, heads=3, rank=16, nope=8, rope=4, v=6,
                     page_size=4, dtype=torch.float32, device="cpu", seed=0, spare_blocks=1,
                     extra_columns=1, pad_block=0):
    """Random inputs of one MLA chunked-prefill forward, as a dict.

    Tensors (on ``device``, ``dtype`` unless said): ``q [T, heads, nope + rope]``,
    ``kv_c_new [T, rank]``, ``k_pe_new [T, rope]``, ``kv_cache [num_blocks, page_size,
    rank + rope]``, ``block_table`` int32 (layout as :func:`paged_cache`; by default one column
    past the widest context, for tests that write there), ``weight [heads * (nope + v), rank]``
    scaled by ``rank ** -0.5``; T = sum(query_lens). Also the dims ``heads``, ``rank``, ``nope``,
    ``rope``, ``v``, ``page_size``. Values come from one generator on ``device``, seeded ``seed``.
    """
    g = torch.Generator(device=device).manual_seed(seed)
    kv_cache, block_table = _paged_cache(
        context_lens, g, page_size=page_size, latent_dim=rank + rope, spare_blocks=spare_blocks,
        extra_columns=extra_columns, pad_block=pad_block, dtype=dtype, device=device)
    t = sum(query_lens)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device)

    return dict(
        q=randn(t, heads, nope + rope).to(dtype),
        kv_c_new=randn(t, rank).to(dtype),
        k_pe_new=randn(t, rope).to(dtype),
        kv_cache=kv_cache,
        block_table=block_table,
        weight=(randn(heads * (nope + v), rank) * rank ** -0.5).to(dtype),
        heads=heads, rank=rank, nope=nope, rope=rope, v=v, page_size=page_size,
    )


def split_key_reference(q, k_nope, k_rope, v, cu_q, cu_k, softmax_scale):
    """float64 attention of split keys (``k_nope [Tk, H, nope]``, the rope key ``k_rope [Tk,
    rope]`` shared by every head), non-causal, by the ``math`` backend on the joined key:
    ``(out [Tq, H, v], lse [Tq, H])``, rows without keys 0 / -inf."""
    from mlaprefill.backends import BACKENDS, VarlenSeqs

    heads = k_nope.shape[1]
    k = torch.cat([k_nope.double(), k_rope.double()[:, None].expand(-1, heads, -1)], -1)
    lens_q, lens_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    seqs = VarlenSeqs(cu_q, cu_k, int(lens_q.max()) if lens_q.numel() else 0,
                      int(lens_k.max()) if lens_k.numel() else 0)
    return BACKENDS["math"]().attend(q.double(), k, v.double(), seqs, causal=False,
                                     softmax_scale=softmax_scale)


def run_interpreter_tests(module, *, passed, timeout=1200):
    """Run ``tests/interpreter/<module>`` in a fresh pytest process with ``TRITON_INTERPRET=1``.

    The variable must be set before triton is imported, so the Triton kernels on CPU tensors run
    in a process of their own; without it the module's tests skip. Asserts the run passed with
    exactly ``passed`` tests (none failed or skipped; warnings allowed); on failure the message is
    the inner run's report, which names the failing tests.
    """
    pytest.importorskip("triton")
    tests = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(tests)
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([os.path.join(root, "src"), tests, *sys.path]))
    cmd = [sys.executable, "-m", "pytest", os.path.join(tests, "interpreter", module), "-q",
           "-p", "no:cacheprovider"]
    proc = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True,
                          timeout=timeout)
    report = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, report
    summary = proc.stdout.splitlines()[-1]  # "10 passed in 95.2s"
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", summary)}
    assert counts.get("passed") == passed, report
    assert set(counts) <= {"passed", "warning", "warnings"}, report  # none failed or skipped
