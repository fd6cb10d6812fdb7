"""The Triton varlen attention kernel and its backends in Triton's interpreter, on CPU tensors.

Run only with ``TRITON_INTERPRET=1`` set before triton is imported: tests/test_triton_attention.py
runs this module so, in a pytest subprocess (conftest.run_interpreter_tests); without the
variable every test here is skipped. Each test checks against a float64 einsum reference
written here, per sequence, independently of the kernel and of the ``math`` backend. Small tiles
(16/32) make the awkward lengths (0, 1, 17, 63, 64, 65, 130) hit partial, full, diagonal and
empty key blocks.

bfloat16 is not covered: the interpreter's ``tl.dot`` multiplies bfloat16's raw bits (Triton
3.9), so float16 stands in for the half-precision path (``p`` cast before the PV dot).
"""

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 before triton is imported (see "
                "tests/test_triton_attention.py)", allow_module_level=True)

import torch

from mlaprefill.kernels.attention import AttentionConfig, varlen_attention

INF = float("inf")
g = torch.Generator().manual_seed(0)


def padded_launches(plan, joined=()):
    # What graphs launch for a plan (eager on CPU, each a warm run): the new tokens' stage,
    # then per run of consecutive split-key iterations with rows of one row bucket a launch
    # per set bit of the run's length (8 + 2 for 10), a joined one alone.
    from mlaprefill.graphs import row_bucket

    runs, last = [], None
    for i, rows in enumerate(plan.iteration_tokens):
        if not rows:
            continue
        if i in joined:
            runs.append(1)
            last = None
            continue
        here = (i, row_bucket(rows))
        if last is not None and here == (last[0] + 1, last[1]):
            runs[-1] += 1
        else:
            runs.append(1)
        last = here
    return 1 + sum(bin(r).count("1") for r in runs)


def cu(lens):
    return torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()],
                        dtype=torch.int32)


def reference(q, k, v, q_lens, k_lens, causal, scale):
    # float64, one sequence at a time: plain softmax(q k^T * scale) v.
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64)
    lse = torch.full(q.shape[:2], -INF, dtype=torch.float64)
    cq, ck = cu(q_lens).tolist(), cu(k_lens).tolist()
    for s in range(len(q_lens)):
        if q_lens[s] == 0 or k_lens[s] == 0:
            continue
        qs = q[cq[s]:cq[s + 1]].double()
        ks, vs = k[ck[s]:ck[s + 1]].double(), v[ck[s]:ck[s + 1]].double()
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        if causal:
            keep = torch.ones(q_lens[s], k_lens[s], dtype=torch.bool).tril()
            scores = scores.masked_fill(~keep, -INF)
        lse[cq[s]:cq[s + 1]] = torch.logsumexp(scores, -1).t()
        out[cq[s]:cq[s + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs)
    return out, lse


def inputs(q_lens, k_lens, heads, dqk, dv, dtype, strided=False):
    tq, tk = sum(q_lens), sum(k_lens)
    if strided:  # q a slice of a wider buffer, k head-major, v a slice of a padded v
        q = torch.randn(tq, heads, dqk + 8, generator=g)[..., 3:3 + dqk]
        k = torch.randn(heads, tk, dqk, generator=g).transpose(0, 1)
        v = torch.randn(tk, heads, dv + 5, generator=g)[..., :dv]
    else:
        q = torch.randn(tq, heads, dqk, generator=g)
        k = torch.randn(tk, heads, dqk, generator=g)
        v = torch.randn(tk, heads, dv, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def check(q_lens, k_lens=None, *, dqk, dv, causal, cfg, heads=2, dtype=torch.float32,
          strided=False):
    k_lens = q_lens if k_lens is None else k_lens
    q, k, v = inputs(q_lens, k_lens, heads, dqk, dv, dtype, strided)
    scale = dqk ** -0.5
    out, lse = varlen_attention(q, k, v, cu(q_lens), cu(k_lens),
                                max_seqlen_q=max(q_lens, default=0), causal=causal,
                                softmax_scale=scale, config=cfg)
    ref_out, ref_lse = reference(q, k, v, q_lens, k_lens, causal, scale)
    what = f"q_lens={q_lens} k_lens={k_lens} dqk={dqk} dv={dv} causal={causal} {cfg}"
    assert out.shape == ref_out.shape and out.dtype == q.dtype, what
    assert lse.shape == ref_lse.shape and lse.dtype == torch.float32, what
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), what
    # Empty sequences: exactly -inf and 0; everything else finite.
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), what
    assert torch.equal(out[torch.isneginf(ref_lse)], torch.zeros_like(out[torch.isneginf(
        ref_lse)])), what
    fin = torch.isfinite(ref_lse)
    assert torch.isfinite(lse[fin]).all(), what
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    err_o = (out.double() - ref_out).abs().max().item() if out.numel() else 0.0
    err_l = (lse.double()[fin] - ref_lse[fin]).abs().max().item() if fin.any() else 0.0
    assert err_o < tol, f"{what}: max |out - ref| = {err_o}"
    assert err_l < 1e-5, f"{what}: max |lse - ref| = {err_l}"


