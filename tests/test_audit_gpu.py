"""Runtime audit on real CUDA memory (marked gpu; skipped without CUDA)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from hostsync import Finding, no_host_sync

pytestmark = pytest.mark.gpu
THIS = os.path.abspath(__file__)


def _next_line() -> int:
    return sys._getframe(1).f_lineno + 1


def _kinds(findings: list[Finding]) -> list[tuple[str, int]]:
    assert all(f.filename == THIS for f in findings), [f.describe() for f in findings]
    return [(f.kind, f.lineno) for f in findings]


def test_real_pageable_non_blocking_copy_is_found() -> None:
    x = torch.arange(1024, dtype=torch.int32)  # 4 KiB of pageable memory
    assert not x.is_pinned()
    with no_host_sync() as audit:
        line = _next_line()
        y = x.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert _kinds(audit.findings) == [("pageable_h2d", line)]
    assert audit.findings[0].devices.startswith("cpu->cuda") and audit.findings[0].nbytes == 4096
    assert torch.equal(y.cpu(), x)


def test_real_pinned_copy_is_clean_non_dense_pinned_is_found() -> None:
    pinned = torch.arange(64 * 64, dtype=torch.int32).reshape(64, 64).pin_memory()
    assert pinned.is_pinned()
    dst = torch.empty(64, 64, dtype=torch.int32, device="cuda")
    with no_host_sync() as audit:
        pinned.to("cuda", non_blocking=True)
        pinned[8:16].to("cuda", non_blocking=True)
        dst.copy_(pinned, non_blocking=True)
    assert audit.findings == []
    with no_host_sync() as audit:
        line = _next_line()
        pinned[:, :8].to("cuda", non_blocking=True)
    assert _kinds(audit.findings) == [("strided_pinned_h2d", line)]
    torch.cuda.synchronize()


def test_item_and_host_reads_of_cuda_tensors() -> None:
    d = torch.arange(16, device="cuda")
    with no_host_sync() as audit:
        line = _next_line()
        total = d.sum().item()
        line2 = _next_line()
        d.tolist()
        line3 = _next_line()
        d.cpu()
        d.to("cpu", non_blocking=True)  # pinned output, no wait
    assert total == 120
    assert _kinds(audit.findings) == [("item", line), ("d2h", line2), ("d2h", line3)]


def test_data_dependent_ops_and_masked_fill_path() -> None:
    d = torch.arange(16, device="cuda")
    with no_host_sync() as audit:
        line = _next_line()
        d.nonzero()
        line2 = _next_line()
        d[d > 3]
        d[d > 3] = 0  # python scalar on CUDA: torch uses masked_fill_, no sync
        torch.repeat_interleave(torch.ones(4, dtype=torch.long, device="cuda"), output_size=4)
    assert _kinds(audit.findings) == [("data_dependent_shape", line),
                                      ("data_dependent_shape", line2)]


def test_explicit_synchronizes() -> None:
    ev = torch.cuda.Event()
    ev.record()
    with no_host_sync() as audit:
        line = _next_line()
        torch.cuda.synchronize()
        line2 = _next_line()
        ev.synchronize()
        line3 = _next_line()
        torch.cuda.current_stream().synchronize()
    assert _kinds(audit.findings) == [("synchronize", line), ("synchronize", line2),
                                      ("synchronize", line3)]


def test_torch_tensor_with_cuda_device_is_a_blocking_copy() -> None:
    with no_host_sync() as audit:
        line = _next_line()
        torch.tensor([1, 2, 3], device="cuda")
    assert _kinds(audit.findings) == [("sync_h2d", line)]


def test_profiler_confirms_pageable_memcpy() -> None:
    x = torch.ones(1 << 20, dtype=torch.uint8)
    with no_host_sync(profile=True) as audit:
        x.to("cuda", non_blocking=True)
    assert audit.profiler_pageable_memcpy is not None and audit.profiler_pageable_memcpy >= 1
    kinds = [f.kind for f in audit.findings]
    assert kinds[0] == "pageable_h2d"
    if audit.profiler_pageable_memcpy == 1:
        assert kinds == ["pageable_h2d"]  # the dispatcher attributed it: no extra finding
    pinned = x.pin_memory()
    with no_host_sync(profile=True) as audit:
        pinned.to("cuda", non_blocking=True)
    assert audit.profiler_pageable_memcpy == 0 and audit.findings == []


def test_pinned_copy_does_not_block_behind_queued_work() -> None:
    from mlaprefill.stallmap import CudaCopyTimer

    timer = CudaCopyTimer(queue_ms=20.0)
    timer.warmup()
    blocked, queued = min(timer(4 << 20, "pinned") for _ in range(3))
    assert queued > 10.0  # the calibrated sleep really queued work
    assert blocked < 0.25 * queued


def test_graph_break_item_in_compiled_code_is_found() -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        if x.sum().item() > 0:  # dynamo graph-breaks here; the read runs eagerly
            return x + 1
        return x - 1

    compiled = torch.compile(step, backend="eager")
    x = torch.ones(8, device="cuda")
    compiled(x)  # compile outside the audit
    with no_host_sync() as audit:
        compiled(x)
    assert "item" in [f.kind for f in audit.findings]
