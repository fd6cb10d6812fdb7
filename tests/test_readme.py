"""The README's example runs as printed and computes full causal attention."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from mlaprefill.reference import mla_prefill_reference

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs_and_matches_reference(capsys) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README.md has no python example"
    ns: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), ns)
    assert "(8, 16, 128) (8, 16)" in capsys.readouterr().out
    ref_out, ref_lse = mla_prefill_reference(
        ns["q"].cpu(), ns["kv_c_new"].cpu(), ns["k_pe_new"].cpu(), ns["kv_cache"].cpu(),
        ns["block_table"].cpu(), [5, 3], [200, 0], ns["kv_b_proj"].cpu(),
        qk_nope_head_dim=128, v_head_dim=128)
    out, lse = ns["out"].cpu().double(), ns["lse"].cpu().double()
    assert torch.linalg.norm(out - ref_out) / torch.linalg.norm(ref_out) < 1e-4
    assert torch.allclose(lse, ref_lse, atol=1e-4)