C16, C32_16, C16_32 = AttentionConfig(16, 16, 4, 1), AttentionConfig(32, 16, 4, 2), \
    AttentionConfig(16, 32, 4, 1)
LENS = [0, 1, 17, 63, 64, 65, 130]
Q_LENS = [0, 1, 17, 63, 64, 65, 130, 3, 2]   # non-causal: a sequence without queries,
K_LENS = [5, 0, 1, 65, 64, 130, 17, 63, 0]   # one without keys, one key, block edges


def test_small_dims():
    for cfg in (C16, C32_16):
        check(Q_LENS, K_LENS, dqk=24, dv=16, causal=False, cfg=cfg)
    for cfg in (C16, C32_16, C16_32):  # diagonal blocks: M == N, M > N, M < N
        check(LENS, dqk=24, dv=16, causal=True, cfg=cfg)
    # Padded second QK part (40 = 32 + 8 -> 16) and V (24 -> 32), arbitrary strides, H=3.
    check([17, 40], [33, 5], dqk=40, dv=24, causal=False, cfg=C16, heads=3, strided=True)
    check([17, 40], dqk=40, dv=24, causal=True, cfg=C16, heads=3, strided=True)
    # Powers of two: no second QK dot.
    check([9, 33], [33, 16], dqk=16, dv=16, causal=False, cfg=C16)
    # No keys at all (k is empty): no launch, out 0 and lse -inf everywhere.
    check([3, 4], [0, 0], dqk=24, dv=16, causal=False, cfg=C16)
    check([], [], dqk=24, dv=16, causal=False, cfg=C16)


def test_deepseek_dims():
    check(Q_LENS, K_LENS, dqk=192, dv=128, causal=False, cfg=C16)
    check(LENS, dqk=192, dv=128, causal=True, cfg=C16)
    check([1, 65, 130], [130, 0, 64], dqk=192, dv=128, causal=False, cfg=C16,
          dtype=torch.float16)
    check([65, 130], dqk=192, dv=128, causal=True, cfg=C16, dtype=torch.float16)
    # The Hopper default tiles (128 x 64), a tail in both loops.
    check([130, 7], [200, 64], dqk=192, dv=128, causal=False, cfg=None, heads=1)
    check([200, 7], dqk=192, dv=128, causal=True, cfg=None, heads=1)


def test_nonfinite():
    from mlaprefill.backends.base import VarlenSeqs
    from mlaprefill.backends.math import MathBackend
    from mlaprefill.backends.triton import TritonBackend

    for causal in (False, True):
        q_lens = [17, 40, 33, 5]
        k_lens = q_lens if causal else [20, 33, 40, 16]
        q, k, v = inputs(q_lens, k_lens, 2, 24, 16, torch.float32)
        cq, ck = cu(q_lens), cu(k_lens)
        qb, kb = cq.tolist(), ck.tolist()
        # Sequence 2, head 0: key dim 0 is negative for every key, so a query with +inf in
        # dim 0 scores -inf against all keys (softmax sum 0): reported NaN, not "no keys".
        k[kb[2]:kb[3], 0, 0] = -1.0

        def run(q, k, v, cq=cq, ck=ck, causal=causal):
            return varlen_attention(q, k, v, cq, ck, max_seqlen_q=40, causal=causal,
                                    softmax_scale=0.3, config=AttentionConfig(16, 16, 4, 1))

        out0, lse0 = run(q, k, v)
        assert torch.isfinite(out0).all() and torch.isfinite(lse0).all()
        q1, k1, v1 = q.clone(), k.clone(), v.clone()
        k1[kb[1], 1, 3] = float("nan")   # sequence 1: NaN in its first key (head 1)
        v1[kb[1], 0] = float("nan")      # and first value (head 0)
        q1[qb[2] + 4, 0, 0] = INF        # sequence 2: one query row, head 0
        out1, lse1 = run(q1, k1, v1)
        nan_out = torch.zeros(q.shape[:2], dtype=torch.bool)
        nan_out[qb[1]:qb[2]] = True      # key 0 is visible to every row, causal or not
        nan_out[qb[2] + 4, 0] = True
        nan_lse = torch.zeros(q.shape[:2], dtype=torch.bool)
        nan_lse[qb[1]:qb[2], 1] = True   # a NaN value leaves the LSE alone
        nan_lse[qb[2] + 4, 0] = True
        assert torch.equal(torch.isnan(out1).all(dim=-1), nan_out), f"causal={causal}"
        assert not torch.isnan(out1[~nan_out]).any()
        assert torch.equal(torch.isnan(lse1), nan_lse), f"causal={causal}"
        # Every other row and LSE, bitwise as without the non-finite values.
        assert torch.equal(out1[~nan_out], out0[~nan_out]), f"NaN leaked (causal={causal})"
        assert torch.equal(lse1[~nan_lse], lse0[~nan_lse]), f"NaN leaked (causal={causal})"

        # The backend, on the clean inputs, agrees with the math backend (two float32
        # computations in different orders: 4.8e-5 apart seen once on a 2-core machine).
        seqs = VarlenSeqs(cq, ck, max(q_lens), max(k_lens))
        t_out, t_lse = TritonBackend().attend(q, k, v, seqs, causal=causal,
                                              softmax_scale=0.3)
        m_out, m_lse = MathBackend().attend(q, k, v, seqs, causal=causal,
                                            softmax_scale=0.3)
        assert torch.allclose(t_out, m_out, atol=1e-4), (t_out - m_out).abs().max()
        assert torch.allclose(t_lse, m_lse, atol=1e-4), (t_lse - m_lse).abs().max()


