"""Prefix sharing through the Triton path in Triton's interpreter, on CPU tensors.

Run only with ``TRITON_INTERPRET=1`` set before triton is imported: tests/test_prefix.py runs this
module so (conftest.run_interpreter_tests). A shared tree (a run of requests over one prefix,
two of them over a longer one, page-unaligned tails, a request sharing nothing) through the
``mlaprefill`` backend: the Triton gather and kernel with the epilogue merge, eagerly and through
the iteration graphs' padded launches (eager on CPU) with static I/O, against the float64
reference, output and LSE.
"""

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 before triton is imported (see tests/test_prefix.py)",
                allow_module_level=True)

import torch


def test_shared_tree_through_the_kernel_graphs_and_static_io():
    from conftest import paged_mla_inputs
    from mlaprefill.batch import PrefillBatch
    from mlaprefill.graphs import IterationGraphs
    from mlaprefill.plan import ChunkPlanner
    from mlaprefill.prefill import MLAChunkedPrefill
    from mlaprefill.reference import mla_prefill_reference
    from mlaprefill.staging import StagingRing
    from test_prefix import shared_table

    page = 16
    query, ctx = [5, 17, 1, 9, 3], [70, 90, 64, 33, 40]
    # 0-3 share 2 pages (ending mid-page for request 3), 0-1 a third; 4 shares nothing
    table, used = shared_table(ctx, [(0, 0), (0, 9), (1, 2), (2, 9), (3, 0)], page)
    x = paged_mla_inputs(query, [used * page], heads=2, rank=16, nope=16, rope=8, v=16,
                         page_size=page)
    x["block_table"] = torch.from_numpy(table)
    ref_out, ref_lse = mla_prefill_reference(
        x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"], x["block_table"], query, ctx,
        x["weight"], qk_nope_head_dim=16, v_head_dim=16)
    batch = PrefillBatch(query, ctx, page_size=page, block_table=table)
    T = sum(query)
    for policy, workspace, graphs, static in [("balanced", 64, False, False),
                                              ("packed", 48, True, False),
                                              ("equal", 96, True, True)]:
        plan = ChunkPlanner(workspace, page, policy=policy, min_saved_rows=0).plan(batch)
        assert plan.shares_prefixes and plan.num_iterations >= 3, policy
        assert plan.num_gathered_rows < sum(ctx)
        shared = IterationGraphs()
        op = MLAChunkedPrefill(x["weight"], qk_nope_head_dim=16, v_head_dim=16,
                               backend="mlaprefill", graphs=shared if graphs else None)
        dp = StagingRing("cpu").upload(plan)
        rest = (x["kv_c_new"], x["k_pe_new"], x["kv_cache"], x["block_table"], dp)
        if static:
            io = op.io_buffers(T, dtype=torch.float32, device="cpu", qk_rope_head_dim=8)
            io.q.copy_(x["q"])
            op.forward(io.q, *rest, out=io.out, lse=io.lse)  # grows the arena: copies
            io = op.io_buffers(T, dtype=torch.float32, device="cpu", qk_rope_head_dim=8)
            io.q.copy_(x["q"])
            out, lse = op.forward(io.q, *rest, out=io.out, lse=io.lse)
            assert out.data_ptr() == io.out.data_ptr()
        else:
            out, lse = op.forward(x["q"], *rest, return_lse=True)
        err_o = (out.double() - ref_out).abs().max().item()
        err_l = (lse.double() - ref_lse).abs().max().item()
        assert err_o < 1e-4 and err_l < 1e-4, (policy, graphs, err_o, err_l)
        if graphs:  # every context iteration ran as a padded launch through the arena
            assert shared.warm_runs >= 2 and shared.captures == shared.replays == 0
            (arena,) = shared._arenas.values()
            k, r = plan.num_iterations, plan.num_reqs
            assert arena.seq_q[:k, :r + 1].tolist() == plan.iteration_cu_query_lens.tolist()
            assert arena.seq_k[:k, :r + 1].tolist() == plan.iteration_cu_seq_lens.tolist()
