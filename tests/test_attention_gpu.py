"""GPU tests of the forward, backends and kernels (marked ``gpu``; skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from conftest import paged_mla_inputs
from mlaprefill.api import mla_chunked_prefill
from mlaprefill.backends import BACKENDS, VarlenSeqs, get_backend
from mlaprefill.batch import PrefillBatch
from mlaprefill.graphs import IterationGraphs
from mlaprefill.kernels import (
    gather_context_rows,
    gather_context_rows_torch,
    merge_attention_states,
    merge_attention_states_torch,
)
from mlaprefill.plan import ChunkPlanner
from mlaprefill.prefill import MLAChunkedPrefill
from mlaprefill.reference import mla_prefill_reference
from mlaprefill.staging import StagingRing

pytestmark = pytest.mark.gpu

RANK, NOPE, ROPE, V, PAGE = 512, 128, 64, 128, 64
GPU_BACKENDS = ["mlaprefill", "cudnn", "flex", "fa2", "math"]


def _cu(lens, device="cuda"):
    """cu_seqlens of a packed batch of these lengths: int32 [len(lens) + 1]."""
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                        device=device)


def _inputs(query_lens, context_lens, heads, seed=0):
    """DeepSeek-sized bf16 inputs, built on the GPU."""
    return paged_mla_inputs(query_lens, context_lens, heads=heads, rank=RANK, nope=NOPE, rope=ROPE,
                            v=V, page_size=PAGE, dtype=torch.bfloat16, device="cuda", seed=seed)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("policy,workspace", [("packed", 128), ("equal", 256), ("balanced", 192),
                                             ("packed", 4096)])
def test_forward_matches_reference(backend, policy, workspace):
    # zero context, one token, page-boundary context (128 = 2 pages), single-token context
    query_lens, context_lens = [17, 1, 64, 5, 33], [0, 64, 200, 1, 128]
    x = _inputs(query_lens, context_lens, heads=16)
    out, lse = mla_chunked_prefill(
        x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"], x["block_table"], query_lens,
        context_lens, x["weight"], workspace_tokens=workspace, policy=policy, backend=backend,
        return_lse=True)
    ref_out, ref_lse = mla_prefill_reference(
        x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"], x["block_table"], query_lens,
        context_lens, x["weight"], qk_nope_head_dim=NOPE, v_head_dim=V)
    rel = (out.double().cpu() - ref_out).norm() / ref_out.norm()
    assert rel <= 1e-2, f"{backend}: relative error {rel:.2e}"
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    lse_err = (lse.double().cpu() - ref_lse).abs().max()
    assert lse_err <= 1e-2, f"{backend}: LSE max abs error {lse_err:.2e}"


@pytest.mark.parametrize("backend", ["mlaprefill", "cudnn", "flex", "fa2"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("host_offsets", [False, True])
def test_backend_matches_math_with_empty_sequences(backend, causal, host_offsets):
    """Also with the offsets as host ints: cuDNN then launches its cached dense kernel per
    sequence, without them its ragged kernel."""
    q_lens = [37, 1, 64, 5]
    k_lens = q_lens if causal else [100, 0, 129, 64]
    heads, qk = 8, NOPE + ROPE

    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(sum(q_lens), heads, qk, device="cuda", generator=g).bfloat16()
    k = torch.randn(sum(k_lens), heads, qk, device="cuda", generator=g).bfloat16()
    v = torch.randn(sum(k_lens), heads, V, device="cuda", generator=g).bfloat16()
    seqs = VarlenSeqs(_cu(q_lens), _cu(k_lens), max(q_lens), max(k_lens))
    ref_o, ref_l = BACKENDS["math"]().attend(q.double(), k.double(), v.double(), seqs,
                                            causal=causal, softmax_scale=qk ** -0.5)
    be = get_backend(backend, device="cuda", dtype=torch.bfloat16, qk_head_dim=qk, v_head_dim=V)
    if host_offsets:
        seqs = VarlenSeqs(seqs.cu_seqlens_q, seqs.cu_seqlens_k, max(q_lens), max(k_lens),
                          cu_seqlens_q_host=seqs.cu_seqlens_q.cpu().numpy(),
                          cu_seqlens_k_host=seqs.cu_seqlens_k.cpu().numpy())
    o, lse = be.attend(q, k, v, seqs, causal=causal, softmax_scale=qk ** -0.5)
    assert o.shape == (sum(q_lens), heads, V) and lse.shape == (sum(q_lens), heads)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    finite = torch.isfinite(ref_l)
    assert torch.equal(torch.isfinite(lse), finite)  # empty key sequence -> -inf
    assert (lse[~finite] == float("-inf")).all()
    assert (o[~finite.all(1)] == 0).all()
    assert (o.double() - ref_o).norm() / ref_o.norm() <= 1e-2
    assert (lse.double()[finite] - ref_l[finite]).abs().max() <= 1e-3 * 10


def test_triton_gather_matches_torch():
    query_lens, context_lens = [3, 2, 4], [1000, 64, 4097]
    x = _inputs(query_lens, context_lens, heads=1)
    plan = ChunkPlanner(1024, PAGE).plan(PrefillBatch(query_lens, context_lens, page_size=PAGE))
    dplan = StagingRing("cuda").upload(plan)
    for i in range(plan.num_iterations):
        n = plan.iteration_tokens[i]
        a = torch.zeros(plan.max_iteration_tokens, RANK + ROPE, device="cuda",
                        dtype=torch.bfloat16)
        b = a.clone()
        args = (x["kv_cache"], x["block_table"], dplan.cu_seq_lens[i], dplan.chunk_starts[i])
        gather_context_rows(*args, a, n, use_kernel=True)
        gather_context_rows_torch(*args, b, n)
        assert torch.equal(a, b)


@pytest.mark.parametrize("num_reqs", [1, 2, 7, 300])
def test_triton_gather_row_mapping_many_requests(num_reqs):
    """The on-device row -> request search for 1..300 requests (0..9 search steps), with empty
    pieces and page-boundary lengths, equals the torch fallback and the vLLM table's rows."""
    g = torch.Generator().manual_seed(num_reqs)
    context_lens = torch.randint(0, 3 * PAGE, (num_reqs,), generator=g).tolist()
    context_lens[0] = PAGE  # on a page boundary
    if num_reqs > 2:
        context_lens[1], context_lens[2] = 0, PAGE + 1
    x = _inputs([1] * num_reqs, context_lens, heads=1)
    plan = ChunkPlanner(2048, PAGE, "balanced").plan(
        PrefillBatch([1] * num_reqs, context_lens, page_size=PAGE))
    dplan = StagingRing("cuda").upload(plan)
    assert torch.equal(dplan.token_to_seq.cpu(), torch.from_numpy(plan.token_to_seq.copy()))
    for i in range(plan.num_iterations):
        n = plan.iteration_tokens[i]
        a = torch.full((plan.max_iteration_tokens, RANK + ROPE), float("nan"), device="cuda",
                       dtype=torch.bfloat16)
        b = a.clone()
        args = (x["kv_cache"], x["block_table"], dplan.cu_seq_lens[i], dplan.chunk_starts[i])
        gather_context_rows(*args, a, n, use_kernel=True)
        gather_context_rows_torch(*args, b, n)
        assert torch.equal(a[:n], b[:n]) and not torch.isnan(a[:n].float()).any()


