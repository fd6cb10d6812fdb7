"""Fuzzing every public entry point and CLI command: each outcome is a clear error or a correct
result, never a silent wrong result or a traceback.

Each case is classified:

* **clear error** -- ``ValueError``/``TypeError`` (CLI: exit 2, the last stderr line
  ``mlaprefill ...: error: ...``) whose message names the field it is about, one line, no
  printed tensor;
* **correct result** -- the call returned and an independent oracle agrees: lengths add up
  exactly, the plan covers every context token once, the forward matches the float64 reference
  (NaN by the README's rule: wherever the reference's output is NaN, exactly there for a NaN,
  only in the request whose inputs hold the NaN or inf), CLI output equals what the API computes.

Anything else fails the test (an accepted invalid input, a wrong number, another exception, a
traceback). The session prints the count per entry point and class ("fuzz: ..."); with
``MLAPREFILL_FUZZ_REPORT=path`` it also writes them as JSON. Run only this file with
``pytest tests/test_fuzz.py -q`` (``MLAPREFILL_FUZZ_SCALE=20`` for 20x the examples).
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import re
import tempfile
from collections import Counter
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from conftest import paged_mla_inputs
from mlaprefill.api import mla_chunked_prefill
from mlaprefill.batch import INT32_MAX, PrefillBatch
from mlaprefill.cli import main
from mlaprefill.graphs import IterationGraphs
from mlaprefill.kernels import gather_context_rows_torch, merge_attention_states_torch
from mlaprefill.plan import POLICIES, ChunkPlanner
from mlaprefill.prefill import MLAChunkedPrefill
from mlaprefill.reference import mla_prefill_reference
from mlaprefill.staging import DevicePlan, StagingRing

OUTCOMES: Counter = Counter()
#: MLAPREFILL_FUZZ_SCALE=20 runs 20x the examples (a longer hunt; the default keeps CI fast)
SCALE = max(1, int(os.environ.get("MLAPREFILL_FUZZ_SCALE", "1")))
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                      HealthCheck.data_too_large])


def _summary() -> list[str]:
    total = sum(OUTCOMES.values())
    by_class: Counter = Counter()
    for (_, cls), n in OUTCOMES.items():
        by_class[cls] += n
    lines = [f"fuzz: {total} cases: {by_class['clear error']} clear errors, "
             f"{by_class['correct result']} correct results, 0 silent wrong results, "
             f"0 tracebacks (any other outcome fails its test)"]
    lines += [f"fuzz:   {entry:<22} {cls:<15} {n}" for (entry, cls), n in sorted(OUTCOMES.items())]
    path = os.environ.get("MLAPREFILL_FUZZ_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump({"total": total, "classes": dict(by_class),
                       "per_entry": {f"{e}/{c}": n for (e, c), n in OUTCOMES.items()}}, f,
                      indent=1)
    return lines


class _SummaryPlugin:
    """Prints the counts in pytest's terminal summary (after output capturing ends)."""

    def pytest_terminal_summary(self, terminalreporter):
        if OUTCOMES:
            for line in _summary():
                terminalreporter.write_line(line)


@pytest.fixture(scope="module", autouse=True)
def _report(request):
    manager = request.config.pluginmanager
    if not manager.has_plugin("mlaprefill-fuzz-summary"):
        manager.register(_SummaryPlugin(), "mlaprefill-fuzz-summary")
    yield


def clear_error(entry: str, exc: BaseException, *fields: str) -> None:
    """Assert ``exc`` is a clear error about one of ``fields``; count it."""
    assert isinstance(exc, ValueError | TypeError), f"{entry}: {type(exc).__name__}: {exc}"
    msg = str(exc)
    assert msg and "\n" not in msg, f"{entry}: not one line: {msg!r}"
    assert "tensor(" not in msg, f"{entry}: a tensor printed in the message: {msg}"
    assert any(f in msg for f in fields), f"{entry}: names none of {fields}: {msg}"
    OUTCOMES[(entry, "clear error")] += 1


def correct(entry: str) -> None:
    OUTCOMES[(entry, "correct result")] += 1


# -- PrefillBatch ------------------------------------------------------------------------------
INT_ATOMS = st.one_of(st.integers(-3, 40), st.sampled_from(
    [0, 1, INT32_MAX, INT32_MAX + 1, 2**31 - 2, 2**40, 2**62, 2**63 - 1, 2**64, -2**63 - 1,
     -1]))
ATOMS = st.one_of(INT_ATOMS, INT_ATOMS, INT_ATOMS,
                  st.sampled_from([1.0, 2.5, float("nan"), True, False, "3", None, [1]]))


def _container(draw, values):
    kind = draw(st.sampled_from(["list", "list", "tuple", "np64", "np32", "npu64", "torch64",
                                 "torch_f32", "meta", "2d"]))
    ints = all(type(v) is int for v in values)
    try:
        if kind == "tuple":
            return tuple(values)
        if kind == "np64" and ints:
            return np.array(values, dtype=np.int64)
        if kind == "np32" and ints:
            return np.array(values, dtype=np.int32)
        if kind == "npu64" and ints:
            return np.array(values, dtype=np.uint64)
        if kind == "torch64" and ints:
            return torch.tensor(values, dtype=torch.int64)
        if kind == "torch_f32" and ints:
            return torch.tensor(values, dtype=torch.float32)
        if kind == "meta" and ints:
            return torch.tensor(values, dtype=torch.int64).to("meta")
        if kind == "2d":
            return [values]
    except (OverflowError, RuntimeError, ValueError, TypeError):
        pass  # value does not fit that container: keep the list
    return list(values)


@st.composite
def batch_args(draw):
    if draw(st.booleans()):  # half of the cases plausible scheduler input, mostly valid
        n = draw(st.integers(1, 5))
        q = draw(st.lists(st.integers(1, 4096), min_size=n, max_size=n))
        c = draw(st.lists(st.integers(0, 10**6), min_size=n, max_size=n))
        return _container(draw, q), _container(draw, c), draw(st.sampled_from([1, 16, 64]))
    n = draw(st.integers(0, 4))
    q = draw(st.lists(ATOMS, min_size=n, max_size=n))
    c = draw(st.lists(ATOMS, min_size=n + draw(st.sampled_from([0, 0, 0, 1])),
                      max_size=n + 1))
    page = draw(st.one_of(st.integers(-1, 70), st.sampled_from(
        [2**31, 2**40, 4.0, "4", None, True, np.int64(16)])))
    return _container(draw, q), _container(draw, c), page


def _as_ints(x):
    """The Python ints a container holds, or None if it is not a valid 1-D int sequence."""
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu" or x.dtype.is_floating_point:
            return None
        return [int(v) for v in x.tolist()]
    if isinstance(x, np.ndarray):
        return [int(v) for v in x.tolist()] if x.ndim == 1 and x.dtype.kind in "iu" else None
    if not isinstance(x, list | tuple) or not all(type(v) is int for v in x):
        return None
    return list(x)


def _batch_valid(q, c, page) -> bool:
    qs, cs = _as_ints(q), _as_ints(c)
    if qs is None or cs is None or not qs or len(qs) != len(cs):
        return False
    if isinstance(page, bool) or not isinstance(page, int | np.integer):
        return False
    if not 0 < int(page) <= INT32_MAX:
        return False
    if not all(1 <= v <= INT32_MAX for v in qs) or not all(0 <= v <= INT32_MAX for v in cs):
        return False
    return (sum(qs) <= INT32_MAX and sum(cs) <= INT32_MAX
            and all(a + b <= INT32_MAX for a, b in zip(qs, cs, strict=True)))


@settings(max_examples=120 * SCALE, **SETTINGS)
@given(args=batch_args())
@example(args=([1] * 4, [2**62] * 4, 4))        # issue 12: int64 sum wrapped to 0
@example(args=([1], [2**64], 4))
@example(args=([2**31 - 1], [1], 64))
@example(args=([1, 1], [2**31 - 1, 1], 64))
@example(args=([1, 1, 1], [0, 0, True], 1))     # a bool among ints (np.asarray made it 1)
def test_fuzz_prefill_batch(args):
    q, c, page = args
    valid = _batch_valid(q, c, page)
    try:
        b = PrefillBatch(q, c, page_size=page)
    except Exception as exc:
        assert not valid, f"valid input rejected: {exc}"
        clear_error("PrefillBatch", exc, "PrefillBatch")
        return
    assert valid, f"invalid input accepted: {args!r}"
    assert b.num_context_tokens == sum(_as_ints(c))  # exact: no wrap
    assert b.num_query_tokens == sum(_as_ints(q))
    correct("PrefillBatch")


# -- ChunkPlanner ------------------------------------------------------------------------------
def _check_plan(plan, batch, workspace, page):
    ctx = batch.context_lens.tolist()
    covered = [0] * len(ctx)
    for i in range(plan.num_iterations):
        assert plan.iteration_tokens[i] <= workspace
        assert int(plan.chunk_lens[i].sum()) == plan.iteration_tokens[i]
        assert plan.cu_seq_lens[i].tolist() == [0, *np.cumsum(plan.chunk_lens[i]).tolist()]
        for r, n in enumerate(plan.chunk_lens[i].tolist()):
            if n:
                assert plan.chunk_starts[i, r] == covered[r]  # in order, no gap, no overlap
                assert plan.chunk_starts[i, r] % page == 0     # page-aligned splits
                covered[r] += n
    assert covered == ctx


@settings(max_examples=80 * SCALE, **SETTINGS)
@given(ctx=st.lists(st.one_of(st.just(0), st.integers(1, 300)), min_size=1, max_size=6),
       page=st.sampled_from([1, 4, 16]),
       workspace=st.one_of(st.integers(16, 400), st.integers(16, 400), st.integers(-2, 400),
                           st.sampled_from([2**31, "64", 64.0, None])),
       planner_page=st.sampled_from([None, None, None, 0, 8, 2**40]),
       policy=st.sampled_from([*POLICIES, "auto", "fast", None]))
