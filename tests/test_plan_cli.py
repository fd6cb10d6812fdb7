import json
import re
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlaprefill.cli import main


def run_cli(capsys, *argv):
    rc = main(["plan", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_human_readable_table(capsys):
    rc, out, err = run_cli(capsys, "--context-lens", "80000,1000", "--query-lens", "4096,512",
                           "--workspace-tokens", "65536", "--page-size", "64")
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert "policy=packed" in lines[0] and "context_tokens=81000" in lines[0]
    assert lines[1].startswith("iterations=2 (lower bound ceil(context/W) = 2)")
    assert lines[3].split()[:4] == ["0", "65536", "100.0%", "65536"]
    assert "0:[0,65536)" in lines[3]
    assert "0:[65536,80000)" in lines[4] and "1:[0,1000)" in lines[4]


def test_json_full_plan(capsys):
    rc, out, _ = run_cli(capsys, "--context-lens", "80000,1000", "--query-lens", "4096,512",
                         "--workspace-tokens", "131072", "--policy", "equal", "--json")
    assert rc == 0
    j = json.loads(out)
    for key in ("policy", "num_iterations", "chunk_starts", "chunk_lens", "cu_seq_lens",
                "iteration_tokens"):
        assert key in j
    assert "token_to_seq" not in j and len(out) < 1000  # compact: no per-token table
    rc, out, _ = run_cli(capsys, "--context-lens", "80000,1000", "--query-lens", "4096,512",
                         "--workspace-tokens", "131072", "--policy", "equal", "--json",
                         "--token-tables")
    assert rc == 0
    j = json.loads(out)
    assert j["policy"] == "equal" and j["num_iterations"] == 2
    assert j["chunk_lens"] == [[65536, 1000], [14464, 0]]
    assert j["chunk_starts"] == [[0, 0], [65536, 65536]]
    assert len(j["token_to_seq"]) == 2 and len(j["token_to_seq"][0]) == 66536


def test_zero_context(capsys):
    rc, out, _ = run_cli(capsys, "--context-lens", "0,0", "--query-lens", "3,4")
    assert rc == 0 and "iterations=0" in out and "no context" in out


def test_batches_json_lines(tmp_path, capsys):
    f = tmp_path / "b.jsonl"
    f.write_text('{"context_lens": [100, 200], "query_lens": [1, 2]}\n\n'
                 '{"context_lens": [0], "query_lens": [5]}\n'
                 '{"context_lens": [1000], "query_lens": [7]}\n')
    rc, out, err = run_cli(capsys, "--batches", str(f), "--workspace-tokens", "128",
                           "--page-size", "16")
    assert rc == 0 and err == ""
    plans = [json.loads(line) for line in out.splitlines()]
    assert [p["num_iterations"] for p in plans] == [3, 0, 8]
    assert plans[0]["context_lens"] == [100, 200] and plans[2]["query_lens"] == [7]


@pytest.mark.parametrize("content, match", [
    ('{"context_lens": [1], "query_lens": [1]}\n{"context_lens": [1], "query_lens": [0]}\n',
     r"line 2: PrefillBatch.query_lens\[0\] = 0"),
    ('{"context_lens": [1], "query_lens": [1]}\nnot json\n', r"line 2: not valid JSON"),
    ('{"context_lens": [1], "query_len": [1]}\n', r"line 1: unknown keys \['query_len'\]"),
    ('{"context_lens": [1]}\n', r"line 1: missing keys \['query_lens'\]"),
    ('{"context_lens": [1.5], "query_lens": [1]}\n', r"line 1: context_lens must be a list"),
    ('[1, 2]\n', r"line 1: expected an object"),
])
def test_batches_errors_exit_2_with_line(tmp_path, capsys, content, match):
    f = tmp_path / "b.jsonl"
    f.write_text(content)
    rc, out, err = run_cli(capsys, "--batches", str(f))
    assert rc == 2 and out == ""
    assert err.startswith("mlaprefill plan: error: ")

    assert re.search(match, err), err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv, match", [
    (["--context-lens", "10,-1", "--query-lens", "1,1"], r"context_lens\[1\] = -1 is negative"),
    (["--context-lens", "10,x", "--query-lens", "1,1"], r"--context-lens must be comma-separated"),
    (["--context-lens", "1,,2", "--query-lens", "1,1"], r"--context-lens has an empty item"),
    (["--context-lens", "1,2", "--query-lens", "1,1,"], r"--query-lens has an empty item"),
    (["--context-lens", "", "--query-lens", "1"], r"--context-lens has an empty item"),
    (["--query-lens", "1"], r"--context-lens is required"),
    (["--context-lens", "1", "--query-lens", "1", "--workspace-tokens", "0"],
     r"workspace_tokens must be a positive int"),
    (["--context-lens", "100,100,100", "--query-lens", "1,1,1", "--workspace-tokens", "128",
      "--policy", "equal"], r"smaller than one page per request with context"),
    (["--batches", "/nonexistent/x.jsonl"], r"cannot read --batches"),
    (["--batches", "f", "--context-lens", "1"], r"--batches replaces"),
])
def test_validation_errors_exit_2(capsys, argv, match):
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2 and out == ""

    assert re.search(match, err), err


