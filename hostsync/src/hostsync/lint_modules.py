"""Cross-module summaries of the static lint: what the linted modules' functions return.

When several files are linted together, each module is first summarized (the return kind of
every top-level function and method, the attribute kinds of its classes: the facts of
:func:`~hostsync.lint_flow.summarize`), then each is linted knowing the summaries of what it
imports from the others (``from m import f``, ``from . import m``, ``import m``, ``import m as
a``; ``a.f(...)``, ``C(...).meth()``). A module's name is its path relative to the root it was
found under (``pkg/sub/mod.py`` -> ``pkg.sub.mod``, ``__init__.py`` names the package), prefixed
by the enclosing packages above the root (directories holding ``__init__.py``); an import that
names no linted module exactly resolves to the one module whose name ends with it in two or
more parts (``from minisgl.core import f`` finds ``python/minisgl/core.py`` linted from the
repository root).

Summaries are computed from each module's own facts, then recomputed once with the first
round's imports (so that a chain of two modules resolves); the rounds are capped at
:data:`ROUNDS`, so cycles cost nothing. A module that cannot be read or parsed has no summary
(and is its own HS000 finding).
"""

from __future__ import annotations

import ast
import dataclasses
import os
from collections.abc import Iterable

from hostsync.lint import LintFinding, lint_path
from hostsync.lint_flow import summarize
from hostsync.lint_kinds import Imported

__all__ = ["ROUNDS", "Module", "imported_for", "lint_modules", "module_name", "summaries"]

#: Summary rounds: the first from local facts only, each later one given the previous one's.
ROUNDS = 2


@dataclasses.dataclass(slots=True)
class Module:
    """One linted file: its path, dotted module name and (once parsed) syntax tree."""

    path: str
    name: str
    tree: ast.Module | None = None

    @property
    def is_package(self) -> bool:
        return os.path.basename(self.path) == "__init__.py"


@dataclasses.dataclass(slots=True)
class _Summary:
    functions: dict[str, str]
    classes: set[str]
    methods: dict[tuple[str, str], str]
    attrs: dict[tuple[str, str], str]


def module_name(path: str, root: str | None = None) -> str:
    """Dotted module name of ``path`` linted from ``root`` (a directory given on the command
    line; the file's own directory when it was given itself)."""
    path = os.path.normpath(os.path.abspath(path))
    base = os.path.dirname(path) if root is None or not os.path.isdir(root) else \
        os.path.normpath(os.path.abspath(root))
    rel = os.path.relpath(path, base)
    parts = [] if rel.startswith("..") else rel[:-3].split(os.sep) if rel.endswith(".py") \
        else rel.split(os.sep)
    if not parts:
        parts = [os.path.splitext(os.path.basename(path))[0]]
    if parts[-1] == "__init__":
        parts.pop()
    above = base
    for _ in range(32):  # the packages enclosing the root
        if not os.path.isfile(os.path.join(above, "__init__.py")):
            break
        parts.insert(0, os.path.basename(above))
        above = os.path.dirname(above)
    return ".".join(p for p in parts if p)


def _read(path: str) -> ast.Module | None:
    from hostsync.cli_common import UsageError, read_python

    try:
        return ast.parse(read_python(path, field="PATH", skip="pass --exclude"), filename=path)
    except (UsageError, SyntaxError, ValueError, RecursionError, MemoryError):
        return None  # the lint itself reports it (HS000)


def _summarize(tree: ast.Module, imported: Imported | None) -> _Summary:
    facts = summarize(tree, imported)
    functions = {n: k for (owner, n), k in facts.returns.items() if owner is None}
    methods = {(o, n): k for (o, n), k in facts.returns.items() if o is not None}
    attrs = {(o, a): k for (o, a), k in facts.attrs.items() if o is not None}
    classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    return _Summary(functions, classes, methods, attrs)


