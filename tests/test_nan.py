"""NaN propagates and stays inside its request: merge rules, backends, the whole forward.

Contract (README "Validation contract"): a NaN anywhere in a request's inputs gives NaN in that
request's rows and never changes another request's rows; ``-inf`` LSE only for a query with no
keys at all. CPU paths here; the GPU backends and the Triton merge in the ``gpu`` tests below.
"""

from __future__ import annotations

import pytest
import torch

from conftest import paged_mla_inputs, run_interpreter_tests
from mlaprefill.api import mla_chunked_prefill
from mlaprefill.backends import VarlenSeqs, get_backend, isolate_nonfinite_values
from mlaprefill.batch import PrefillBatch
from mlaprefill.kernels import merge_attention_states, merge_attention_states_torch
from mlaprefill.plan import ChunkPlanner
from mlaprefill.prefill import MLAChunkedPrefill
from mlaprefill.reference import mla_prefill_reference
from mlaprefill.staging import StagingRing

NAN, NEG_INF = float("nan"), float("-inf")


# -- merge rules -----------------------------------------------------------------------------
def _merge_case(dtype=torch.float32):
    """Rows of [T=9, H=2, V=4]: each row t is one rule (head 0 the case, head 1 finite)."""
    g = torch.Generator().manual_seed(0)
    o1 = torch.randn(9, 2, 4, generator=g).to(dtype)
    o2 = torch.randn(9, 2, 4, generator=g).to(dtype)
    l1 = torch.randn(9, 2, generator=g)
    l2 = torch.randn(9, 2, generator=g)
    l2[0, 0] = NAN                            # 0: NaN partial LSE
    l1[1, 0] = NAN                            # 1: NaN running LSE
    o2[2, 0, 1] = NAN                         # 2: NaN in a contributing partial output
    o2[3, 0, 2] = NAN                         # 3: ... whose weight underflows to 0
    l1[3, 0], l2[3, 0] = 0.0, -1000.0
    l1[4, 0], l2[4, 0] = NEG_INF, NAN         # 4: running side empty, partial NaN
    l2[5, 0], o2[5, 0] = NEG_INF, NAN         # 5: empty partial with NaN garbage: no effect
    l1[6, 0], l2[6, 0] = NEG_INF, NEG_INF     # 6: both empty: 0 and -inf
    o1[6, 0], o2[6, 0] = NAN, NAN
    q_nan = torch.full((2,), NAN)             # 7: NaN in both LSEs
    l1[7], l2[7] = q_nan, q_nan
    l2[8, 0] = float("inf")                   # 8: a kernel's "+inf" LSE (sum 0 or NaN): NaN
    return o1, l1, o2, l2


def _check_merge_rules(out, lse, o1, l1):
    assert torch.isnan(out[0, 0]).all() and torch.isnan(lse[0, 0])
    assert torch.isnan(out[1, 0]).all() and torch.isnan(lse[1, 0])
    assert torch.isnan(out[2, 0, 1]) and torch.isfinite(lse[2, 0])
    assert torch.isnan(out[3, 0, 2]) and torch.isfinite(lse[3, 0])
    assert torch.isnan(out[4, 0]).all() and torch.isnan(lse[4, 0])
    assert torch.equal(out[5, 0], o1[5, 0]) and lse[5, 0] == l1[5, 0]
    assert (out[6, 0] == 0).all() and lse[6, 0] == NEG_INF
    assert torch.isnan(out[7]).all() and torch.isnan(lse[7]).all()
    assert torch.isnan(out[8, 0]).all() and torch.isnan(lse[8, 0])  # the hybrid backend relies
    assert torch.isfinite(out[8, 1]).all() and torch.isfinite(lse[8, 1])  # on this rule
    assert torch.isfinite(out[:, 1][:7]).all() and torch.isfinite(lse[:7, 1]).all()
    assert not torch.isnan(out[5:7]).any()  # "no keys" never becomes NaN


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_merge_propagates_nan_and_keeps_empty_rule(dtype):
    """Was: a NaN LSE merged as 'no keys' (output 0, LSE -inf) because `s > 0` is false."""
    o1, l1, o2, l2 = _merge_case(dtype)
    out, lse = o1.clone(), l1.clone()
    merge_attention_states_torch(out, lse, o2, l2)
    _check_merge_rules(out, lse, o1, l1)


