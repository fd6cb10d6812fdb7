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
from hostsync.lint_kinds import Arg, Imported, Site, merge_shape
from hostsync.lint_where import DEV_CALL, DEVICE, TENSOR_KINDS

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
    sites: dict[tuple[int, int], Site] = dataclasses.field(default_factory=dict)
    shapes: dict[frozenset[str], dict[str, str]] = dataclasses.field(default_factory=dict)
    host_keys: set[str] = dataclasses.field(default_factory=set)


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
    return _Summary(functions, classes, methods, attrs, facts.sites,
                    {k: dict(v) for k, v in facts.shapes.items()}, set(facts.host_keys))


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


@dataclasses.dataclass(slots=True)
class _Def:
    """A top-level function or a method of a top-level class, as call sites bind it."""

    path: str
    owner: str | None
    name: str
    positional: list[str]  # what positional arguments bind, in order (``self`` dropped)
    names: frozenset[str]


def _defs(module: Module) -> list[_Def]:
    out: list[_Def] = []
    assert module.tree is not None

    def add(fn: ast.FunctionDef | ast.AsyncFunctionDef, owner: str | None) -> None:
        decorators = [ast.unparse(d) for d in fn.decorator_list]
        if any("register" in d or d.endswith(("property", "setter")) for d in decorators) \
                or (fn.name.startswith("__") and fn.name.endswith("__")) \
                or (owner is not None and fn.name == "forward"):
            # called through a registry, read as an attribute, or called implicitly
            # (``C(x)``, ``obj(x)``; an ``nn.Module``'s ``forward`` by ``module(x)``):
            # its callers are not seen
            return
        a = fn.args
        positional = [p.arg for p in [*a.posonlyargs, *a.args]]
        if owner is not None and "staticmethod" not in decorators and positional:
            positional = positional[1:]  # self / cls
        names = frozenset([*positional, *(p.arg for p in a.kwonlyargs)])
        out.append(_Def(module.path, owner, fn.name, positional, names))

    for node in module.tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            add(node, None)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    add(item, node.name)
    return out


def _escapes(tree: ast.Module) -> set[str]:
    """Names used other than as a callee (``to_thread(self.accept, x)``, ``fn = f``): what
    such a function is given is not seen at its call sites."""
    callees = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    out: set[str] = set()
    for n in ast.walk(tree):
        if id(n) in callees:
            continue
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
            out.add(n.id)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load):
            out.add(n.attr)
    return out


class _Calls:
    """Call-site parameter facts: a parameter of a top-level function or method holds a kind
    when every call site in the linted modules that may call it passes that kind (``device``:
    every caller passes a device tensor). A call ``f(x)`` binds the function ``f`` this module
    defines or imports from a linted module; any other call of the name, and every ``obj.f(x)``
    whatever ``obj`` is, counts for every function and method of that name (so a name many
    classes define is rarely known). No fact for a function whose name is used other than as
    a callee, registered by a decorator, or called with ``*args`` / ``**kwargs``."""

    def __init__(self, modules: list[Module], index: _Index) -> None:
        self.by_name: dict[str, list[_Def]] = {}
        self.local: dict[str, dict[str, _Def]] = {}  # path -> what a plain name calls there
        escapes: set[str] = set()
        top: dict[str, dict[str, _Def]] = {}
        for m in modules:
            if m.tree is None:
                continue
            escapes |= _escapes(m.tree)
            for d in _defs(m):
                self.by_name.setdefault(d.name, []).append(d)
                if d.owner is None:
                    top.setdefault(m.path, {})[d.name] = d
        for name in escapes:
            self.by_name.pop(name, None)
        self.callees = frozenset(self.by_name)
        for m in modules:
            if m.tree is None:
                continue
            local = dict(top.get(m.path, {}))
            for node in m.tree.body:
                if isinstance(node, ast.ImportFrom):
                    source = _absolute(m, node)
                    target = index.find(source) if source else None
                    for alias in node.names:
                        d = top.get(target.path, {}).get(alias.name) if target else None
                        if d is not None:
                            local[alias.asname or alias.name] = d
            self.local[m.path] = {k: d for k, d in local.items() if d.name in self.callees}
        self.params: dict[str, dict[tuple[str | None, str], dict[str, Arg]]] = {}

    def update(self, sums: dict[str, _Summary]) -> None:
        """Recompute the facts from the call sites of ``sums``."""
        given: dict[int, dict[str, list[Arg]]] = {}
        poisoned: set[int] = set()
        defs: dict[int, _Def] = {}
        for path, summary in sums.items():
            local = self.local.get(path, {})
            for is_attr, name, pos, kws in summary.sites.values():
                exact = None if is_attr else local.get(name)
                for d in [exact] if exact is not None else self.by_name.get(name, []):
                    defs[id(d)] = d
                    if pos is None or len(pos) > len(d.positional):
                        poisoned.add(id(d))
                        continue
                    out = given.setdefault(id(d), {})
                    for p, arg in zip(d.positional, pos, strict=False):
                        out.setdefault(p, []).append(arg)
                    for k, arg in kws:
                        if k in d.names:
                            out.setdefault(k, []).append(arg)
        self.params = {}
        for key, per_param in given.items():
            if key in poisoned:
                continue
            d = defs[key]
            facts = {p: _meet(args) for p, args in per_param.items()}
            facts = {p: a for p, a in facts.items() if a != (None, None)}
            if facts:
                self.params.setdefault(d.path, {})[(d.owner, d.name)] = facts


