"""The bench engine's first tokens equal a plain non-chunked forward of the same random model."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mlaprefill.bench.engine import EngineConfig, PrefillEngine, Variant
from mlaprefill.bench.model import BenchModel


def plain_attention(model: BenchModel):
    """Full causal MLA attention over one whole prompt (no cache, no chunks, no plan)."""
    m = model.dims.mla
    H, nope, vd, r = m.num_heads, m.qk_nope_head_dim, m.v_head_dim, m.kv_lora_rank

    def attend(i, q, kv_c, k_pe):
        w = model.kv_b_proj[i].view(H, nope + vd, r)
        k_nope = torch.einsum("tr,hdr->thd", kv_c, w[:, :nope])
        v = torch.einsum("tr,hdr->thd", kv_c, w[:, nope:])
        k = torch.cat((k_nope, k_pe[:, None, :].expand(-1, H, -1)), dim=-1)
        s = torch.einsum("thd,shd->hts", q, k) * m.default_softmax_scale
        T = q.shape[0]
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
        return torch.einsum("hts,shd->thd", s.softmax(dim=-1), v)

    return attend


def reference_first_tokens(engine: PrefillEngine) -> dict[int, int]:
    out = {}
    for rid in range(engine.config.num_requests):
        ids = torch.from_numpy(engine.prompt(rid).copy())
        n = ids.shape[0]
        tok = engine.model.forward(ids, torch.arange(n, dtype=torch.int32),
                                   torch.tensor([n - 1], dtype=torch.int32),
                                   plain_attention(engine.model))
        out[rid] = int(tok[0])
    return out


BASE = dict(preset="tiny", tp=1, num_layers=2, vocab_size=97, device="cpu", dtype="float64",
            backend="auto")

CASES = [
    # fair share, awkward prompt lengths, workspace of 2 pages -> many context iterations
    dict(prompt_len=61, prompt_len_spread=0.6, num_requests=5, max_concurrent=3,
         token_budget=24, workspace_tokens=48, page_size=16, share="fair"),
    # fcfs (vLLM-like), budget not a page multiple, page_size 1
    dict(prompt_len=45, num_requests=3, max_concurrent=3, token_budget=40,
         workspace_tokens=20, page_size=1, share="fcfs"),
    # admission limited by free cache pages + Poisson arrivals
    dict(prompt_len=40, prompt_len_spread=0.5, num_requests=4, max_concurrent=3,
         token_budget=16, workspace_tokens=24, page_size=8, share="fair", num_blocks=9,
         request_rate=2000.0),
]


@pytest.mark.parametrize("case", CASES, ids=["fair-multi-iter", "fcfs-page1", "blocks-rate"])
def test_first_tokens_equal_plain_forward(case):
    engine = PrefillEngine(EngineConfig(**BASE, **case))
    expected = reference_first_tokens(engine)
    assert len(set(expected.values())) > 1  # a degenerate model would make this test vacuous
    for name in ("pageable+equal", "ring+packed"):
        res = engine.run(Variant.parse(name))
        assert res.first_tokens == expected, name
        assert res.prompt_tokens == int(engine.prompt_lens.sum())
        assert res.ttft_ms.shape == (case["num_requests"],) and (res.ttft_ms > 0).all()
        steps = res.steps
        assert max(s.num_tokens for s in steps) <= case["token_budget"]
        assert sum(s.num_tokens for s in steps) == res.prompt_tokens
        assert any(s.num_iterations >= 2 for s in steps)
        assert all(s.device_end_ms >= s.device_start_ms for s in steps)


def test_variant_parse_and_errors():
    assert Variant.parse("pin+equal") == Variant("pin", "equal")
    assert Variant.parse("ring+packed").name == "ring+packed"
    with pytest.raises(ValueError, match="TRANSFER\\+POLICY"):
        Variant.parse("ring")
    with pytest.raises(ValueError, match="transfer"):
        Variant.parse("dma+packed")
    assert Variant.parse("ring+balanced@fa2") == Variant("ring", "balanced", backend="fa2")
    assert Variant.parse("pin+equal+vllm@math").name == "pin+equal+vllm@math"
    with pytest.raises(ValueError, match="backend"):
        Variant.parse("ring+equal@fastest")
    with pytest.raises(ValueError, match="BACKEND"):
        Variant.parse("ring+equal@")
    graphs = Variant.parse("ring+balanced@mlaprefill+graphs")
    assert graphs == Variant("ring", "balanced", backend="mlaprefill+graphs")
    assert graphs.name == "ring+balanced@mlaprefill+graphs"
    with pytest.raises(ValueError, match="CUDA-graph replays"):
        Variant.parse("ring+equal@fastest+graphs")
    for old in ("mlaprefill+graphs+static", "hybrid", "varlen", "mlaprefill+graphs-device-rows"):
        with pytest.raises(ValueError, match="unknown"):
            Variant.parse(f"ring+equal@{old}")
    with pytest.raises(ValueError, match="prompt_len"):
        EngineConfig(prompt_len=0)
    with pytest.raises(ValueError, match="request_rate"):
        EngineConfig(request_rate=0.0)
    engine = PrefillEngine(EngineConfig(**BASE, prompt_len=8, num_requests=2, max_concurrent=4,
                                        token_budget=8, workspace_tokens=16, page_size=8))
    with pytest.raises(ValueError, match="workspace_tokens"):
        engine.run(Variant.parse("ring+equal"))


def test_max_steps_stops_early_and_engine_is_reusable():
    engine = PrefillEngine(EngineConfig(**BASE, prompt_len=32, num_requests=2, max_concurrent=2,
                                        token_budget=8, workspace_tokens=16, page_size=4,
                                        share="fair"))
    part = engine.run(Variant.parse("pin+packed"), max_steps=2)
    assert len(part.steps) == 2 and part.first_tokens == {}
    full = engine.run(Variant.parse("pin+packed"))
    assert len(full.first_tokens) == 2
    assert np.isfinite(full.throughput_tok_s)


def test_engine_keeps_one_ring_per_mode_and_counts_per_run():
    """The ring outlives a run (arenas grown in warm-up are reused); each run's staging counters
    are that run's share, not the ring's running total."""
    engine = PrefillEngine(EngineConfig(**BASE, prompt_len=32, num_requests=2, max_concurrent=2,
                                        token_budget=8, workspace_tokens=16, page_size=4))
    ring = engine.ring("ring")
    first = engine.run(Variant.parse("ring+packed"))
    second = engine.run(Variant.parse("ring+equal"))
    assert engine.ring("ring") is ring and engine.ring("pin") is not ring
    assert first.staging["uploads"] == len(first.steps) > 0
    assert second.staging["uploads"] == len(second.steps)
    assert ring.stats.uploads == len(first.steps) + len(second.steps)
    assert first.staging["bytes"] + second.staging["bytes"] == ring.stats.bytes


def test_variant_backend_runs_its_own_layers_and_counts_builds():
    """A variant's @BACKEND gets its own attention layers (weights shared, same first tokens);
    every step records the forward's host time per layer, every run its kernel builds."""
    engine = PrefillEngine(EngineConfig(**BASE, prompt_len=32, num_requests=2, max_concurrent=2,
                                        token_budget=8, workspace_tokens=16, page_size=4))
    default = engine.run(Variant.parse("ring+packed"))
    math_run = engine.run(Variant.parse("ring+packed@math"))
    assert engine.attention_layers("math") is not engine.attention_layers()
    assert engine.backend_name("math") == "math"
    assert math_run.first_tokens == default.first_tokens
    assert math_run.kernel_builds == 0  # plain torch ops build nothing
    assert all(s.host_forward_ms_per_layer > 0 for s in math_run.steps)
    # @BACKEND+graphs: the same backend with graphs on (math: never used, same result), the
    # model writing q into each layer's io_buffers (the arena's queries still)
    layers = engine.attention_layers("math+graphs")
    asked = []  # the model asks every layer for its io_buffers once a step
    for layer in layers:
        real = layer.io_buffers
        layer.io_buffers = lambda t, real=real: asked.append(t) or real(t)
    graphs_run = engine.run(Variant.parse("ring+packed@math+graphs"))
    assert engine.backend_name("math+graphs") == "math+graphs"
    assert len(asked) == len(layers) * len(graphs_run.steps) and all(asked)
    assert all(layer.graphs for layer in layers)
    assert len({id(layer.graphs) for layer in layers}) == 1  # one shared arena
    assert not any(layer.graphs for layer in engine.attention_layers("math"))
    assert graphs_run.first_tokens == default.first_tokens
    # graph counters: this run's share, 0 here (math takes no graphs); None without +graphs
    assert (graphs_run.graph_captures, graphs_run.graph_replays,
            graphs_run.graph_capture_ms) == (0, 0, 0.0)
    assert (math_run.graph_captures, math_run.graph_replays, math_run.graph_capture_ms) == (
        None, None, None)
    # per step: launches run eagerly at a key's first sight (none: math never uses the graphs)
    assert [s.graph_first_sights for s in graphs_run.steps] == [0] * len(graphs_run.steps)
    assert all(s.graph_first_sights is None for s in math_run.steps)
    with pytest.raises(ValueError, match="graphs"):
        Variant.parse("ring+packed@math+graphs-rows")