def test_triton_gather_block_id_outside_cache_gives_nan_rows():
    """No silent read of another page: a bad block id makes that page's rows NaN, only."""
    x = _inputs([1, 1], [2 * PAGE, 2 * PAGE], heads=1)
    table = x["block_table"].clone()
    table[0, 1] = -1
    table[1, 0] = x["kv_cache"].shape[0]  # one past the last block
    cu = torch.tensor([0, 2 * PAGE, 4 * PAGE], dtype=torch.int32, device="cuda")
    cs = torch.zeros(2, dtype=torch.int32, device="cuda")
    ws = torch.zeros(4 * PAGE, RANK + ROPE, device="cuda", dtype=torch.bfloat16)
    gather_context_rows(x["kv_cache"], table, cu, cs, ws, 4 * PAGE, use_kernel=True)
    nan_rows = torch.isnan(ws.float()).all(dim=1).cpu()
    expect = torch.zeros(4 * PAGE, dtype=torch.bool)
    expect[PAGE:3 * PAGE] = True  # request 0's second page, request 1's first page
    assert torch.equal(nan_rows, expect)
    good = gather_context_rows_torch(x["kv_cache"], x["block_table"], cu, cs,
                                     torch.zeros_like(ws), 4 * PAGE)
    assert torch.equal(ws[~expect.cuda()], good[~expect.cuda()])


def test_triton_merge_matches_torch_and_inf_rules():
    t, h = 1000, 16
    g = torch.Generator(device="cuda").manual_seed(1)
    o = torch.randn(t, h, V, device="cuda", generator=g).bfloat16()
    lse = torch.randn(t, h, device="cuda", generator=g)
    part = torch.randn(t, h, NOPE + ROPE, device="cuda", generator=g).bfloat16()[..., :V]
    part_lse = torch.randn(h, t, device="cuda", generator=g).t()  # strided, like FA2's
    lse[:10] = float("-inf")
    part_lse[5:20] = float("-inf")
    part[5:20] = float("nan")  # a -inf side contributes nothing, whatever it holds
    o1, l1, o2, l2 = o.clone(), lse.clone(), o.clone(), lse.clone()
    merge_attention_states(o1, l1, part, part_lse, use_kernel=True)
    merge_attention_states_torch(o2, l2, part, part_lse)
    assert not torch.isnan(o1).any()
    assert (o1[5:10] == 0).all() and torch.isneginf(l1[5:10]).all()
    assert torch.allclose(o1.float(), o2.float(), atol=1e-2 * o2.float().abs().max().item())
    assert torch.allclose(l1, l2, atol=1e-5)


def test_triton_merge_is_bitwise_repeatable_at_scale():
    """Regression for the in-place LSE race in the merge kernel (see kernels/merge.py): at a
    prefill-sized merge, every repeat must give the same bits, and match the torch merge."""
    t, h = 4096, 128
    g = torch.Generator(device="cuda").manual_seed(7)
    o = (torch.randn(t, h, V, device="cuda", generator=g) * 0.01).bfloat16()
    lse = torch.randn(t, h, device="cuda", generator=g) * 4
    part = (torch.randn(t, h, V, device="cuda", generator=g) * 0.01).bfloat16()
    part_lse = torch.randn(t, h, device="cuda", generator=g) * 4
    ref_o, ref_l = merge_attention_states_torch(o.clone(), lse.clone(), part, part_lse)
    first = None
    for _ in range(30):
        o1, l1 = o.clone(), lse.clone()
        merge_attention_states(o1, l1, part, part_lse, use_kernel=True)
        if first is None:
            first = (o1, l1)
            assert torch.allclose(l1, ref_l, atol=1e-5)
            assert torch.allclose(o1.float(), ref_o.float(), atol=2e-4, rtol=1e-2)
        else:
            assert torch.equal(o1, first[0]) and torch.equal(l1, first[1])


def test_triton_split_keys_and_epilogue_merge_match_joined_and_merge_pass():
    """k_rope (one rope row per key, head stride 0) gives the bits of the joined keys; merging
    in the epilogue (state=) matches attention + the merge kernel, and repeats bitwise."""
    from mlaprefill.kernels.attention import varlen_attention
    from mlaprefill.kernels.rope import broadcast_rope_

    q_lens, k_lens, h = [1, 300, 4096, 77], [5000, 0, 8192, 129], 16
    g = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(sum(q_lens), h, NOPE + ROPE, device="cuda", generator=g).bfloat16()
    k_nope = torch.randn(sum(k_lens), h, NOPE, device="cuda", generator=g).bfloat16()
    k_pe = torch.randn(sum(k_lens), ROPE, device="cuda", generator=g).bfloat16()
    v = torch.randn(sum(k_lens), h, V, device="cuda", generator=g).bfloat16()
    k = torch.empty(sum(k_lens), h, NOPE + ROPE, device="cuda", dtype=torch.bfloat16)
    k[..., :NOPE] = k_nope
    broadcast_rope_(k, k_pe, NOPE)
    assert torch.equal(k[..., NOPE:], k_pe[:, None, :].expand(-1, h, -1))
    kw = dict(max_seqlen_q=max(q_lens), causal=False, softmax_scale=0.1)
    joined = varlen_attention(q, k, v, _cu(q_lens), _cu(k_lens), **kw)
    split = varlen_attention(q, k_nope, v, _cu(q_lens), _cu(k_lens), **kw, k_rope=k_pe)
    assert torch.equal(joined[0], split[0]) and torch.equal(joined[1], split[1])
    base_o = (torch.randn(sum(q_lens), h, V, device="cuda", generator=g) * 0.1).bfloat16()
    base_l = torch.randn(sum(q_lens), h, device="cuda", generator=g) * 3
    ref_o, ref_l = merge_attention_states(base_o.clone(), base_l.clone(), *joined)
    first = None
    for _ in range(10):
        state = (base_o.clone(), base_l.clone())
        varlen_attention(q, k_nope, v, _cu(q_lens), _cu(k_lens), **kw, k_rope=k_pe, state=state)
        if first is None:
            first = state
            assert torch.allclose(state[1], ref_l, atol=1e-5)
            assert torch.allclose(state[0].float(), ref_o.float(), atol=1e-2, rtol=1e-2)
            # sequence 1 has no keys: its rows are the untouched base
            assert torch.equal(state[0][1:301], base_o[1:301])
        else:
            assert torch.equal(state[0], first[0]) and torch.equal(state[1], first[1])