def test_hybrid():
    # The hybrid backend's composition: the kernel skips each rectangle (dense=), the
    # rectangle is computed apart (torch on CPU, cuDNN on CUDA) and merged by LSE.
    from mlaprefill.backends.base import VarlenSeqs
    from mlaprefill.backends.mlaprefill import MLAPrefillBackend, dense_rectangles

    be = MLAPrefillBackend(big_work=1, min_queries_per_key=0)
    cases = [
        # off-grid lengths: one rectangle per sequence (520 -> 512 queries, 1100 -> 1024
        # keys; 300 -> 256, 700 -> 640; 5 -> none), each with a tail of 256 queries (the
        # last 256 of the sequence), so the kernel skips every row: 520 -> 768, 300 -> 512
        ([300, 5, 520], [700, 0, 1100], [(2, 3, 768, 1024), (0, 1, 512, 640)]),
        ([300, 5, 520], None, [(2, 3, 512, 512), (0, 1, 256, 256)]),
        # on-grid equal neighbours batch into one call; the odd one out is alone
        ([256, 256, 256, 300], [384, 384, 384, 384], [(0, 3, 256, 384), (3, 4, 512, 384)]),
        ([256, 256, 1], None, [(0, 2, 256, 256)]),
    ]
    for q_lens, k_lens, expect in cases:
        causal = k_lens is None
        k_lens = q_lens if causal else k_lens
        cq, ck = cu(q_lens), cu(k_lens)
        rects = dense_rectangles(cq.tolist(), ck.tolist(), num_heads=2, causal=causal,
                                 big_work=1)
        assert [r.kernel_args for r in rects] == expect, (rects, expect)
        q, k, v = inputs(q_lens, k_lens, 2, 24, 16, torch.float32)
        seqs = VarlenSeqs(cq, ck, max(q_lens), max(k_lens), cu_seqlens_q_host=cq.tolist(),
                          cu_seqlens_k_host=ck.tolist())
        out, lse = be.attend(q, k, v, seqs, causal=causal, softmax_scale=0.3)
        ref_out, ref_lse = reference(q, k, v, q_lens, k_lens, causal, 0.3)
        fin = torch.isfinite(ref_lse)
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
        err = (out.double() - ref_out).abs().max()
        assert err < 1e-5, (q_lens, k_lens, err)
        assert (lse.double()[fin] - ref_lse[fin]).abs().max() < 1e-5
        # A NaN key inside sequence 0's rectangle: sequence 0 NaN, the others bitwise equal.
        k1 = k.clone()
        k1[3, 1, 2] = float("nan")
        out1, lse1 = be.attend(q, k1, v, seqs, causal=causal, softmax_scale=0.3)
        assert torch.isnan(lse1[:q_lens[0], 1][3 if causal else 0:]).all()
        rest = slice(q_lens[0], None)
        assert torch.equal(out1[rest], out[rest]) and torch.equal(lse1[rest], lse[rest])
        # attend_and_store: the same result stored into given tensors (over stale values), the
        # rectangles merged into them
        o2 = torch.full_like(out, 5.0)
        l2 = torch.full_like(lse, -3.0)
        assert be.attend_and_store(q, k, v, seqs, o2, l2, causal=causal,
                                   softmax_scale=0.3) is None
        assert torch.equal(o2, out) and torch.equal(l2, lse), (q_lens, k_lens)