@pytest.mark.gpu
def test_gpu_engine_ring_has_no_host_sync_and_pageable_is_seen():
    """On CUDA: the ring variant's step loop issues no hidden host sync (only the engine's
    deliberate event waits and the synchronize around the run); the pageable variant's plan
    and engine arrays are all pageable copies."""
    from hostsync import no_host_sync

    cfg = EngineConfig(preset="tiny", tp=1, num_layers=2, vocab_size=97, prompt_len=256,
                       num_requests=4, max_concurrent=4, token_budget=64, workspace_tokens=128,
                       page_size=16, share="fair", device="cuda")
    engine = PrefillEngine(cfg)
    engine.run(Variant.parse("ring+packed"), max_steps=2)  # warm-up outside the audit
    with no_host_sync(allow=["synchronize"]) as audit:
        ring = engine.run(Variant.parse("ring+equal"))
    assert not audit.findings, audit.report()
    with no_host_sync(allow=["synchronize"]) as audit:
        pageable = engine.run(Variant.parse("pageable+equal"))
    kinds = {f.kind for f in audit.findings}
    assert kinds == {"pageable_h2d"}, audit.report()
    # cu_query_lens, token_ids, positions, slot_mapping, block_table are never empty
    assert sum(f.count for f in audit.findings) >= 5 * len(pageable.steps)
    assert ring.first_tokens == pageable.first_tokens
    assert len(ring.first_tokens) == cfg.num_requests
    assert np.mean([s.device_end_ms - s.device_start_ms for s in ring.steps]) > 0