def _meet(args: list[Arg]) -> Arg:
    """What every call site passes: one tensor kind (``dev-call`` for device tensors and device
    calls' results), and ``device`` strictly only when every site's argument is so strictly."""
    kinds = {k for k, _ in args}
    kind = next(iter(kinds)) if len(kinds) == 1 and kinds <= TENSOR_KINDS | {DEV_CALL} else \
        DEV_CALL if kinds == {DEVICE, DEV_CALL} else None
    strict = DEVICE if {s for _, s in args} == {DEVICE} else None
    return kind, strict


def imported_for(module: Module, index: _Index, sums: dict[str, _Summary],
                 calls: _Calls | None = None) -> Imported:
    """What ``module``'s imports of other linted modules bind, from their summaries; with
    ``calls``, what the call sites in ``sums`` pass to its functions' parameters too."""
    out = Imported()
    if module.tree is None:
        return out
    if calls is not None:
        out.callees = calls.callees
        out.params = calls.params.get(module.path, {})
    for path, summary in sums.items():
        # dicts travel through parameters without imports: every other module's stores count
        if path == module.path:
            continue
        for keys, entries in summary.shapes.items():
            merge_shape(out.shapes.setdefault(keys, {}), entries)
        out.host_keys |= summary.host_keys
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


def summaries(modules: list[Module]) -> tuple[_Index, dict[str, _Summary], _Calls]:
    """Summaries of every parsed module, :data:`ROUNDS` rounds (fewer when one changes
    nothing), and the call-site parameter facts of the last round's call sites."""
    index = _Index(modules)
    calls = _Calls(modules, index)
    sums: dict[str, _Summary] = {}
    given: dict[str, Imported] = {}
    for _ in range(ROUNDS):
        new: dict[str, _Summary] = {}
        for m in modules:
            if m.tree is None:
                continue
            imported = imported_for(m, index, sums, calls)
            if m.path in sums and given.get(m.path) == imported:
                new[m.path] = sums[m.path]  # given what it was given before: as before
                continue
            given[m.path] = imported
            try:
                new[m.path] = _summarize(m.tree, imported)
            except (RecursionError, MemoryError):
                continue  # the lint reports it (HS000)
        if new == sums:
            break
        sums = new
        calls.update(sums)
    return index, sums, calls


def lint_modules(files: Iterable[tuple[str, str | None]], *,
                 select: Iterable[str] | None = None) -> list[LintFinding]:
    """Lint ``(path, root)`` pairs together: each file knows what the functions and classes it
    imports from the others return. ``root``: the directory the file was found under (None for
    a file given itself). Findings in file order."""
    select = list(select) if select is not None else None
    modules = [Module(p, module_name(p, r)) for p, r in files]
    for m in modules:
        m.tree = _read(m.path)
    index, sums, calls = summaries(modules)
    findings: list[LintFinding] = []
    for m in modules:
        imported = imported_for(m, index, sums, calls) if m.tree is not None else None
        findings.extend(lint_path(m.path, select=select, imported=imported))
    return findings
