"""DCP over real gloo process groups (world 2, 3, 4), spawned on this machine.

One spawn per world size; each spawn runs several cases (the machine has 2 cores). The store is
a FileStore in pytest's tmp_path, so no port is ever chosen. A rank that fails makes the others
time out of their next collective (init timeout 60 s) instead of hanging the suite.
"""

from __future__ import annotations

import datetime
import os
import sys
import traceback

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import paged_mla_inputs
from hostsync.runtime import no_host_sync
from mlaprefill.api import mla_chunked_prefill_dcp
from mlaprefill.batch import PrefillBatch
from mlaprefill.dcp import (
    DCPChunkPlanner,
    DCPContextSource,
    shard_paged_cache,
)
from mlaprefill.kernels import gather_context_rows
from mlaprefill.reference import mla_prefill_reference
from mlaprefill.staging import StagingRing

pytestmark = pytest.mark.slow  # spawns gloo process groups: ~20 s for the three

# Tiny MLA head dims: latent rows are kv_lora_rank + qk_rope_head_dim = 24 wide.
NUM_HEADS, KV_LORA_RANK, QK_NOPE, QK_ROPE, V_HEAD = 2, 16, 8, 8, 8

# (query_lens, context_lens, page_size, interleave, workspace_tokens, policy) per world size.
# Context lengths cover: zero context, one token, shorter than world * I, page boundaries.
CASES: dict[int, list[tuple]] = {
    2: [
        ([3, 1, 2, 4], [0, 1, 31, 16], 16, 16, 64, "packed"),
        ([2, 5, 1], [17, 48, 100], 16, 1, 64, "equal"),
        ([1, 1], [15, 33], 8, 8, 32, "balanced"),
        ([4, 2, 3], [0, 0, 0], 16, 16, 64, "packed"),
    ],
    3: [
        ([2, 1, 3, 1], [0, 47, 16, 95], 16, 16, 96, "packed"),
        ([1, 3], [1, 65], 16, 1, 48, "equal"),
        ([2, 2], [7, 24], 8, 8, 48, "balanced"),
    ],
    4: [
        ([1, 2, 3], [63, 1, 128], 16, 16, 128, "packed"),
        ([3, 1, 1], [0, 5, 200], 16, 1, 64, "equal"),
        ([2, 1], [31, 32], 8, 8, 64, "equal"),
    ],
}


def _inputs(query_lens, context_lens, page_size, seed, device):
    """(q, kv_c_new, k_pe_new, kv_cache, block_table, weight) on ``device``: built on the CPU so
    that every rank holds the same values."""
    x = paged_mla_inputs(query_lens, context_lens, heads=NUM_HEADS, rank=KV_LORA_RANK,
                         nope=QK_NOPE, rope=QK_ROPE, v=V_HEAD, page_size=page_size, seed=seed)
    return tuple(x[k].to(device) for k in ("q", "kv_c_new", "k_pe_new", "kv_cache",
                                           "block_table", "weight"))