def test_gc_clock_counts_collections_only_while_entered():
    import gc

    from mlaprefill.bench.engine import _GcClock

    clock = _GcClock()
    with clock:
        assert clock._on_gc in gc.callbacks
        gc.collect()
    inside = clock.ms
    assert inside > 0.0
    assert clock._on_gc not in gc.callbacks
    gc.collect()
    assert clock.ms == inside


def test_summary_separates_steps_that_ran_a_launch_eagerly():
    """The graph metrics: per run, the steps with an eager first sight; the forward's host p99
    over the other steps only; None (per run, and the p99) without iteration graphs."""
    from mlaprefill.bench.metrics import RunResult, StepRecord, summarize

    def run(forward_ms, first_sights):
        steps = [StepRecord(num_reqs=1, num_tokens=8, num_context_tokens=0, num_iterations=1,
                            metadata_bytes=64, plan_bytes=32, largest_array_bytes=16,
                            token_to_seq_bytes=0, host_prep_ms=0.1, host_upload_ms=0.1,
                            host_launch_ms=0.1, host_forward_ms_per_layer=ms,
                            graph_first_sights=fs, device_start_ms=float(i),
                            device_end_ms=i + 0.5)
                 for i, (ms, fs) in enumerate(zip(forward_ms, first_sights, strict=True))]
        return RunResult(variant="v", repeat=0, steps=steps, ttft_ms=np.array([1.0]),
                         first_tokens={0: 1}, prompt_tokens=8 * len(steps),
                         duration_ms=len(steps) + 0.5, wall_ms=1.0)

    forward = [0.3] * 97 + [5.0] * 3  # the slow steps are the ones with a first sight
    m = summarize([run(forward, [0] * 97 + [2] * 3), run([0.3] * 100, [0] * 100)])
    assert m["graph_first_sight_steps_per_run"] == [3, 0]
    assert m["graph_replay_only_host_forward_ms_per_layer_p99"] == pytest.approx(0.3)
    assert m["host_forward_ms_per_layer_p99"] > 1.0  # the pooled p99 keeps those steps
    eager = summarize([run(forward, [None] * 100)])
    assert eager["graph_first_sight_steps_per_run"] == [None]
    assert eager["graph_replay_only_host_forward_ms_per_layer_p99"] is None