def test_console_entry_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "mlaprefill", "plan", "--context-lens", "5",
                           "--query-lens", "0"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "query_lens[0] = 0" in proc.stderr and "Traceback" not in proc.stderr


# -- issue 12: no tracebacks, memory proportional to the output, first-use options ----------
def test_negative_list_value_reports_the_field():
    """Was: argparse's 'argument --context-lens: expected one argument'."""
    rc = main(["plan", "--context-lens", "-5,1000", "--query-lens", "1,1"])
    assert rc == 2
    rc = main(["plan", "--query-lens", "-1", "--context-lens", "4"])
    assert rc == 2


def test_negative_list_value_message(capsys):
    rc, out, err = run_cli(capsys, "--context-lens", "-5,1000", "--query-lens", "1,1")
    assert rc == 2 and out == ""
    assert "context_lens[0] = -5 is negative" in err and "expected one argument" not in err


def test_huge_plan_refused_before_planning(capsys):
    """Was: 2e9 context tokens in 64-token iterations allocated ~7.5 GiB, even for text."""
    import tracemalloc

    tracemalloc.start()
    rc, out, err = run_cli(capsys, "--context-lens", "2000000000", "--query-lens", "1",
                           "--workspace-tokens", "64")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert rc == 2 and out == ""
    assert "may have up to 31,250,000 iterations" in err or "2,000,000,000 iterations" in err
    assert "--max-iterations 100,000" in err and "raise --workspace-tokens" in err
    assert peak < 20 * 2**20, peak
    rc, out, err = run_cli(capsys, "--context-lens", "20000000", "--query-lens", "1",
                           "--workspace-tokens", "64")
    assert rc == 2 and "312,500 iterations" in err  # refused too
    rc, out, _ = run_cli(capsys, "--context-lens", "20000000", "--query-lens", "1",
                         "--workspace-tokens", "64", "--max-iterations", "400000", "--json")
    assert rc == 0 and json.loads(out)["num_iterations"] == 312_500


def test_token_tables_bounded_before_they_are_built(capsys, tmp_path):
    """Issue #30: --token-tables of a 2e9-token context took 11.6 GB and was killed; one line
    of 10**6 requests took 24 GB. Both are one line now, and the table limit can be raised."""
    import tracemalloc

    big = ("--context-lens", "2000000000", "--query-lens", "1", "--json", "--token-tables")
    tracemalloc.start()
    rc, out, err = run_cli(capsys, *big)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "2,000,027,648 entries" in err and "--max-table-entries 16,777,216" in err
    assert peak < 20 * 2**20, peak
    rc, _, err = run_cli(capsys, *big, "--max-table-entries", str(10**12))
    assert rc == 2 and "MAX_TOKEN_TABLE_ENTRIES" in err  # the API's own limit, still one line
    rc, _, err = run_cli(capsys, *big[:4], "--max-table-entries", "-1")
    assert rc == 2 and "--max-table-entries must be >= 0" in err
    rc, out, _ = run_cli(capsys, "--context-lens", "300,20", "--query-lens", "1,1", "--json",
                         "--token-tables", "--workspace-tokens", "64", "--page-size", "16",
                         "--max-table-entries", "320")  # 5 iterations x 64 rows: just fits
    assert rc == 0 and len(json.loads(out)["token_to_seq"]) == 5
    rc, _, err = run_cli(capsys, "--context-lens", "300,20", "--query-lens", "1,1", "--json",
                         "--token-tables", "--workspace-tokens", "64", "--page-size", "16",
                         "--max-table-entries", "319")
    assert rc == 2 and "320 entries" in err
    lines = tmp_path / "many.jsonl"
    lines.write_text(json.dumps({"context_lens": [100] * 10**6, "query_lens": [1] * 10**6}))
    rc, out, err = run_cli(capsys, "--batches", str(lines))
    assert rc == 2 and out == "" and "1,000,000 requests" in err
    assert "fewer requests per line" in err and "--workspace-tokens" in err


@settings(max_examples=60, deadline=None)
@given(context_lens=st.lists(st.integers(0, 3000), min_size=1, max_size=6),
       page_size=st.sampled_from([1, 4, 16, 64]), extra=st.integers(0, 300),
       policy=st.sampled_from(["packed", "equal", "balanced"]))
