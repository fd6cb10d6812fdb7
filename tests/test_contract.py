"""The README's "Validation contract", sentence by sentence: which test checks each one.

:data:`CONTRACT` maps every sentence of the section's prose, and every item of its table (cells
split at ``; ``), to the tests that check it; ``test_every_sentence_has_a_test`` fails when the
README gains a sentence without an entry here, or names a test that does not exist. The NaN and
inf rule is tested here too, against the float64 reference, on the CPU paths (``math``; the
Triton kernel of the ``mlaprefill`` backend in Triton's interpreter, run by
``tests/test_nan.py::test_triton_merge_nan_rules_in_interpreter``); the GPU backends in
``tests/test_nan.py``'s ``gpu`` tests.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import torch

from conftest import paged_mla_inputs
from mlaprefill.api import mla_chunked_prefill
from mlaprefill.reference import mla_prefill_reference

ROOT = Path(__file__).resolve().parents[1]
#: for the "undefined" row only: no behaviour is promised, so nothing can be tested
NO_PROMISE = "no promise"

F = "tests/test_fuzz.py::"
V = "tests/test_validation.py::"
C = "tests/test_contract.py::"
N = "tests/test_nan.py::"
K = "tests/test_fp8_cache.py::"
CONTRACT: dict[str, list[str]] = {
    # -- the first paragraph
    "A wrong input gives a `ValueError` or `TypeError` that names the field, says what it got "
    "and what it expected, and how to fix it, and changes no state; never a wrong answer.": [
        F + "test_fuzz_forward_and_one_call", F + "test_fuzz_io_buffers",
        F + "test_fuzz_staging_ring", F + "test_fuzz_broadcast_rope",
        "tests/test_staging.py::test_upload_of_something_else_is_a_type_error_and_changes_nothing",
    ],
    # -- the table: always (host)
    "types, shapes, dtypes, devices of every input against each other, the weight and the plan": [
        F + "test_fuzz_forward_and_one_call", V + "test_device_plan_must_be_uploaded",
        F + "test_fuzz_process_group_must_be_a_group",
    ],
    "the `DevicePlan`'s tensors against its plan's shapes": [
        F + "test_fuzz_hand_built_device_plan"],
    "`out=` / `lse=` buffers": [F + "test_fuzz_io_buffers"],
    "every length and sum fits int32": [
        F + "test_fuzz_prefill_batch",
        "tests/test_batch.py::test_lengths_beyond_int32_rejected_before_summing"],
    "sizes bounded before anything is allocated (plans, token tables, `io_buffers`, `--batches` "
    "lines)": [
        F + "test_fuzz_plan_and_token_table_bounds",
        F + "test_fuzz_plan_of_many_requests_refused_before_allocating",
        F + "test_fuzz_io_buffers_bounded_by_device_memory",
        F + "test_fuzz_cli_plan_pathological_batches",
        "tests/test_bench_cli.py::test_step_plan_beyond_the_planner_bound_is_refused_up_front"],
    "`softmax_scale` and a float `kv_cache_scale` finite > 0": [
        V + "test_softmax_scale_checked_up_front", F + "test_fuzz_forward_and_one_call",
        K + "test_bad_cache_format_is_a_clear_error_before_anything_runs",
        K + "test_fuzz_cache_format_and_scale_outcomes"],
    "the cache's format": [K + "test_bad_cache_format_is_a_clear_error_before_anything_runs",
                           K + "test_fuzz_cache_format_and_scale_outcomes",
                           K + "test_ds_mla_needs_deepseek_dims"],
    "head dims the backend's kernel runs (at construction; the rope dim of `k_pe_new` at the "
    "forward)": [F + "test_fuzz_head_dims_checked_at_construction",
                 F + "test_fuzz_auto_backend_is_picked_per_dtype"],
    "block ids of a **CPU** block table in `[0, num_blocks)`": [
        V + "test_cpu_block_ids_checked_before_any_work", F + "test_fuzz_forward_and_one_call"],
    "free: host ints and metadata only": [
        "tests/test_dcp_dist.py::test_dcp_matches_single_rank",
        "tests/test_bench_engine.py::test_gpu_engine_ring_has_no_host_sync_and_pageable_is_seen"],
    # -- validate=True
    "the same block-id check for a device block table": [
        V + "test_gpu_validate_reads_device_block_table_and_default_gives_nan_rows"],
    "a device `kv_cache_scale`": [K + "test_validate_reads_a_device_scale_tensor"],
    "the `DevicePlan`'s tensors still hold its plan": [
        V + "test_validate_catches_a_reused_ring_slot"],
    "on DCP, all ranks passed the same lengths and config": [
        "tests/test_dcp_dist.py::test_dcp_matches_single_rank"],
    "**synchronizes**: debugging and first integration only": [
        V + "test_gpu_validate_reads_device_block_table_and_default_gives_nan_rows"],
    # -- undefined
    "a CUDA block id outside the cache without `validate` (the gather writes NaN rows: that "
    "request's output is NaN, no other changes)": [
        V + "test_gpu_validate_reads_device_block_table_and_default_gives_nan_rows"],
    "a `DevicePlan` used after its ring slot was reused": [NO_PROMISE],
    "inputs changed while the forward runs": [NO_PROMISE],
    # -- the NaN and inf paragraph
    "NaN and inf: a NaN or inf in one request's inputs gives NaN in rows of that request only, in "
    "every backend, and never changes another request's rows.": [
        C + "test_nan_and_inf_follow_the_reference", N + "test_nan_in_one_request_stays_in_that_"
        "request", N + "test_gpu_forward_nan_stays_in_request",
        N + "test_triton_merge_nan_rules_in_interpreter"],
    "The output is NaN wherever the float64 reference's output is NaN, and for a NaN exactly "
    "there.": [C + "test_nan_and_inf_follow_the_reference", F + "test_fuzz_forward_and_one_call"],
    "An inf can make more of that request's rows NaN: each part of a query's keys (its new "
    "tokens, each workspace iteration) is attended on its own, and a part whose scores are all "
    "`-inf` is NaN even where the reference's softmax over all keys at once is finite.": [
        C + "test_one_part_of_keys_all_minus_inf_is_nan"],
    "The LSE is NaN wherever the reference's LSE is NaN, and only in rows whose output is NaN; "
    "where the bad value reaches only the values (a new token's value that the causal mask hides "
    "from earlier queries), the LSE may stay finite, as the reference's does.": [
        C + "test_nan_and_inf_follow_the_reference", F + "test_fuzz_forward_and_one_call"],
    "An LSE of `-inf` means a query with no keys at all (only inside the merge: every query has "
    "itself as a key).": [N + "test_inf_gives_nan_never_no_keys",
                          N + "test_merge_propagates_nan_and_keeps_empty_rule"],
    "The command line never prints a traceback for a user error: one line on stderr naming the "
    "option and the fix, exit status 2.": [
        F + "test_fuzz_cli_plan", F + "test_fuzz_cli_bench", F + "test_fuzz_cli_top_level",
        F + "test_fuzz_cli_plan_pathological_batches",
        "tests/test_plan_cli.py::test_usage_errors_are_one_line_and_ctrl_c_is_130"],
    "`tests/test_fuzz.py` fuzzes every public entry point and checks the class of each outcome; "
    "`tests/test_contract.py` names the test of each sentence here.": [
        C + "test_every_sentence_has_a_test"],
}
#: the table's labels: what each row and column is, not a claim
LABELS = ("**always** (host)", "**`validate=True`**", "**undefined**", "what", "cost", "---")


def _section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## Validation contract")
    return text[start + len("## Validation contract"):text.index("\n## ", start + 1)]


def test_every_sentence_has_a_test() -> None:
    rest = " ".join(_section().split())
    for sentence, tests in CONTRACT.items():
        assert sentence in rest, f"not in the README (reworded?): {sentence!r}"
        rest = rest.replace(sentence, "|", 1)
        assert tests, sentence
        for test in tests:
            if test == NO_PROMISE:
                continue
            path, name = test.split("::")
            source = (ROOT / path).read_text()
            assert re.search(rf"^def {name}\(", source, re.M), f"{test} does not exist"
    for label in LABELS:
        rest = rest.replace(label, "|")
    left = re.sub(r"[|;\s]", "", rest)  # table rules and the cells' separators
    assert not left, f"README text without an entry here: {rest!r}"


# -- the NaN and inf rule against the float64 reference --------------------------------------
QUERY_LENS, CONTEXT_LENS = [3, 2, 2], [9, 5, 0]
WHERE = ["q", "kv_c_new", "k_pe_new", "cache"]
VALUES = [float("nan"), float("inf"), float("-inf")]


def _poisoned(seed, value, where, col):
    """Inputs with one bad value in request 0's data (its second new token, or a context
    row), and clean ones of the same seed."""
    clean = paged_mla_inputs(QUERY_LENS, CONTEXT_LENS, heads=2, nope=16, rope=4, v=16, rank=16,
                             seed=seed, page_size=4)
    x = {k: (t.clone() if isinstance(t, torch.Tensor) else t) for k, t in clean.items()}
    if where == "q":
        x["q"][1, 0, col] = value
    elif where == "kv_c_new":
        x["kv_c_new"][1, col] = value
    elif where == "k_pe_new":
        x["k_pe_new"][1, col] = value
    else:
        x["kv_cache"][x["block_table"][0, 1], 2, col] = value
    return clean, x


def _run(x, backend):
    return mla_chunked_prefill(*(x[k] for k in ("q", "kv_c_new", "k_pe_new", "kv_cache",
                                                "block_table")),
                               QUERY_LENS, CONTEXT_LENS, x["weight"], backend=backend,
                               return_lse=True, workspace_tokens=8)


def check_nan_rule(backend, seeds=(0, 1, 2), cols=(0, -1)):
    """Every (seed, value, where, column) case: the README's NaN and inf sentences."""
    rows_a = slice(0, QUERY_LENS[0])
    clean_runs = {}  # seed -> the clean inputs' (out, lse): one forward per seed
    for seed, value, where, col in itertools.product(seeds, VALUES, WHERE, cols):
        clean, x = _poisoned(seed, value, where, col)
        out, lse = _run(x, backend)
        if seed not in clean_runs:
            clean_runs[seed] = _run(clean, backend)
        clean_out, clean_lse = clean_runs[seed]
        ref_out, ref_lse = mla_prefill_reference(
            *(x[k] for k in ("q", "kv_c_new", "k_pe_new", "kv_cache", "block_table")),
            QUERY_LENS, CONTEXT_LENS, x["weight"], qk_nope_head_dim=16, v_head_dim=16)
        case = (backend, seed, value, where, col)
        out_nan, ref_nan = out.isnan(), ref_out.isnan()
        # other requests bitwise unchanged; NaN only in request 0's rows
        assert torch.equal(out[3:], clean_out[3:]) and torch.equal(lse[3:], clean_lse[3:]), case
        assert out_nan[rows_a].any(), case
        assert not (ref_nan & ~out_nan).any(), case  # wherever the reference's out is NaN
        if value != value:  # a NaN: exactly there
            assert torch.equal(out_nan, ref_nan), case
        lse_nan = lse.isnan()
        assert not (ref_lse.isnan() & ~lse_nan).any(), case  # wherever the reference's LSE is
        assert not (lse_nan & ~out_nan.any(-1)).any(), case  # only in NaN-out rows
        assert not out.isinf().any() and not lse.isinf().any(), case  # never inf, never -inf