@pytest.mark.slow
def test_triton_merge_nan_rules_in_interpreter():
    """The Triton merge kernel follows the same NaN / -inf rules, and the whole forward on the
    Triton attention kernel the README's NaN and inf rule (Triton's interpreter):
    tests/interpreter/test_interp_nan.py, in its own process."""
    run_interpreter_tests("test_interp_nan.py", passed=2)


# -- backends --------------------------------------------------------------------------------
def _cu(lens, device="cpu"):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                        device=device)


def _attend(name, q, k, v, q_lens, k_lens, *, causal, device="cpu"):
    be = get_backend(name, device=device, dtype=q.dtype, qk_head_dim=q.shape[-1],
                     v_head_dim=v.shape[-1])
    seqs = VarlenSeqs(_cu(q_lens, device), _cu(k_lens, device), max(q_lens), max(k_lens),
                      cu_seqlens_q_host=_cu(q_lens).tolist(),
                      cu_seqlens_k_host=_cu(k_lens).tolist())
    return be.attend(q, k, v, seqs, causal=causal, softmax_scale=q.shape[-1] ** -0.5)


def _backend_isolation(name, device, dtype):
    """NaN in sequence 1's q / k / v: its rows NaN, sequences 0 and 2 bitwise unchanged."""
    q_lens, k_lens = [5, 3, 4], [6, 7, 0]
    g = torch.Generator().manual_seed(1)
    # head dims 32 / 16: multiples of 8 (cuDNN, FA2) and >= 16 (FlexAttention)
    q = torch.randn(sum(q_lens), 2, 32, generator=g).to(device, dtype)
    k = torch.randn(sum(k_lens), 2, 32, generator=g).to(device, dtype)
    v = torch.randn(sum(k_lens), 2, 16, generator=g).to(device, dtype)
    clean_o, clean_l = _attend(name, q, k, v, q_lens, k_lens, causal=False, device=device)
    rows_b = slice(5, 8)
    keys_b = slice(6, 13)
    for what in ("q", "k", "v"):
        qq, kk, vv = q.clone(), k.clone(), v.clone()
        {"q": qq[6], "k": kk[keys_b][2], "v": vv[keys_b][4]}[what][0, 3] = NAN
        o, lse = _attend(name, qq, kk, vv, q_lens, k_lens, causal=False, device=device)
        others = torch.ones(sum(q_lens), dtype=torch.bool)
        others[rows_b] = False
        assert torch.equal(o[others], clean_o[others]), (name, what)
        assert torch.equal(lse[others], clean_l[others]), (name, what)
        if what == "q":
            assert torch.isnan(o[6, 0]).all() and torch.isnan(lse[6, 0])
            assert torch.equal(o[5], clean_o[5]) and torch.equal(o[6, 1], clean_o[6, 1])
        else:  # every query of sequence 1 sees the key/value in head 0
            assert torch.isnan(o[rows_b, 0]).any(dim=-1).all(), (name, what)
        assert (lse[8:] == NEG_INF).all() and (o[8:] == 0).all()  # sequence 2 has no keys


def test_math_backend_keeps_nan_inside_its_sequence():
    """Was: sequence 1's NaN value reached sequences 0 and 2 (masked probability 0 x NaN)."""
    _backend_isolation("math", "cpu", torch.float32)


