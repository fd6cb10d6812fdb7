"""CPU tests of the Triton varlen attention kernel (Triton's interpreter) and its backend.

The kernel's tests proper live in tests/interpreter/test_interp_attention.py: they run on CPU
tensors under ``TRITON_INTERPRET=1`` in a subprocess (the variable must be set before triton is
imported), started by :func:`test_varlen_attention_in_interpreter` here. The rest of this module
runs in process.
"""

from __future__ import annotations

import pytest
import torch

from conftest import run_interpreter_tests


@pytest.mark.slow
def test_varlen_attention_in_interpreter():
    """Output and LSE against the float64 reference, empty sequences, NaN isolation: the tests of
    tests/interpreter/test_interp_attention.py, in their own process under Triton's interpreter."""
    run_interpreter_tests("test_interp_attention.py", passed=10)


def test_backend_unsupported_reason(monkeypatch):
    pytest.importorskip("triton")
    from mlaprefill.backends.triton import TritonBackend

    be = TritonBackend()
    cpu = torch.device("cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    why = be.unsupported_reason(cpu, torch.bfloat16, 192, 128)
    assert isinstance(why, str) and "CUDA" in why
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert be.unsupported_reason(cpu, torch.float32, 192, 128) is None
    assert "bfloat16" in be.unsupported_reason(cpu, torch.bfloat16, 192, 128)
    assert "head dims" in be.unsupported_reason(cpu, torch.float32, 320, 128)
    assert "head dims" in be.unsupported_reason(cpu, torch.float32, 8, 8)
    assert be.preferred_policy == "balanced" and be.name == "mlaprefill-kernel"


def test_bucket_floor_grid():
    from mlaprefill.backends.mlaprefill import bucket_floor

    assert bucket_floor(127, per_octave=16, align=128) == 0
    assert bucket_floor(128, per_octave=16, align=128) == 128
    assert bucket_floor(61000, per_octave=16, align=128) == 59392   # step 2048
    assert bucket_floor(4000, per_octave=8, align=256) == 3840      # step 256
    assert bucket_floor(4096, per_octave=8, align=256) == 4096
    with pytest.raises(ValueError, match="per_octave"):
        bucket_floor(100, per_octave=12, align=128)
    with pytest.raises(ValueError, match="align"):
        bucket_floor(100, per_octave=8, align=0)
    with pytest.raises(TypeError, match="n must be an int"):
        bucket_floor(100.0, per_octave=8, align=128)
    for n in range(1, 70000, 997):
        for per_octave, align in ((8, 256), (16, 128)):
            f = bucket_floor(n, per_octave=per_octave, align=align)
            assert f <= n and f % align == 0
            if n >= align:  # at most 1/per_octave of n is left over (or less than align)
                assert n - f < max(align, n / per_octave)


def test_launcher_validates_inputs():
    pytest.importorskip("triton")
    from mlaprefill.kernels.attention import AttentionConfig, attention_configs, varlen_attention

    q = torch.zeros(4, 2, 24)
    k = torch.zeros(4, 2, 24)
    v = torch.zeros(4, 2, 16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    kw = dict(max_seqlen_q=4, causal=False, softmax_scale=0.2)
    with pytest.raises(ValueError, match="contiguous last dim"):
        varlen_attention(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, cu, cu, **kw)
    with pytest.raises(ValueError, match="int32"):
        varlen_attention(q, k, v, cu.long(), cu, **kw)
    with pytest.raises(TypeError, match="one dtype"):
        varlen_attention(q.double(), k.double(), v.double(), cu, cu, **kw)
    with pytest.raises(ValueError, match="softmax_scale"):
        varlen_attention(q, k, v, cu, cu, max_seqlen_q=4, causal=False, softmax_scale=-1.0)
    with pytest.raises(ValueError, match="qk_head_dim"):
        varlen_attention(q[..., :8], k[..., :8], v, cu, cu, **kw)
    with pytest.raises(ValueError, match="power of two"):
        AttentionConfig(block_m=48)
    with pytest.raises(ValueError, match="warp_specialize must be a bool"):
        AttentionConfig(warp_specialize=1)
    with pytest.raises(ValueError, match="multiple of block_m"):
        varlen_attention(q, k, v, cu, cu, **kw, dense=((0, 1, 100, 64),))
    with pytest.raises(ValueError, match="range inside"):
        varlen_attention(q, k, v, cu, cu, **kw, dense=((1, 2, 128, 64),))
    with pytest.raises(ValueError, match="range inside"):
        varlen_attention(q, k, v, cu, cu, **kw, dense=((0, 0, 128, 64),))
    with pytest.raises(ValueError, match="at most"):
        varlen_attention(q, k, v, cu, cu, **kw, dense=((0, 1, 128, 64),) * 5)
    configs = attention_configs()
    assert next(iter(configs.values())) == AttentionConfig()
    # one compiled kernel per (causal, ...): the default config is a function of causal alone
    from mlaprefill.kernels.attention import (
        CONTEXT_ATTENTION_CONFIG,
        DEFAULT_ATTENTION_CONFIG,
        default_config,
    )
    for q in (1, 256, 70000):
        assert default_config(causal=True, max_seqlen_q=q) == DEFAULT_ATTENTION_CONFIG
        assert default_config(causal=False, max_seqlen_q=q) == CONTEXT_ATTENTION_CONFIG
    # three stages, not warp-specialized (with Triton 3.6 that flag compiles the same binary)
    assert AttentionConfig(128, 64, 8, 3) == CONTEXT_ATTENTION_CONFIG
    assert configs["m128_n64_w8_s3"] is CONTEXT_ATTENTION_CONFIG
    assert not any(c.warp_specialize for c in configs.values())
    assert all(c.block_m >= 16 and c.block_n >= 16 for c in configs.values())


def test_launcher_validates_split_keys_and_state():
    pytest.importorskip("triton")
    from mlaprefill.kernels.attention import varlen_attention

    q, k, v = torch.zeros(4, 2, 24), torch.zeros(4, 2, 16), torch.zeros(4, 2, 16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    kw = dict(max_seqlen_q=4, causal=False, softmax_scale=0.2)
    with pytest.raises(ValueError, match="k_rope must be"):
        varlen_attention(q, k, v, cu, cu, **kw, k_rope=torch.zeros(3, 8))
    with pytest.raises(ValueError, match="power of two"):
        varlen_attention(q, k[..., :12], v, cu, cu, **kw, k_rope=torch.zeros(4, 12))
    with pytest.raises(ValueError, match="Dqk - Drope"):
        varlen_attention(q, k, v, cu, cu, **kw, k_rope=torch.zeros(4, 4))
    with pytest.raises(TypeError, match="state must be a tuple"):
        varlen_attention(q, k, v, cu, cu, **kw, k_rope=torch.zeros(4, 8), state=[q, q])
    with pytest.raises(ValueError, match="state lse must be float32"):
        varlen_attention(q, k, v, cu, cu, **kw, k_rope=torch.zeros(4, 8),
                         state=(torch.zeros(4, 2, 16), torch.zeros(4, 2, dtype=torch.float64)))
    with pytest.raises(ValueError, match="state out must be"):
        varlen_attention(q, k, v, cu, cu, **kw, k_rope=torch.zeros(4, 8),
                         state=(torch.zeros(4, 2, 8), torch.zeros(4, 2)))


def test_broadcast_rope_torch_path_and_errors():
    from mlaprefill.kernels.rope import broadcast_rope_

    k = torch.randn(5, 3, 12, dtype=torch.float64)
    pe = torch.randn(5, 4, dtype=torch.float64)
    want = k.clone()
    want[:, :, 6:10] = pe[:, None, :]
    assert torch.equal(broadcast_rope_(k, pe, 6), want)
    assert broadcast_rope_(k[:0], pe[:0], 6).shape == (0, 3, 12)
    with pytest.raises(ValueError, match="start must be"):
        broadcast_rope_(k, pe, 9)
    with pytest.raises(ValueError, match=r"need k \[n, H, D\]"):
        broadcast_rope_(k, pe[:4], 0)
    with pytest.raises(ValueError, match="dtype and device"):
        broadcast_rope_(k, pe.float(), 0)


def test_hybrid_takes_cudnn_only_where_it_pays_for_joined_keys():
    """MIN_QUERIES_PER_KEY: rectangles only when they hold enough query-key pairs per key row;
    otherwise the call is the Triton kernel's alone, on split keys."""
    from mlaprefill.backends.base import VarlenSeqs
    from mlaprefill.backends.mlaprefill import MIN_QUERIES_PER_KEY, MLAPrefillBackend

    def seqs(q_lens, k_lens):
        cq = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
        ck = [0, *torch.tensor(k_lens).cumsum(0).tolist()]
        t = torch.tensor(cq, dtype=torch.int32)
        return VarlenSeqs(t, torch.tensor(ck, dtype=torch.int32), max(q_lens), max(k_lens),
                          cu_seqlens_q_host=cq, cu_seqlens_k_host=ck)

    be = MLAPrefillBackend()
    few = seqs([256] * 16, [4096] * 16)      # 256 queries per key row: Triton, split keys
    many = seqs([1024] * 4, [16384] * 4)     # 1024 per key row: one batched cuDNN call
    assert MIN_QUERIES_PER_KEY > 256
    assert not be.wants_joined_keys(few, 128, False) and be._rectangles(few, 128, False) == []
    assert be.wants_joined_keys(many, 128, False)
    assert [r.batch for r in be._rectangles(many, 128, False)] == [4]
    assert MLAPrefillBackend(min_queries_per_key=0).wants_joined_keys(few, 128, False)
    # Fewer than MANY_HEADS heads: context calls need MIN_QUERIES_PER_KEY_FEW_HEADS; causal
    # calls (the new tokens) keep MIN_QUERIES_PER_KEY; an explicit value applies to both.
    from mlaprefill.backends.mlaprefill import MANY_HEADS, MIN_QUERIES_PER_KEY_FEW_HEADS

    assert MIN_QUERIES_PER_KEY < 512 < MIN_QUERIES_PER_KEY_FEW_HEADS <= 1024 and MANY_HEADS > 16
    deep = seqs([4096], [65536])             # 4096 per key row
    square = seqs([1024] * 4, [1024] * 4)    # 1024 x 1024: 512 pairs per key row causal
    half = seqs([512] * 4, [4096] * 4)       # 512 per key row
    assert be.wants_joined_keys(many, 16, False)            # 1024 per key row: at the floor
    assert be.wants_joined_keys(deep, 16, False)
    small = MLAPrefillBackend(big_work=1)        # any rectangle is big enough: the floor decides
    assert small.wants_joined_keys(square, 16, True)        # causal: 512 >= 384
    assert not small.wants_joined_keys(half, 16, False)     # context: 512 < the few-heads floor
    assert small.wants_joined_keys(half, 128, False)
    assert MLAPrefillBackend(big_work=1, min_queries_per_key=384).wants_joined_keys(half, 16, False)


def test_hopper_kernel_declines_what_it_cannot_run(monkeypatch):
    """The Gluon kernel's gate: a clear reason for every call it cannot run (host metadata
    only), so varlen_attention runs the Triton kernel there; the debug override
    MLAPREFILL_DISABLE_HOPPER_KERNEL=1 turns it off."""
    from mlaprefill.kernels import hopper_attention as ha

    q = torch.zeros(4, 2, 192, dtype=torch.bfloat16)
    k = torch.zeros(4, 2, 128, dtype=torch.bfloat16)
    rope = torch.zeros(4, 64, dtype=torch.bfloat16)
    v = torch.zeros(4, 2, 128, dtype=torch.bfloat16)
    why = ha.unsupported_reason(q, k, v, rope)
    assert why is not None
    assert ("CUDA device" in why) if ha.HAS_GLUON else ("Gluon" in why)
    monkeypatch.setenv(ha.DISABLE_ENV, "1")
    assert f"disabled ({ha.DISABLE_ENV}=1)" in ha.unsupported_reason(q, k, v, rope)
    assert ha.BLOCK_M % 128 == 0 and ha.BLOCK_N % 64 == 0  # hybrid's rectangles divide them
    from mlaprefill.backends.mlaprefill import K_ALIGN, Q_ALIGN
    assert Q_ALIGN % ha.BLOCK_M == 0 and K_ALIGN % ha.BLOCK_N == 0


def test_hopper_kernel_layout_gate_on_cpu_tensors():
    """The layout half of the Hopper kernel's gate (pure metadata, so CPU tensors do): MLA's
    dims in bf16 / fp16 qualify as split keys (views of one [k_nope | v] buffer, a shared rope
    row) and as joined keys; a misaligned base or stride (TMA needs 16 bytes), other dims, fp32
    or rectangles off its tiles each get their reason."""
    from mlaprefill.kernels import hopper_attention as ha

    t, h = 10, 4
    q = torch.zeros(t, h, 192, dtype=torch.bfloat16)
    kv = torch.zeros(t, h, 256, dtype=torch.bfloat16)
    k, v, rope = kv[..., :128], kv[..., 128:], torch.zeros(t, 64, dtype=torch.bfloat16)
    joined = torch.zeros(t, h, 192, dtype=torch.float16)
    assert ha.layout_reason(q, k, v, rope) is None
    assert ha.layout_reason(q.half(), joined, v.half(), None) is None
    assert ha.layout_reason(q, k, v, rope, ((0, 1, 256, 1024),)) is None
    assert ha.layout_reason(q, k, v, torch.zeros(t, h, 64, dtype=torch.bfloat16)) is None
    assert "float16" in ha.layout_reason(q.float(), k.float(), v.float(), rope.float())
    assert "qk_head_dim 192" in ha.layout_reason(q[..., :128], k, v, rope)
    assert "v_head_dim 128" in ha.layout_reason(q, k, kv[..., :64], rope)
    assert "joined keys" in ha.layout_reason(q, k, v, None)
    assert "split keys" in ha.layout_reason(q, k, v, torch.zeros(t, 32, dtype=torch.bfloat16))
    shifted = torch.zeros(t, h, 257, dtype=torch.bfloat16)[..., 1:]  # base 2 bytes off
    assert "16-byte" in ha.layout_reason(q, shifted[..., :128], v, rope)
    odd = torch.zeros(t, h, 130, dtype=torch.bfloat16)[..., :128]   # head stride 260 bytes
    assert "16-byte" in ha.layout_reason(q, k, odd, rope)
    odd_rope = torch.zeros(t, 66, dtype=torch.bfloat16)[:, :64]     # row stride 132 bytes
    assert "16-byte" in ha.layout_reason(q, k, v, odd_rope)
    q_shifted = torch.zeros(t, h, 193, dtype=torch.bfloat16)[..., 1:]  # Q is read by TMA too
    assert "16-byte" in ha.layout_reason(q_shifted, k, v, rope)
    q_odd = torch.zeros(t, h, 194, dtype=torch.bfloat16)[..., :192]    # head stride 388 bytes
    assert "16-byte" in ha.layout_reason(q_odd, k, v, rope)
    assert "multiples of 128 x 128" in ha.layout_reason(q, k, v, rope, ((0, 1, 128, 64),))
    assert "multiples of 128 x 128" in ha.layout_reason(q, k, v, rope, ((0, 1, 64, 128),))


def test_hopper_kernel_causal_forms_follow_the_thresholds(monkeypatch):
    """A causal part's form (persistent, query rows, keys per block, ring stages) by its
    128-query blocks per sequence: 64-row programs up to CAUSAL_SINGLE_MAX_BLOCKS, then 128 rows
    with 64-key blocks up to CAUSAL_NARROW_MAX_BLOCKS, then 128-key blocks; one program per tile
    only past CAUSAL_PERSISTENT_MAX_BLOCKS. The first causal call builds exactly the forms some
    length can select, so a later length compiles nothing."""
    from mlaprefill.kernels import hopper_attention as ha

    single = ha._SINGLE
    narrow, wide = (ha.BLOCK_M, *ha._NARROW), (ha.BLOCK_M, ha.BLOCK_N, ha.STAGES)
    one, cut = ha.CAUSAL_SINGLE_MAX_BLOCKS, ha.CAUSAL_NARROW_MAX_BLOCKS
    assert narrow != wide and narrow[1] < wide[1] and single[0] < ha.BLOCK_M
    assert 1 <= one < cut
    assert ha._causal_form(1) == (True, *single)
    assert ha._causal_form(one) == (True, *single)
    assert ha._causal_form(one + 1) == (True, *narrow)
    assert ha._causal_form(cut) == (True, *narrow)
    assert ha._causal_form(cut + 1) == (True, *wide)
    assert ha._causal_form((1 << 31) // ha.BLOCK_M) == (True, *wide)  # the longest int32 length
    assert ha._causal_forms() == {(True, *single), (True, *narrow), (True, *wide)}
    # the register budget follows the programs' rows: two 64-row programs share an SM
    assert ha._form_consts((True, *single))["maxnreg"] == ha._MAXNREG_SINGLE
    assert ha._form_consts((True, *narrow))["maxnreg"] == ha._MAXNREG
    assert ha._form_consts((True, *wide))["maxnreg"] == ha._MAXNREG
    assert 2 * 8 * 32 * ha._MAXNREG_SINGLE <= 64 * 1024  # two programs' 8 warps fit an SM's file
    monkeypatch.setattr(ha, "CAUSAL_PERSISTENT_MAX_BLOCKS", 0)  # the tests' comparison form
    assert ha._causal_form(1) == (False, *narrow)  # 64-row programs only persistent
    assert ha._causal_forms() == {(False, *narrow), (False, *wide)}
    monkeypatch.setattr(ha, "CAUSAL_SINGLE_MAX_BLOCKS", 0)
    monkeypatch.setattr(ha, "CAUSAL_PERSISTENT_MAX_BLOCKS", 4)
    assert ha._causal_forms() == {(True, *narrow), (False, *narrow), (False, *wide)}
    monkeypatch.setattr(ha, "CAUSAL_NARROW_MAX_BLOCKS", 0)  # 128-key blocks everywhere
    assert ha._causal_forms() == {(True, *wide), (False, *wide)}


def test_tile_cost_probe_variants_still_apply(tmp_path):
    """scripts/tile_cost_probe.py writes its variants by editing the Hopper
    kernel's source: each edit must still match exactly one place, so that a kernel change
    fails here instead of on the GPU. The variants are valid Python and differ from the kernel
    only where edited."""
    import ast
    import difflib
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("tile_cost_probe",
                                                  root / "scripts" / "tile_cost_probe.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    names = probe.write_variants(tmp_path)
    assert names == [f"hv_{name}" for name in probe.EDITS]
    assert set(probe.PARTS) == set(probe.EDITS) and set(probe.DEFAULT_VARIANTS) <= set(probe.EDITS)
    kernel = probe.KERNEL.read_text().splitlines()
    for name in names:
        text = (tmp_path / f"{name}.py").read_text()
        ast.parse(text)
        changed = [line for line in difflib.unified_diff(kernel, text.splitlines(), n=0)
                   if line[:1] in "+-" and not line.startswith(("+++", "---"))]
        edits = probe.EDITS[name[3:]]
        assert 0 < len(changed) <= sum(old.count("\n") + new.count("\n") + 2
                                       for old, new in edits)


def test_ncu_attention_summarize_groups_launches_per_part(tmp_path):
    """scripts/ncu_attention.py --summarize: ncu's details CSV (after its log lines) becomes one
    entry per part, our launch with the cuDNN launches that follow it, values as numbers
    (thousands separators dropped); a CSV with fewer of our launches than parts is an error."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("ncu_attention",
                                                  root / "scripts" / "ncu_attention.py")
    ncu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ncu)
    head = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
            '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
            '"Metric Value"')

    def rec(i, kernel, metric, unit, value):
        return (f'"{i}","1","python","h","{kernel}","1","7","(384, 1, 1)","(132, 1, 1)","0",'
                f'"9.0","GPU Speed Of Light Throughput","{metric}","{unit}","{value}"')
    csv = tmp_path / "ncu.csv"
    csv.write_text("\n".join([
        "==PROF== Connected to process 1", head,
        rec(0, "_hopper_attention_kernel", "Duration", "ns", "378,944"),
        rec(0, "_hopper_attention_kernel", "DRAM Throughput", "%", "33.38"),
        rec(1, "cudnn_generated_fort_native_sdpa_sm90", "Duration", "ns", "372512"),
        rec(2, "_hopper_attention_kernel", "Duration", "us", "14.6"),
    ]) + "\n")
    parts = ncu.parse("128:4x1024:causal,16:4x1024x32768:context")
    doc = ncu.summarize(csv, parts)
    first, second = doc["parts"]
    assert (first["heads"], first["q_len"], first["k_len"], first["causal"]) == (128, 1024,
                                                                                  1024, True)
    assert first["ours"]["metrics"]["GPU Speed Of Light Throughput: Duration [ns]"] == 378944.0
    assert [k["kernel"] for k in first["cudnn"]] == ["cudnn_generated_fort_native_sdpa_sm90"]
    assert (second["k_len"], second["causal"], second["cudnn"]) == (32768, False, [])
    with pytest.raises(SystemExit, match="2 of our launches for 3 parts"):
        ncu.summarize(csv, ncu.parse("128:4x1024:causal,16:4x1024x32768:context,16:1x4:causal"))
    with pytest.raises(SystemExit, match="part 'both'"):
        ncu.parse("128:4x1024:both")
