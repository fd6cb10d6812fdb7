"""DCP over NCCL on two GPUs: the CPU cases of test_dcp_dist, each rank on its own GPU."""

from __future__ import annotations

import pytest
import torch

from test_dcp_dist import spawn_dcp


@pytest.mark.gpu
@pytest.mark.slow  # spawns an NCCL process group
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs >= 2 CUDA devices")
def test_dcp_nccl_matches_single_rank(tmp_path) -> None:
    spawn_dcp(2, tmp_path, "cuda")
