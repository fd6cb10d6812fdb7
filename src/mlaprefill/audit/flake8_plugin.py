"""flake8 plugin (entry point ``flake8.extension``, prefix ``HS``): the host-sync lint.

``flake8 --select HS path/`` reports HS101/HS102/HS201 (see :mod:`mlaprefill.audit.lint`);
flake8 itself applies ``# noqa`` comments.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from typing import Any

from mlaprefill.audit.lint import lint_tree

__all__ = ["HostSyncChecker"]


class HostSyncChecker:
    """AST checker yielding ``(line, col, "HSxxx message", type)`` tuples."""

    name = "mlaprefill-hostsync"
    version = "0.1.0"

    def __init__(self, tree: ast.AST, filename: str = "<unknown>") -> None:
        self.tree = tree
        self.filename = filename

    def run(self) -> Iterator[tuple[int, int, str, type[Any]]]:
        for f in lint_tree(self.tree, self.filename):
            yield f.line, f.col, f"{f.code} {f.message}", type(self)