def test_isolate_nonfinite_values_marks_own_sequence_and_head():
    v = torch.ones(5, 2, 3)
    v[3, 1, 2] = float("inf")
    v_clean, poisoned = isolate_nonfinite_values(v, torch.tensor([0, 0, 1, 1, 1]),
                                                 torch.tensor([0, 1, 1, 2]), 3)
    assert torch.isfinite(v_clean).all() and v_clean[3, 1, 2] == 0 and (v_clean[3, 0] == 1).all()
    assert poisoned.tolist() == [[False, False], [False, True], [False, True], [False, False]]


# -- the whole forward -----------------------------------------------------------------------
QUERY_LENS, CONTEXT_LENS = [3, 2, 4], [9, 14, 5]  # A = request 1, B = requests 0 and 2
A_ROWS = slice(3, 5)


def _forward(x, workspace, policy, *, backend="math", **kw):
    plan = ChunkPlanner(workspace, x["page_size"], policy=policy).plan(
        PrefillBatch(QUERY_LENS, CONTEXT_LENS, page_size=x["page_size"]))
    op = MLAChunkedPrefill(x["weight"], qk_nope_head_dim=x["nope"], v_head_dim=x["v"],
                           backend=backend)
    out, lse = op.forward(x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"], x["block_table"],
                          StagingRing(x["q"].device).upload(plan), return_lse=True, **kw)
    return out, lse, plan