@pytest.mark.parametrize("causal", [False, True])
def test_triton_tma_loads_match_pointer_loads(causal):
    """config.tma (K / V tiles through device-side tensor descriptors) against the pointer loads
    on the forward's layout (split keys from one [k_nope | v] GEMM output, state merge): the same
    result up to the MMA's accumulation order, and a NaN key of one sequence stays there."""
    import dataclasses

    from mlaprefill.kernels.attention import DEFAULT_ATTENTION_CONFIG, varlen_attention

    q_lens = [1, 300, 1024, 77] if causal else [1, 300, 2048, 77]
    k_lens = q_lens if causal else [5000, 0, 8192, 129]
    h = 16
    g = torch.Generator(device="cuda").manual_seed(6)
    q = torch.randn(sum(q_lens), h, NOPE + ROPE, device="cuda", generator=g).bfloat16()
    kv = torch.randn(sum(k_lens), h, NOPE + V, device="cuda", generator=g).bfloat16()
    k_pe = torch.randn(sum(k_lens), ROPE, device="cuda", generator=g).bfloat16()
    k, v = kv[..., :NOPE], kv[..., NOPE:]
    tma = dataclasses.replace(DEFAULT_ATTENTION_CONFIG, tma=True)

    def run(cfg, kk):
        state = (torch.zeros(sum(q_lens), h, V, device="cuda", dtype=torch.bfloat16),
                 torch.full((sum(q_lens), h), float("-inf"), device="cuda"))
        return varlen_attention(q, kk, v, _cu(q_lens), _cu(k_lens), max_seqlen_q=max(q_lens),
                                causal=causal, softmax_scale=0.1, config=cfg, k_rope=k_pe,
                                state=state)

    ptr, desc = run(DEFAULT_ATTENTION_CONFIG, k), run(tma, k)
    assert torch.allclose(desc[1], ptr[1], atol=1e-4, rtol=0, equal_nan=True)
    assert torch.allclose(desc[0].float(), ptr[0].float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(torch.isneginf(desc[1]), torch.isneginf(ptr[1]))
    # A NaN in sequence 2's first key: its rows NaN, every other row exactly as before.
    k_bad = kv.clone()[..., :NOPE]
    s2 = sum(k_lens[:2])
    k_bad[s2, 3, 7] = float("nan")
    bad = run(tma, k_bad)
    rows2 = slice(sum(q_lens[:2]), sum(q_lens[:3]))
    assert torch.isnan(bad[1][rows2, 3]).all()
    other = torch.ones(sum(q_lens), dtype=torch.bool)
    other[rows2] = False
    assert torch.equal(bad[0][other], desc[0][other]) and torch.equal(bad[1][other], desc[1][other])


def _attention_f64(q, k, v, q_lens, k_lens, causal, scale, heads=(0, 5)):
    """float64 out / LSE of a packed varlen batch for a few heads, by the math backend:
    ([Tq, h, Dv], [Tq, h])."""
    h = list(heads)
    return BACKENDS["math"]().attend(
        q[:, h].double(), k[:, h].double(), v[:, h].double(),
        VarlenSeqs(_cu(q_lens, q.device), _cu(k_lens, q.device), max(q_lens), max(k_lens)),
        causal=causal, softmax_scale=scale)


@pytest.mark.parametrize("q_lens", [[256] * 24, [1024] * 6, [4096, 1, 700, 3, 1, 2000, 64]])
def test_hopper_causal_forms_at_128_heads_run_each_tile_once(q_lens, monkeypatch):
    """Every causal form (64-row programs at 256 queries, 64-key blocks at 1024, 128-key blocks
    past) with far more tiles than programs (128 heads) and with uneven lengths (most of a
    short sequence's tiles empty): the persistent pair order runs every tile once, bitwise one
    program per tile's outputs, the same on every repeat, matching the float64 reference."""
    from mlaprefill.kernels import hopper_attention
    from mlaprefill.kernels.attention import varlen_attention

    if torch.cuda.get_device_capability() != (9, 0) or not hopper_attention.HAS_GLUON:
        pytest.skip("the Hopper kernel needs an sm_90 GPU and Triton's Gluon")
    h, scale = 128, 192 ** -0.5
    g = torch.Generator(device="cuda").manual_seed(5)
    n = sum(q_lens)
    q = torch.randn(n, h, NOPE + ROPE, device="cuda", generator=g).bfloat16()
    kv = torch.randn(n, h, NOPE + V, device="cuda", generator=g).bfloat16()
    k_pe = torch.randn(n, ROPE, device="cuda", generator=g).bfloat16()
    cu = _cu(q_lens)
    kw = dict(max_seqlen_q=max(q_lens), causal=True, softmax_scale=scale, k_rope=k_pe)
    runs = [varlen_attention(q, kv[..., :NOPE], kv[..., NOPE:], cu, cu, **kw) for _ in range(3)]
    assert not hopper_attention._FAILED
    for o, s in runs:  # which (row, head) pairs went wrong, NaN or Inf, if any
        bad_o, bad_l = ~torch.isfinite(o).all(-1), ~torch.isfinite(s)
        assert not bad_o.any() and not bad_l.any(), (
            f"non-finite out at {bad_o.nonzero()[:8].tolist()} ({int(bad_o.sum())} rows x "
            f"heads, {int(torch.isnan(o).any(-1).sum())} with NaN), LSE at "
            f"{bad_l.nonzero()[:8].tolist()}")
    out, lse = runs[0]
    assert all(torch.equal(o, out) and torch.equal(s, lse) for o, s in runs[1:])
    with monkeypatch.context() as m:
        m.setattr(hopper_attention, "CAUSAL_PERSISTENT_MAX_BLOCKS", 0)
        tile = varlen_attention(q, kv[..., :NOPE], kv[..., NOPE:], cu, cu, **kw)
    assert torch.isfinite(tile[0]).all() and torch.isfinite(tile[1]).all()
    assert torch.equal(tile[0], out) and torch.equal(tile[1], lse)
    k_joined = torch.cat([kv[..., :NOPE], k_pe[:, None].expand(n, h, ROPE)], dim=-1)
    heads = (0, 77, 127)
    ref_o, ref_l = _attention_f64(q, k_joined, kv[..., NOPE:], q_lens, q_lens, True, scale,
                                  heads=heads)
    got_o, got_l = out[:, list(heads)].double(), lse[:, list(heads)].double()
    assert (got_l - ref_l).abs().max() <= 1e-3
    assert ((got_o - ref_o).norm() / ref_o.norm()) <= 1e-2


@pytest.mark.parametrize("heads,q_lens,k_lens", [
    (4, [200, 130, 5], [197000, 300, 0]),  # fewer tiles than SMs: every tile in parts
    (9, [1024, 100], [131000, 300]),       # 144 tiles: one round and 12 tiles, the 12 in parts
])
def test_hopper_split_last_round_matches_f64_and_whole_tiles(heads, q_lens, k_lens,
                                                              monkeypatch):
    """A context part whose last round of tiles is split over every SM (parts of a tile's keys
    merged by LSE, _split_plan / _merge_tail): against the float64 reference and against whole
    tiles (SPLIT_TAIL off), bitwise repeatable, merged into a state (rows without keys
    untouched), and a NaN key of a split tile's sequence staying in that sequence and head."""
    from mlaprefill.kernels import hopper_attention as ha
    from mlaprefill.kernels.attention import varlen_attention

    if torch.cuda.get_device_capability() != (9, 0) or not ha.HAS_GLUON:
        pytest.skip("the Hopper kernel needs an sm_90 GPU and Triton's Gluon")
    n_tiles = -(-max(q_lens) // ha.BLOCK_M) * len(q_lens) * heads
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    _, n_main, n_split = ha._split_plan(n_tiles, sms, sum(k_lens) / len(q_lens) / ha.BLOCK_N)
    assert n_split > 1, "the case must split"
    scale = 192 ** -0.5
    g = torch.Generator(device="cuda").manual_seed(9)
    q = torch.randn(sum(q_lens), heads, NOPE + ROPE, device="cuda", generator=g).bfloat16()
    kv = torch.randn(sum(k_lens), heads, NOPE + V, device="cuda", generator=g).bfloat16()
    k_pe = torch.randn(sum(k_lens), ROPE, device="cuda", generator=g).bfloat16()
    kw = dict(max_seqlen_q=max(q_lens), causal=False, softmax_scale=scale, k_rope=k_pe)
    cq, ck = _cu(q_lens), _cu(k_lens)

    def run(kv=kv, **extra):
        return varlen_attention(q, kv[..., :NOPE], kv[..., NOPE:], cq, ck, **kw, **extra)

    out, lse = run()
    again = run()
    assert not ha._FAILED
    assert torch.equal(again[0], out) and torch.equal(again[1], lse)
    with monkeypatch.context() as m:
        m.setattr(ha, "SPLIT_TAIL", False)
        whole_o, whole_l = run()
    # fp32 sums in another order: the H200 A/B saw up to 3.8e-6 apart at 131072 keys
    assert torch.allclose(lse, whole_l, atol=5e-5, rtol=0)
    assert torch.allclose(out.float(), whole_o.float(), atol=1e-2, rtol=1e-2)
    # the split tiles are the last ones: the last sequence's last heads
    split_heads = sorted({(t // -(-max(q_lens) // ha.BLOCK_M)) % heads
                          for t in range(n_main, n_tiles)})
    k_joined = torch.cat([kv[..., :NOPE], k_pe[:, None].expand(-1, heads, -1)], -1)
    check = sorted({0, *split_heads[:2], split_heads[-1]})
    ref_o, ref_l = _attention_f64(q, k_joined, kv[..., NOPE:], q_lens, k_lens, False, scale,
                                  heads=check)
    got_o, got_l = out[:, check].double(), lse[:, check].double()
    assert torch.equal(torch.isneginf(got_l), torch.isneginf(ref_l))
    fin = torch.isfinite(ref_l)
    assert (got_l[fin] - ref_l[fin]).abs().max() <= 1e-3
    assert ((got_o - ref_o).norm() / ref_o.norm()) <= 1e-2
    assert (got_o[torch.isneginf(ref_l)] == 0).all()
    # merged into a state: the merge rules, rows without keys untouched
    base_o = (torch.randn(sum(q_lens), heads, V, device="cuda", generator=g) * 0.1).bfloat16()
    base_l = torch.randn(sum(q_lens), heads, device="cuda", generator=g) * 3
    state = (base_o.clone(), base_l.clone())
    run(state=state)
    ref_mo, ref_ml = merge_attention_states(base_o.clone(), base_l.clone(), out, lse)
    assert torch.allclose(state[1], ref_ml, atol=1e-5)
    assert torch.allclose(state[0].float(), ref_mo.float(), atol=1e-2, rtol=1e-2)
    empty = [i for i, n in enumerate(k_lens) if n == 0]
    for s_ in empty:
        rows = slice(sum(q_lens[:s_]), sum(q_lens[:s_ + 1]))
        assert torch.equal(state[0][rows], base_o[rows]) and torch.equal(state[1][rows],
                                                                          base_l[rows])
    # a NaN key and value of the last sequence with keys, in a split head
    bad_seq = max(i for i, n in enumerate(k_lens) if n)
    head = split_heads[-1]
    kv_bad = kv.clone()
    kv_bad[sum(k_lens[:bad_seq]) + k_lens[bad_seq] // 2, head, 3] = float("nan")
    kv_bad[sum(k_lens[:bad_seq]) + k_lens[bad_seq] // 2, head, NOPE + 1] = float("nan")
    bad_o, bad_l = run(kv=kv_bad)
    rows = slice(sum(q_lens[:bad_seq]), sum(q_lens[:bad_seq + 1]))
    assert torch.isnan(bad_l[rows, head]).all() and torch.isnan(bad_o[rows, head, 1]).all()
    other = torch.ones(sum(q_lens), heads, dtype=torch.bool, device="cuda")
    other[rows, head] = False
    assert torch.equal(bad_o[other], out[other]) and torch.equal(bad_l[other], lse[other])


@pytest.mark.parametrize("causal,q_max", [(False, 2048), (True, 256), (True, 1024),
                                           (True, 2100)])
@pytest.mark.parametrize("keys", ["split", "joined"])
def test_hopper_kernel_is_the_default_and_matches_f64_and_triton(causal, q_max, keys,
                                                                  monkeypatch):
    """On an sm_90 GPU varlen_attention's default is the warp-specialized Gluon kernel (it
    compiles, nothing fell back): against the float64 reference and the Triton kernel on awkward
    sizes (one token, no keys, page and block boundaries, a tail), with state merged in, with a
    dense rectangle left out, and a NaN key and value staying in their sequence (also right past
    a partial block, which the persistent form reads). ``q_max``: the longest sequence's queries;
    causal, 256 and 1024 read keys in 64-key blocks (the lower half's warpgroup skipping the
    diagonal's second half), 2100 in 128-key blocks. Every causal part runs persistent (balanced
    pairs of query blocks), bitwise equal to one program per tile."""
    from mlaprefill.kernels import hopper_attention
    from mlaprefill.kernels.attention import default_config, varlen_attention

    if torch.cuda.get_device_capability() != (9, 0) or not hopper_attention.HAS_GLUON:
        pytest.skip("the Hopper kernel needs an sm_90 GPU and Triton's Gluon")
    if causal:
        q_lens = [1, 200 if q_max <= 256 else 300, q_max, 77, 128, 129]
    else:
        q_lens = [1, 300, q_max, 77, 128, 1]
    k_lens = q_lens if causal else [5000, 0, 8192, 129, 128, 64]
    h, scale = 16, 192 ** -0.5
    g = torch.Generator(device="cuda").manual_seed(11)
    q = torch.randn(sum(q_lens), h, NOPE + ROPE, device="cuda", generator=g).bfloat16()
    kv = torch.randn(sum(k_lens), h, NOPE + V, device="cuda", generator=g).bfloat16()
    k_pe = torch.randn(sum(k_lens), ROPE, device="cuda", generator=g).bfloat16()
    k_joined = torch.cat([kv[..., :NOPE], k_pe[:, None].expand(-1, h, -1)], -1)
    v = kv[..., NOPE:]  # a strided view, as the forward passes it
    if keys == "split":
        k, extra = kv[..., :NOPE], {"k_rope": k_pe}
    else:
        k, extra = k_joined, {}
    kw = dict(max_seqlen_q=max(q_lens), causal=causal, softmax_scale=scale, **extra)
    assert hopper_attention.unsupported_reason(q, k, v, extra.get("k_rope"),
                                               causal=causal) is None
    before = hopper_attention.num_compiled_kernels()
    out, lse = varlen_attention(q, k, v, _cu(q_lens), _cu(k_lens), **kw)
    torch.cuda.synchronize()
    assert hopper_attention.num_compiled_kernels() >= max(before, 1)
    assert not hopper_attention._FAILED
    blocks = -(-max(q_lens) // hopper_attention.BLOCK_M)
    assert blocks <= hopper_attention.CAUSAL_PERSISTENT_MAX_BLOCKS  # persistent, every length
    if causal:  # every causal form is covered: 64-row programs, 64- and 128-key blocks
        narrow = blocks <= hopper_attention.CAUSAL_NARROW_MAX_BLOCKS
        assert narrow == (q_max <= 1024)
        single = blocks <= hopper_attention.CAUSAL_SINGLE_MAX_BLOCKS
        assert single == (q_max <= 256)
    if causal:  # the persistent form against one program per tile: the same bits
        with monkeypatch.context() as m:
            m.setattr(hopper_attention, "CAUSAL_PERSISTENT_MAX_BLOCKS", 0)
            tile_o, tile_l = varlen_attention(q, k, v, _cu(q_lens), _cu(k_lens), **kw)
        assert torch.equal(tile_o, out) and torch.equal(tile_l, lse)
    ref_o, ref_l = _attention_f64(q, k_joined, v, q_lens, k_lens, causal, scale)
    heads = [0, 5]
    got_o, got_l = out[:, heads].double(), lse[:, heads].double()
    assert torch.equal(torch.isneginf(got_l), torch.isneginf(ref_l))
    fin = torch.isfinite(ref_l)
    assert (got_l[fin] - ref_l[fin]).abs().max() <= 1e-3
    assert ((got_o - ref_o).norm() / ref_o.norm()) <= 1e-2
    empty = torch.isneginf(ref_l)
    assert (got_o[empty] == 0).all()  # no keys: out = 0, lse = -inf
    tri = varlen_attention(q, k, v, _cu(q_lens), _cu(k_lens), **kw,
                           config=default_config(causal=causal, max_seqlen_q=max(q_lens)))
    assert torch.allclose(lse, tri[1], atol=1e-4, rtol=0)
    assert torch.allclose(out.float(), tri[0].float(), atol=2e-2, rtol=2e-2)
    # state: merged in the epilogue, rows without keys untouched; bitwise repeatable
    base_o = (torch.randn(sum(q_lens), h, V, device="cuda", generator=g) * 0.1).bfloat16()
    base_l = torch.randn(sum(q_lens), h, device="cuda", generator=g) * 3
    ref_mo, ref_ml = merge_attention_states(base_o.clone(), base_l.clone(), out, lse)
    runs = []
    for _ in range(3):
        state = (base_o.clone(), base_l.clone())
        varlen_attention(q, k, v, _cu(q_lens), _cu(k_lens), **kw, state=state)
        runs.append(state)
    assert torch.allclose(runs[0][1], ref_ml, atol=1e-5)
    assert torch.allclose(runs[0][0].float(), ref_mo.float(), atol=1e-2, rtol=1e-2)
    assert all(torch.equal(r[0], runs[0][0]) and torch.equal(r[1], runs[0][1]) for r in runs)
    if not causal:
        rows1 = slice(1, 301)  # sequence 1 has no keys
        assert torch.equal(runs[0][0][rows1], base_o[rows1])
        # a dense rectangle (sequence 2: queries [0, 1024) x keys [0, 4096)) left out: those
        # rows see keys [4096, 8192) only, the others everything
        s2q, s2k = sum(q_lens[:2]), sum(k_lens[:2])
        d_out, d_lse = varlen_attention(q, k, v, _cu(q_lens), _cu(k_lens), **kw,
                                        dense=((2, 3, 1024, 4096),))
        part_o, part_l = _attention_f64(q[s2q:s2q + 1024], k_joined[s2k + 4096:s2k + 8192],
                                        v[s2k + 4096:s2k + 8192], [1024], [4096], False, scale)
        assert (d_lse[s2q:s2q + 1024][:, heads].double() - part_l).abs().max() <= 1e-3
        got = d_out[s2q:s2q + 1024][:, heads].double()
        assert ((got - part_o).norm() / part_o.norm()) <= 1e-2
        rest = torch.ones(sum(q_lens), dtype=torch.bool, device="cuda")
        rest[s2q:s2q + 1024] = False
        assert torch.equal(d_out[rest], out[rest]) and torch.equal(d_lse[rest], lse[rest])
    # a NaN in the first key (K and V) of sequence 3, then of sequence 4 (head 3): that
    # sequence's rows NaN, every other row as before. Sequence 3's last key block reaches past
    # its end into sequence 4's rows (77 or 129 keys), which must not leak into it.
    for bad_seq in (3, 4):
        kv_bad = kv.clone()
        kv_bad[sum(k_lens[:bad_seq]), 3, 7] = float("nan")
        kv_bad[sum(k_lens[:bad_seq]), 3, NOPE + 5] = float("nan")
        k_bad = kv_bad[..., :NOPE] if keys == "split" else torch.cat(
            [kv_bad[..., :NOPE], k_pe[:, None].expand(-1, h, -1)], -1)
        bad_o, bad_l = varlen_attention(q, k_bad, kv_bad[..., NOPE:], _cu(q_lens), _cu(k_lens),
                                        **kw)
        rows = slice(sum(q_lens[:bad_seq]), sum(q_lens[:bad_seq + 1]))
        assert torch.isnan(bad_l[rows, 3]).all() and torch.isnan(bad_o[rows, 3, 5]).all()
        other = torch.ones(sum(q_lens), h, dtype=torch.bool, device="cuda")
        other[rows, 3] = False
        assert torch.equal(bad_o[other], out[other]) and torch.equal(bad_l[other], lse[other])


def test_hybrid_takes_no_rectangles_where_the_hopper_kernel_runs():
    """With its default floors hybrid leaves cuDNN out where the Hopper kernel runs (it reads
    split keys at cuDNN's speed); an explicit floor still gets rectangles."""
    from mlaprefill.backends.mlaprefill import MLAPrefillBackend
    from mlaprefill.kernels import hopper_attention

    cq, ck = [0, 1024, 2048, 3072, 4096], [0, 16384, 32768, 49152, 65536]
    seqs = VarlenSeqs(torch.tensor(cq, dtype=torch.int32, device="cuda"),
                      torch.tensor(ck, dtype=torch.int32, device="cuda"), 1024, 16384,
                      cu_seqlens_q_host=cq, cu_seqlens_k_host=ck)
    hopper = hopper_attention.available(torch.device("cuda"))
    assert MLAPrefillBackend().wants_joined_keys(seqs, 128, False) is not hopper
    assert MLAPrefillBackend(min_queries_per_key=0).wants_joined_keys(seqs, 128, False)
    # host offsets alone (how the iteration graphs ask): the same answer
    host = VarlenSeqs(None, None, 1024, 16384, cu_seqlens_q_host=cq, cu_seqlens_k_host=ck)
    assert MLAPrefillBackend().wants_joined_keys(host, 128, False) is not hopper


@pytest.mark.parametrize("backend", ["mlaprefill", "cudnn", "fa2"])
def test_long_context_forward_is_bitwise_repeatable(backend):
    """The whole forward at a long-context shape (128k context, 4 iterations) gives the same
    bits run after run; before the merge-kernel barrier it did not (determinism_h200.json)."""
    d = _inputs([2048], [131072], 128, seed=3)
    plan = ChunkPlanner(32768, PAGE).plan(PrefillBatch([2048], [131072], page_size=PAGE))
    dp = StagingRing("cuda").upload(plan)
    mla = MLAChunkedPrefill(d["weight"], qk_nope_head_dim=NOPE, v_head_dim=V, backend=backend)
    runs = [mla.forward(d["q"], d["kv_c_new"], d["k_pe_new"], d["kv_cache"], d["block_table"],
                        dp, return_lse=True) for _ in range(5)]
    for out, lse in runs[1:]:
        assert torch.equal(out, runs[0][0]) and torch.equal(lse, runs[0][1])


@pytest.mark.parametrize("backend", ["auto", "mlaprefill", "cudnn", "fa2"])
def test_plan_upload_forward_never_syncs(backend):
    from hostsync.cuda_check import check_step_async

    query_lens, context_lens = [512, 1, 300, 64], [4096, 0, 1000, 64 * 20]
    x = _inputs(query_lens, context_lens, heads=16)
    op = MLAChunkedPrefill(x["weight"], qk_nope_head_dim=NOPE, v_head_dim=V, backend=backend)
    ring = StagingRing("cuda")
    planner = ChunkPlanner(2048, PAGE)
    batch = PrefillBatch(query_lens, context_lens, page_size=PAGE)

    def step():
        dplan = ring.upload(planner.plan(batch))
        return op.forward(x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"],
                          x["block_table"], dplan)

    check = check_step_async(step, steps=3)  # one plan upload per step, nothing else
    assert check.sync_debug_error is None
    assert check.pageable_htod == 0 and check.dtoh == 0, check.memcpy_events
    assert check.htod >= 3 and check.passed


@pytest.mark.parametrize("backend,policy", [("mlaprefill", "balanced"), ("mlaprefill", "equal"),
                                            ("mlaprefill", "packed")])
def test_iteration_graphs_match_eager_and_reference(backend, policy):
    """iteration_graphs: the padded iterations (the hybrid's rectangle ones with joined keys and
    cuDNN calls too) captured once and replayed give the eager forward's result up to the GEMM's
    rounding (its row count is the row bucket, not the iteration's), match the float64
    reference, repeat bitwise, and never sync."""
    from hostsync.cuda_check import check_step_async

    query_lens, context_lens = [17, 1, 300, 64, 5], [0, 64, 5000, 1280, 129]
    x = _inputs(query_lens, context_lens, heads=16, seed=7)
    ref_out, ref_lse = mla_prefill_reference(
        x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"], x["block_table"], query_lens,
        context_lens, x["weight"], qk_nope_head_dim=NOPE, v_head_dim=V)
    plan = ChunkPlanner(768, PAGE, policy=policy).plan(
        PrefillBatch(query_lens, context_lens, page_size=PAGE))
    assert plan.num_iterations >= 6
    dp = StagingRing("cuda").upload(plan)
    results = {}
    for graphs in (False, True):
        op = MLAChunkedPrefill(x["weight"], qk_nope_head_dim=NOPE, v_head_dim=V,
                               backend=backend, graphs=IterationGraphs() if graphs else None)
        if backend == "mlaprefill":  # rectangles at this size, so some iterations stay eager
            from mlaprefill.backends.mlaprefill import MLAPrefillBackend
            op._backend = MLAPrefillBackend(big_work=1 << 20, min_queries_per_key=0)
        runs = [op.forward(x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"],
                           x["block_table"], dp, return_lse=True) for _ in range(3)]
        # a graph was captured exactly when asked, the hybrid's cuDNN rectangle iterations too
        assert (op.graphs is not None and op.graphs.captures > 0) == graphs
        if graphs:
            assert op.graphs.capture_failures == 0, op.graphs.last_capture_error
        for out, lse in runs[1:]:
            assert torch.equal(out, runs[0][0]) and torch.equal(lse, runs[0][1]), graphs
        out, lse = results[graphs] = runs[0]
        rel = (out.double().cpu() - ref_out).norm() / ref_out.norm()
        assert rel <= 1e-2, f"{backend} graphs={graphs}: relative error {rel:.2e}"
        assert (lse.double().cpu() - ref_lse).abs().max() <= 1e-2
    (eo, el), (go, gl) = results[False], results[True]
    assert torch.allclose(gl, el, atol=1e-3, rtol=0)
    assert torch.allclose(go.float(), eo.float(), atol=2e-2, rtol=2e-2)

    def step():
        return op.forward(x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"],
                          x["block_table"], StagingRing("cuda").upload(plan))

    check = check_step_async(step, steps=3)
    assert check.sync_debug_error is None
    assert check.pageable_htod == 0 and check.dtoh == 0, check.memcpy_events


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens", ["mixed", "batched"])
def test_hybrid_rectangles_on_cudnn_match_reference(causal, lens):
    """With a threshold of 1 every sequence of >= 256 queries gets a cuDNN rectangle: the
    composition (Triton skips it, cuDNN computes it, LSE merge) against the float64 math
    backend, a NaN in one rectangle staying in its sequence, and warm-up then no new builds."""
    from mlaprefill.backends.mlaprefill import MLAPrefillBackend, dense_rectangles

    if lens == "mixed":  # one rectangle per long sequence (off the grid)
        q_lens, k_lens, num_rects, nan_seq = [300, 5, 520, 1000], [700, 0, 1100, 4100], 3, 2
    else:  # on-grid equal neighbours: one batched cuDNN call of 3, then one of 1
        q_lens, k_lens, num_rects, nan_seq = [256, 256, 256, 1, 512], [4096] * 3 + [7, 4096], 2, 1
    k_lens = q_lens if causal else k_lens
    heads, qk = 8, NOPE + ROPE
    cu_q, cu_k = _cu(q_lens, "cpu"), _cu(k_lens, "cpu")
    rects = dense_rectangles(cu_q.tolist(), cu_k.tolist(), num_heads=heads, causal=causal,
                             big_work=1)
    assert len(rects) == num_rects, rects
    g = torch.Generator(device="cuda").manual_seed(11)
    q = torch.randn(sum(q_lens), heads, qk, device="cuda", generator=g).bfloat16()
    k = torch.randn(sum(k_lens), heads, qk, device="cuda", generator=g).bfloat16()
    v = torch.randn(sum(k_lens), heads, V, device="cuda", generator=g).bfloat16()
    seqs = VarlenSeqs(cu_q.cuda(), cu_k.cuda(), max(q_lens), max(k_lens),
                      cu_seqlens_q_host=cu_q.numpy(), cu_seqlens_k_host=cu_k.numpy())
    be = MLAPrefillBackend(big_work=1, min_queries_per_key=0)
    out, lse = be.attend(q, k, v, seqs, causal=causal, softmax_scale=qk ** -0.5)
    ref_o, ref_l = BACKENDS["math"]().attend(q.double(), k.double(), v.double(), seqs,
                                            causal=causal, softmax_scale=qk ** -0.5)
    finite = torch.isfinite(ref_l)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (out.double() - ref_o).norm() / ref_o.norm() <= 1e-2
    assert (lse.double()[finite] - ref_l[finite]).abs().max() <= 1e-2
    k1 = k.clone()
    k1[int(cu_k[nan_seq]) + 7, 3, 5] = float("nan")  # inside that sequence's rectangle
    out1, lse1 = be.attend(q, k1, v, seqs, causal=causal, softmax_scale=qk ** -0.5)
    r2 = slice(int(cu_q[nan_seq]), int(cu_q[nan_seq + 1]))
    assert torch.isnan(lse1[r2, 3][7:]).all()
    others = torch.ones(q.shape[0], dtype=torch.bool, device="cuda")
    others[r2] = False
    assert torch.equal(out1[others], out[others]) and torch.equal(lse1[others], lse[others])
    # Warm-up of shapes not seen yet (4 heads) builds them; the real call then builds nothing.
    q4, k4, v4 = (x[:, :4].contiguous() for x in (q, k, v))
    assert be.warmup([(q_lens, k_lens, causal)], num_heads=4, qk_head_dim=qk,
                     v_head_dim=V) >= 1
    before = be.builds()
    be.attend(q4, k4, v4, seqs, causal=causal, softmax_scale=qk ** -0.5)
    torch.cuda.synchronize()
    assert be.builds() == before


@pytest.mark.parametrize("policy", ["equal", "balanced"])
def test_hybrid_forward_with_rectangles_matches_reference(policy):
    """The whole chunked forward with the hybrid backend where every piece of >= 256 queries
    takes the cuDNN path (threshold 1): gather + up-projection + rectangles + merges against
    the float64 reference (output and LSE)."""
    from mlaprefill.backends.mlaprefill import MLAPrefillBackend

    query_lens, context_lens = [256, 300, 256, 1], [1024, 700, 1024, 64]
    x = _inputs(query_lens, context_lens, heads=16)
    op = MLAChunkedPrefill(x["weight"], qk_nope_head_dim=NOPE, v_head_dim=V, backend="mlaprefill")
    # the default thresholds skip shapes this small
    op._backend = MLAPrefillBackend(big_work=1, min_queries_per_key=0)
    plan = ChunkPlanner(2048, PAGE, policy=policy).plan(
        PrefillBatch(query_lens, context_lens, page_size=PAGE))
    out, lse = op.forward(x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"], x["block_table"],
                          StagingRing("cuda").upload(plan), return_lse=True)
    ref_out, ref_lse = mla_prefill_reference(
        x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"], x["block_table"], query_lens,
        context_lens, x["weight"], qk_nope_head_dim=NOPE, v_head_dim=V)
    assert (out.double().cpu() - ref_out).norm() / ref_out.norm() <= 1e-2
    assert (lse.double().cpu() - ref_lse).abs().max() <= 1e-2


def test_triton_compiles_once_per_config_not_per_length():
    """Changing step shapes (lengths, request counts) compile nothing new after the first call
    of each (causal, dtype, head dims) kernel: the point of the triton backend in an engine."""
    from mlaprefill.kernels.attention import num_compiled_kernels

    be = get_backend("mlaprefill", device="cuda", dtype=torch.bfloat16, qk_head_dim=NOPE + ROPE,
                     v_head_dim=V)
    g = torch.Generator(device="cuda").manual_seed(5)

    def call(q_lens, k_lens, causal):
        cu = [_cu(q_lens), _cu(k_lens)]
        q = torch.randn(sum(q_lens), 16, NOPE + ROPE, device="cuda", generator=g).bfloat16()
        k = torch.randn(sum(k_lens), 16, NOPE + ROPE, device="cuda", generator=g).bfloat16()
        v = torch.randn(sum(k_lens), 16, V, device="cuda", generator=g).bfloat16()
        be.attend(q, k, v, VarlenSeqs(cu[0], cu[1], max(q_lens), max(k_lens)), causal=causal,
                  softmax_scale=0.1)

    call([5], [5], True)
    call([7], [300], False)
    call([300], [300], False)
    before = num_compiled_kernels()
    assert before is not None and before >= 2  # one kernel per causal (the Hopper one or not)
    for q_lens, k_lens in [([1], [1]), ([33, 1, 400], [33, 1, 400]), ([129] * 9, [129] * 9)]:
        call(q_lens, k_lens, True)
    for q_lens, k_lens in [([1], [4097]), ([3, 300], [0, 65]), ([64] * 16, [1000] * 16)]:
        call(q_lens, k_lens, False)
    torch.cuda.synchronize()
    assert num_compiled_kernels() == before


def test_step_check_sees_a_pageable_upload():
    """The check can fail: the same kind of step, uploading from pageable memory, is caught."""
    from hostsync.cuda_check import check_step_async

    plan = ChunkPlanner(2048, PAGE).plan(PrefillBatch([64, 1], [4096, 0], page_size=PAGE))
    ring = StagingRing("cuda", mode="pageable")
    check = check_step_async(lambda: ring.upload(plan), steps=2)
    assert check.pageable_htod >= 2 and not check.passed


def _graph_launches(plan, row_bucket):
    """The launches iteration_graphs makes for a plan (split keys only), in order: the new
    tokens' stage (its row bucket), then per run of consecutive iterations with rows of one
    row bucket, its length split into powers of two, largest first."""
    launches = [("new", row_bucket(plan.num_query_tokens))]
    runs = []  # [first iteration, bucket, length]
    for i, rows in enumerate(plan.iteration_tokens):
        if not rows:
            continue
        if runs and runs[-1][0] + runs[-1][2] == i and runs[-1][1] == row_bucket(rows):
            runs[-1][2] += 1
        else:
            runs.append([i, row_bucket(rows), 1])
    for _, bucket, length in runs:
        while length:
            part = 1 << (length.bit_length() - 1)
            launches.append((bucket, part))
            length -= part
    return launches


def test_iteration_graphs_replayed_across_forwards_and_layers():
    """One IterationGraphs shared by two layers over steps of changing shapes (3, 4 and 2
    requests, so padded sequences; other query and row counts; runs of equal iterations share a
    launch): per layer, a launch shape's
    first sight runs eagerly, it is captured at its second sight (before capture_pending is first
    called; after that it runs eagerly again) or by capture_pending between steps, and replayed
    from then on, in later steps too; a third round only replays. Every
    forward matches the eager forward and the float64 reference; the steady state never syncs."""
    from hostsync.cuda_check import check_step_async
    from mlaprefill.graphs import pow2_at_least, row_bucket

    steps = [([17, 1, 300], [3000, 1280, 129]), ([64, 200, 5, 90], [2000, 64, 2500, 700]),
             ([100, 33, 260], [1500, 3000, 10]), ([7, 250], [4000, 999])]
    heads, workspace = 16, 768
    shared = IterationGraphs()
    layers, caches = [], []
    for layer in range(2):
        x = _inputs([1], [0], heads=heads, seed=100 + layer)
        layers.append((MLAChunkedPrefill(x["weight"], qk_nope_head_dim=NOPE, v_head_dim=V,
                                         backend="mlaprefill", graphs=shared),
                       MLAChunkedPrefill(x["weight"], qk_nope_head_dim=NOPE, v_head_dim=V,
                                         backend="mlaprefill")))
        # one cache per layer at a fixed address, as an engine has: each step's pages copied in
        caches.append(torch.empty(128, PAGE, RANK + ROPE, dtype=torch.bfloat16, device="cuda"))
    planner = ChunkPlanner(workspace, PAGE, policy="equal")
    ring = StagingRing("cuda")
    state: list[dict] = [{}, {}]  # per layer: key -> "seen" | "captured", as the contract says
    idle = False  # capture_pending called: from then on forwards never capture

    def generation():
        return next(iter(shared._arenas.values())).generation if shared._arenas else None

    for rnd in range(3):  # the buffers grow in the first round; the third only replays
        for s, (query_lens, context_lens) in enumerate(steps):
            plan = planner.plan(PrefillBatch(query_lens, context_lens, page_size=PAGE))
            base = (pow2_at_least(plan.num_reqs), pow2_at_least(plan.max_query_len, 64))
            keys = [(*base, key) for key in _graph_launches(plan, row_bucket)]
            dp = ring.upload(plan)
            for li, (op, eager) in enumerate(layers):
                x = _inputs(query_lens, context_lens, heads=heads, seed=10 * s + li)
                cache = caches[li]
                cache[:x["kv_cache"].shape[0]].copy_(x["kv_cache"])
                args = (x["q"], x["kv_c_new"], x["k_pe_new"], cache, x["block_table"], dp)
                before = (shared.captures, shared.replays, shared.warm_runs, shared.stand_ins)
                gen = generation()
                out, lse = op.forward(*args, return_lse=True)
                if generation() != gen:  # the buffers grew: every layer's graphs are dropped
                    assert rnd == 0, f"grown in round {rnd}"
                    state = [{}, {}]
                expect = [0, 0, 0]  # captures, replays, eager first sights
                for key in keys:
                    seen = state[li].get(key)
                    if seen is None:
                        expect[2] += 1
                        state[li][key] = "seen"
                    elif seen == "seen" and idle:  # left to capture_pending: eager again
                        expect[2] += 1
                    else:
                        expect[0] += seen == "seen"
                        expect[1] += 1
                        state[li][key] = "captured"
                # a first sight runs eagerly or replays a graph of bigger buckets (stand-in)
                stand_ins = shared.stand_ins - before[3]
                got = [shared.captures - before[0], shared.replays - before[1] - stand_ins,
                       shared.warm_runs - before[2] + stand_ins]
                assert got == expect, (rnd, s, li, got, expect)
                assert rnd < 2 or got == [0, len(keys), 0]
                e_out, e_lse = eager.forward(*args, return_lse=True)
                assert torch.allclose(lse, e_lse, atol=1e-3, rtol=0), (rnd, s, li)
                assert torch.allclose(out.float(), e_out.float(), atol=2e-2, rtol=2e-2)
                ref_out, ref_lse = mla_prefill_reference(
                    x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"], x["block_table"],
                    query_lens, context_lens, op.weight, qk_nope_head_dim=NOPE, v_head_dim=V)
                rel = (out.double().cpu() - ref_out).norm() / ref_out.norm()
                assert rel <= 1e-2 and (lse.double().cpu() - ref_lse).abs().max() <= 1e-2
            if s % 2:  # between steps: capture what was seen once, outside the forwards
                pending = sum(v == "seen" for st in state for v in st.values())
                assert shared.capture_pending() == pending
                state = [dict.fromkeys(st, "captured") for st in state]
                idle = True
    assert len(shared._arenas) == 1  # both layers, every step: one set of static buffers

    op = layers[0][0]
    query_lens, context_lens = steps[0]
    x = _inputs(query_lens, context_lens, heads=heads, seed=0)
    caches[0][:x["kv_cache"].shape[0]].copy_(x["kv_cache"])
    plan = planner.plan(PrefillBatch(query_lens, context_lens, page_size=PAGE))
    captures = shared.captures

    def step():
        return op.forward(x["q"], x["kv_c_new"], x["k_pe_new"], caches[0], x["block_table"],
                          ring.upload(plan))

    check = check_step_async(step, steps=3)
    assert check.sync_debug_error is None
    assert check.pageable_htod == 0 and check.dtoh == 0, check.memcpy_events
    assert shared.captures == captures  # a known shape: replays only


@pytest.mark.parametrize("backend", ["mlaprefill"])
def test_iteration_graphs_static_io(backend):
    """io_buffers with captured graphs: two layers sharing one IterationGraphs over steps of
    changing shapes, three rounds (the last replays only); each forward with q written into
    io.q and out= / lse= the io buffers is bitwise the copying forward through the same graphs,
    and the float64 reference's within bf16; the buffers are the arena's own; such a step never
    syncs."""
    from hostsync.cuda_check import check_step_async

    steps = [([17, 1, 300], [3000, 1280, 129]), ([64, 200, 5, 90], [2000, 64, 2500, 700])]
    heads = 16
    shared = IterationGraphs()
    ops, caches = [], []
    for layer in range(2):
        w = _inputs([1], [0], heads=heads, seed=200 + layer)["weight"]
        ops.append(MLAChunkedPrefill(w, qk_nope_head_dim=NOPE, v_head_dim=V, backend=backend,
                                     graphs=shared))
        # one cache per layer at a fixed address (graphs record it): each step's pages copied in
        caches.append(torch.empty(128, PAGE, RANK + ROPE, dtype=torch.bfloat16, device="cuda"))
    planner = ChunkPlanner(768, PAGE, policy="equal")
    ring = StagingRing("cuda")
    for rnd in range(3):
        for s, (query_lens, context_lens) in enumerate(steps):
            plan = planner.plan(PrefillBatch(query_lens, context_lens, page_size=PAGE))
            dp = ring.upload(plan)
            for li, op in enumerate(ops):
                x = _inputs(query_lens, context_lens, heads=heads, seed=10 * s + li)
                caches[li][:x["kv_cache"].shape[0]].copy_(x["kv_cache"])
                rest = (x["kv_c_new"], x["k_pe_new"], caches[li], x["block_table"], dp)
                copied = op.forward(x["q"], *rest, return_lse=True)
                io = op.io_buffers(plan.num_query_tokens)
                io.q.copy_(x["q"])
                replays = shared.replays
                out, lse = op.forward(io.q, *rest, out=io.out, lse=io.lse)
                assert rnd < 2 or shared.replays > replays
                (arena,) = shared._arenas.values()
                assert out is io.out and lse is io.lse
                assert io.q.data_ptr() == arena.q.data_ptr()
                assert out.data_ptr() == arena.out.data_ptr()
                assert lse.data_ptr() == arena.lse.data_ptr()
                assert torch.equal(out, copied[0]) and torch.equal(lse, copied[1]), (rnd, s, li)
                ref_out, ref_lse = mla_prefill_reference(
                    x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"], x["block_table"],
                    query_lens, context_lens, op.weight, qk_nope_head_dim=NOPE, v_head_dim=V)
                rel = (out.double().cpu() - ref_out).norm() / ref_out.norm()
                assert rel <= 1e-2 and (lse.double().cpu() - ref_lse).abs().max() <= 1e-2
            shared.capture_pending()

    query_lens, context_lens = steps[1]  # the caches hold this step's pages now
    x = _inputs(query_lens, context_lens, heads=heads, seed=0)
    plan = planner.plan(PrefillBatch(query_lens, context_lens, page_size=PAGE))
    captures = shared.captures

    def step():
        dp = ring.upload(plan)
        for op, cache in zip(ops, caches, strict=True):
            io = op.io_buffers(plan.num_query_tokens)
            io.q.copy_(x["q"])
            out = op.forward(io.q, x["kv_c_new"], x["k_pe_new"], cache, x["block_table"], dp,
                             out=io.out)
            out.sum()  # a consumer of the view, in stream order

    check = check_step_async(step, steps=3)
    assert check.sync_debug_error is None
    assert check.pageable_htod == 0 and check.dtoh == 0, check.memcpy_events
    assert shared.captures == captures  # known shapes: replays only
