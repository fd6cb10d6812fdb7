import json
import re
import subprocess
import sys

import pytest

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