def test_deadline_stops_a_wait_for_a_late_arrival():
    """Was: with arrivals minutes apart the engine slept until the next one whatever the
    deadline (``bench --request-rate 0.003 --max-seconds 5`` still ran at 150 s)."""
    import time

    engine = PrefillEngine(EngineConfig(**BASE, prompt_len=8, num_requests=3, max_concurrent=4,
                                        token_budget=64, workspace_tokens=32, page_size=4,
                                        request_rate=0.003))  # ~5 min between arrivals
    t = time.perf_counter()
    result = engine.run(Variant.parse("ring+packed"), deadline=time.perf_counter() + 0.5)
    assert time.perf_counter() - t < 20
    assert result.truncated


def test_shared_prefix_first_tokens_equal_plain_forward_with_and_without_sharing():
    # one system prompt for all, two documents for contiguous groups, unique tails; the
    # prefixes are prefilled into pages of their own that every request's block table starts with
    # (the system prompt saves 5 x 512 rows, past MIN_SAVED_ROWS; the documents, 2 requests
    # each, save too little to be planned apart)
    engine = PrefillEngine(EngineConfig(
        **BASE, prompt_len=20, prompt_len_spread=0.5, num_requests=6, max_concurrent=6,
        token_budget=48, workspace_tokens=256, page_size=16, share="fair",
        shared_prefix_len=512, doc_groups=2, doc_len=64))
    assert engine.prefix_lens.tolist() == [512, 512, 576, 576, 576, 576]
    expected = reference_first_tokens(engine)
    assert len(set(expected.values())) > 1
    gathered = {}
    for name in ("ring+balanced", "ring+balanced+noshare"):
        variant = Variant.parse(name)
        assert variant.share_prefixes == ("noshare" not in name) and variant.name == name
        res = engine.run(variant)
        assert res.first_tokens == expected, name
        # only the tails are prefilled in the run: the prefixes were cached before it
        assert res.prompt_tokens == int((engine.prompt_lens - engine.prefix_lens).sum())
        gathered[name] = sum(s.num_gathered_rows for s in res.steps)
        context = sum(s.num_context_tokens for s in res.steps)
        assert gathered[name] < context if variant.share_prefixes else gathered[name] == context
    assert gathered["ring+balanced"] < gathered["ring+balanced+noshare"] / 2
