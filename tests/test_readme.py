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


def test_readme_cpu_install_takes_torch_from_the_cpu_index() -> None:
    """Plain `pip install torch==X` is the CUDA build on Linux x86-64 (several GB); the README's
    quick start must take the CPU build from PyTorch's own index and say what the test extra
    pulls; CI installs the pinned CPU build first too (its machines keep it on local disk)."""
    text = README.read_text()
    quick = re.search(r"## Quick start.*?```bash\n(.*?)```", text, flags=re.S).group(1)
    install = re.search(r"pip install torch==[\d.]+ --index-url (\S+)", quick)
    assert install and install.group(1) == "https://download.pytorch.org/whl/cpu"
    assert "Triton" in text and "1.0 GB" in text
    ci = (README.parent / ".ci" / "run").read_text()
    torch_line = ci.index("pip install -q torch==")
    assert torch_line < ci.index('pip install -q -e ".[test')  # before anything pulls torch


def test_readme_states_the_validation_contract() -> None:
    text = README.read_text()
    section = text[text.index("## Validation contract"):]
    for words in ("always", "validate=True", "synchronizes", "undefined", "NaN", "-inf",
                  "exit status 2"):
        assert words in section, words