def test_nan_and_inf_follow_the_reference():
    check_nan_rule("math", seeds=(0,))  # 24 cases; test_fuzz draws more


def test_one_part_of_keys_all_minus_inf_is_nan():
    """A query's own rope key of -inf score (its only new-token key) while its context keys are
    finite: the reference's softmax over all keys is finite, the forward's is NaN (the new
    tokens' part has no softmax), in that (token, head) only."""
    query_lens, context_lens = [1, 2], [4, 3]
    x = paged_mla_inputs(query_lens, context_lens, heads=2, nope=16, rope=4, v=16, rank=16,
                         page_size=4)
    x["k_pe_new"][0, 0] = float("-inf") * torch.sign(x["q"][0, 0, 16])  # head 0: score -inf
    x["k_pe_new"][0, 1:] = 0  # ... and head 1's score is -inf too only through dim 0
    args = [x[k] for k in ("q", "kv_c_new", "k_pe_new", "kv_cache", "block_table")]
    out, lse = mla_chunked_prefill(*args, query_lens, context_lens, x["weight"], backend="math",
                                   return_lse=True, workspace_tokens=8)
    ref_out, ref_lse = mla_prefill_reference(*args, query_lens, context_lens, x["weight"],
                                             qk_nope_head_dim=16, v_head_dim=16)
    assert torch.isfinite(ref_out[0, 0]).all() and torch.isfinite(ref_lse[0, 0])
    assert out[0, 0].isnan().all() and lse[0, 0].isnan()
    assert torch.isfinite(out[1:]).all() and torch.isfinite(lse[1:]).all()

