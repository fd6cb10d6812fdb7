"""``mlaprefill plan``: show how a batch's context is split into workspace iterations.

Examples::

    mlaprefill plan --context-lens 80000,1000 --query-lens 4096,512
    mlaprefill plan --context-lens 80000,1000 --query-lens 4096,512 --policy equal --json
    mlaprefill plan --context-lens 16384,16384,9000 --query-lens 256,256,256 \
        --shared-with-next 16384,8192             # prefix sharing: rows gathered once
    mlaprefill plan --batches batches.jsonl      # one {"context_lens": [...], "query_lens": [...]}
                                                 # per line -> one JSON plan per line, in order

Defaults: ``--workspace-tokens 65536`` (vLLM's default chunked-context workspace) and
``--page-size 64`` (the page size of FlashMLA-style MLA kernels and DeepSeek deployments).
Invalid input prints the validation message (with the line number for ``--batches``) and exits 2.

Memory and time grow with what is printed: before planning, the number of iterations is bounded
from the lengths alone, and a plan of more than ``--max-iterations`` (default 100,000) is refused
with exit 2 (a 2e9-token context in 64-token iterations would otherwise take GiBs to print); so
is a plan beyond the planner's ``MAX_PLAN_ENTRIES`` (iterations x requests), a ``--token-tables``
table of more than ``--max-table-entries`` (default 2**24) entries, and a ``--batches`` line
longer than 64 MiB. ``--batches`` keeps only the batches while it checks every line, and plans
each again as it prints it, so memory holds one plan at a time.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from typing import Any

import numpy as np

from mlaprefill.batch import PrefillBatch
from mlaprefill.plan import (
    MAX_PLAN_ENTRIES,
    POLICIES,
    ChunkPlan,
    ChunkPlanner,
    PlanTooLargeError,
    check_token_table_size,
)

__all__ = ["add_parser", "format_plan", "run"]

DEFAULT_WORKSPACE_TOKENS = 65536
DEFAULT_PAGE_SIZE = 64
_MAX_PIECES_SHOWN = 8
_MAX_ITERATIONS = 100_000
_MAX_TABLE_ENTRIES = 2**24  # ~100 MB of JSON text, a few hundred MB while it is serialized
_MAX_LINE_BYTES = 2**26  # a 64 MiB line holds ~10**7 requests, far past MAX_PLAN_ENTRIES / 2
# Kept here (not imported) so `mlaprefill plan` does not import torch unless --policy auto.
_BACKEND_NAMES = ("mlaprefill", "cudnn", "fa2", "flex", "math", "mlaprefill-fp8")


class _InputError(ValueError):
    pass


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``plan`` subcommand on ``subparsers`` (from ``add_subparsers``)."""
    p = subparsers.add_parser(
        "plan",
        help="show the chunk plan of a batch (pure CPU)",
        description=__doc__.split("\n\n")[0].replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Exit status: 0 ok, 2 invalid input.",
    )
    p.add_argument("--context-lens", metavar="N,N,...",
                   help="cached context tokens per request, comma-separated")
    p.add_argument("--query-lens", metavar="N,N,...",
                   help="new tokens per request (each >= 1), comma-separated")
    p.add_argument("--workspace-tokens", type=int, default=DEFAULT_WORKSPACE_TOKENS,
                   help=f"workspace rows per iteration (default {DEFAULT_WORKSPACE_TOKENS}, "
                        f"vLLM's)")
    p.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE,
                   help=f"tokens per cache page (default {DEFAULT_PAGE_SIZE})")
    p.add_argument("--policy", choices=("auto", *POLICIES), default="packed",
                   help="packed: fewest iterations (default); equal: vLLM's chunking; "
                        "balanced: about as few, each request in every iteration until it runs "
                        "out; auto: what mla_chunked_prefill(policy='auto') picks for --backend")
    p.add_argument("--backend", default="auto", choices=("auto", *_BACKEND_NAMES),
                   help="with --policy auto: the attention backend whose preferred policy to use "
                        "(default auto: the backend picked on this machine, bf16 on CUDA, fp32 "
                        "on CPU)")
    p.add_argument("--shared-with-next", metavar="N,N,...",
                   help="prefix sharing: leading context tokens request r shares with request "
                        "r+1 (num_reqs - 1 entries; whole pages are shared: ceil(N / page_size) "
                        "pages, capped by both contexts); the plan gathers shared rows once "
                        "(gathered_rows)")
    p.add_argument("--json", action="store_true",
                   help="print the plan as JSON (compact: O(iterations x requests) entries)")
    p.add_argument("--token-tables", action="store_true",
                   help="with --json/--batches: also print vLLM's per-token token_to_seq table "
                        "(one entry per context token; left out by default)")
    p.add_argument("--batches", metavar="FILE",
                   help='UTF-8 JSON lines (- for stdin), one batch per line: {"context_lens": '
                        '[ints], "query_lens": [ints]} (exactly these two keys, one entry per '
                        'request); prints one JSON plan per line, in order (compact unless '
                        '--token-tables), or nothing if a line is invalid')
    p.add_argument("--max-iterations", type=int, default=_MAX_ITERATIONS, metavar="N",
                   help=f"refuse plans that may have more than N iterations, before planning "
                        f"(default {_MAX_ITERATIONS:,}; memory and output grow with it)")
    p.add_argument("--max-table-entries", type=int, default=_MAX_TABLE_ENTRIES, metavar="N",
                   help=f"with --token-tables: refuse a table of more than N entries "
                        f"(iterations x workspace rows; default {_MAX_TABLE_ENTRIES:,})")
    return p


