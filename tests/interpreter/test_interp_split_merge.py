"""``hopper_attention._merge_tail`` (the merge of a split tile's parts) in Triton's interpreter,
against a float64 log-sum-exp (run by tests/test_split_tail.py in a subprocess with
``TRITON_INTERPRET=1``)."""

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 before triton is imported (see tests/test_split_tail.py)",
                allow_module_level=True)

import torch

from mlaprefill.kernels import hopper_attention as ha
from mlaprefill.kernels.merge import merge_attention_states_torch

H, DV, PARTS = 3, 16, 3
Q_LENS = [5, 0, 128, 130]  # the tail tiles (below) are the last sequence's: 128 + 2 rows
N_M = 2  # 128-row query blocks of the longest sequence
N_MAIN = 18  # tiles [0, 18) run whole; 18..23 (sequence 3, every head, both blocks) split


def _parts(seed):
    g = torch.Generator().manual_seed(seed)
    slots = (N_M * H * len(Q_LENS) - N_MAIN) * PARTS
    ws_o = torch.randn(slots, ha.BLOCK_M, DV, generator=g)
    ws_l = torch.randn(slots, ha.BLOCK_M, generator=g) * 3
    ws_l[::2, 7] = float("-inf")        # a part without keys for row 7
    ws_l[:, 9] = float("-inf")          # row 9: no key in any part
    ws_l[1, 11] = float("nan")          # tile 18 (block 0, head 0), row 11: a NaN part
    ws_l[PARTS + 1, 12] = float("nan")  # tile 19 (block 1, head 0), row 140: past the sequence
    ws_o[0, 7] = float("nan")           # garbage under a "no keys" LSE: ignored
    return ws_o, ws_l


def _reference(ws_o, ws_l, base_o, base_l, accumulate):
    """out / lse after the merge, in float64, for every (token, head)."""
    cu = [0, *torch.tensor(Q_LENS).cumsum(0).tolist()]
    out, lse = base_o.double().clone(), base_l.double().clone()
    for j in range(ws_l.shape[0] // PARTS):
        t = N_MAIN + j
        m, head, seq = t % N_M, (t // N_M) % H, t // (N_M * H)
        ls = ws_l[j * PARTS:(j + 1) * PARTS].double()      # [PARTS, 128]
        os_ = ws_o[j * PARTS:(j + 1) * PARTS].double()     # [PARTS, 128, DV]
        big = torch.logsumexp(ls, 0)                         # -inf where every part is -inf
        w = torch.where(torch.isneginf(ls), 0.0, torch.exp(ls - big.clamp_min(-1e300)))
        o = torch.where(torch.isneginf(ls)[..., None], 0.0, os_ * w[..., None]).sum(0)
        nan = torch.isnan(ls).any(0)
        o[nan], big[nan] = float("nan"), float("nan")
        for r in range(ha.BLOCK_M):
            row = m * ha.BLOCK_M + r
            if row >= Q_LENS[seq]:
                continue
            tok = cu[seq] + row
            if not accumulate:
                out[tok, head], lse[tok, head] = o[r], big[r]
            elif not torch.isneginf(big[r]):
                mo, ml = out[tok, head][None, None].clone(), lse[tok, head][None, None].clone()
                merge_attention_states_torch(mo, ml, o[r][None, None], big[r][None, None])
                out[tok, head], lse[tok, head] = mo[0, 0], ml[0, 0]
    return out, lse


@pytest.mark.parametrize("accumulate", [False, True])
def test_merge_tail_matches_float64(accumulate):
    ws_o, ws_l = _parts(3)
    n = sum(Q_LENS)
    g = torch.Generator().manual_seed(4)
    base_o = torch.randn(n, H, DV, generator=g).bfloat16()
    base_l = torch.randn(n, H, generator=g)
    out, lse = base_o.clone(), base_l.clone()
    cu = torch.tensor([0, *torch.tensor(Q_LENS).cumsum(0).tolist()], dtype=torch.int32)
    ha._merge_tail(ws_o, ws_l, out, lse, cu, n_main=N_MAIN, n_split=PARTS, n_m=N_M,
                   accumulate=accumulate)
    ref_o, ref_l = _reference(ws_o, ws_l, base_o, base_l, accumulate)
    assert torch.equal(torch.isnan(lse), torch.isnan(ref_l))
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_l))
    fin = torch.isfinite(ref_l)
    assert (lse[fin].double() - ref_l[fin]).abs().max() <= 1e-5
    assert torch.equal(torch.isnan(out), torch.isnan(ref_o))
    ok = ~torch.isnan(ref_o)
    assert (out.double()[ok] - ref_o[ok]).abs().max() <= 2e-2  # bf16 rounding
    cu_l = cu.tolist()
    untouched = torch.ones(n, H, dtype=torch.bool)
    untouched[cu_l[3]:cu_l[4]] = False                   # the split sequence's rows
    assert torch.equal(out[untouched], base_o[untouched])
    assert torch.equal(lse[untouched], base_l[untouched])
    assert torch.isnan(lse[cu_l[3] + 11, 0]) and torch.isnan(out[cu_l[3] + 11, 0]).all()
    assert int(torch.isnan(lse).sum()) == 1  # the NaN past the sequence is never written
    if accumulate:  # row 9 has no key in any part: untouched
        assert torch.equal(out[cu_l[3] + 9], base_o[cu_l[3] + 9])
    else:
        assert torch.isneginf(lse[cu_l[3] + 9]).all() and (out[cu_l[3] + 9] == 0).all()