def test_fuzz_planner(ctx, page, workspace, planner_page, policy):
    batch = PrefillBatch([1] * len(ctx), ctx, page_size=page)
    ps = page if planner_page is None else planner_page
    try:
        plan = ChunkPlanner(workspace, ps, policy).plan(batch)
    except Exception as exc:
        clear_error("ChunkPlanner", exc, "ChunkPlanner", "workspace_tokens", "page_size",
                    "policy")
        return
    assert type(workspace) is int and 0 < workspace <= INT32_MAX and ps == page
    assert policy in POLICIES and workspace >= page
    _check_plan(plan, batch, workspace, page)
    correct("ChunkPlanner")


# -- StagingRing -------------------------------------------------------------------------------
@settings(max_examples=25 * SCALE, **SETTINGS)
@given(device=st.sampled_from(["cpu", "cpu", "cpu", "meta", "xyz", "cuda", "cuda:7", None, 5,
                               torch.device("cpu")]),
       mode=st.sampled_from(["ring", "ring", "pin", "pageable", "fast"]),
       valid_uploads=st.sampled_from([0, 3, 3, -1, True, 1024, 1025, 10**9]),
       plan_kind=st.sampled_from(["plan"] * 6 + [None, 3, "plan?"]))
def test_fuzz_staging_ring(device, mode, valid_uploads, plan_kind):
    plan = ChunkPlanner(16, 4).plan(PrefillBatch([1, 2], [9, 30], page_size=4))
    arg = plan if plan_kind == "plan" else plan_kind
    bad_uploads = type(valid_uploads) is not int or not 0 <= valid_uploads <= 1024
    try:
        dplan = StagingRing(device, mode=mode, valid_uploads=valid_uploads).upload(arg)
    except Exception as exc:
        clear_error("StagingRing", exc, "StagingRing", "plan must be")
        return
    assert not bad_uploads and arg is plan, (valid_uploads, plan_kind)
    assert isinstance(dplan, DevicePlan) and not torch.cuda.is_available()
    for name, arr in plan.device_arrays().items():
        assert np.array_equal(dplan.tensors[name].numpy(), arr)
    correct("StagingRing")


# -- the forward and the one-call API ---------------------------------------------------------
# mutation -> (what it does, the field an error must name); "ok" and "nan" expect a result
MUTATIONS = {
    "none": "ok", "validate": "ok", "unused_block_neg": "ok",
    "nan_q": "nan", "nan_cache": "nan", "nan_kv_c_new": "nan", "nan_k_pe_new": "nan",
    "inf_q": "nan", "ninf_cache": "nan", "inf_kv_c_new": "nan", "ninf_k_pe_new": "nan",
    "block_neg": "block_table", "block_big": "block_table", "block_int64": "block_table",
    "block_short": "block_table", "block_list": "block_table",
    "q_short": "q", "q_int": "q", "q_numpy": "q", "q_strided": "q", "k_pe_short": "k_pe_new",
    "kv_c_new_meta": "kv_c_new", "cache_dtype": "kv_cache", "cache_rank": "kv_cache",
    "weight_rows": "kv_b_proj_weight", "scale_nan": "softmax_scale",
    "scale_str": "softmax_scale", "scale_zero": "softmax_scale", "policy": "policy",
    "backend": "backend", "flag": "return_lse", "page_mismatch": "page_size",
    "lens_mismatch": "query_lens", "device_plan_host": "device_plan",
    "context_source": "context_source", "workspace": "workspace_tokens",
}
FORWARD_ONLY = {"device_plan_host", "context_source"}
ONE_CALL_ONLY = {"lens_mismatch", "workspace"}


@st.composite
def forward_cases(draw):
    n = draw(st.integers(1, 4))
    ql = draw(st.lists(st.integers(1, 5), min_size=n, max_size=n))
    cl = draw(st.lists(st.one_of(st.just(0), st.integers(1, 20)), min_size=n, max_size=n))
    page = draw(st.sampled_from([1, 2, 4]))
    dims = draw(st.sampled_from([(2, 8, 4, 2, 3), (1, 6, 3, 4, 5), (3, 16, 8, 4, 6)]))
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
    policy = draw(st.sampled_from(POLICIES))
    with_ctx = max(1, sum(c > 0 for c in cl))
    workspace = draw(st.sampled_from([page * with_ctx, page * with_ctx + page, 64]))
    entry = draw(st.sampled_from(["forward", "one_call"]))
    allowed = sorted(m for m in MUTATIONS
                     if not (entry == "forward" and m in ONE_CALL_ONLY)
                     and not (entry == "one_call" and m in FORWARD_ONLY))
    mutation = draw(st.sampled_from(allowed))
    victim = draw(st.integers(0, n - 1))
    return dict(ql=ql, cl=cl, page=page, dims=dims, dtype=dtype, policy=policy,
                workspace=workspace, entry=entry, mutation=mutation, victim=victim,
                seed=draw(st.integers(0, 3)), pass_dims=draw(st.booleans()))


def _inputs(case):
    heads, rank, nope, rope, v = case["dims"]
    return paged_mla_inputs(case["ql"], case["cl"], heads=heads, rank=rank, nope=nope, rope=rope,
                            v=v, page_size=case["page"], dtype=case["dtype"], seed=case["seed"])