def test_iteration_bound_holds(context_lens, page_size, extra, policy):
    from mlaprefill.batch import PrefillBatch
    from mlaprefill.plan import ChunkPlanner
    from mlaprefill.plan_cli import max_iterations_bound

    planner = ChunkPlanner(page_size + extra, page_size, policy)
    batch = PrefillBatch([1] * len(context_lens), context_lens, page_size=page_size)
    try:
        plan = planner.plan(batch)
    except ValueError:  # equal without one page per request: the planner's own error
        assert policy == "equal" and max_iterations_bound(batch, planner) == 0
        return
    assert plan.num_iterations <= max_iterations_bound(batch, planner)


def test_policy_auto_works_like_the_api(capsys):
    import torch

    from mlaprefill.prefill import MLAChunkedPrefill

    api = MLAChunkedPrefill(torch.zeros(2 * 16, 8), qk_nope_head_dim=8, v_head_dim=8,
                            qk_rope_head_dim=8).resolve_policy("auto")
    rc, out, err = run_cli(capsys, "--context-lens", "80000,1000", "--query-lens", "4,1",
                           "--policy", "auto")
    assert rc == 0 and err == ""
    assert out.splitlines()[0].startswith(f"policy={api} ") and "(auto: backend" in out
    rc, out, _ = run_cli(capsys, "--context-lens", "80000,1000", "--query-lens", "4,1",
                         "--policy", "auto", "--backend", "fa2", "--json")
    assert rc == 0 and json.loads(out)["policy"] == "balanced"  # FA2 varlen's preference
    rc, _, err = run_cli(capsys, "--context-lens", "8", "--query-lens", "1", "--backend", "math")
    assert rc == 2 and "--backend only matters with --policy auto" in err


@pytest.mark.parametrize("content, match", [
    (b'{"context_lens": [1], "query_lens": [1]}\n\xff\xfe{}\n', r"line 2: not UTF-8 text"),
    (b"[" * 100_000 + b"\n", r"line 1: not valid JSON \(nested too deeply\)"),
    (b'{"context_lens": [1e400], "query_lens": [1]}\n', r"line 1: context_lens must be a list"),
    (b'{"context_lens": [' + b"9" * 30 + b'], "query_lens": [1]}\n',
     r"line 1: PrefillBatch.context_lens\[0\] = 9{30} overflows int32"),
    (b'{"context_lens": [2000000000], "query_lens": [1]}\n', r"line 1: the plan may have up to"),
])
def test_batches_bad_bytes_exit_2(tmp_path, capsys, content, match):
    """Was: UnicodeDecodeError / RecursionError tracebacks."""
    f = tmp_path / "b.jsonl"
    f.write_bytes(content)
    rc, out, err = run_cli(capsys, "--batches", str(f), "--workspace-tokens", "64")
    assert rc == 2 and out == ""
    assert re.search(match, err), err
    assert len(err.strip().splitlines()) == 1


def test_batches_keys_and_compact_mode_in_help(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert '{"context_lens": [ints], "query_lens": [ints]}' in text
    assert "compact unless --token-tables" in text and "--max-iterations" in text


def test_version(capsys):
    from mlaprefill import __version__

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"mlaprefill {__version__}"


def test_closed_pipe_is_not_a_traceback():
    proc = subprocess.Popen([sys.executable, "-m", "mlaprefill", "plan", "--context-lens",
                             "3200000", "--query-lens", "1", "--workspace-tokens", "64"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = proc.stdout.readline()
    proc.stdout.close()  # like `| head -1`
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0
    assert first.startswith(b"policy=packed") and "Traceback" not in err, err


def test_batches_from_stdin(capsys, monkeypatch):
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO('{"context_lens": [100], "query_lens": [2]}\n'))
    rc, out, err = run_cli(capsys, "--batches", "-", "--workspace-tokens", "64",
                           "--page-size", "16")
    assert rc == 0 and err == "" and json.loads(out)["num_iterations"] == 2


def test_plan_cli_knows_every_backend():
    """The torch-free copy of the backend names in the plan CLI matches the registry."""
    from mlaprefill.backends import BACKENDS
    from mlaprefill.plan_cli import _BACKEND_NAMES

    assert set(_BACKEND_NAMES) == set(BACKENDS)


def test_usage_errors_are_one_line_and_ctrl_c_is_130(capsys, monkeypatch):
    """Was: an argparse error printed the whole usage block (8-16 lines); Ctrl-C while a
    subcommand's module imported torch printed a 52-line traceback."""
    import importlib

    from mlaprefill import cli

    for argv in (["plan", "--policy", "x"], ["bench", "--nope"], ["plan", "--workspace-tokens"]):
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "error:" in err and "--help" in err, err

    def interrupted(name, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib, "import_module", interrupted)
    assert cli.main(["bench", "--dry-run"]) == 130
    assert capsys.readouterr().err == "mlaprefill: interrupted\n"