def test_forward():
    # The whole chunked forward on the triton and hybrid backends (Triton gather, attention
    # and merge all in the interpreter; the hybrid's rectangles in torch on CPU) against the
    # float64 reference: zero context, one token, page boundaries, a rectangle-sized request.
    from conftest import paged_mla_inputs
    from mlaprefill.backends.base import VarlenSeqs
    from mlaprefill.backends.mlaprefill import MLAPrefillBackend
    from mlaprefill.backends.triton import TritonBackend
    from mlaprefill.batch import PrefillBatch
    from mlaprefill.graphs import IterationGraphs
    from mlaprefill.plan import ChunkPlanner
    from mlaprefill.prefill import MLAChunkedPrefill
    from mlaprefill.reference import mla_prefill_reference
    from mlaprefill.staging import StagingRing

    query_lens, context_lens = [17, 1, 300, 5], [0, 64, 700, 128]
    x = paged_mla_inputs(query_lens, context_lens, heads=2, rank=16, nope=16, rope=8, v=16,
                         page_size=16)
    ref_out, ref_lse = mla_prefill_reference(
        x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"], x["block_table"], query_lens,
        context_lens, x["weight"], qk_nope_head_dim=16, v_head_dim=16)
    runs = [("triton", "balanced", 512, False), ("hybrid", "equal", 512, False),
            # padded iterations (what graphs capture; eager on CPU): many
            # iterations, the last ones short; hybrid's iterations with a cuDNN-sized
            # rectangle through the static buffers too; equal's part-filled iterations
            # padded to their own row buckets
            ("triton", "packed", 96, True), ("hybrid", "packed", 160, True),
            ("triton", "equal", 96, True)]
    for name, policy, workspace, graphs in runs:
        shared = IterationGraphs()  # on CPU it counts every padded iteration as a warm run
        op = MLAChunkedPrefill(x["weight"], qk_nope_head_dim=16, v_head_dim=16,
                               backend="mlaprefill", graphs=shared if graphs else None)
        # "triton": our kernel alone; "hybrid": with rectangles even at this size
        op._backend = (TritonBackend() if name == "triton"
                       else MLAPrefillBackend(big_work=1, min_queries_per_key=0))
        plan = ChunkPlanner(workspace, 16, policy=policy).plan(
            PrefillBatch(query_lens, context_lens, page_size=16))
        assert not graphs or plan.num_iterations >= 4
        out, lse = op.forward(x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"],
                              x["block_table"], StagingRing("cpu").upload(plan),
                              return_lse=True)
        assert op.backend_name == {"triton": "mlaprefill-kernel", "hybrid": "mlaprefill"}[name]
        if name == "triton":  # split keys only: one [k_nope | v] GEMM, no zero-row W_K
            assert {key[-1] for key in op.upproj._cache} == {"kv"}
        err_o = (out.double() - ref_out).abs().max().item()
        err_l = (lse.double() - ref_lse).abs().max().item()
        assert err_o < 1e-4 and err_l < 1e-4, (name, workspace, graphs, err_o, err_l)
        if graphs:  # every iteration padded through the static buffers, the hybrid's
            # rectangle ones (joined keys, cuDNN's part in torch here) too
            split = [i for i in range(plan.num_iterations) if not op.backend.wants_joined_keys(
                VarlenSeqs(None, None, 0, 0, cu_seqlens_q_host=plan.cu_query_lens,
                           cu_seqlens_k_host=plan.cu_seq_lens[i]), 2, False)]
            joined = set(range(plan.num_iterations)) - set(split)
            assert shared.warm_runs == padded_launches(plan, joined)
            # triton: consecutive iterations share launches
            assert name == "hybrid" or shared.warm_runs < 1 + sum(
                1 for t in plan.iteration_tokens if t)
            assert name == "triton" or 0 < len(split) < plan.num_iterations, split
            assert shared.captures == shared.replays == 0  # no CUDA graphs on CPU
        else:
            assert op.graphs is None


