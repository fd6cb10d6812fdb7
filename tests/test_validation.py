"""The validation contract of the forward and the one-call API (README "Validation contract").

Checked always on the host: types, shapes, dtypes, devices, the plan against the inputs, block
ids of CPU block tables. Only with ``validate=True`` (it synchronizes): block ids of device block
tables, a DevicePlan whose ring slot was reused.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import paged_mla_inputs
from mlaprefill.api import mla_chunked_prefill
from mlaprefill.batch import PrefillBatch
from mlaprefill.plan import ChunkPlanner
from mlaprefill.prefill import MLAChunkedPrefill
from mlaprefill.staging import StagingRing
from test_attention import check, run_forward

QUERY_LENS, CONTEXT_LENS = [2, 3], [5, 9]


@pytest.fixture
def x():
    return paged_mla_inputs(QUERY_LENS, CONTEXT_LENS, page_size=4)


def _op(x, **kw):
    return MLAChunkedPrefill(x["weight"], qk_nope_head_dim=x["nope"], v_head_dim=x["v"], **kw)


def _plan(x, workspace=8):
    return ChunkPlanner(workspace, 4).plan(PrefillBatch(QUERY_LENS, CONTEXT_LENS, page_size=4))


def _args(x, **replace):
    args = {k: x[k] for k in ("q", "kv_c_new", "k_pe_new", "kv_cache", "block_table")}
    args.update(replace)
    return [args[k] for k in ("q", "kv_c_new", "k_pe_new", "kv_cache", "block_table")]


def _one_call(x, **kw):
    return mla_chunked_prefill(*_args(x), QUERY_LENS, CONTEXT_LENS, x["weight"],
                               workspace_tokens=8, **kw)


@pytest.mark.parametrize("device_plan, match", [
    ("host_plan", r"device_plan must be a DevicePlan, got ChunkPlan \(a host plan: upload it "
                  r"first\); pass StagingRing\(device\).upload\(plan\)"),
    (None, r"device_plan must be a DevicePlan, got NoneType"),
    ({"cu_query_lens": 0}, r"device_plan must be a DevicePlan, got dict"),
])
def test_device_plan_must_be_uploaded(x, device_plan, match):
    """Was: AttributeError ('ChunkPlan' object has no attribute 'plan') deep in the forward."""
    if device_plan == "host_plan":
        device_plan = _plan(x)
    with pytest.raises(TypeError, match=match):
        _op(x).forward(*_args(x), device_plan)


@pytest.mark.parametrize("scale, exc, match", [
    ("x", TypeError, r"softmax_scale must be a number .* got str 'x'"),
    (True, TypeError, r"softmax_scale must be a number .* got bool"),
    (torch.tensor(0.5), TypeError, r"softmax_scale must be a number .* got Tensor"),
    (float("nan"), ValueError, r"softmax_scale must be a finite number > 0, got nan"),
    (float("inf"), ValueError, r"softmax_scale must be a finite number > 0, got inf"),
    (0.0, ValueError, r"softmax_scale must be a finite number > 0, got 0.0"),
    (-0.1, ValueError, r"softmax_scale must be a finite number > 0, got -0.1"),
    (2 ** 1100, ValueError, r"softmax_scale must be a finite number > 0, got inf"),  # was an
    # OverflowError from float()
])
def test_softmax_scale_checked_up_front(x, scale, exc, match):
    """Was: 'x' failed deep in math.py; NaN gave output 0 and LSE -inf for every query."""
    with pytest.raises(exc, match=match):
        _op(x, softmax_scale=scale)
    with pytest.raises(exc, match=match):
        _one_call(x, softmax_scale=scale)


def test_numpy_scale_accepted(x):
    import numpy as np

    out, lse = _one_call(x, softmax_scale=np.float32(12 ** -0.5), return_lse=True)
    check(out, lse, x, QUERY_LENS, CONTEXT_LENS, torch.float32)


@pytest.mark.parametrize("kw, exc, match", [
    (dict(return_lse="yes"), TypeError, r"return_lse must be a bool \(True or False\), got str"),
    (dict(validate=1), TypeError, r"validate must be a bool \(True or False\), got int"),
    # was "must be a bool, got bool": numpy's bool is named as such
    (dict(return_lse=np.True_), TypeError, r"return_lse must be a bool \(True or False\), got "
                                           r"numpy\.bool"),
    (dict(context_source=3), TypeError, r"context_source must be a callable"),
])
def test_forward_flags_are_typed(x, kw, exc, match):
    dplan = StagingRing("cpu").upload(_plan(x))
    with pytest.raises(exc, match=match):
        _op(x).forward(*_args(x), dplan, **kw)


@pytest.mark.parametrize("bad_id, row, col", [(-1, 1, 2), (-7, 0, 0), (10_000, 1, 1)])
def test_cpu_block_ids_checked_before_any_work(x, bad_id, row, col):
    """A negative id used to wrap to the last page (silently another request's data)."""
    table = x["block_table"].clone()
    table[row, col] = bad_id
    num_blocks = x["kv_cache"].shape[0]
    with pytest.raises(ValueError, match=rf"block_table\[{row}, {col}\] = {bad_id} is outside "
                                         rf"\[0, num_blocks={num_blocks}\) but request {row}"):
        _op(x).forward(*_args(x, block_table=table), StagingRing("cpu").upload(_plan(x)))
    with pytest.raises(ValueError, match=rf"block_table\[{row}, {col}\] = {bad_id}"):
        mla_chunked_prefill(*_args(x, block_table=table), QUERY_LENS, CONTEXT_LENS, x["weight"],
                            workspace_tokens=8)


def test_unused_block_table_entries_may_hold_anything(x):
    table = x["block_table"].clone()
    table[0, 2:] = -1  # request 0 has 5 tokens: pages 0 and 1 only
    out, lse = mla_chunked_prefill(*_args(x, block_table=table), QUERY_LENS, CONTEXT_LENS,
                                   x["weight"], workspace_tokens=8, return_lse=True)
    check(out, lse, x, QUERY_LENS, CONTEXT_LENS, torch.float32)


def test_validate_catches_a_reused_ring_slot(x):
    """A ring-mode DevicePlan used after valid_uploads later uploads reads another plan."""
    ring = StagingRing("cpu", valid_uploads=0)
    first = ring.upload(_plan(x, workspace=8))
    ring.upload(_plan(x, workspace=12))  # same slot, other chunk boundaries
    op = _op(x)
    with pytest.raises(ValueError, match=r"device_plan\.\w+ on cpu differs from its host plan"):
        op.forward(*_args(x), first, validate=True)
    fresh = ring.upload(_plan(x, workspace=8))
    out, lse = op.forward(*_args(x), fresh, validate=True, return_lse=True)
    check(out, lse, x, QUERY_LENS, CONTEXT_LENS, torch.float32)


def test_one_call_argument_checks(x, monkeypatch):
    with pytest.raises(ValueError, match=r"page_size=8 but kv_cache has 4 tokens per page"):
        _one_call(x, page_size=8)
    with pytest.raises(TypeError, match=r"policy must be a str, got NoneType"):
        _one_call(x, policy=None)
    with pytest.raises(TypeError, match=r"backend must be a str, got list"):
        _one_call(x, backend=["math"])
    with pytest.raises(TypeError, match=r"backend must be a str \('auto', .*\), got list"):
        _op(x, backend=["math"])
    with pytest.raises(TypeError, match=r"graphs must be an IterationGraphs or None, got int"):
        _op(x, graphs=1)
    with pytest.raises(TypeError, match=r"validate must be a bool \(True or False\), got str"):
        _one_call(x, validate="yes")


def test_staging_ring_rejects_devices_it_cannot_ship_to():
    """Was: StagingRing('meta') accepted, then a TypeError from numpy in upload."""
    with pytest.raises(ValueError, match=r"StagingRing device meta is not supported"):
        StagingRing("meta")
    with pytest.raises(ValueError, match=r"StagingRing device 'xyz' \(str\) is not a device"):
        StagingRing("xyz")


def test_validate_true_on_cpu_gives_the_same_result(x):
    out, lse, _, _ = run_forward(x, QUERY_LENS, CONTEXT_LENS, 8, "packed", validate=True)
    check(out, lse, x, QUERY_LENS, CONTEXT_LENS, torch.float32)


# -- GPU: device block tables are read only with validate=True ------------------------------
@pytest.mark.gpu
def test_gpu_validate_reads_device_block_table_and_default_gives_nan_rows():
    x = paged_mla_inputs(QUERY_LENS, CONTEXT_LENS, page_size=4, heads=2, rank=32, nope=16,
                         rope=16, v=16, dtype=torch.bfloat16, device="cuda")
    dplan = StagingRing("cuda").upload(_plan(x))
    op = _op(x)
    clean = op.forward(*_args(x), dplan)
    table = x["block_table"].clone()
    table[1, 2] = -1
    with pytest.raises(ValueError, match=r"block_table\[1, 2\] = -1 is outside"):
        op.forward(*_args(x, block_table=table), dplan, validate=True)
    out = op.forward(*_args(x, block_table=table), dplan)  # no sync: the gather writes NaN rows
    assert torch.isnan(out[2:]).any(-1).all()              # request 1's rows
    assert torch.equal(out[:2], clean[:2])                 # request 0 untouched
