"""``hostsync audit [--json] [--strict] [--allow PATTERN] [--profile] SCRIPT [ARGS...]``.

Runs a Python script (``runpy``, ``sys.argv = [SCRIPT, *ARGS]``, as ``__main__``) under
:func:`hostsync.no_host_sync` and prints the host syncs grouped by the first frame
outside torch, with counts and bytes, one line per kind with its fix, and what the audit could
not see (on a machine without CUDA no tensor is on a device, so no copy or read can
synchronize: the report says so instead of an all-clear). Exit status: 0 clean, 1 host syncs
found (or, in strict mode, the first one raised), 2 usage error (a missing, unreadable,
non-UTF-8 or unparsable script, --profile without CUDA, a bad flag), as one line on stderr.
A script that fails on its own keeps its exit status (an uncaught exception gives 1, like
``python SCRIPT``), after the report is printed. With ``--json`` stdout holds only the JSON
report (``complete``, ``not_seen``, ``by_frame``, ``fixes``, ...); the script's own stdout goes
to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import runpy
import sys
import traceback
from typing import Any

from hostsync.cli_common import UsageError, one_line_errors, read_python

__all__ = ["add_parser", "audit_script", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "audit",
        help="run a Python script and report its host syncs / host stalls",
        description=re.sub(r":\w+:`([^`]*)`", r"\1", __doc__.split("\n\n")[1]).replace("``", ""),
    )
    p.add_argument("--json", action="store_true", help="print a JSON report on stdout")
    p.add_argument("--format", choices=("text", "json"), default="text",
                   help="report format (--json is --format json)")
    p.add_argument("--strict", action="store_true",
                   help="stop the script at the first host sync (HostSyncError)")
    p.add_argument("--allow", action="append", default=[], metavar="PATTERN",
                   help="accepted syncs: a kind (e.g. synchronize) or a path_glob[:line]; "
                        "repeatable")
    p.add_argument("--profile", action="store_true",
                   help="CUDA only: also count pageable memcpys with torch.profiler")
    p.add_argument("script", metavar="SCRIPT", help="Python script to run")
    p.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS",
                   help="arguments passed to the script")
    p.set_defaults(prog=p.prog)
    return one_line_errors(p)


def audit_script(
    script: str, args: list[str], *, strict: bool = False, allow: list[str] | None = None,
    profile: bool = False,
) -> tuple[Any, int, str | None]:
    """Run ``script`` under the audit.

    Returns
    -------
    (audit, script_status, error)
        The finished :class:`~hostsync.HostSyncAudit`, the script's own exit status
        (0 when it returned normally) and a formatted traceback if it raised.
    """
    from hostsync.runtime import HostSyncError, no_host_sync

    audit = no_host_sync(strict=strict, allow=allow or (), profile=profile)
    script_path = os.path.abspath(script)
    saved_argv, saved_path0 = sys.argv, sys.path[0] if sys.path else None
    sys.argv = [script, *args]
    if sys.path:
        sys.path[0] = os.path.dirname(script_path)
    status, error = 0, None
    try:
        with audit:
            runpy.run_path(script_path, run_name="__main__")
    except SystemExit as e:
        code = e.code
        status = code if isinstance(code, int) else (0 if code is None else 1)
        if code is not None and not isinstance(code, int):
            error = str(code)
    except HostSyncError as e:
        status, error = 1, f"HostSyncError: {e}"
    except BaseException:  # the script's own failure is reported, not raised
        status, error = 1, traceback.format_exc()
    finally:
        sys.argv = saved_argv
        if saved_path0 is not None:
            sys.path[0] = saved_path0
    return audit, status, error


def check_script(script: str) -> None:
    """Raise :class:`~hostsync.cli_common.UsageError` unless ``script`` is a readable
    Python file that decodes and parses (so that a user error is never the script's failure)."""
    if not os.path.exists(script):
        raise UsageError(f"SCRIPT {script!r} does not exist; pass the path of a Python script")
    if os.path.isdir(script):
        raise UsageError(f"SCRIPT {script!r} is a directory; pass the path of a Python script "
                         "(e.g. its __main__.py)")
    source = read_python(script, field="SCRIPT", skip="audit another script")
    try:
        compile(source, script, "exec", dont_inherit=True)
    except SyntaxError as e:
        raise UsageError(f"SCRIPT {script!r} does not parse (line {e.lineno}: {e.msg}); fix "
                         "the syntax error") from None
    except ValueError as e:  # null bytes
        raise UsageError(f"SCRIPT {script!r} cannot be compiled ({e}); pass a Python "
                         "source file") from None


def _check_profile(profile: bool) -> None:
    if not profile:
        return
    import torch

    if not torch.cuda.is_available():
        raise UsageError("--profile needs CUDA (torch.cuda.is_available() is False on this "
                         "machine); drop --profile here, or run on a CUDA machine")


_PYTHON = re.compile(r"python(\d+(\.\d+)?)?(\.exe)?")


def _drop_interpreter(script: str, script_args: list[str], prog: str = "hostsync audit",
                      ) -> tuple[str, list[str]]:
    """``hostsync audit -- python s.py ARGS`` (the form people type) is ``audit s.py ARGS``:
    a first word naming a Python interpreter that is not a file here is dropped."""
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    if (_PYTHON.fullmatch(os.path.basename(script)) and not os.path.isfile(script)) or (
            script == sys.executable):
        if not script_args:
            raise UsageError(f"SCRIPT {script!r} is the Python interpreter; pass the script "
                             f"to audit after it ({prog} {script} s.py ARGS...)")
        if script_args[0].startswith("-"):
            raise UsageError(f"{script} {script_args[0]} ...: the audit runs a script file, "
                             f"not interpreter options; pass the script's path "
                             f"(for -m MODULE, the module's file)")
        return script_args[0], script_args[1:]
    return script, script_args


def run(args: argparse.Namespace) -> int:
    prog = getattr(args, "prog", "hostsync audit")  # `mlaprefill audit` when run through it
    try:
        script, script_args = _drop_interpreter(args.script, list(args.args), prog)
        check_script(script)
        _check_profile(args.profile)
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    as_json = args.json or args.format == "json"
    redirect = contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext()
    with redirect:
        audit, status, error = audit_script(script, script_args, strict=args.strict,
                                            allow=args.allow, profile=args.profile)
    if error:
        print(error.rstrip(), file=sys.stderr)
    if as_json:
        out = {"script": script, "args": script_args, "script_status": status, **audit.summary()}
        print(json.dumps(out, indent=2))
    else:
        print(f"{prog} {script}: " + audit.report())
    if audit.findings:
        return 1
    return status