def test_split_and_state():
    # k_rope: the key's last dims as one row per key shared by every head (MLA's rope key,
    # head stride 0) or per head; state: merge into a running (out, lse) in place.
    for causal in (False, True):
        q_lens = [0, 1, 17, 64, 65, 40]
        k_lens = q_lens if causal else [5, 0, 65, 64, 17, 130]
        q, k, v = inputs(q_lens, k_lens, 3, 24, 16, torch.float32)
        k[..., 16:] = k[:, :1, 16:]  # one rope row per key, the same in every head
        cq, ck = cu(q_lens), cu(k_lens)
        kw = dict(max_seqlen_q=max(q_lens), causal=causal, softmax_scale=0.3, config=C16)
        joined = varlen_attention(q, k, v, cq, ck, **kw)
        shared = varlen_attention(q, k[..., :16].contiguous(), v, cq, ck, **kw,
                                  k_rope=k[:, 0, 16:].contiguous())
        per_head = varlen_attention(q, k[..., :16], v, cq, ck, **kw, k_rope=k[..., 16:])
        for got in (shared, per_head):  # the same loads, so bitwise the same
            assert torch.equal(got[0], joined[0]) and torch.equal(got[1], joined[1])
        ref_out, ref_lse = reference(q, k, v, q_lens, k_lens, causal, 0.3)
        fin = torch.isfinite(ref_lse)
        assert (joined[0].double() - ref_out).abs().max() < 1e-5
        assert (joined[1].double()[fin] - ref_lse[fin]).abs().max() < 1e-5
        # out=: the same result stored into strided views of bigger tensors over stale
        # values (a sequence without keys too), nothing outside the views written
        big_o = torch.full((q.shape[0] + 3, 3, 20), 7.0)
        big_l = torch.full((q.shape[0] + 3, 3), 7.0)
        o_view, l_view = big_o[2:-1, :, :16], big_l[2:-1]
        got = varlen_attention(q, k[..., :16].contiguous(), v, cq, ck, **kw,
                               k_rope=k[:, 0, 16:].contiguous(), out=(o_view, l_view))
        assert got[0] is o_view and got[1] is l_view
        assert torch.equal(o_view, joined[0]) and torch.equal(l_view, joined[1])
        assert (big_o[:2] == 7).all() and (big_o[-1] == 7).all()
        assert (big_o[..., 16:] == 7).all() and (big_l[:2] == 7).all()
        for bad, match in (({"state": (o_view, l_view)}, "not both"),
                           ({}, "out lse must be float32")):
            try:
                varlen_attention(q, k, v, cq, ck, **kw, out=(o_view, l_view.double())
                                 if not bad else (o_view, l_view), **bad)
            except ValueError as exc:
                assert match in str(exc), exc
            else:
                raise AssertionError(f"out= accepted with {bad or 'a float64 lse'}")

    # The rope copy for backends that need joined keys (Triton kernel in the interpreter).
    from mlaprefill.kernels.rope import broadcast_rope_

    kk = torch.randn(37, 3, 24, generator=g)
    pe = torch.randn(37, 8, generator=g)
    want = kk.clone()
    want[:, :, 16:] = pe[:, None, :]
    assert torch.equal(broadcast_rope_(kk, pe, 16), want)

    # state: keys split in two parts per sequence; part A fresh, part B merged into it.
    q_lens, a_lens, b_lens = [17, 1, 40, 9, 33], [20, 3, 0, 64, 1], [45, 0, 17, 1, 64]
    heads = 2
    q = torch.randn(sum(q_lens), heads, 24, generator=g)
    parts = [inputs([0] * 5, lens, heads, 24, 16, torch.float32)[1:] for lens in
             (a_lens, b_lens)]
    (ka, va), (kb, vb) = parts
    kw = dict(max_seqlen_q=40, causal=False, softmax_scale=0.3, config=C16)
    out, lse = varlen_attention(q, ka, va, cu(q_lens), cu(a_lens), **kw)
    state = (out, lse)
    got = varlen_attention(q, kb, vb, cu(q_lens), cu(b_lens), **kw, state=state)
    assert got[0] is out and got[1] is lse
    ca, cb = cu(a_lens).tolist(), cu(b_lens).tolist()
    k_all = torch.cat([torch.cat([ka[ca[s]:ca[s + 1]], kb[cb[s]:cb[s + 1]]]) for s in
                       range(5)])
    v_all = torch.cat([torch.cat([va[ca[s]:ca[s + 1]], vb[cb[s]:cb[s + 1]]]) for s in
                       range(5)])
    all_lens = [a + b for a, b in zip(a_lens, b_lens, strict=True)]
    ref_out, ref_lse = reference(q, k_all, v_all, q_lens, all_lens, False, 0.3)
    assert (out.double() - ref_out).abs().max() < 1e-5
    assert (lse.double() - ref_lse).abs().max() < 1e-5
    # Rows with no key in the call (sequence 1 has none in part B; a rectangle left to
    # another kernel) are left exactly as they were: the merge of nothing.
    before = (out.clone(), lse.clone())
    dense = ((4, 5, 32, 64),)  # sequence 4: rows [0, 32) x keys [0, 64) = all of part B
    varlen_attention(q, kb, vb, cu(q_lens), cu(b_lens), **kw, dense=dense, state=state)
    q4 = cu(q_lens).tolist()[4]
    assert torch.equal(out[q4:q4 + 32], before[0][q4:q4 + 32])
    assert torch.equal(lse[q4:q4 + 32], before[1][q4:q4 + 32])
    assert torch.equal(out[17:18], before[0][17:18])  # sequence 1: no keys in part B
    # NaN in a state row stays NaN; other rows unchanged by a NaN elsewhere.
    lse[0, 0] = float("nan")
    varlen_attention(q, kb, vb, cu(q_lens), cu(b_lens), **kw, state=state)
    assert torch.isnan(lse[0, 0]) and torch.isnan(out[0, 0]).all()
    assert torch.isfinite(lse[1:]).all() and torch.isfinite(lse[0, 1])