class _Index:
    """Linted modules by name. An import names a module exactly, or as the end of its name in
    two or more parts (``minisgl.core`` is ``python/minisgl/core.py`` linted from the repository
    root: a source directory above the package), when one module only ends so. Never the other
    way round: ``vllm.v1.worker.utils`` is not ``vllm_ascend/worker/utils.py``."""

    def __init__(self, modules: list[Module]) -> None:
        self.by_name: dict[str, Module] = {}
        self.by_suffix: dict[str, Module | None] = {}
        for m in modules:
            self.by_name.setdefault(m.name, m)
            parts = m.name.split(".")
            for i in range(1, len(parts) - 1):  # proper suffixes of two parts or more
                suffix = ".".join(parts[i:])
                self.by_suffix[suffix] = m if self.by_suffix.get(suffix, m) is m else None

    def find(self, name: str) -> Module | None:
        if name in self.by_name:
            return self.by_name[name]
        return self.by_suffix.get(name)


def _absolute(module: Module, node: ast.ImportFrom) -> str | None:
    if not node.level:
        return node.module
    parts = module.name.split(".") if module.name else []
    drop = node.level - 1 if module.is_package else node.level
    if drop > len(parts):
        return None
    base = parts[: len(parts) - drop]
    return ".".join([*base, *([node.module] if node.module else [])])


def _add(out: Imported, local: str, summary: _Summary, name: str | None) -> None:
    """Bind what ``summary``'s module exports under ``local``: the module itself when
    ``name`` is None, else its function or class ``name``."""
    if name is None:
        for f, k in summary.functions.items():
            out.functions[f"{local}.{f}"] = k
        return
    if name in summary.functions:
        out.functions[local] = summary.functions[name]
    if name in summary.classes:
        out.classes.add(local)
        for (c, m), k in summary.methods.items():
            if c == name:
                out.methods[(local, m)] = k
        for (c, a), k in summary.attrs.items():
            if c == name:
                out.attrs[(local, a)] = k


def imported_for(module: Module, index: _Index, sums: dict[str, _Summary]) -> Imported:
    """What ``module``'s imports of other linted modules bind, from their summaries."""
    out = Imported()
    if module.tree is None:
        return out
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = index.find(alias.name)
                if target is None or target is module or target.path not in sums:
                    continue
                _add(out, alias.asname or alias.name, sums[target.path], None)
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, node)
            if source is None:
                continue
            target = index.find(source) if source else None
            for alias in node.names:
                local = alias.asname or alias.name
                sub = index.find(f"{source}.{alias.name}" if source else alias.name)
                if sub is not None and sub is not module and sub.path in sums:
                    _add(out, local, sums[sub.path], None)  # from pkg import module
                elif target is not None and target is not module and target.path in sums:
                    _add(out, local, sums[target.path], alias.name)
    return out


def summaries(modules: list[Module]) -> tuple[_Index, dict[str, _Summary]]:
    """Summaries of every parsed module, :data:`ROUNDS` rounds (fewer when one changes
    nothing)."""
    index = _Index(modules)
    sums: dict[str, _Summary] = {}
    for _ in range(ROUNDS):
        new: dict[str, _Summary] = {}
        for m in modules:
            if m.tree is None:
                continue
            imported = imported_for(m, index, sums) if sums else None
            if imported is not None and imported == Imported() and m.path in sums:
                new[m.path] = sums[m.path]  # imports nothing summarized: as before
                continue
            try:
                new[m.path] = _summarize(m.tree, imported)
            except (RecursionError, MemoryError):
                continue  # the lint reports it (HS000)
        if new == sums:
            break
        sums = new
    return index, sums


def lint_modules(files: Iterable[tuple[str, str | None]], *,
                 select: Iterable[str] | None = None) -> list[LintFinding]:
    """Lint ``(path, root)`` pairs together: each file knows what the functions and classes it
    imports from the others return. ``root``: the directory the file was found under (None for
    a file given itself). Findings in file order."""
    select = list(select) if select is not None else None
    modules = [Module(p, module_name(p, r)) for p, r in files]
    for m in modules:
        m.tree = _read(m.path)
    index, sums = summaries(modules)
    findings: list[LintFinding] = []
    for m in modules:
        imported = imported_for(m, index, sums) if m.tree is not None else None
        findings.extend(lint_path(m.path, select=select, imported=imported))
    return findings
