"""``mlaprefill audit [--json] [--strict] [--allow PATTERN] SCRIPT [ARGS...]``.

Runs a Python script (``runpy``, ``sys.argv = [SCRIPT, *ARGS]``, as ``__main__``) under
:func:`mlaprefill.audit.no_host_sync` and prints the host syncs grouped by location, with counts
and bytes. Exit status: 0 clean, 1 host syncs found (or, in strict mode, the first one raised),
2 usage error (missing script ...). A script that fails on its own keeps its exit status
(an uncaught exception gives 1, like ``python SCRIPT``), after the report is printed.
With ``--json`` stdout holds only the JSON report; the script's own stdout goes to stderr.
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

__all__ = ["add_parser", "audit_script", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "audit",
        help="run a Python script and report its host syncs / host stalls",
        description=re.sub(r":\w+:`([^`]*)`", r"\1", __doc__.split("\n\n")[1]).replace("``", ""),
    )
    p.add_argument("--json", action="store_true", help="print a JSON report on stdout")
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
    return p


def audit_script(
    script: str, args: list[str], *, strict: bool = False, allow: list[str] | None = None,
    profile: bool = False,
) -> tuple[Any, int, str | None]:
    """Run ``script`` under the audit.

    Returns
    -------
    (audit, script_status, error)
        The finished :class:`~mlaprefill.audit.HostSyncAudit`, the script's own exit status
        (0 when it returned normally) and a formatted traceback if it raised.
    """
    from mlaprefill.audit.runtime import HostSyncError, no_host_sync

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


def run(args: argparse.Namespace) -> int:
    script = args.script
    if not os.path.isfile(script):
        print(f"mlaprefill audit: error: SCRIPT {script!r} is not a file; pass the path of a "
              "Python script", file=sys.stderr)
        return 2
    script_args = list(args.args)
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    redirect = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    with redirect:
        try:
            audit, status, error = audit_script(script, script_args, strict=args.strict,
                                                allow=args.allow, profile=args.profile)
        except ValueError as e:  # e.g. --profile without CUDA
            print(f"mlaprefill audit: error: {e}", file=sys.stderr)
            return 2
    if error:
        print(error.rstrip(), file=sys.stderr)
    found = bool(audit.findings)
    if args.json:
        out = {"script": script, "args": script_args, "script_status": status, **audit.summary()}
        print(json.dumps(out, indent=2))
    else:
        print(f"mlaprefill audit {script}: " + audit.report())
    if found:
        return 1
    return status