def test_tma():
    # K / V tiles through tensor descriptors: bitwise the pointer loads' result (the same
    # values, zeros past each sequence), NaN included, on the shapes above.
    import dataclasses

    def same(a, b, what):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True, msg=what)

    def both(q, k, v, q_lens, k_lens, cfg, **kw):
        tma = dataclasses.replace(cfg, tma=True)
        args = (q, k, v, cu(q_lens), cu(k_lens))
        kw = dict(max_seqlen_q=max(q_lens), softmax_scale=0.3, **kw)
        a = varlen_attention(*args, config=cfg, **kw)
        b = varlen_attention(*args, config=tma, **kw)
        same(a, b, f"{q_lens} {k_lens} {cfg} {kw.get('causal')}")
        return b

    cases = [(Q_LENS, K_LENS, False, 24, 16), (LENS, LENS, True, 24, 16),
             ([1, 65, 130], [130, 0, 64], False, 192, 128), ([65, 130], None, True, 192, 128)]
    for q_lens, k_lens, causal, dqk, dv in cases:
        k_lens = q_lens if k_lens is None else k_lens
        for cfg, dtype in ((C16, torch.float32), (C32_16, torch.float16), (C16_32,
                                                                              torch.float32)):
            q, k, v = inputs(q_lens, k_lens, 2, dqk, dv, dtype)
            out, lse = both(q, k, v, q_lens, k_lens, cfg, causal=causal)
        ref_out, ref_lse = reference(q, k, v, q_lens, k_lens, causal, 0.3)
        fin = torch.isfinite(ref_lse)
        assert (out.double() - ref_out).abs().max() < 1e-5
        assert (lse.double()[fin] - ref_lse[fin]).abs().max() < 1e-5
    # NaN / inf in one sequence's keys, values and queries (rows past a short sequence's
    # keys are the next sequence's: the descriptor must not read them).
    q_lens, k_lens = [17, 40, 33, 5], [20, 33, 40, 16]
    q, k, v = inputs(q_lens, k_lens, 2, 24, 16, torch.float32)
    k[20, 1, 3] = v[20, 0, 5] = float("nan")
    q[17 + 4, 0, 0] = INF
    out, lse = both(q, k, v, q_lens, k_lens, C16, causal=False)
    assert torch.isfinite(lse[:17]).all() and torch.isfinite(out[:17]).all()
    # split keys (shared rope row, head stride 0) and the state merge
    q, k, v = inputs(q_lens, k_lens, 3, 24, 16, torch.float32)
    kn, pe = k[..., :16].contiguous(), k[:, 0, 16:].contiguous()
    both(q, kn, v, q_lens, k_lens, C16, causal=False, k_rope=pe)
    s1 = varlen_attention(q[:, :, :16].contiguous(), kn, v, cu(q_lens), cu(k_lens),
                          max_seqlen_q=40, causal=False, softmax_scale=0.3, config=C16)
    s2 = tuple(t.clone() for t in s1)
    varlen_attention(q, kn, v, cu(q_lens), cu(k_lens), max_seqlen_q=40, causal=False,
                     softmax_scale=0.3, config=C16, k_rope=pe, state=s1)
    varlen_attention(q, kn, v, cu(q_lens), cu(k_lens), max_seqlen_q=40, causal=False,
                     softmax_scale=0.3, config=dataclasses.replace(C16, tma=True),
                     k_rope=pe, state=s2)
    same(s1, s2, "state")
    # A misaligned layout is a clear error naming the fix, not a wrong answer.
    q, k, v = inputs(q_lens, k_lens, 2, 24, 16, torch.float32, strided=True)
    kodd = torch.randn(sum(k_lens), 2, 25, generator=g)[..., 1:]  # base 4 bytes off
    vodd = torch.randn(sum(k_lens), 2, 17, generator=g)[..., :16]  # token stride 136 B
    for kk, vv in ((kodd, v), (k, vodd)):
        try:
            varlen_attention(q, kk, vv, cu(q_lens), cu(k_lens), max_seqlen_q=40,
                             causal=False, softmax_scale=0.3,
                             config=dataclasses.replace(C16, tma=True))
        except ValueError as e:
            assert "tma=False" in str(e), e
        else:
            raise AssertionError("misaligned k / v accepted with tma=True")


def test_graphs_random():
    # the graphs' padded iterations (eager here) on random awkward batches: zero
    # context, one token, contexts at and one past page boundaries, many short iterations;
    # against the float64 reference and the unpadded forward. One IterationGraphs
    # serves every case and two layers: its static buffers keep the previous case's
    # values (more sequences, other offsets) where this one pads, and grow when it is bigger.
    import random

    from conftest import paged_mla_inputs
    from mlaprefill.batch import PrefillBatch
    from mlaprefill.graphs import IterationGraphs
    from mlaprefill.plan import ChunkPlanner
    from mlaprefill.prefill import MLAChunkedPrefill
    from mlaprefill.reference import mla_prefill_reference
    from mlaprefill.staging import StagingRing

    rnd = random.Random(11)
    shared = IterationGraphs()
    generations = set()
    for case in range(7):
        n = rnd.randint(2, 4) if case else 1  # the first case small: later ones grow it
        query_lens = [rnd.choice([1, 2, 7, 16, 17]) for _ in range(n)]
        context_lens = [rnd.choice([0, 1, 15, 16, 17, 32, 33, 90]) for _ in range(n)]
        workspace = max(16 * n, 16 * rnd.randint(1, 3))
        context_lens[0] = max(context_lens[0], 3 * workspace + 1)  # >= 4 iterations
        policy = rnd.choice(["packed", "equal", "balanced"])
        x = paged_mla_inputs(query_lens, context_lens, heads=2, rank=16, nope=16, rope=8,
                             v=16, page_size=16, seed=case)
        ref_out, ref_lse = mla_prefill_reference(
            x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"], x["block_table"],
            query_lens, context_lens, x["weight"], qk_nope_head_dim=16, v_head_dim=16)
        plan = ChunkPlanner(workspace, 16, policy=policy).plan(
            PrefillBatch(query_lens, context_lens, page_size=16))
        what = (query_lens, context_lens, workspace, policy, plan.num_iterations)
        assert plan.num_iterations >= 4, what
        got = []
        ops = [MLAChunkedPrefill(x["weight"], qk_nope_head_dim=16, v_head_dim=16,
                                 backend="mlaprefill", graphs=g)
               for g in (None, shared, shared)]
        for op in ops:
            counts = op.graphs or shared
            runs_before = counts.warm_runs
            got.append(op.forward(x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"],
                                  x["block_table"], StagingRing("cpu").upload(plan),
                                  return_lse=True))
            out, lse = got[-1]
            assert (out.double() - ref_out).abs().max() < 1e-4, what
            assert (lse.double() - ref_lse).abs().max() < 1e-4, what
            padded = counts.warm_runs - runs_before
            assert padded == (0 if op.graphs is None else padded_launches(plan)), (
                what, padded)
        generations.update(a.generation for a in shared._arenas.values())
        for eager_or_graph in got[1:]:
            assert (got[0][0] - eager_or_graph[0]).abs().max() < 1e-5, what
    assert len(shared._arenas) == 1 and len(generations) >= 2  # one arena, grown