def _parse_list(flag: str, text: str | None) -> list[int]:
    if text is None:
        raise _InputError(f"{flag} is required (comma-separated ints), unless --batches is given")
    tokens = text.split(",")
    if any(not tok.strip() for tok in tokens):  # "1,,2" is a typo, not the list [1, 2]
        raise _InputError(f"{flag} has an empty item in {text!r}; give comma-separated ints "
                          f"such as 80000,1000")
    try:
        return [int(tok) for tok in tokens]
    except ValueError:
        raise _InputError(f"{flag} must be comma-separated ints, got {text!r}") from None


def format_plan(plan: ChunkPlan) -> str:
    """Human-readable summary: one header line, then one table row per iteration."""
    total = plan.num_context_tokens
    gathered = plan.num_gathered_rows
    lower = -(-gathered // plan.workspace_tokens)
    lines = [
        f"policy={plan.policy} workspace_tokens={plan.workspace_tokens} "
        f"page_size={plan.page_size} requests={plan.num_reqs} "
        f"query_tokens={plan.num_query_tokens} context_tokens={total} "
        f"gathered_rows={gathered}" + (f" ({100 * gathered / total:.1f}%: prefix sharing)"
                                       if plan.shares_prefixes else ""),
        f"iterations={plan.num_iterations} (lower bound "
        f"ceil({'gathered' if plan.shares_prefixes else 'context'}/W) = {lower})",
    ]
    if plan.num_iterations == 0:
        lines.append("no context: nothing to gather")
        return "\n".join(lines)
    lines.append(f"{'iter':>4} {'tokens':>8} {'fill':>6} {'max_piece':>9}  "
                 f"pieces (req:[start,end))")
    for i in range(plan.num_iterations):
        lens = plan.chunk_lens[i]
        reqs = lens.nonzero()[0]
        seq_q, seq_k = plan.iteration_sequences(i)[:2]
        # a shared piece: the requests whose queries its sequence spans ("0-31:")
        seq = np.searchsorted(seq_k, plan.cu_seq_lens[i, reqs], side="right") - 1
        last = np.searchsorted(plan.cu_query_lens, seq_q[seq + 1]) - 1
        who = [f"{r}" if b == r else f"{r}-{b}"
               for r, b in zip(reqs[:_MAX_PIECES_SHOWN], last, strict=False)]
        pieces = [f"{w}:[{plan.chunk_starts[i, r]},{plan.chunk_starts[i, r] + lens[r]})"
                  for w, r in zip(who, reqs[:_MAX_PIECES_SHOWN], strict=True)]
        if len(reqs) > _MAX_PIECES_SHOWN:
            pieces.append(f"... +{len(reqs) - _MAX_PIECES_SHOWN} more")
        tokens = plan.iteration_tokens[i]
        lines.append(f"{i:>4} {tokens:>8} {100 * tokens / plan.workspace_tokens:>5.1f}% "
                     f"{plan.max_chunk_lens[i]:>9}  {' '.join(pieces)}")
    return "\n".join(lines)


def max_iterations_bound(batch: PrefillBatch, planner: ChunkPlanner) -> int:
    """An upper bound on ``planner.plan(batch).num_iterations`` from the lengths alone (O(R)).

    ``packed``: every iteration but the last holds >= W - page_size + 1 tokens (plan.py), and
    cutting each request alone into pieces of ``floor(W / page_size)`` pages is a stream plan,
    which greedy furthest-reach never needs more iterations than. ``equal``: exactly
    ``ceil(max / chunk)`` (0 if infeasible: the planner raises). ``balanced``: at most equal's
    count when equal is feasible, else at most one page per iteration of the longest context, or
    packed's pieces.
    """
    ctx = batch.context_lens
    longest, total = int(ctx.max()), int(ctx.sum())
    if longest == 0:
        return 0
    w, ps = planner.workspace_tokens, planner.page_size
    packed = min(-(-total // (w - ps + 1)), int((-(-ctx // (w // ps * ps))).sum()))
    if planner.policy == "packed":
        return packed
    chunk = (w // int(np.count_nonzero(ctx))) // ps * ps
    equal = -(-longest // chunk) if chunk else 0
    if planner.policy == "equal":
        return equal
    return equal if chunk else max(packed, -(-longest // ps))


def _resolve_auto_policy(backend: str) -> tuple[str, str]:
    """``(policy, backend name)`` as ``MLAChunkedPrefill(...).resolve_policy("auto")`` gives."""
    import torch

    from mlaprefill.backends import BACKENDS, get_backend

    if backend != "auto":  # a named backend: its preference, wherever it would run
        return BACKENDS[backend].preferred_policy, backend
    cuda = torch.cuda.is_available()
    chosen = get_backend("auto", device="cuda" if cuda else "cpu",
                         dtype=torch.bfloat16 if cuda else torch.float32,
                         qk_head_dim=192, v_head_dim=128)  # DeepSeek head dims
    return chosen.preferred_policy, chosen.name


def _plan_checked(planner: ChunkPlanner, batch: PrefillBatch, limit: int,
                  table_limit: int | None = None) -> ChunkPlan:
    """Plan ``batch`` after the size checks; ``table_limit``: the --token-tables bound."""
    bound = max_iterations_bound(batch, planner)
    if bound > limit:
        raise _InputError(
            f"the plan may have up to {bound:,} iterations (policy {planner.policy}, "
            f"{batch.num_context_tokens:,} context tokens, workspace_tokens "
            f"{planner.workspace_tokens}, page_size {planner.page_size}), more than "
            f"--max-iterations {limit:,}; raise --workspace-tokens, or raise --max-iterations "
            f"to print it anyway (memory and output grow with the iterations)")
    try:
        plan = planner.plan(batch)
    except PlanTooLargeError as exc:  # the same limit, in the options of this command
        raise _InputError(
            f"{exc.num_reqs:,} requests in {exc.num_iterations:,}+ iterations make a plan of "
            f"more than {MAX_PLAN_ENTRIES:,} entries (iterations x (requests + 1), the "
            f"planner's MAX_PLAN_ENTRIES); split the batch into fewer requests per line, or "
            f"raise --workspace-tokens") from None
    entries = plan.num_iterations * plan.max_iteration_tokens
    if table_limit is not None and entries > table_limit:
        raise _InputError(
            f"--token-tables would print {entries:,} entries ({plan.num_iterations:,} "
            f"iterations x {plan.max_iteration_tokens:,} rows), more than --max-table-entries "
            f"{table_limit:,}; drop --token-tables, or raise --max-table-entries to print it "
            f"anyway")
    if table_limit is not None:
        check_token_table_size(plan.num_iterations, plan.max_iteration_tokens)  # the API's limit
    return plan


def _batch_from_json_line(line: str, page_size: int) -> PrefillBatch:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise _InputError(f"not valid JSON ({exc.msg})") from None
    except RecursionError:
        raise _InputError("not valid JSON (nested too deeply)") from None
    except ValueError as exc:  # an integer of more than 4300 digits (Python's int limit)
        raise _InputError(f"not valid JSON ({str(exc).partition(':')[0]})") from None
    except MemoryError:
        raise _InputError("too large to parse; give fewer requests per line") from None
    if not isinstance(obj, dict):
        raise _InputError('expected an object {"context_lens": [...], "query_lens": [...]}')
    unknown = sorted(set(obj) - {"context_lens", "query_lens"})
    if unknown:
        raise _InputError(f"unknown keys {unknown}; expected context_lens and query_lens")
    missing = [k for k in ("context_lens", "query_lens") if k not in obj]
    if missing:
        raise _InputError(f"missing keys {missing}")
    for key in ("context_lens", "query_lens"):
        value = obj[key]
        if not isinstance(value, list) or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise _InputError(f"{key} must be a list of ints, got {value!r}")
    return PrefillBatch(obj["query_lens"], obj["context_lens"], page_size=page_size)


def _shared_block_table(context_lens: list[int], shared: list[int],
                        page_size: int) -> np.ndarray:
    """int32 [R, max_pages]: request r+1's first ``ceil(shared[r] / page_size)`` pages are request
    r's, every other page its own."""
    if len(shared) != len(context_lens) - 1:
        raise _InputError(f"--shared-with-next needs num_reqs - 1 = {len(context_lens) - 1} "
                          f"entries (request r with r+1), got {len(shared)}")
    if any(s < 0 for s in shared):
        raise _InputError(f"--shared-with-next entries must be >= 0, got {shared}")
    pages = -(-np.asarray(context_lens, dtype=np.int64) // page_size)
    width = max(int(pages.max(initial=0)), 1)
    if width * len(context_lens) > 2**26:
        raise _InputError(f"--shared-with-next: a block table of {len(context_lens)} x {width} "
                          f"pages is too large to build here; raise --page-size")
    ids = np.arange(width * len(context_lens), dtype=np.int32).reshape(-1, width)
    for r, s in enumerate(shared):  # a loop over requests: the table is the CLI's own input
        n = min(-(-s // page_size), int(pages[r]), int(pages[r + 1]))
        ids[r + 1, :n] = ids[r, :n]
    return ids


def _error(message: str) -> int:
    print(f"mlaprefill plan: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    """Run ``mlaprefill plan``; returns the exit code (0 ok, 2 invalid input)."""
    if args.max_iterations < 0:
        return _error(f"--max-iterations must be >= 0, got {args.max_iterations}")
    if args.max_table_entries < 0:
        return _error(f"--max-table-entries must be >= 0, got {args.max_table_entries}")
    table_limit = args.max_table_entries if args.token_tables else None
    policy, auto_note = args.policy, ""
    if policy == "auto":
        try:
            policy, backend = _resolve_auto_policy(args.backend)
        except ValueError as exc:
            return _error(str(exc))
        auto_note = f" (auto: backend {backend})"
    elif args.backend != "auto":
        return _error("--backend only matters with --policy auto; drop it or add --policy auto")
    try:
        planner = ChunkPlanner(args.workspace_tokens, args.page_size, policy)
    except ValueError as exc:
        return _error(str(exc))
    out = sys.stdout
    if args.batches is not None:
        if args.context_lens is not None or args.query_lens is not None:
            return _error("--batches replaces --context-lens/--query-lens; give one or the other")
        try:
            # bytes, decoded per line: a non-UTF-8 line is reported with its number
            if args.batches == "-":
                # a text-only stdin (embedding callers) is re-encoded as UTF-8
                fh = getattr(sys.stdin, "buffer", None) or io.BytesIO(
                    sys.stdin.read().encode("utf-8", "surrogateescape"))
            else:
                fh = open(args.batches, "rb")  # noqa: SIM115
        except OSError as exc:
            return _error(f"cannot read --batches {args.batches!r}: {exc.strerror}")
        batches = []
        with fh:
            try:
                for lineno, raw in enumerate(iter(lambda: fh.readline(_MAX_LINE_BYTES + 1), b""),
                                             start=1):
                    if len(raw) > _MAX_LINE_BYTES:  # also /dev/zero: never read unbounded
                        return _error(f"{args.batches} line {lineno}: longer than "
                                      f"{_MAX_LINE_BYTES >> 20} MiB; --batches takes one JSON "
                                      f"batch per line (split the batch)")
                    try:
                        line = raw.decode("utf-8")
                    except UnicodeDecodeError as exc:
                        return _error(f"{args.batches} line {lineno}: not UTF-8 text (byte "
                                      f"{exc.start}); --batches takes UTF-8 JSON lines")
                    if not line.strip():
                        continue
                    try:
                        batch = _batch_from_json_line(line, args.page_size)
                        _plan_checked(planner, batch, args.max_iterations, table_limit)
                        batches.append(batch)
                    except ValueError as exc:
                        return _error(f"{args.batches} line {lineno}: {exc}")
            except OSError as exc:
                return _error(f"cannot read --batches {args.batches!r}: {exc.strerror}")
        # Printed only once every line is valid, so output is all-or-nothing; planned again here
        # (planning is microseconds) so that memory holds one plan, not the whole file's.
        for batch in batches:
            plan = planner.plan(batch)
            out.write(json.dumps(plan.to_json(token_tables=args.token_tables),
                                 separators=(",", ":")) + "\n")
        return 0
    try:
        context_lens = _parse_list("--context-lens", args.context_lens)
        query_lens = _parse_list("--query-lens", args.query_lens)
        table = None
        if args.shared_with_next is not None:
            table = _shared_block_table(
                context_lens, _parse_list("--shared-with-next", args.shared_with_next),
                args.page_size)
        batch = PrefillBatch(query_lens, context_lens, page_size=args.page_size,
                             block_table=table)
        plan = _plan_checked(planner, batch, args.max_iterations,
                             table_limit if args.json else None)
    except ValueError as exc:
        return _error(str(exc))
    if args.json:
        out.write(json.dumps(plan.to_json(token_tables=args.token_tables)) + "\n")
    else:
        text = format_plan(plan)
        if auto_note:
            first, _, rest = text.partition("\n")
            text = f"{first}{auto_note}\n{rest}"
        out.write(text + "\n")
    return 0