def _poison(x, where):
    """A copy of the inputs with one NaN in request A's data (or in a page nobody reads)."""
    y = dict(x)
    page = x["page_size"]
    if where in ("cache_kv_c", "cache_k_pe", "unused_page"):
        y["kv_cache"] = x["kv_cache"].clone()
        if where == "unused_page":
            used = {int(b) for r, c in enumerate(CONTEXT_LENS)
                    for b in x["block_table"][r, :-(-c // page)]}
            block, row = next(b for b in range(x["kv_cache"].shape[0]) if b not in used), 0
        else:
            block, row = int(x["block_table"][1, 2]), 1  # A's context token 2 * page + 1
        col = 0 if where != "cache_k_pe" else -1  # latent (k and v) or rope part (k only)
        y["kv_cache"][block, row, col] = NAN
    elif where == "q":
        y["q"] = x["q"].clone()
        y["q"][4, 1, 0] = NAN
    elif where == "kv_c_new":
        y["kv_c_new"] = x["kv_c_new"].clone()
        y["kv_c_new"][3, 0] = NAN
    return y


@pytest.mark.parametrize("policy", ["packed", "equal", "balanced"])
@pytest.mark.parametrize("workspace", [12, 16, 64])  # many iterations / shared / one
@pytest.mark.parametrize("where", ["cache_kv_c", "cache_k_pe", "q", "kv_c_new", "unused_page"])
def test_nan_in_one_request_stays_in_that_request(policy, workspace, where):
    x = paged_mla_inputs(QUERY_LENS, CONTEXT_LENS, page_size=4)
    clean_out, clean_lse, _ = _forward(x, workspace, policy)
    out, lse, _ = _forward(_poison(x, where), workspace, policy)
    b_rows = torch.ones(sum(QUERY_LENS), dtype=torch.bool)
    b_rows[A_ROWS] = False
    # B is bitwise what it was: no NaN, no change, also when A shares B's iterations
    assert torch.equal(out[b_rows], clean_out[b_rows]), (policy, workspace, where)
    assert torch.equal(lse[b_rows], clean_lse[b_rows])
    a_out, a_lse = out[A_ROWS], lse[A_ROWS]
    if where == "unused_page":
        assert torch.equal(out, clean_out) and torch.equal(lse, clean_lse)
    elif where == "q":  # q[4, head 1]: exactly that (token, head)
        assert torch.isnan(out[4, 1]).all() and torch.isnan(lse[4, 1])
        assert torch.equal(out[3], clean_out[3]) and torch.equal(out[4, 0], clean_out[4, 0])
    elif where == "kv_c_new":  # A's first new token: every later query of A sees it
        assert torch.isnan(a_out).any(dim=-1).all()
    else:  # a context row: every query of A attends to it, in every head
        assert torch.isnan(a_out).any(dim=-1).all() and torch.isnan(a_lse).all()
    # the float64 reference agrees on which (token, head) rows are NaN
    ref_out, ref_lse = mla_prefill_reference(
        *(_poison(x, where)[k] for k in ("q", "kv_c_new", "k_pe_new", "kv_cache",
                                          "block_table")),
        QUERY_LENS, CONTEXT_LENS, x["weight"], qk_nope_head_dim=x["nope"], v_head_dim=x["v"])
    assert torch.equal(torch.isnan(lse), torch.isnan(ref_lse)), where
    assert torch.equal(torch.isnan(out).any(-1), torch.isnan(ref_out).any(-1)), where
    assert not torch.isneginf(lse).any()  # every query has keys: -inf never appears


def test_nan_weight_poisons_every_request_and_never_reads_as_no_keys():
    """A NaN shared by everyone (the up-projection weight) gives NaN everywhere, not 0/-inf."""
    x = paged_mla_inputs(QUERY_LENS, CONTEXT_LENS, page_size=4)
    x["weight"] = x["weight"].clone()
    x["weight"][0, 0] = NAN  # head 0's first nope row: head 0's keys
    out, lse, _ = _forward(x, 8, "packed")
    assert torch.isnan(lse[:, 0]).all() and torch.isnan(out[:, 0]).any(-1).all()
    assert torch.isfinite(lse[:, 1:]).all()


def test_one_call_nan_stays_in_request():
    x = paged_mla_inputs(QUERY_LENS, CONTEXT_LENS, page_size=4)
    args = ("q", "kv_c_new", "k_pe_new", "kv_cache", "block_table")
    clean = mla_chunked_prefill(*(x[k] for k in args), QUERY_LENS, CONTEXT_LENS, x["weight"],
                                workspace_tokens=8)
    y = _poison(x, "cache_kv_c")
    out = mla_chunked_prefill(*(y[k] for k in args), QUERY_LENS, CONTEXT_LENS, x["weight"],
                              workspace_tokens=8)
    assert torch.isnan(out[A_ROWS]).any(-1).all()
    assert torch.equal(out[:3], clean[:3]) and torch.equal(out[5:], clean[5:])


# -- GPU: every backend and the Triton merge -------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["mlaprefill", "cudnn", "flex", "fa2", "math"])
def test_gpu_backend_keeps_nan_inside_its_sequence(name):
    dtype = torch.float32 if name == "math" else torch.bfloat16
    _backend_isolation(name, "cuda", dtype)


@pytest.mark.gpu
def test_gpu_triton_merge_nan_rules():
    o1, l1, o2, l2 = (t.cuda() for t in _merge_case())
    out, lse = o1.clone(), l1.clone()
    merge_attention_states(out, lse, o2, l2, use_kernel=True)
    _check_merge_rules(out.cpu(), lse.cpu(), o1.cpu(), l1.cpu())


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["mlaprefill", "cudnn", "flex", "fa2", "math"])
@pytest.mark.parametrize("where", ["cache_kv_c", "q"])
def test_gpu_forward_nan_stays_in_request(backend, where):
    """Triton gather + merge + each backend: B unchanged, A NaN (bf16; math in fp32)."""
    dtype = torch.float32 if backend == "math" else torch.bfloat16
    x = paged_mla_inputs(QUERY_LENS, CONTEXT_LENS, page_size=4, heads=2, rank=32, nope=16,
                         rope=16, v=16, dtype=dtype, device="cuda")
    for policy in ("packed", "equal", "balanced"):
        clean_out, clean_lse, _ = _forward(x, 12, policy, backend=backend)
        out, lse, _ = _forward(_poison(x, where), 12, policy, backend=backend)
        b_rows = torch.ones(sum(QUERY_LENS), dtype=torch.bool, device="cuda")
        b_rows[A_ROWS] = False
        assert torch.equal(out[b_rows], clean_out[b_rows]), (backend, policy, where)
        assert torch.equal(lse[b_rows], clean_lse[b_rows]), (backend, policy, where)
        if where == "q":
            assert torch.isnan(out[4, 1]).all() and torch.isnan(lse[4, 1])
        else:
            assert torch.isnan(out[A_ROWS]).any(-1).all() and torch.isnan(lse[A_ROWS]).all()
        assert not torch.isneginf(lse).any()
        # the README's rule against the float64 reference (tests/test_contract.py)
        y = _poison(x, where)
        ref_out, ref_lse = mla_prefill_reference(
            *(y[k] for k in ("q", "kv_c_new", "k_pe_new", "kv_cache", "block_table")),
            QUERY_LENS, CONTEXT_LENS, x["weight"], qk_nope_head_dim=x["nope"],
            v_head_dim=x["v"])
        out_nan, lse_nan = out.isnan().cpu(), lse.isnan().cpu()
        assert torch.equal(out_nan, ref_out.isnan()), (backend, policy, where)
        assert not (ref_lse.isnan() & ~lse_nan).any(), (backend, policy, where)
        assert not (lse_nan & ~out_nan.any(-1)).any(), (backend, policy, where)



@pytest.mark.parametrize("value", [float("inf"), float("-inf")])
@pytest.mark.parametrize("where", ["q", "k_pe_new"])
def test_inf_gives_nan_never_no_keys(value, where):
    """An inf whose scores are all -inf (or any +inf) for a query that has keys: NaN in that
    query's out and LSE, as the float64 reference's softmax, never ``out = 0, lse = -inf`` (no
    keys); other requests bitwise unchanged. Request 1 has no context, so its first query's only
    key is itself: one inf entry in q or in that token's rope key decides its score's sign."""
    query_lens, context_lens = [2, 3], [6, 0]
    x = paged_mla_inputs(query_lens, context_lens, page_size=4)
    first = 2  # request 1's first query: it sees one key, its own
    y = dict(x)
    if where == "q":
        y["q"] = x["q"].clone()
        sign = torch.sign(x["k_pe_new"][first, 0])  # the rope part of its own key, dim 0
        y["q"][first, 0, x["nope"]] = value * sign  # score = value (x the key's sign twice)
    else:
        y["k_pe_new"] = x["k_pe_new"].clone()
        sign = torch.sign(x["q"][first, :, x["nope"]])  # per head
        y["k_pe_new"][first, 0] = value * sign[0]
    plan = ChunkPlanner(8, 4, policy="packed").plan(
        PrefillBatch(query_lens, context_lens, page_size=4))
    op = MLAChunkedPrefill(x["weight"], qk_nope_head_dim=x["nope"], v_head_dim=x["v"],
                           backend="math")

    def run(inp):
        return op.forward(inp["q"], inp["kv_c_new"], inp["k_pe_new"], inp["kv_cache"],
                          inp["block_table"], StagingRing("cpu").upload(plan), return_lse=True)

    clean_out, clean_lse = run(x)
    out, lse = run(y)
    assert torch.isnan(out[first, 0]).all() and torch.isnan(lse[first, 0])
    assert not torch.isneginf(lse).any()  # every query has keys
    assert torch.equal(out[:2], clean_out[:2]) and torch.equal(lse[:2], clean_lse[:2])
    ref_out, _ = mla_prefill_reference(
        *(y[k] for k in ("q", "kv_c_new", "k_pe_new", "kv_cache", "block_table")),
        query_lens, context_lens, x["weight"], qk_nope_head_dim=x["nope"], v_head_dim=x["v"])
    assert torch.equal(torch.isnan(out).any(-1), torch.isnan(ref_out).any(-1)), where