def test_stand_ins():
    # What a stand-in replays: the launches of bigger buckets (sequences, longest query run,
    # rows, new tokens) over a step's static buffers give that step's result (the float64
    # reference): the extra sequences are empty, the extra query blocks and rows unused.
    from conftest import paged_mla_inputs
    from mlaprefill.batch import PrefillBatch
    from mlaprefill.graphs import IterationGraphs, pow2_at_least, row_bucket
    from mlaprefill.kvcache import resolve_kv_cache
    from mlaprefill.plan import ChunkPlanner
    from mlaprefill.prefill import MLAChunkedPrefill
    from mlaprefill.reference import mla_prefill_reference
    from mlaprefill.replay import _ArenaReplay, _NewTokens, _PaddedIteration
    from mlaprefill.staging import StagingRing

    shared = IterationGraphs()
    big = ([9, 70, 3, 1, 5, 2, 8, 4], [100, 33, 600, 0, 17, 64, 90, 40])
    step = ([3, 17, 1], [40, 300, 16])
    for (query_lens, context_lens), check in ((big, False), (step, True)):
        x = paged_mla_inputs(query_lens, context_lens, heads=2, rank=16, nope=16, rope=8,
                             v=16, page_size=16, seed=len(query_lens))
        op = MLAChunkedPrefill(x["weight"], qk_nope_head_dim=16, v_head_dim=16,
                               backend="mlaprefill", graphs=shared)
        plan = ChunkPlanner(128, 16, policy="equal").plan(
            PrefillBatch(query_lens, context_lens, page_size=16))
        dp = StagingRing("cpu").upload(plan)
        if not check:  # grows the arena: 8 sequences, more rows and tokens
            op.forward(x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"],
                       x["block_table"], dp)
            continue
        tokens = row_bucket(plan.num_query_tokens)
        rows = [row_bucket(t) for t in plan.iteration_tokens]
        spec = resolve_kv_cache(x["kv_cache"], latent_dim=x["kv_cache"].shape[2],
                                dtype=x["q"].dtype)
        replay = _ArenaReplay(op, x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"], spec,
                              x["block_table"], dp, 8, 24 ** -0.5,
                              2 * tokens, 2 * max(tokens, *rows))  # room for the bigger
        arena = replay.arena
        assert arena.cu_q.shape[0] - 1 >= 8 > pow2_at_least(plan.num_reqs)
        seqs, max_q = 8, 2 * pow2_at_least(plan.max_query_len, 64)  # bigger buckets
        scale = 24 ** -0.5
        _NewTokens(op, arena, seqs, max_q, 2 * tokens, 8, scale, None)()
        arena.counter.fill_(0)
        for i, r in enumerate(rows):
            if plan.iteration_tokens[i]:
                arena.counter.fill_(i)
                _PaddedIteration(op, arena, x["kv_cache"], spec, seqs, max_q, 2 * r, 1, scale,
                                 None)()
        out, lse = replay.result(torch.float32, True, None, None)
        ref_out, ref_lse = mla_prefill_reference(
            x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"], x["block_table"],
            query_lens, context_lens, x["weight"], qk_nope_head_dim=16, v_head_dim=16)
        assert (out.double() - ref_out).abs().max() < 1e-4
        assert (lse.double() - ref_lse).abs().max() < 1e-4