def _mutate(case, x):
    """Apply the mutation in place; returns extra kwargs for the call."""
    m, r, ql, cl, page = case["mutation"], case["victim"], case["ql"], case["cl"], case["page"]
    row = sum(ql[:r])  # the victim's first new token
    kw = {}
    if m in ("nan_cache", "ninf_cache", "block_neg", "block_big") and cl[r] == 0:
        case["mutation"] = m = {"nan_cache": "nan_q", "ninf_cache": "inf_q"}.get(m, "none")
    if m == "unused_block_neg":
        x["block_table"][r, -1] = -1  # past every context: never read
    elif m == "nan_q":
        x["q"][row + ql[r] - 1, 0, 0] = float("nan")
    elif m == "nan_cache":
        tok = cl[r] - 1
        x["kv_cache"][x["block_table"][r, tok // page], tok % page, 0] = float("nan")
    elif m == "nan_kv_c_new":
        x["kv_c_new"][row, 0] = float("nan")
    elif m == "nan_k_pe_new":
        x["k_pe_new"][row, -1] = float("nan")
    elif m == "inf_q":  # an inf reaches scores: the reference's softmax is NaN (or its LSE inf)
        x["q"][row, -1, -1] = float("inf")
    elif m == "ninf_cache":  # latent column: the keys and the values of that context token
        tok = cl[r] - 1
        x["kv_cache"][x["block_table"][r, tok // page], tok % page, 1] = float("-inf")
    elif m == "inf_kv_c_new":  # a new token's value the causal mask hides from earlier queries
        x["kv_c_new"][row + ql[r] - 1, -1] = float("inf")
    elif m == "ninf_k_pe_new":
        x["k_pe_new"][row, 0] = float("-inf")
    elif m == "block_neg":
        x["block_table"][r, 0] = -1
    elif m == "block_big":
        x["block_table"][r, (cl[r] - 1) // page] = x["kv_cache"].shape[0]
    elif m == "block_int64":
        x["block_table"] = x["block_table"].long()
    elif m == "block_short":
        if max(cl) == 0:
            case["mutation"] = "none"
        else:
            x["block_table"] = x["block_table"][:, :max(0, -(-max(cl) // page) - 1)]
    elif m == "block_list":
        x["block_table"] = x["block_table"].tolist()
    elif m == "q_short":
        x["q"] = x["q"][:, :, :-1].contiguous()
    elif m == "q_int":
        x["q"] = x["q"].to(torch.int32)
    elif m == "q_numpy":
        x["q"] = x["q"].float().numpy()
    elif m == "q_strided":
        x["q"] = x["q"].transpose(0, 1).contiguous().transpose(0, 1)
        if x["q"].is_contiguous():  # one token or one head: nothing to break
            case["mutation"] = "none"
    elif m == "k_pe_short":
        x["k_pe_new"] = x["k_pe_new"][:-1]
    elif m == "kv_c_new_meta":
        x["kv_c_new"] = x["kv_c_new"].to("meta")
    elif m == "cache_dtype":
        x["kv_cache"] = x["kv_cache"].to(torch.float16)
    elif m == "cache_rank":
        x["kv_cache"] = x["kv_cache"][..., 1:]
    elif m == "weight_rows":
        x["weight"] = x["weight"][:-1]
    elif m in ("scale_nan", "scale_str", "scale_zero"):
        kw["softmax_scale"] = {"scale_nan": float("nan"), "scale_str": "x",
                               "scale_zero": 0.0}[m]
    elif m == "flag":
        kw["return_lse"] = "yes"
    elif m == "validate":
        kw["validate"] = True
    elif m == "context_source":
        kw["context_source"] = "rows"
    return kw


def _run(case, x, kw):
    m = case["mutation"]
    args = [x[k] for k in ("q", "kv_c_new", "k_pe_new", "kv_cache", "block_table")]
    policy = {"policy": "fastest"}.get(m, case["policy"])
    backend = {"backend": "cuDNN"}.get(m, "auto")
    if case["entry"] == "one_call":
        ql = [*case["ql"][:-1], case["ql"][-1] + 1] if m == "lens_mismatch" else case["ql"]
        extra = {"page_size": case["page"] + 1} if m == "page_mismatch" else {}
        workspace = 0 if m == "workspace" else case["workspace"]
        if case["pass_dims"] or m in ("q_short", "k_pe_short", "weight_rows"):
            # Inferred head dims read a q or weight of the wrong width as another split of the
            # weight (documented); passing the dims is how a caller gets them checked.
            extra.update(qk_nope_head_dim=x["nope"], v_head_dim=x["v"])
        res = mla_chunked_prefill(*args, ql, case["cl"], x["weight"], workspace_tokens=workspace,
                                  policy=policy, backend=backend,
                                  **{"return_lse": True, **kw}, **extra)
    else:
        page = case["page"] * 2 if m == "page_mismatch" else case["page"]
        workspace = max(case["workspace"], page * len(case["cl"]))
        plan = ChunkPlanner(workspace, page, policy=case["policy"]).plan(
            PrefillBatch(case["ql"], case["cl"], page_size=page))
        dplan = plan if m == "device_plan_host" else StagingRing("cpu").upload(plan)
        op = MLAChunkedPrefill(x["weight"], qk_nope_head_dim=x["nope"], v_head_dim=x["v"],
                               backend=backend,
                               **({"softmax_scale": kw.pop("softmax_scale")}
                                  if "softmax_scale" in kw else {}))
        if m == "policy":
            op.resolve_policy(policy)
        res = op.forward(*args, dplan, **{"return_lse": True, **kw})
    return res


def _check_against_reference(case, x, out, lse):
    ql, cl = case["ql"], case["cl"]
    ref_out, ref_lse = mla_prefill_reference(
        x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"], x["block_table"], ql, cl,
        x["weight"], qk_nope_head_dim=x["nope"], v_head_dim=x["v"])
    # The README's NaN rule: out is NaN wherever the reference's out is (exactly there for a
    # NaN; an inf can add NaN rows of its request: each part of the keys is attended on its
    # own, and one part's scores all -inf is NaN even where the reference's softmax over all
    # keys is finite); the LSE is NaN wherever the reference's LSE is, only in NaN-out rows.
    out_nan, ref_nan = torch.isnan(out.cpu()), torch.isnan(ref_out)
    assert not (ref_nan & ~out_nan).any(), "the reference's out is NaN, not ours"
    if case["mutation"].startswith(("inf_", "ninf_")):
        nan_rows = out_nan.any(-1)  # the victim-only check below covers the extra rows
    else:
        assert torch.equal(out_nan, ref_nan), "out NaN where the reference's is not"
        nan_rows = ref_nan.any(-1)  # [T, H]
    lse_nan = torch.isnan(lse.cpu())
    assert not (torch.isnan(ref_lse) & ~lse_nan).any(), "the reference's LSE is NaN, not ours"
    assert not (lse_nan & ~nan_rows).any(), "a NaN LSE in a row whose output is not NaN"
    assert not torch.isinf(out).any() and not torch.isinf(lse).any()
    if MUTATIONS[case["mutation"]] == "nan":
        r = case["victim"]
        rows = torch.zeros(sum(ql), dtype=torch.bool)
        rows[sum(ql[:r]):sum(ql[:r + 1])] = True
        assert nan_rows[rows].any() and not nan_rows[~rows].any()  # only the victim
    assert not torch.isneginf(lse).any()  # every query has keys
    tol = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 3e-2}[case["dtype"]]
    ok = ~nan_rows
    err_out = (out.double().cpu() - ref_out)[ok].norm() / ref_out[ok].norm().clamp_min(1e-30)
    assert err_out <= tol, f"output relative error {err_out:.2e}"
    lse_err = (lse.double().cpu() - ref_lse)[ok].abs()
    assert not lse_err.numel() or lse_err.max() <= tol * 10


def _assert_small_reference(x, ql, cl, out, lse):
    """The forward of the small float32 inputs (nope 4, v 4) of the graph fuzz tests against
    the float64 reference: output and LSE within 1e-4."""
    ref_out, ref_lse = mla_prefill_reference(
        x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"], x["block_table"], ql, cl,
        x["weight"], qk_nope_head_dim=4, v_head_dim=4)
    assert (out.double() - ref_out).abs().max() <= 1e-4
    assert (lse.double() - ref_lse).abs().max() <= 1e-4


@settings(max_examples=30 * SCALE, **SETTINGS)
@given(limit=st.one_of(INT_ATOMS, st.sampled_from([1.5, True, None, "4"])),
       graphs=st.sampled_from(["shared", "shared", None, None, True, False, 1, "yes", [True]]),
       ql=st.lists(st.integers(1, 4), min_size=1, max_size=3),
       ctx=st.lists(st.integers(0, 40), min_size=3, max_size=3))
def test_fuzz_iteration_graphs(limit, graphs, ql, ctx):
    """IterationGraphs' cap and MLAChunkedPrefill's graphs: a clear error naming the field, or
    an object whose forward matches the reference (on the CPU the backend takes joined keys, so
    the graphs never run: they must not change the result)."""
    try:
        IterationGraphs(max_graphs_per_layer=limit)
    except Exception as exc:
        clear_error("IterationGraphs", exc, "max_graphs_per_layer")
        assert isinstance(limit, bool) or not isinstance(limit, int) or limit < 1, limit
    else:
        assert not isinstance(limit, bool) and isinstance(limit, int) and limit >= 1, limit
        correct("IterationGraphs")
    arg = IterationGraphs() if graphs == "shared" else graphs
    cl = ctx[:len(ql)]
    x = paged_mla_inputs(ql, cl, heads=2, rank=8, nope=4, rope=4, v=4, page_size=4)
    try:
        op = MLAChunkedPrefill(x["weight"], qk_nope_head_dim=4, v_head_dim=4, graphs=arg)
    except Exception as exc:
        clear_error("MLAChunkedPrefill.graphs", exc, "graphs")
        assert arg is not None and not isinstance(arg, IterationGraphs), arg
        return
    assert arg is None or isinstance(arg, IterationGraphs), arg
    assert op.graphs is arg
    plan = ChunkPlanner(16, 4).plan(PrefillBatch(ql, cl, page_size=4))
    out, lse = op.forward(x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"], x["block_table"],
                          StagingRing("cpu").upload(plan), return_lse=True)
    _assert_small_reference(x, ql, cl, out, lse)
    correct("MLAChunkedPrefill.graphs")


def _out_candidate(kind, io, t):
    """A value for forward's ``out`` (``lse`` for ``kind`` ending in "lse") of ``t`` tokens."""
    like = io.lse if kind.endswith("lse") else io.out
    if kind.startswith("io"):
        return like
    if kind.startswith("new"):
        return torch.full_like(like, 7.0)  # stale values: must be overwritten
    if kind.startswith("short"):
        return like.new_zeros((t + 1, *like.shape[1:]))
    if kind.startswith("dtype"):
        return like.to(torch.float16)
    if kind.startswith("strided"):
        return like.new_zeros((*like.shape[:-1], 2 * like.shape[-1]))[..., ::2]
    if kind.startswith("list"):
        return like.tolist()
    return None


@settings(max_examples=30 * SCALE, **SETTINGS)
@given(tokens=st.sampled_from(["T"] * 12 + [-1, 0, 3, True, 1.5, "4", None, INT32_MAX + 1]),
       dtype=st.sampled_from([None] * 5 + [torch.float32, torch.float64, torch.int32,
                                           "float32"]),
       rope=st.sampled_from([4] * 8 + [None, 0, -1, True, 4.0]),
       device=st.sampled_from([None] * 6 + ["cpu", torch.device("cpu"), "gpu", 3.5]),
       graphs=st.booleans(),
       out_kind=st.sampled_from(["io", "io", "new", "none", "short", "dtype", "strided", "list"]),
       lse_kind=st.sampled_from(["io_lse", "io_lse", "new_lse", "none", "short_lse", "dtype_lse",
                                 "list_lse"]),
       ql=st.lists(st.integers(1, 4), min_size=1, max_size=3),
       ctx=st.lists(st.integers(0, 40), min_size=3, max_size=3))
def test_fuzz_io_buffers(tokens, dtype, rope, device, graphs, out_kind, lse_kind, ql, ctx):
    """MLAChunkedPrefill.io_buffers and forward(out=, lse=): a clear error naming the field
    (and no state changed), or buffers of the asked shapes and dtypes that a forward (run where
    q was written into them) fills with the reference's result, returning the given tensors."""
    cl = ctx[:len(ql)]
    x = paged_mla_inputs(ql, cl, heads=2, rank=8, nope=4, rope=4, v=4, page_size=4)
    op = MLAChunkedPrefill(x["weight"], qk_nope_head_dim=4, v_head_dim=4,
                           graphs=IterationGraphs() if graphs else None)
    tokens = sum(ql) if tokens == "T" else tokens
    valid = (type(tokens) is int and 0 <= tokens <= INT32_MAX
             and dtype in (None, torch.float32, torch.float64)
             and (rope is None or (type(rope) is int and rope >= 0))
             and device in (None, "cpu", torch.device("cpu")))
    arenas = dict(op.graphs._arenas) if graphs else None
    try:
        io = op.io_buffers(tokens, dtype=dtype, qk_rope_head_dim=rope, device=device)
    except Exception as exc:
        clear_error("io_buffers", exc, "num_tokens", "dtype", "qk_rope_head_dim", "device")
        assert not valid, (tokens, dtype, rope, device)
        assert not graphs or op.graphs._arenas == arenas  # no state changed
        return
    assert valid, (tokens, dtype, rope, device)
    assert io.q.device.type == "cpu"
    want_rope = 64 if rope is None else rope
    want = dtype or torch.float32
    assert tuple(io.q.shape) == (tokens, 2, 4 + want_rope) and io.q.dtype == want
    assert tuple(io.out.shape) == (tokens, 2, 4) and io.out.dtype == want
    assert tuple(io.lse.shape) == (tokens, 2)
    assert io.lse.dtype == (torch.float64 if want == torch.float64 else torch.float32)
    correct("io_buffers")
    if io.q.shape != x["q"].shape or io.q.dtype != x["q"].dtype:
        return
    io.q.copy_(x["q"])
    out, lse = _out_candidate(out_kind, io, tokens), _out_candidate(lse_kind, io, tokens)
    good = {"io", "new", "none", "io_lse", "new_lse"}
    plan = ChunkPlanner(16, 4).plan(PrefillBatch(ql, cl, page_size=4))
    try:
        got = op.forward(io.q, x["kv_c_new"], x["k_pe_new"], x["kv_cache"], x["block_table"],
                         StagingRing("cpu").upload(plan), return_lse=True, out=out, lse=lse)
    except Exception as exc:
        clear_error("forward(out=, lse=)", exc, "out", "lse")
        assert not (out_kind in good and lse_kind in good), (out_kind, lse_kind)
        return
    assert out_kind in good and lse_kind in good, (out_kind, lse_kind)
    if out is not None:
        assert got[0] is out
    if lse is not None:
        assert got[1] is lse
    _assert_small_reference(x, ql, cl, *got)
    correct("forward(out=, lse=)")


@settings(max_examples=150 * SCALE, **SETTINGS)
@given(case=forward_cases())
def test_fuzz_forward_and_one_call(case):
    x = _inputs(case)
    kw = _mutate(case, x)
    entry = f"forward ({case['entry']})"
    expect = MUTATIONS[case["mutation"]]
    try:
        out, lse = _run(case, x, kw)
    except Exception as exc:
        assert expect not in ("ok", "nan"), f"{case['mutation']}: rejected: {exc!r}"
        fields = {"q": ("q ", "q\u00a0", "q dtype", "q has", "q must", "q head dim")}.get(
            expect, (expect,))
        clear_error(entry, exc, *fields)
        return
    assert expect in ("ok", "nan"), f"{case['mutation']} accepted: a silent wrong result"
    _check_against_reference(case, x, out, lse)
    correct(entry)


# -- kernels (torch paths) --------------------------------------------------------------------
LSE_ATOMS = st.one_of(st.floats(-30, 30), st.sampled_from([float("-inf"), float("nan"),
                                                           float("inf")]))


@settings(max_examples=40 * SCALE, **SETTINGS)
@given(l1=st.lists(LSE_ATOMS, min_size=6, max_size=6),
       l2=st.lists(LSE_ATOMS, min_size=6, max_size=6),
       nan_out=st.lists(st.booleans(), min_size=12, max_size=12),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_fuzz_merge(l1, l2, nan_out, dtype):
    g = torch.Generator().manual_seed(0)
    o1, o2 = (torch.randn(3, 2, 4, generator=g).to(dtype) for _ in range(2))
    flags = torch.tensor(nan_out).view(2, 3, 2)
    o1[flags[0], 1] = float("nan")
    o2[flags[1], 2] = float("nan")
    a1, a2 = torch.tensor(l1).view(3, 2), torch.tensor(l2).view(3, 2)
    out, lse = o1.clone(), a1.clone().to(torch.float32 if dtype != torch.float64 else dtype)
    merge_attention_states_torch(out, lse, o2, a2.to(lse.dtype))
    # oracle, one (token, head) at a time, from the rules in merge.py
    for t in range(3):
        for h in range(2):
            x1, x2 = float(a1[t, h]), float(a2[t, h])
            e1, e2 = x1 == -math.inf, x2 == -math.inf
            # NaN, or a kernel's +inf ("sum 0 or NaN"), on either side: NaN
            if math.isnan(x1) or math.isnan(x2) or math.inf in (x1, x2):
                assert torch.isnan(out[t, h]).all() and math.isnan(float(lse[t, h]))
                continue
            if e1 and e2:
                assert (out[t, h] == 0).all() and float(lse[t, h]) == -math.inf
                continue
            m = max(x1, x2)
            s = (0 if e1 else math.exp(x1 - m)) + (0 if e2 else math.exp(x2 - m))
            want_lse = m + math.log(s)
            want = torch.zeros(4, dtype=torch.float64)
            if not e1:
                want = want + o1[t, h].double() * math.exp(x1 - want_lse)
            if not e2:
                want = want + o2[t, h].double() * math.exp(x2 - want_lse)
            assert torch.equal(torch.isnan(out[t, h]), torch.isnan(want))
            fin = ~torch.isnan(want)
            assert torch.allclose(out[t, h].double()[fin], want[fin], atol=1e-5, rtol=1e-5)
            assert abs(float(lse[t, h]) - want_lse) <= 1e-5
    correct("merge_attention_states")


# -- the rope copy into every head (kernels.rope) -------------------------------------------------
@settings(max_examples=80 * SCALE, **SETTINGS)
@given(n=st.integers(0, 40), heads=st.integers(1, 5), nope=st.integers(0, 9),
       rope=st.integers(0, 9), extra=st.integers(0, 3),
       defect=st.sampled_from(["none", "none", "start", "rows", "dtype", "rank"]))
def test_fuzz_broadcast_rope(n, heads, nope, rope, extra, defect):
    """Every head's rope slots get the token's rope row and nothing else changes; bad input is a
    ValueError naming the field."""
    from mlaprefill.kernels.rope import broadcast_rope_

    g = torch.Generator().manual_seed(n * 131 + heads * 7 + nope)
    k = torch.randn(n, heads, nope + rope + extra, generator=g, dtype=torch.float64)
    pe = torch.randn(n, rope, generator=g, dtype=torch.float64)
    start = nope
    field = {"start": "start", "rows": "k_pe", "dtype": "dtype", "rank": "k [n, H, D]"}
    if defect == "start":
        start = nope + extra + 1
    elif defect == "rows":
        pe = torch.zeros(n + 1, rope, dtype=torch.float64)
    elif defect == "dtype":
        pe = pe.float()
    elif defect == "rank":
        k = k[0] if n else k.reshape(-1)
    if defect != "none":
        before = k.clone()
        with pytest.raises(ValueError) as info:
            broadcast_rope_(k, pe, start)
        assert torch.equal(k, before)  # no state changed
        clear_error("broadcast_rope_", info.value, field[defect])
        return
    want = k.clone()
    want[:, :, start:start + rope] = pe[:, None, :]
    assert broadcast_rope_(k, pe, start) is k and torch.equal(k, want)
    correct("broadcast_rope_")


# -- attention: the hybrid backend's rectangles (pure host) and the Triton launcher's checks ---
@settings(max_examples=150 * SCALE, **SETTINGS)
@given(q_lens=st.lists(st.sampled_from([0, 1, 255, 256, 300, 512, 1000, 4096]), min_size=1,
                       max_size=9),
       k_lens=st.lists(st.sampled_from([0, 1, 127, 128, 384, 700, 4096, 65536, 100000]),
                       min_size=9, max_size=9),
       causal=st.booleans(), heads=st.sampled_from([1, 16, 128]),
       big_work=st.sampled_from([1, 2**20, 2**28, 2**34]))
def test_fuzz_dense_rectangles(q_lens, k_lens, causal, heads, big_work):
    from mlaprefill.backends.mlaprefill import (
        K_ALIGN,
        K_PER_OCTAVE,
        Q_ALIGN,
        Q_PER_OCTAVE,
        bucket_floor,
        dense_rectangles,
        grid_step,
    )
    from mlaprefill.kernels.attention import MAX_DENSE_BLOCKS

    k_lens = q_lens if causal else k_lens[:len(q_lens)]
    cq = [0, *np.cumsum(q_lens).tolist()]
    ck = [0, *np.cumsum(k_lens).tolist()]
    rects = dense_rectangles(cq, ck, num_heads=heads, causal=causal, big_work=big_work)
    assert len(rects) <= MAX_DENSE_BLOCKS
    assert [r.work for r in rects] == sorted((r.work for r in rects), reverse=True)
    covered = set()
    for r in rects:
        seqs = range(r.seq_lo, r.seq_hi)
        assert 0 <= r.seq_lo < r.seq_hi <= len(q_lens) and not covered & set(seqs)
        covered |= set(seqs)
        assert r.q_rows % Q_ALIGN == 0 and r.k_rows % K_ALIGN == 0 and r.q_rows and r.k_rows
        assert (r.q_start, r.k_start) == (cq[r.seq_lo], ck[r.seq_lo])
        nq = q_lens[r.seq_lo]
        step = grid_step(nq, per_octave=Q_PER_OCTAVE, align=Q_ALIGN)
        # a tail exactly where it is allowed and worth it: one sequence, non-causal, off the
        # query grid, >= big_work / 4
        want_tail = (not causal and r.batch == 1 and nq > r.q_rows
                     and step * r.k_rows * heads >= big_work // 4)
        assert bool(r.tail_rows) == want_tail
        if r.tail_rows:
            assert r.tail_rows == step and r.q_len == nq
            assert nq - r.q_rows < r.tail_rows <= nq and r.tail_rows % Q_ALIGN == 0
            assert r.tail_rows == bucket_floor(step, per_octave=Q_PER_OCTAVE, align=Q_ALIGN)
            assert r.work == nq * r.k_rows * heads
            assert r.kernel_args[2] >= nq and r.kernel_args[2] % Q_ALIGN == 0
        else:
            assert r.work == r.batch * r.q_rows * r.k_rows * heads // (2 if causal else 1)
            assert r.kernel_args[2] == r.q_rows
        assert r.work >= big_work
        for s in seqs:  # inside each sequence; the largest grid values that fit
            assert q_lens[s] >= r.q_rows and k_lens[s] >= r.k_rows
            assert r.q_rows == bucket_floor(q_lens[s], per_octave=Q_PER_OCTAVE, align=Q_ALIGN)
            if causal:
                assert r.k_rows == r.q_rows and k_lens[s] == q_lens[s]
            else:
                assert r.k_rows == bucket_floor(k_lens[s], per_octave=K_PER_OCTAVE,
                                                align=K_ALIGN)
        if r.batch > 1:  # a batch: equal, exactly on-grid lengths, so its rows are contiguous
            assert all((q_lens[s], k_lens[s]) == (r.q_rows, r.k_rows) for s in seqs)
    correct("dense_rectangles")


@settings(max_examples=60 * SCALE, **SETTINGS)
@given(defect=st.sampled_from(["none", "rank", "heads", "dtype", "mixed_dtype", "stride",
                               "cu_dtype", "cu_len", "max_q", "scale", "dims", "dense",
                               "rope_rows", "rope_split", "state_type", "state_lse",
                               "tma_align", "tma_rope", "tma_type"]),
       causal=st.booleans())
def test_fuzz_varlen_attention_inputs(defect, causal):
    """Bad inputs are clear errors naming the field; valid CPU inputs (no interpreter) are a
    clear error naming the device, never a Triton traceback."""
    pytest.importorskip("triton")
    from mlaprefill.kernels.attention import AttentionConfig, varlen_attention

    q, k, v = torch.zeros(6, 2, 24), torch.zeros(9, 2, 24), torch.zeros(9, 2, 16)
    cu_q = torch.tensor([0, 2, 6], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 9], dtype=torch.int32)
    kw = dict(max_seqlen_q=4, causal=causal, softmax_scale=0.2)
    field = {"rank": "[T, H, D]", "heads": "q [Tq, H, Dqk]", "dtype": "dtype",
             "mixed_dtype": "dtype", "stride": "contiguous", "cu_dtype": "cu_seqlens_q",
             "cu_len": "num_seqs", "max_q": "max_seqlen_q", "scale": "softmax_scale",
             "dims": "qk_head_dim", "dense": "dense", "none": "device",
             "rope_rows": "k_rope", "rope_split": "power of two", "state_type": "state",
             "state_lse": "state lse", "tma_align": "tma=False", "tma_rope": "k_rope",
             "tma_type": "AttentionConfig.tma"}[defect]
    if defect == "rank":
        q = q[0]
    elif defect == "heads":
        k, v = torch.zeros(9, 3, 24), torch.zeros(9, 3, 16)
    elif defect == "dtype":
        q, k, v = q.long(), k.long(), v.long()
    elif defect == "mixed_dtype":
        v = v.half()
    elif defect == "stride":
        q = torch.zeros(6, 24, 2).transpose(1, 2)
    elif defect == "cu_dtype":
        cu_q = cu_q.long()
    elif defect == "cu_len":
        cu_k = cu_k[:2]
    elif defect == "max_q":
        kw["max_seqlen_q"] = -1
    elif defect == "scale":
        kw["softmax_scale"] = float("nan")
    elif defect == "dims":
        q, k = q[..., :8], k[..., :8]
    elif defect == "dense":
        kw["dense"] = ((0, 3, 128, 64),)
    elif defect == "rope_rows":  # the rope key apart, one row short
        k, kw["k_rope"] = k[..., :16].contiguous(), torch.zeros(8, 8)
    elif defect == "rope_split":  # the first key part must be a power of two
        k, kw["k_rope"] = k[..., :12].contiguous(), torch.zeros(9, 12)
    elif defect == "state_type":
        kw["state"] = torch.zeros(6, 2, 16)
    elif defect == "state_lse":
        kw["state"] = (torch.zeros(6, 2, 16), torch.zeros(6, 2, dtype=torch.float16))
    elif defect == "tma_align":  # K's token stride 26 x 4 bytes: not a multiple of 16
        k, kw["config"] = torch.zeros(9, 2, 26)[..., :24], AttentionConfig(16, 16, 4, 1, tma=True)
    elif defect == "tma_rope":  # the shared rope rows 9 x 4 bytes apart
        k, kw["k_rope"] = k[..., :16].contiguous(), torch.zeros(9, 9)[:, :8]
        kw["config"] = AttentionConfig(16, 16, 4, 1, tma=True)
    env = os.environ.pop("TRITON_INTERPRET", None)
    try:
        with pytest.raises((ValueError, TypeError)) as info:
            if defect == "tma_type":
                AttentionConfig(tma=1)
            varlen_attention(q, k, v, cu_q, cu_k, **kw)
    finally:
        if env is not None:
            os.environ["TRITON_INTERPRET"] = env
    clear_error("varlen_attention", info.value, field)


@settings(max_examples=40 * SCALE, **SETTINGS)
@given(ctx=st.lists(st.integers(0, 20), min_size=1, max_size=4),
       page=st.sampled_from([1, 4]), bad=st.sampled_from([None, -1, -5, 10_000, "num_blocks"]),
       where=st.sampled_from(["used", "unused"]))
def test_fuzz_gather(ctx, page, bad, where):
    blocks = [max(1, -(-c // page)) for c in ctx]
    num_blocks = sum(blocks) + 1
    table = torch.arange(num_blocks - 1, dtype=torch.int32)
    width = max(blocks) + 1
    table = torch.cat([table, torch.full((width,), num_blocks - 1, dtype=torch.int32)])
    bt = torch.stack([table[sum(blocks[:r]):sum(blocks[:r]) + width] for r in range(len(ctx))])
    bt = bt.contiguous()
    cache = torch.randn(num_blocks, page, 8)
    used = [r for r, c in enumerate(ctx) if c]
    if bad is not None:
        value = num_blocks if bad == "num_blocks" else bad
        if where == "used" and used:
            bt[used[0], 0] = value
        else:
            bt[0, width - 1] = value  # past every context
    plan = ChunkPlanner(max(16, page * len(ctx)), page).plan(
        PrefillBatch([1] * len(ctx), ctx, page_size=page))
    ws = torch.empty(max(plan.max_iteration_tokens, 1), 8)
    try:
        for i in range(plan.num_iterations):
            rows = gather_context_rows_torch(cache, bt,
                                             torch.from_numpy(plan.cu_seq_lens[i].copy()),
                                             torch.from_numpy(plan.chunk_starts[i].copy()), ws,
                                             plan.iteration_tokens[i])
            want = [cache[bt[r, p // page], p % page] for r in range(len(ctx))
                    for p in range(int(plan.chunk_starts[i, r]),
                                   int(plan.chunk_starts[i, r] + plan.chunk_lens[i, r]))]
            assert torch.equal(rows, torch.stack(want))
    except ValueError as exc:
        assert bad is not None and where == "used" and used, exc
        clear_error("gather_context_rows", exc, "block_table")
        return
    assert bad is None or where == "unused" or not used, "bad block id read silently"
    correct("gather_context_rows")


# -- the CLI -----------------------------------------------------------------------------------
def _cli(argv):
    """(exit code, stdout, stderr) of ``mlaprefill ARGV`` in-process; any exception escaping
    ``main`` (a traceback for the user) fails the test."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as exc:  # argparse: usage errors (2), --help/--version (0)
            rc = exc.code if isinstance(exc.code, int) else 1
    return rc, out.getvalue(), err.getvalue()


def _cli_error(entry, rc, err, prog):
    assert rc == 2, f"{entry}: exit {rc}: {err}"
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert re.match(rf"(usage: )?mlaprefill( {prog})?: error: \S", last) or \
        last.startswith("mlaprefill: error:"), last
    OUTCOMES[(entry, "clear error")] += 1


VALID_LIST = st.lists(st.integers(1, 5000), min_size=2, max_size=2).map(
    lambda v: ",".join(map(str, v)))
LIST_TEXT = st.one_of(
    VALID_LIST, VALID_LIST, VALID_LIST,
    st.sampled_from(["-5,1000", "1,-1", "x", "", ",", "1.5", "1e3", "2147483648", "9" * 40,
                     " 3, 4 ", "1,,2", "\u0663", "2000000000", "-0"]))


# Files the CLI strategies write (and the examples read): one directory per session.
_TMP = Path(tempfile.mkdtemp(prefix="mlaprefill-fuzz-"))
(_TMP / "not_utf8.jsonl").write_bytes(b'{"context_lens": [1], "query_lens": [1]}\n\xff\xfe\n')
(_TMP / "FILE").write_text("x")


@st.composite
def plan_argv(draw):
    tmp = _TMP
    argv = ["plan"]
    use_batches = draw(st.integers(0, 4)) == 0
    if use_batches:
        lines = draw(st.lists(st.one_of(
            st.builds(lambda c, q: json.dumps({"context_lens": c, "query_lens": q}).encode(),
                      st.lists(st.integers(0, 3000), min_size=1, max_size=3),
                      st.lists(st.integers(0, 5), min_size=1, max_size=3)),
            st.sampled_from([b"", b"not json", b"\xff\xfe", b"[" * 3000, b"{}", b"[1]",
                             b'{"context_lens": [1], "query_lens": [1], "x": 1}',
                             b'{"context_lens": [1e400], "query_lens": [1]}'])),
            min_size=0, max_size=4))
        path = tmp / f"b{draw(st.integers(0, 10**9))}.jsonl"
        path.write_bytes(b"\n".join(lines) + b"\n")
        argv += ["--batches", str(path)]
    else:
        for flag in ("--context-lens", "--query-lens"):
            if draw(st.integers(0, 6)):
                argv += [flag, draw(LIST_TEXT)]
    for flag, values in (("--workspace-tokens", ["64", "0", "-3", "x", "4096", "100000000000",
                                                 "1024", "256", "16"]),
                         ("--page-size", ["16", "64", "0", "x", "1", "16", "64"]),
                         ("--policy", [*POLICIES, *POLICIES, "auto", "fast"]),
                         ("--max-iterations", ["10", "-1", "100000"])):
        if draw(st.booleans()):
            argv += [flag, draw(st.sampled_from(values))]
    for flag in ("--json", "--token-tables"):
        if draw(st.integers(0, 3)) == 0:
            argv.append(flag)
    return argv


def _api_plans(argv):
    """The plans the API makes for ``argv`` (the oracle of a successful ``plan``)."""
    opts = dict(zip(argv[1::2], argv[2::2], strict=False))
    workspace = int(opts.get("--workspace-tokens", 65536))
    page = int(opts.get("--page-size", 64))
    policy = opts.get("--policy", "packed")
    if policy == "auto":
        policy = "packed"  # the math backend's choice (CPU test machine)
    planner = ChunkPlanner(workspace, page, policy)
    if "--batches" in opts:
        with open(opts["--batches"], "rb") as f:
            objs = [json.loads(line) for line in f if line.strip()]
        return [planner.plan(PrefillBatch(o["query_lens"], o["context_lens"], page_size=page))
                for o in objs]

    def ints(text):
        return [int(t) for t in text.split(",") if t.strip()]
    return [planner.plan(PrefillBatch(ints(opts["--query-lens"]), ints(opts["--context-lens"]),
                                      page_size=page))]


@settings(max_examples=120 * SCALE, **SETTINGS)
@given(argv=plan_argv())
# issue 12's cases: argparse's "expected one argument", 7.5 GiB for a 2e9-token context, a
# UnicodeDecodeError traceback
@example(argv=["plan", "--context-lens", "-5,1000", "--query-lens", "1,1"])
@example(argv=["plan", "--context-lens", "2000000000", "--query-lens", "1",
               "--workspace-tokens", "64"])
@example(argv=["plan", "--batches", str(_TMP / "not_utf8.jsonl")])
@example(argv=["plan", "--context-lens", "100,20", "--query-lens", "3,4", "--policy", "auto"])
def test_fuzz_cli_plan(argv):
    rc, out, err = _cli(argv)
    if rc != 0:
        # "expected one argument" only where the value is really missing (not "-5,1000")
        if "expected one argument" in err:
            flag = re.search(r"argument (--[\w-]+)", err).group(1)
            assert argv[-1] == flag, err
        _cli_error("cli plan", rc, err, "plan")
        return
    assert err == "", err
    plans = _api_plans(argv)  # the API accepts what the CLI accepted
    token_tables = "--token-tables" in argv
    if "--batches" in argv:
        got = [json.loads(line) for line in out.splitlines()]
        assert got == [p.to_json(token_tables=token_tables) for p in plans]
    elif "--json" in argv:
        assert json.loads(out) == plans[0].to_json(token_tables=token_tables)
    else:
        first = out.splitlines()[0]
        assert first.startswith(f"policy={plans[0].policy} ")
        assert f"iterations={plans[0].num_iterations} " in out
    OUTCOMES[("cli plan", "correct result")] += 1


class _WouldRun(Exception):
    """Raised instead of running the benchmark: the fuzz checks validation, not the engine."""


BENCH_VALUES = {
    "--prompt-len": ["48", "0", "-1", "x", "1e8", "100000000", "1000000000000", "64"],
    "--num-requests": ["2", "0", "100000000", "3"],
    "--concurrency": ["2", "0", "100000"],
    "--token-budget": ["16", "0", "100000000000", "4096"],
    "--workspace": ["32", "0", "100000000000", "64"],
    "--page-size": ["8", "0", "100000000000", "16"],
    "--layers": ["1", "0", "1000000"],
    "--vocab": ["64", "0", "100000000000"],
    "--tp": ["1", "3", "0"],
    "--preset": ["tiny", "deepseek-v3", "nope"],
    "--request-rate": ["1e-300", "nan", "-1", "100"],
    "--prompt-len-spread": ["0.5", "nan", "1.5"],
    "--num-blocks": ["100000000000", "64"],
    "--variants": ["ring+packed", "ring+fast", ",,", "pageable+equal+vllm", "all", "x+y+z+w"],
    "--repeats": ["0", "1", "x"],
    "--max-seconds": ["nan", "-1", "0", "inf"],
    "--device": ["cpu", "xyz", "cuda:3", "auto"],
    "--backend": ["math", "nope", "cudnn"],
    "--dtype": ["float32", "int8", "float64"],
    "--seed": ["-1", "0", "7"],
    "--scenario": ["cpu-tiny", "stall", "vllm-default", "nope"],
    "--out": ["OUT", "FILE", "FILE/sub"],
}


@st.composite
def bench_argv(draw):
    argv = ["bench", "--no-progress"]
    if draw(st.booleans()):
        argv.append("--dry-run")
    for flag in draw(st.lists(st.sampled_from(sorted(BENCH_VALUES)), max_size=5, unique=True)):
        value = draw(st.sampled_from(BENCH_VALUES[flag]))
        argv += [flag, str(_TMP / value) if flag == "--out" else value]
    if "--dry-run" not in argv and "--device" not in argv:
        argv += ["--device", "cpu"]
    if "--dry-run" not in argv and "--out" not in argv:
        argv += ["--out", str(_TMP / "OUT")]  # never the default ./bench-out of the cwd
    return argv


@settings(max_examples=60 * SCALE, **SETTINGS)
@given(argv=bench_argv())
# issue 12's cases: minutes of dry run, MemoryError, an unwritable --out found after the run
@example(argv=["bench", "--dry-run", "--prompt-len", "100000000"])
@example(argv=["bench", "--dry-run", "--prompt-len", "1000000000000"])
@example(argv=["bench", "--device", "cpu", "--out", str(_TMP / "FILE" / "sub")])
def test_fuzz_cli_bench(argv):
    with pytest.MonkeyPatch.context() as mp:
        _fuzz_cli_bench(argv, mp)


def _fuzz_cli_bench(argv, monkeypatch):
    import mlaprefill.bench.runner as runner

    def would_run(*a, **k):
        raise _WouldRun
    monkeypatch.setattr(runner, "run_suite", would_run)
    dry = "--dry-run" in argv
    try:
        rc, out, err = _cli(argv)
    except _WouldRun:
        assert not dry
        OUTCOMES[("cli bench", "correct result")] += 1  # validated; the run would start
        return
    if rc != 0:
        _cli_error("cli bench", rc, err, "bench")
        return
    assert dry and "policy" in out and "steps" in out, (argv, out, err)
    OUTCOMES[("cli bench", "correct result")] += 1


@pytest.mark.parametrize("argv", [[], ["--version"], ["nope"], ["plan", "--nope"],
                                  ["bench", "--dry-run", "--nope"], ["--help"]])
def test_fuzz_cli_top_level(argv):
    rc, out, err = _cli(argv)
    assert "Traceback" not in err
    if argv in ([], ["nope"], ["plan", "--nope"], ["bench", "--dry-run", "--nope"]):
        assert rc == 2
        if argv:
            _cli_error("cli top level", rc, err, r"\w+")
        else:
            OUTCOMES[("cli top level", "clear error")] += 1
    else:
        assert rc == 0 and out.startswith(("mlaprefill ", "usage: mlaprefill"))
        OUTCOMES[("cli top level", "correct result")] += 1


@settings(max_examples=80 * SCALE, **SETTINGS)
@given(dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
       qk=st.sampled_from([192, 192, 192, 128, 200]), dv=st.sampled_from([128, 128, 96]),
       joined=st.booleans(), pad=st.sampled_from([0, 0, 0, 1, 2, 8]),
       offset=st.sampled_from([0, 0, 0, 1, 8]), rope_pad=st.sampled_from([0, 0, 2, 8]),
       rope_heads=st.booleans(),
       dense=st.lists(st.tuples(st.sampled_from([128, 256, 64, 384]),
                                st.sampled_from([128, 1024, 64, 192])), max_size=2))
def test_fuzz_hopper_layout_gate(dtype, qk, dv, joined, pad, offset, rope_pad, rope_heads,
                                 dense):
    """The Hopper kernel's layout gate against an independent oracle: it qualifies a layout
    exactly when the dtype is bf16 / fp16, the dims are MLA's (qk 192 as 128 + 64 joined or
    128 with a 64-wide rope, v 128), every key / rope / value base and token / head stride is a
    multiple of 16 bytes (TMA), and every rectangle is on its 128 x 128 tiles; otherwise it
    returns a one-line reason. It never raises."""
    from mlaprefill.kernels import hopper_attention as ha

    t, h = 7, 3
    size = torch.tensor([], dtype=dtype).element_size()
    width = (qk if joined else 128) + dv + pad
    buf = torch.zeros(t, h, width + offset, dtype=dtype)[..., offset:]
    k = buf[..., :qk] if joined else buf[..., :128]
    v = buf[..., -dv - pad:width - pad] if pad else buf[..., width - dv:]
    rope = None
    if not joined:
        rope_w = qk - 128 if qk > 128 else 64
        shape = (t, h, rope_w + rope_pad) if rope_heads else (t, rope_w + rope_pad)
        rope = torch.zeros(*shape, dtype=dtype)[..., :rope_w]
    q = torch.zeros(t, h, qk, dtype=dtype)
    rects = tuple((0, 1, qr, kr) for qr, kr in dense)
    why = ha.layout_reason(q, k, v, rope, rects)

    def aligned(x, strides):
        return x.data_ptr() % 16 == 0 and all(s * size % 16 == 0 for s in strides)

    parts = [(k, k.stride()[:2]), (v, v.stride()[:2])]
    if joined:
        parts.append((k[..., 128:], k.stride()[:2]))
    else:
        parts.append((rope, (rope.stride(0), rope.stride(1) if rope.dim() == 3 else 0)))
    expect = (dtype != torch.float32 and qk == 192 and dv == 128
              and all(aligned(x, s) for x, s in parts)
              and all(qr % 128 == 0 and kr % 128 == 0 for qr, kr in dense))
    assert (why is None) == expect, (why, dtype, qk, dv, joined, pad, offset, rope_pad, dense)
    assert why is None or (isinstance(why, str) and why and "\n" not in why)
    correct("hopper layout_reason")


# -- sizes bounded before anything is allocated (issue #30) --------------------------------------
# The limits are patched small so that both sides of each bound are reached with small inputs;
# the oracle is the unbounded result (limit raised): refused exactly when it exceeds the limit.
@settings(max_examples=60 * SCALE, **SETTINGS)
@given(ctx=st.lists(st.one_of(st.just(0), st.integers(1, 400)), min_size=1, max_size=8),
       page=st.sampled_from([1, 4, 16]), workspace=st.integers(16, 200),
       policy=st.sampled_from(POLICIES), plan_limit=st.integers(0, 120),
       table_limit=st.integers(0, 3000))
def test_fuzz_plan_and_token_table_bounds(ctx, page, workspace, policy, plan_limit, table_limit):
    with pytest.MonkeyPatch.context() as monkeypatch:
        _plan_and_token_table_bounds(monkeypatch, ctx, page, workspace, policy, plan_limit,
                                     table_limit)


def _plan_and_token_table_bounds(monkeypatch, ctx, page, workspace, policy, plan_limit,
                                 table_limit):
    import mlaprefill.plan as plan_mod

    batch = PrefillBatch([1] * len(ctx), ctx, page_size=page)
    planner = ChunkPlanner(workspace, page, policy)
    try:
        full = planner.plan(batch)  # the default limits: far above these sizes
    except ValueError as exc:  # equal: less than one page per request
        clear_error("plan bounds", exc, "workspace_tokens")
        return
    entries = full.num_iterations * (full.num_reqs + 1)
    monkeypatch.setattr(plan_mod, "MAX_PLAN_ENTRIES", plan_limit)
    monkeypatch.setattr(plan_mod, "MAX_TOKEN_TABLE_ENTRIES", table_limit)
    try:
        plan = planner.plan(batch)
    except ValueError as exc:
        assert entries > plan_limit, (entries, plan_limit)
        assert isinstance(exc, plan_mod.PlanTooLargeError) and exc.num_reqs == len(ctx)
        assert exc.num_iterations * (len(ctx) + 1) > plan_limit  # its numbers are the limit's
        clear_error("plan bounds", exc, "MAX_PLAN_ENTRIES")
        return
    assert entries <= plan_limit and plan.to_json() == full.to_json()
    table = plan.num_iterations * plan.max_iteration_tokens
    for build in (lambda: plan.token_to_seq, lambda: plan.to_json(token_tables=True),
                  lambda: StagingRing("cpu").upload(plan).token_to_seq,
                  lambda: StagingRing("cpu").upload(plan, token_tables=True)):
        try:
            build()
        except ValueError as exc:
            assert table > table_limit, (table, table_limit)
            clear_error("token table bounds", exc, "token_tables", "MAX_TOKEN_TABLE_ENTRIES")
            continue
        assert table <= table_limit
        correct("token table bounds")
    correct("plan bounds")


@settings(max_examples=20 * SCALE, **SETTINGS)
@given(num_reqs=st.sampled_from([10**5, 10**6, 2 * 10**6]), ctx=st.sampled_from([1, 100, 1000]),
       policy=st.sampled_from(POLICIES), workspace=st.sampled_from([4096, 65536]))
def test_fuzz_plan_of_many_requests_refused_before_allocating(num_reqs, ctx, policy, workspace):
    """Issue #30: one batch of 10**6 requests took 24 GB before its MemoryError. Now the plan's
    size is checked from the lengths first (no [iterations, requests] array is made)."""
    import time

    batch = PrefillBatch(np.ones(num_reqs, np.int64), np.full(num_reqs, ctx), page_size=16)
    start = time.perf_counter()
    try:
        plan = ChunkPlanner(workspace, 16, policy).plan(batch)
    except ValueError as exc:
        assert time.perf_counter() - start < 5.0
        clear_error("plan bounds", exc, "MAX_PLAN_ENTRIES", "workspace_tokens")
        return
    from mlaprefill.plan import MAX_PLAN_ENTRIES
    assert plan.num_iterations * (num_reqs + 1) <= MAX_PLAN_ENTRIES
    correct("plan bounds")


@settings(max_examples=30 * SCALE, **SETTINGS)
@given(tokens=st.sampled_from([0, 1, 7, 2**20, 2**31 - 1, INT32_MAX]),
       heads=st.sampled_from([1, 3, 16]), dims=st.sampled_from([(8, 4, 6), (128, 64, 128)]),
       device=st.sampled_from(["cpu", "meta"]), dtype=st.sampled_from([torch.float32,
                                                                      torch.float64]))
def test_fuzz_io_buffers_bounded_by_device_memory(tokens, heads, dims, device, dtype):
    """io_buffers(2**31 - 1) was the allocator's RuntimeError; now a ValueError naming
    num_tokens when q + out + lse exceed the device's memory (meta: no bound, nothing made)."""
    import os

    nope, rope, v = dims
    weight = torch.randn(heads * (nope + v), 16, dtype=dtype)
    op = MLAChunkedPrefill(weight, qk_nope_head_dim=nope, v_head_dim=v, qk_rope_head_dim=rope)
    size = dtype.itemsize
    need = tokens * heads * ((nope + rope + v) * size + (8 if dtype == torch.float64 else 4))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        io = op.io_buffers(tokens, device=device)
    except ValueError as exc:
        assert device == "cpu" and need > memory, (need, memory)
        clear_error("io_buffers bound", exc, "num_tokens")
        return
    assert device == "meta" or need <= memory
    assert io.q.shape == (tokens, heads, nope + rope) and io.lse.shape == (tokens, heads)
    correct("io_buffers bound")


# -- process_group, hand-built DevicePlans, head dims, auto per dtype (issue #30) -------------
BAD_GROUPS = [object(), "gloo", 0, 2, [], torch.device("cpu"), np.int64(1)]


@settings(max_examples=20 * SCALE, **SETTINGS)
@given(group=st.sampled_from(BAD_GROUPS),
       entry=st.sampled_from(["one_call", "dcp", "source", "consistency"]))
def test_fuzz_process_group_must_be_a_group(group, entry):
    from mlaprefill.api import mla_chunked_prefill_dcp
    from mlaprefill.dcp.forward import DCPContextSource, check_dcp_consistency

    ql, cl = [2, 1], [5, 0]
    x = paged_mla_inputs(ql, cl)
    args = [x[k] for k in ("q", "kv_c_new", "k_pe_new", "kv_cache", "block_table")]
    try:
        if entry == "one_call":
            mla_chunked_prefill(*args, ql, cl, x["weight"], process_group=group)
        elif entry == "dcp":
            mla_chunked_prefill_dcp(*args, ql, cl, x["weight"], process_group=group,
                                    dcp_interleave=1)
        elif entry == "source":
            DCPContextSource(x["kv_cache"], x["block_table"], None, group)
        else:
            check_dcp_consistency((1, 2, 3), group, "cpu")
    except Exception as exc:
        assert isinstance(exc, TypeError), exc
        clear_error("process_group", exc, "process_group")
        return
    raise AssertionError(f"{entry} accepted process_group={group!r}")


DEVICE_PLAN_DEFECTS = ["none", "none", "dtype", "shape", "device", "strided", "not_tensor",
                       "missing", "other_plan", "not_mapping", "numpy", "replaced", "upload"]


@settings(max_examples=40 * SCALE, **SETTINGS)
@given(ql=st.lists(st.integers(1, 4), min_size=1, max_size=3),
       cl=st.lists(st.integers(0, 20), min_size=3, max_size=3),
       defect=st.sampled_from(DEVICE_PLAN_DEFECTS), name=st.sampled_from(
           ["cu_query_lens", "chunk_starts", "chunk_lens", "cu_seq_lens"]),
       dtype=st.sampled_from([torch.int64, torch.int16, torch.float32]), validate=st.booleans())
def test_fuzz_hand_built_device_plan(ql, cl, defect, name, dtype, validate):
    """A DevicePlan whose tensors do not match its plan (dtype, shape, device, layout, type, a
    plan of another size) is an error naming device_plan's field before any work, from host
    metadata only; a matching one gives the reference's result."""
    cl = cl[:len(ql)]
    x = paged_mla_inputs(ql, cl, page_size=4)
    plan = ChunkPlanner(8, 4).plan(PrefillBatch(ql, cl, page_size=4))
    tensors = dict(StagingRing("cpu").upload(plan).tensors)
    t = tensors[name]
    if defect == "dtype":
        tensors[name] = t.to(dtype)
    elif defect == "shape":
        tensors[name] = torch.cat([t.reshape(-1), t.reshape(-1)[:1]]) if t.dim() == 1 else \
            t[:, :-1].contiguous()
    elif defect == "device":
        tensors[name] = t.to("meta")
    elif defect == "strided":
        tensors[name] = torch.stack([t, t], -1)[..., 0]
        if tensors[name].is_contiguous():  # one element: nothing to break
            defect = "none"
    elif defect == "not_tensor":
        tensors[name] = t.tolist()
    elif defect == "numpy":
        tensors[name] = t.numpy()
    elif defect == "missing":
        del tensors[name]
    elif defect == "other_plan":
        other = ChunkPlanner(8, 4).plan(PrefillBatch([*ql, 1], [*cl, 9], page_size=4))
        tensors = dict(StagingRing("cpu").upload(other).tensors)
    elif defect == "not_mapping":
        tensors = list(tensors.values())
    device_plan = DevicePlan(plan, tensors)
    if defect in ("replaced", "upload"):  # an upload (trusted as made), or a copy of another's
        other = ChunkPlanner(8, 4).plan(PrefillBatch([*ql, 1], [*cl, 9], page_size=4))
        device_plan = StagingRing("cpu").upload(plan if defect == "upload" else other)
        if defect == "replaced":
            device_plan = dataclasses.replace(device_plan, plan=plan)
        defect = "none" if defect == "upload" else defect
    op = MLAChunkedPrefill(x["weight"], qk_nope_head_dim=x["nope"], v_head_dim=x["v"])
    args = [x[k] for k in ("q", "kv_c_new", "k_pe_new", "kv_cache", "block_table")]
    try:
        out, lse = op.forward(*args, device_plan, return_lse=True, validate=validate)
    except Exception as exc:
        assert defect != "none", exc
        clear_error("hand-built DevicePlan", exc, "device_plan")
        return
    assert defect == "none", f"{defect} of {name} accepted"
    _assert_reference(x, ql, cl, out, lse)
    correct("hand-built DevicePlan")


def _assert_reference(x, ql, cl, out, lse, tol=1e-4):
    ref_out, ref_lse = mla_prefill_reference(
        x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"], x["block_table"], ql, cl,
        x["weight"], qk_nope_head_dim=x["nope"], v_head_dim=x["v"])
    assert (out.double() - ref_out).abs().max() <= tol
    assert (lse.double() - ref_lse).abs().max() <= tol


def _kernel_accepts_split(nope, rope):
    """The Triton launcher's own check (host metadata only) on keys split nope | rope."""
    from mlaprefill.kernels.attention import _check

    t, h = 3, 2
    q = torch.zeros(t, h, nope + rope, dtype=torch.float16)
    k, v = torch.zeros(t, h, nope, dtype=torch.float16), torch.zeros(t, h, 8, dtype=torch.float16)
    cu = torch.tensor([0, t], dtype=torch.int32)
    try:
        _check(q, k, v, cu, cu, t, 0.1, torch.zeros(t, rope, dtype=torch.float16))
    except ValueError:
        return False
    return True


@settings(max_examples=60 * SCALE, **SETTINGS)
@given(nope=st.sampled_from([1, 8, 15, 16, 24, 32, 64, 96, 128, 160, 192, 256]),
       rope=st.sampled_from([0, 0, 1, 4, 16, 64, 65]), backend=st.sampled_from(
           ["auto", "auto", "math", "mlaprefill"]))
def test_fuzz_head_dims_checked_at_construction(nope, rope, backend):
    """Head dims the kernel cannot split are refused where the dims are known: the split-key
    backends' head_split_reason equals the kernel launcher's own check, a named backend that
    cannot run them fails at construction naming the dim, auto picks one that can."""
    from mlaprefill.backends import MLAPrefillBackend

    why = MLAPrefillBackend().head_split_reason(nope, rope)
    qk_ok = 16 <= nope + rope <= 256
    if qk_ok:  # the launcher checks the joined width first
        assert (why is None) == _kernel_accepts_split(nope, rope), (nope, rope, why)
    assert why is None or ("qk_nope_head_dim" in why or "qk_rope_head_dim" in why)
    heads, v = 2, 8
    weight = torch.randn(heads * (nope + v), 16)
    try:
        op = MLAChunkedPrefill(weight, qk_nope_head_dim=nope, v_head_dim=v, backend=backend,
                               qk_rope_head_dim=rope)
    except ValueError as exc:
        assert backend == "mlaprefill", exc  # math runs any dims; on CPU it is auto's pick
        clear_error("head dims", exc, "backend")
        return
    assert backend != "mlaprefill" or (why is None and qk_ok)
    if nope + rope <= 64:  # and it runs them
        ql, cl = [2, 1], [5, 3]
        x = paged_mla_inputs(ql, cl, heads=heads, nope=nope, rope=rope, v=v, rank=16)
        x["weight"] = weight
        plan = ChunkPlanner(8, 4).plan(PrefillBatch(ql, cl, page_size=4))
        out, lse = op.forward(*(x[k] for k in ("q", "kv_c_new", "k_pe_new", "kv_cache",
                                               "block_table")),
                              StagingRing("cpu").upload(plan), return_lse=True)
        _assert_reference(x, ql, cl, out, lse)
    correct("head dims")


@settings(max_examples=25 * SCALE, **SETTINGS)
@given(dtypes=st.lists(st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
                       min_size=1, max_size=5))
def test_fuzz_auto_backend_is_picked_per_dtype(dtypes):
    """An auto object that once saw float64 stayed on its float64 pick for float32 inputs.
    With a first-choice backend that runs float32 only (a stand-in registered for the test),
    every forward runs on what auto picks for its inputs, and matches the reference."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        _auto_backend_per_dtype(monkeypatch, dtypes)


def _auto_backend_per_dtype(monkeypatch, dtypes):
    import mlaprefill.backends as backends_mod
    from mlaprefill.backends.math import MathBackend

    class Float32Only(MathBackend):
        name = "float32-only"

        def unsupported_reason(self, device, dtype, qk_head_dim, v_head_dim):
            return None if dtype == torch.float32 else "float32 only"

    monkeypatch.setitem(backends_mod.BACKENDS, "float32-only", Float32Only)
    monkeypatch.setattr(backends_mod, "AUTO_ORDER", ("float32-only", "math"))
    ql, cl = [2, 3], [6, 0]
    base = paged_mla_inputs(ql, cl, page_size=4)
    op = MLAChunkedPrefill(base["weight"], qk_nope_head_dim=base["nope"],
                           v_head_dim=base["v"])
    assert op.backend_name == "float32-only"
    device_plan = StagingRing("cpu").upload(
        ChunkPlanner(8, 4).plan(PrefillBatch(ql, cl, page_size=4)))
    for dtype in dtypes:
        x = {k: (t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
             for k, t in base.items()}
        op.weight = x["weight"]  # the weight follows the inputs (as a model's .to(dtype))
        op.upproj = type(op.upproj)(x["weight"], num_heads=op.num_heads,
                                    qk_nope_head_dim=op.qk_nope_head_dim,
                                    v_head_dim=op.v_head_dim)
        out, lse = op.forward(*(x[k] for k in ("q", "kv_c_new", "k_pe_new", "kv_cache",
                                               "block_table")), device_plan, return_lse=True)
        assert op.backend_name == ("float32-only" if dtype == torch.float32 else "math"), dtype
        _assert_reference(x, ql, cl, out, lse, tol=3e-2 if dtype == torch.bfloat16 else 1e-4)
    correct("auto per dtype")


# -- `mlaprefill plan` in a subprocess: pathological --batches, bounded sizes (issue #30) ------
def _plan_subprocess(argv, timeout=60):
    """(exit code, stdout, stderr) of ``python -m mlaprefill ARGV`` in its own process, under a
    wall-clock timeout and an 8 GiB address-space limit (a regression fails, never swaps; one
    BLAS thread, whose per-thread reservations would count against it on many-core hosts)."""
    import resource
    import subprocess
    import sys

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))

    src = str(Path(__file__).resolve().parents[1] / "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
               OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "mlaprefill", *argv], capture_output=True,
                          text=True, timeout=timeout, env=env, preexec_fn=limit)
    return proc.returncode, proc.stdout, proc.stderr


def _pathological_line(kind, n):
    if kind == "requests":  # one line of n requests
        return json.dumps({"context_lens": [100] * n, "query_lens": [1] * n}).encode()
    if kind == "nested":
        return b"[" * n
    if kind == "nested_obj":
        return b'{"context_lens": ' + b"[" * n + b"]" * n + b', "query_lens": [1]}'
    if kind == "digits":
        return b'{"context_lens": [1' + b"0" * n + b'], "query_lens": [1]}'
    if kind == "float":
        return b'{"context_lens": [1e' + str(n).encode() + b'], "query_lens": [1]}'
    return json.dumps({"context_lens": [min(n, 2**31 - 1)], "query_lens": [1]}).encode()


@settings(max_examples=3 * SCALE, **SETTINGS)  # ~1 s each (a process): plus the 4 examples
@given(kind=st.sampled_from(["requests", "nested", "nested_obj", "digits", "float", "long"]),
       n=st.sampled_from([10, 5000, 10**5, 10**6, 2 * 10**9]),
       token_tables=st.booleans(), table_limit=st.sampled_from([None, 0, 10**12]))
@example(kind="zero", n=0, token_tables=False, table_limit=None)
@example(kind="requests", n=10**6, token_tables=False, table_limit=None)
@example(kind="long", n=2 * 10**9, token_tables=True, table_limit=None)
@example(kind="long", n=2 * 10**9, token_tables=True, table_limit=10**12)
def test_fuzz_cli_plan_pathological_batches(kind, n, token_tables, table_limit):
    """/dev/zero, one line of 10**6 requests, deep nesting, a 10**6-digit integer, a 2e9-token
    context with --token-tables: exit 0 with the API's plans, or exit 2 with exactly one stderr
    line -- no traceback, no MemoryError, within the timeout and 8 GiB."""
    if kind == "zero":
        path = "/dev/zero"
    else:
        if kind != "long":
            n = min(n, 10**6)  # a 2e9-byte file is not the point (lines > 64 MiB: see /dev/zero)
        path = _TMP / f"patho_{kind}_{n}.jsonl"
        path.write_bytes(_pathological_line(kind, n) + b"\n")
    argv = ["plan", "--batches", str(path)]
    if token_tables:
        argv.append("--token-tables")
    if table_limit is not None:
        argv += ["--max-table-entries", str(table_limit)]
    rc, out, err = _plan_subprocess(argv)
    if rc == 0:
        assert err == "" and kind in ("requests", "long"), (kind, n, err)
        plans = _api_plans(["plan", "--batches", str(path)])
        got = [json.loads(line) for line in out.splitlines()]
        assert got == [p.to_json(token_tables=token_tables) for p in plans]
        OUTCOMES[("cli plan subprocess", "correct result")] += 1
        return
    assert rc == 2, (rc, err[-2000:])
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err[-2000:]
    assert err.startswith("mlaprefill plan: error: "), err
    OUTCOMES[("cli plan subprocess", "clear error")] += 1