def _run_case(rank, world, case, seed, device, check_delegation):
    from mlaprefill.api import mla_chunked_prefill

    query_lens, context_lens, page_size, interleave, workspace, policy = case
    # GPU: the math backend (fp32, any head dims, no compile); the benchmark times the fast ones.
    backend = "auto" if device == "cpu" else "math"
    q, kv_c_new, k_pe_new, cache, table, weight = _inputs(query_lens, context_lens, page_size,
                                                          seed, device)
    shards = shard_paged_cache(cache, table, np.array(context_lens), world=world,
                               interleave=interleave, seed=seed + 1)
    local_cache, local_table = shards[rank]

    # 1. Context rows: every iteration's DCP rows equal the single-rank gather, bit for bit.
    batch = PrefillBatch(query_lens, context_lens, page_size=page_size)
    plan = DCPChunkPlanner(workspace, page_size, world=world, interleave=interleave,
                           policy=policy).plan(batch, rank=rank)
    device_plan = StagingRing(device).upload(plan)
    source = DCPContextSource(local_cache, local_table, device_plan, dist.group.WORLD)
    workspace_rows = torch.full((max(plan.base.max_iteration_tokens, 1), cache.shape[2]),
                                float("nan"), device=device)
    expect_rows = torch.empty_like(workspace_rows)
    # The source is device work only: with the CPU standing in for the device, the runtime
    # audit must see no host sync (item, d2h, data-dependent shape, synchronize) in it.
    with no_host_sync(is_device=lambda d: d.type in ("cpu", "cuda")) as audit:
        for i in range(plan.base.num_iterations):
            source(i, workspace_rows)
    assert not audit.findings, [str(f) for f in audit.findings]
    for i in range(plan.base.num_iterations):
        got = source(i, workspace_rows)
        n = plan.base.iteration_tokens[i]
        assert got.shape == (n, cache.shape[2])
        want = gather_context_rows(cache, table, device_plan["cu_seq_lens"][i],
                                   device_plan["chunk_starts"][i], expect_rows, n)
        torch.testing.assert_close(got, want, rtol=0, atol=0)

    # 2. Forward: equal to the single-rank forward on the unsharded cache (and the reference).
    single, single_lse = mla_chunked_prefill(
        q, kv_c_new, k_pe_new, cache, table, query_lens, context_lens, weight,
        workspace_tokens=workspace, policy=policy, backend=backend, return_lse=True)
    out, lse = mla_chunked_prefill_dcp(
        q, kv_c_new, k_pe_new, local_cache, local_table, query_lens, context_lens, weight,
        process_group=dist.group.WORLD, dcp_interleave=interleave, workspace_tokens=workspace,
        policy=policy, backend=backend, return_lse=True, validate=True)
    torch.testing.assert_close(out, single, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, single_lse, rtol=1e-5, atol=1e-5)
    # 3. The one-call helper delegates to DCP when the group has more than one rank, and the
    #    whole call (plan, upload, gathers, collectives, attention) makes no host sync.
    if check_delegation:
        with no_host_sync(is_device=lambda d: d.type in ("cpu", "cuda")) as audit:
            out2 = mla_chunked_prefill(
                q, kv_c_new, k_pe_new, local_cache, local_table, query_lens, context_lens,
                weight, workspace_tokens=workspace, policy=policy, backend=backend,
                process_group=dist.group.WORLD, dcp_interleave=interleave)
        assert not audit.findings, [str(f) for f in audit.findings]
        torch.testing.assert_close(out2, out, rtol=0, atol=0)
    if rank != 0:  # every rank checked equality with its own single-rank result above
        return
    ref, ref_lse = mla_prefill_reference(
        q, kv_c_new, k_pe_new, cache, table, query_lens, context_lens, weight,
        qk_nope_head_dim=QK_NOPE, v_head_dim=V_HEAD)
    tol = 1e-4 if device == "cpu" else 2e-3  # GPU backends may use TF32-like math
    torch.testing.assert_close(out.double().cpu(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double().cpu(), ref_lse, rtol=tol, atol=tol)


def _run_shared_case(rank, world, device):
    """Prefix sharing under DCP (``share_prefixes=True``, one global host table on every rank):
    a tree of shared runs, page-unaligned tails; the rows a shared run needs are gathered by
    each rank once, all-gathered once, and the result equals the float64 reference."""
    from mlaprefill.prefill import MLAChunkedPrefill
    from test_prefix import shared_table

    query_lens, context_lens, page, interleave = [3, 1, 4, 2, 2], [40, 37, 50, 20, 9], 8, 8
    table, used = shared_table(context_lens, [(0, 0), (0, 9), (1, 3), (2, 2), (3, 0)], page)
    x = paged_mla_inputs(query_lens, [used * page], heads=NUM_HEADS, rank=KV_LORA_RANK,
                         nope=QK_NOPE, rope=QK_ROPE, v=V_HEAD, page_size=page, seed=7)
    cache, weight = x["kv_cache"].to(device), x["weight"].to(device)
    q, kv_c_new, k_pe_new = (x[k].to(device) for k in ("q", "kv_c_new", "k_pe_new"))
    global_table = torch.from_numpy(table)
    local_cache, local_table = shard_paged_cache(cache, global_table.to(device),
                                                 np.array(context_lens), world=world,
                                                 interleave=interleave, seed=3)[rank]
    batch = PrefillBatch(query_lens, context_lens, page_size=page, block_table=table)
    plan = DCPChunkPlanner(64, page, world=world, interleave=interleave, policy="balanced",
                           share_prefixes=True, min_saved_rows=0).plan(batch, rank=rank)
    assert plan.base.shares_prefixes and plan.base.num_gathered_rows < sum(context_lens)
    device_plan = StagingRing(device).upload(plan)
    mla = MLAChunkedPrefill(weight, qk_nope_head_dim=QK_NOPE, v_head_dim=V_HEAD, backend="math")
    source = DCPContextSource(local_cache, local_table, device_plan, dist.group.WORLD)
    out, lse = mla.forward(q, kv_c_new, k_pe_new, local_cache, local_table, device_plan,
                           return_lse=True, context_source=source)
    ref, ref_lse = mla_prefill_reference(
        q, kv_c_new, k_pe_new, cache, global_table.to(device), query_lens, context_lens,
        weight, qk_nope_head_dim=QK_NOPE, v_head_dim=V_HEAD)
    torch.testing.assert_close(out.double().cpu(), ref.cpu(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse.double().cpu(), ref_lse.cpu(), rtol=1e-4, atol=1e-4)


def _run_errors(rank, world, device):
    q, kv_c_new, k_pe_new, cache, table, weight = _inputs([2, 1], [40, 9], 16, 5, device)
    local_cache, local_table = shard_paged_cache(cache, table, np.array([40, 9]), world=world,
                                                 interleave=16)[rank]
    group = dist.group.WORLD
    # Bad configurations raise on every rank before any collective (else the next one hangs).
    try:
        mla_chunked_prefill_dcp(q, kv_c_new, k_pe_new, local_cache, local_table, [2, 1], [40, 9],
                                weight, process_group=group, dcp_interleave=0)
        raise AssertionError("dcp_interleave=0 did not raise")
    except ValueError as exc:
        assert "dcp_interleave" in str(exc), exc
    try:
        mla_chunked_prefill_dcp(q, kv_c_new, k_pe_new, local_cache, local_table, [2, 1], [40, 9],
                                weight, process_group=group, dcp_interleave=16,
                                workspace_tokens=16)
        raise AssertionError("too small workspace did not raise")
    except ValueError as exc:
        assert "all-gathered rows" in str(exc), exc
    # Inconsistent global lengths across ranks: caught by the debug checksum on every rank.
    context_lens = [40, 9] if rank == 0 else [40, 8]
    try:
        mla_chunked_prefill_dcp(q, kv_c_new, k_pe_new, local_cache, local_table, [2, 1],
                                context_lens, weight, process_group=group, dcp_interleave=16,
                                workspace_tokens=64, validate=True)
        raise AssertionError("inconsistent context_lens did not raise")
    except ValueError as exc:
        assert "disagree on context_lens" in str(exc), exc
        assert "query_lens" not in str(exc).split("(")[0], exc
    # A local error on one rank only (rank 1's block table too narrow): in debug mode every
    # rank raises after the check collective instead of the others hanging in the all-gather.
    bad_table = local_table[:, :0] if rank == 1 else local_table
    try:
        mla_chunked_prefill_dcp(q, kv_c_new, k_pe_new, local_cache, bad_table, [2, 1], [40, 9],
                                weight, process_group=group, dcp_interleave=16,
                                workspace_tokens=64, validate=True)
        raise AssertionError("a too-narrow block table on rank 1 did not raise")
    except ValueError as exc:
        expect = "local block_table covers" if rank == 1 else "another DCP rank failed"
        assert expect in str(exc), exc
    # validate=True reaches the one-call helper's delegation too.
    from mlaprefill.api import mla_chunked_prefill

    try:
        mla_chunked_prefill(q, kv_c_new, k_pe_new, local_cache, local_table, [2, 1],
                            context_lens, weight, process_group=group, dcp_interleave=16,
                            workspace_tokens=64, validate=True)
        raise AssertionError("inconsistent context_lens did not raise with validate=True")
    except ValueError as exc:
        assert "disagree on context_lens" in str(exc), exc
    # policy="auto" resolves per rank from its backend; ranks that resolve differently would
    # all-gather different sizes, so the debug digest compares the resolved policy.
    from mlaprefill.prefill import MLAChunkedPrefill

    saved = MLAChunkedPrefill.preferred_policy
    if rank == 1:
        MLAChunkedPrefill.preferred_policy = "balanced"  # as if rank 1 had picked another backend
    try:
        mla_chunked_prefill_dcp(q, kv_c_new, k_pe_new, local_cache, local_table, [2, 1], [40, 9],
                                weight, process_group=group, dcp_interleave=16,
                                workspace_tokens=64, policy="auto", validate=True)
        raise AssertionError("ranks resolving policy='auto' differently did not raise")
    except ValueError as exc:
        assert "disagree on config" in str(exc), exc
    finally:
        MLAChunkedPrefill.preferred_policy = saved


def _run_fp8(rank, world, device):
    """FP8 caches: the DCP forward equals the single-rank one on the unsharded cache, and its
    all-gathers move the FP8 records (half the bytes of the same plan over a bf16 cache)."""
    from mlaprefill.api import mla_chunked_prefill
    from mlaprefill.kvcache import write_kv_cache

    query_lens, context_lens, page, interleave, workspace = [2, 1, 3], [0, 47, 90], 16, 16, 64
    backend = "auto" if device == "cpu" else "math"
    x = paged_mla_inputs(query_lens, context_lens, heads=NUM_HEADS, rank=512, nope=QK_NOPE,
                         rope=64, v=V_HEAD, page_size=page, seed=7 * world)
    x = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in x.items()}
    bf16 = x["kv_cache"].bfloat16()
    nb = bf16.shape[0]
    rows = x["kv_cache"].reshape(nb * page, -1)
    batch = PrefillBatch(query_lens, context_lens, page_size=page)
    plan = DCPChunkPlanner(workspace, page, world=world, interleave=interleave).plan(
        batch, rank=rank)
    device_plan = StagingRing(device).upload(plan)

    def gathered_bytes(local, dtype, **kw):
        workspace_rows = torch.empty(plan.base.max_iteration_tokens, 576, device=device,
                                     dtype=dtype)
        source = DCPContextSource(local[0], local[1], device_plan, dist.group.WORLD, **kw)
        for i in range(plan.base.num_iterations):
            source(i, workspace_rows)
        return source.all_gather_bytes

    lens = np.array(context_lens)
    bf16_bytes = gathered_bytes(shard_paged_cache(bf16, x["block_table"], lens, world=world,
                                                  interleave=interleave)[rank], torch.bfloat16)
    assert bf16_bytes > 0
    for fmt, scale, ratio in (("fp8", 0.05, 0.5), ("fp8", "tensor", 0.5),
                              ("fp8_ds_mla", None, 656 / 1152)):
        if scale == "tensor":
            scale = torch.tensor([0.03], device=device)
        kw = {"kv_cache_scale": scale,
              "kv_cache_format": "fp8_ds_mla" if fmt == "fp8_ds_mla" else None}
        cache = torch.zeros(nb, page, 656 if fmt == "fp8_ds_mla" else 576, device=device,
                            dtype=torch.uint8 if fmt == "fp8_ds_mla" else torch.float8_e4m3fn)
        write_kv_cache(cache, torch.arange(nb * page, device=device), rows, **kw)
        local = shard_paged_cache(cache, x["block_table"], lens, world=world,
                                  interleave=interleave, seed=3)[rank]
        assert gathered_bytes(local, torch.float32, **kw) == ratio * bf16_bytes, fmt
        args = (x["q"], x["kv_c_new"], x["k_pe_new"])
        single, single_lse = mla_chunked_prefill(
            *args, cache, x["block_table"], query_lens, context_lens, x["weight"],
            workspace_tokens=workspace, backend=backend, return_lse=True, **kw)
        out, lse = mla_chunked_prefill_dcp(
            *args, local[0], local[1], query_lens, context_lens, x["weight"],
            process_group=dist.group.WORLD, dcp_interleave=interleave,
            workspace_tokens=workspace, backend=backend, return_lse=True, validate=True, **kw)
        torch.testing.assert_close(out, single, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse, single_lse, rtol=1e-5, atol=1e-5)


def _worker(rank: int, world: int, store_path: str, error_dir: str, device_kind: str) -> None:
    """One rank: gloo on CPU, or NCCL with device ``cuda:rank`` (``device_kind == "cuda"``)."""
    torch.set_num_threads(1)
    if device_kind == "cuda":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        torch.cuda.set_device(rank)
        device, backend = f"cuda:{rank}", "nccl"
    else:
        device, backend = "cpu", "gloo"
    store = dist.FileStore(store_path, world)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        for k, case in enumerate(CASES[world]):
            _run_case(rank, world, case, seed=1000 * world + k, device=device,
                      check_delegation=k == 0)
        _run_errors(rank, world, device)
        _run_fp8(rank, world, device)
        if world <= 3:
            _run_shared_case(rank, world, device)
        dist.barrier()
    except BaseException:
        with open(os.path.join(error_dir, f"rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()
    # Passed: leave without interpreter finalization. Gloo's worker threads can still be torn
    # down then and abort the process ("terminate called without an active exception", a torch
    # teardown issue seen here about once in ten runs), which would read as a failed rank.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.mark.slow  # spawns `world` CPU ranks (gloo) per case: ~10-17 s each
@pytest.mark.parametrize("world", [2, 3, 4])
def test_dcp_matches_single_rank(world: int, tmp_path) -> None:
    spawn_dcp(world, tmp_path, "cpu")


def spawn_dcp(world: int, tmp_path, device_kind: str) -> None:
    """Run :func:`_worker` on ``world`` spawned ranks; re-raise any rank's traceback."""
    try:
        mp.spawn(_worker, args=(world, str(tmp_path / "store"), str(tmp_path), device_kind),
                 nprocs=world, join=True)
    except Exception as exc:
        logs = "\n".join(p.read_text() for p in sorted(tmp_path.glob("rank*.txt")))
        raise AssertionError(f"a DCP rank failed:\n{logs}") from exc