def test_static_io():
    # MLAChunkedPrefill.io_buffers and forward(out=, lse=) through the static buffers
    # (padded launches, eager on CPU), two layers sharing one IterationGraphs: a q written
    # into io.q is not copied, out= / lse= the io buffers are written in place (the next
    # forward overwrites them), the results are the copying forward's and the float64
    # reference's; io buffers survive the arena growing for more rows; stale ones (the
    # token capacity grew since) are copied like any q / out.
    from torch.utils._python_dispatch import TorchDispatchMode

    from conftest import paged_mla_inputs
    from mlaprefill.batch import PrefillBatch
    from mlaprefill.graphs import IterationGraphs
    from mlaprefill.plan import ChunkPlanner
    from mlaprefill.prefill import MLAChunkedPrefill
    from mlaprefill.reference import mla_prefill_reference
    from mlaprefill.staging import StagingRing

    class CopiesInto(TorchDispatchMode):
        # (storage written, shape written) of every aten.copy_; the interpreter copies each
        # kernel argument back onto itself, a whole argument (arena.q or a bucket of it)
        def __init__(self):
            super().__init__()
            self.into = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.copy_.default:
                self.into.add((args[0].untyped_storage().data_ptr(), tuple(args[0].shape)))
            return func(*args, **(kwargs or {}))

    query_lens, context_lens = [17, 1, 30, 5], [0, 64, 200, 33]
    x = paged_mla_inputs(query_lens, context_lens, heads=2, rank=16, nope=16, rope=8, v=16,
                         page_size=16)
    T = sum(query_lens)
    ref_out, ref_lse = mla_prefill_reference(
        x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"], x["block_table"], query_lens,
        context_lens, x["weight"], qk_nope_head_dim=16, v_head_dim=16)
    dp = StagingRing("cpu").upload(ChunkPlanner(96, 16, policy="balanced").plan(
        PrefillBatch(query_lens, context_lens, page_size=16)))
    assert dp.chunk_plan.num_iterations >= 2
    rest = (x["kv_c_new"], x["k_pe_new"], x["kv_cache"], x["block_table"], dp)
    kw = dict(dtype=torch.float32, device="cpu", qk_rope_head_dim=8)

    def layers(shared):
        return [MLAChunkedPrefill(x["weight"], qk_nope_head_dim=16, v_head_dim=16,
                                  backend="mlaprefill", graphs=shared)
                for _ in range(2)]

    # the io buffers made first: the forward then grows the arena for rows, seqs, ...
    shared = IterationGraphs()
    op1, op2 = layers(shared)
    io = op1.io_buffers(T, **kw)
    assert io.q.shape == x["q"].shape and io.q.dtype == torch.float32
    assert op2.io_buffers(T, **kw).q.data_ptr() == io.q.data_ptr()  # one per IterationGraphs
    io.q.copy_(x["q"])
    with CopiesInto() as copies:
        out, lse = op1.forward(io.q, *rest, out=io.out, lse=io.lse)
    (arena,) = shared._arenas.values()
    assert arena.generation > 1 and arena.q.data_ptr() == io.q.data_ptr()  # grew, q kept
    q_copy = (io.q.untyped_storage().data_ptr(), tuple(io.q.shape))
    out_copy = (io.out.untyped_storage().data_ptr(), tuple(io.out.shape))
    assert q_copy not in copies.into and out_copy not in copies.into  # no copy in or out
    assert out is io.out and lse is io.lse
    assert out.data_ptr() == arena.out.data_ptr() and lse.data_ptr() == arena.lse.data_ptr()
    assert (out.double() - ref_out).abs().max() < 1e-4
    assert (lse.double() - ref_lse).abs().max() < 1e-4
    with CopiesInto() as copies:
        plain = op1.forward(x["q"], *rest, return_lse=True)  # copies in and out
    assert q_copy in copies.into and plain[0].data_ptr() != arena.out.data_ptr()
    assert torch.equal(plain[0], out) and torch.equal(plain[1], lse)
    # the caller's own out= / lse=: written (one copy), the same values
    mine = torch.full_like(out, 9.0), torch.full_like(lse, 9.0)
    got = op1.forward(x["q"], *rest, out=mine[0], lse=mine[1])
    assert got[0] is mine[0] and torch.equal(mine[0], out) and torch.equal(mine[1], lse)
    # the next forward through the arena overwrites the buffers: layer 2, other queries
    first = out.clone()
    q2 = x["q"] * 0.5
    io.q.copy_(q2)
    out2, lse2 = op2.forward(io.q, *rest, out=io.out, lse=io.lse)
    assert out2.data_ptr() == out.data_ptr() and torch.equal(out, out2)
    assert not torch.equal(out2, first)
    want = op1.forward(q2, *rest, return_lse=True)
    assert torch.equal(want[0], out2) and torch.equal(want[1], lse2)
    # stale io buffers: the token capacity grew after they were handed out
    stale = op1.io_buffers(T, **kw)
    grown = op1.io_buffers(8 * arena.q.shape[0], **kw)
    assert grown.q.data_ptr() != stale.q.data_ptr()
    stale.q.copy_(x["q"])
    out3 = op1.forward(stale.q, *rest, out=stale.out)
    assert out3 is stale.out and (out3.double() - ref_out).abs().max() < 1e-4


@pytest.fixture(autouse=True)
def _seeded():
    # Every test starts from the generator's seed, as when each ran in a process of its own.
    g.manual_seed(0)
