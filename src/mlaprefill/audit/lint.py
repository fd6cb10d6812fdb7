"""Static host-sync lint (AST only; imports neither torch nor the runtime audit).

Codes
-----
HS101  ``non_blocking=True`` host->device copy (``.to(dev, ...)``, ``.cuda(...)``,
       ``dev_tensor.copy_(src, ...)``) whose source is not known to be pinned.
HS102  ``.pin_memory()`` inside a loop: a pinned allocation per iteration.
HS201  ``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()`` on a value known to live on CUDA.

What counts as "known" (per function, in statement order; later bindings win):

- pinned: a ``torch`` call with ``pin_memory=`` anything but ``False``/``None`` (a flag such as
  ``pin_memory=self.cuda`` counts: pinning is then requested whenever it matters),
  ``x.pin_memory()``, ``pinned.copy_(...)``, slices/indexing of pinned values, the view methods in
  ``_PINNED_VIEWS`` of pinned values, containers whose elements are all pinned and loop variables
  over them, ``self.<attr>`` assigned pinned anywhere in the class and ``<obj>.<attr>`` where
  ``<attr>`` is assigned pinned anywhere in the module. Arithmetic, ``.to(dtype)``, transposes and
  ``.contiguous()`` of pinned values make new (pageable) tensors and are *not* pinned.
- CUDA: ``device="cuda..."`` / ``torch.device("cuda...")`` (also through a name bound to one),
  ``.cuda()``, ``.to("cuda")`` and everything computed from such a tensor. A device given by an
  unknown expression (``.to(device)``, ``device=self.device``) is "some device": such a tensor
  is never a pageable copy source, and it is a copy destination for HS101, but it is not CUDA
  for HS201.

Only a literal ``non_blocking=True`` (or a positional ``True``) is checked. ``# noqa`` and
``# noqa: HS101[,...]`` (prefixes allowed, as in flake8) on the reported line suppress.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Iterable

__all__ = ["CODES", "LintFinding", "lint_source", "lint_tree"]

CODES: dict[str, str] = {
    "HS101": "non_blocking host->device copy from memory not known to be pinned",
    "HS102": ".pin_memory() inside a loop (a pinned allocation per iteration)",
    "HS201": "host read (.item/.tolist/.cpu/.numpy) of a CUDA tensor synchronizes the host",
}

PINNED, CUDA, DEVICE, HOST = "pinned", "cuda", "device", "host"
CUDA_DEV, CPU_DEV = "cuda-device", "cpu-device"  # kinds of device objects / strings
_RANK = {PINNED: 4, CUDA: 3, DEVICE: 2, HOST: 1}

_PINNED_VIEWS = frozenset({
    "view", "view_as", "reshape", "reshape_as", "narrow", "flatten", "unflatten", "unsqueeze",
    "squeeze", "select", "detach", "split", "chunk", "unbind", "tensor_split", "__getitem__",
})
_NOT_TENSOR = frozenset({
    "size", "dim", "numel", "stride", "data_ptr", "element_size", "is_contiguous", "is_pinned",
    "nelement", "storage_offset", "untyped_storage", "get_device", "tolist", "item", "numpy",
    "record_stream",
})
_HOST_READS = ("item", "tolist", "cpu", "numpy")
_DTYPE_NAMES = frozenset({
    "float32", "float", "float64", "double", "float16", "half", "bfloat16", "int8", "int16",
    "short", "int32", "int", "int64", "long", "uint8", "uint16", "uint32", "uint64", "bool",
    "complex64", "complex128", "float8_e4m3fn", "float8_e5m2",
})
_NOQA = re.compile(r"#\s*noqa(?::\s*(?P<codes>[A-Z]+[0-9]*(?:[,\s]+[A-Z]+[0-9]*)*))?",
                   re.IGNORECASE)


@dataclasses.dataclass(frozen=True, slots=True, order=True)
class LintFinding:
    """One lint finding; ``col`` is 0-based (flake8 convention), shown 1-based in text."""

    path: str
    line: int
    col: int
    code: str
    message: str

    def format_text(self) -> str:
        """``path:line:col: CODE message`` (column 1-based)."""
        return f"{self.path}:{self.line}:{self.col + 1}: {self.code} {self.message}"

    def to_dict(self) -> dict[str, object]:
        """JSON-ready dict (column 1-based, like the text form)."""
        return {"path": self.path, "line": self.line, "col": self.col + 1, "code": self.code,
                "message": self.message}


def _src(node: ast.AST, limit: int = 48) -> str:
    text = ast.unparse(node)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _strongest(kinds: Iterable[str | None]) -> str | None:
    best: str | None = None
    for k in kinds:
        if k in _RANK and (best is None or _RANK[k] > _RANK[best]):
            best = k
    return best


def _is_true(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _kwarg(call: ast.Call, name: str) -> ast.expr | None:
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    return None


class _Analyzer:
    """Two passes over a module: collect attribute facts, then check calls."""

    def __init__(self, tree: ast.AST, path: str) -> None:
        self.tree = tree
        self.path = path
        self.torch_names = {"torch"}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == "torch" and alias.asname:
                        self.torch_names.add(alias.asname)
        # (class name or None for "any object", attribute) -> kinds assigned anywhere
        self.attr_facts: dict[tuple[str | None, str], set[str]] = {}
        self.findings: list[LintFinding] = []
        self.report = False

    def run(self) -> list[LintFinding]:
        body = self.tree.body if isinstance(self.tree, ast.Module) else []
        self._block(body, {}, None, 0)  # pass 1: attribute facts
        self.report = True
        self._block(body, {}, None, 0)
        return sorted(set(self.findings))

    # ------------------------------------------------------------------ statements

    def _block(self, stmts: list[ast.stmt], env: dict[str, str], cls: str | None,
               loop: int) -> None:
        for s in stmts:
            self._stmt(s, env, cls, loop)

    def _stmt(self, s: ast.stmt, env: dict[str, str], cls: str | None, loop: int) -> None:
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for d in s.decorator_list:
                self._expr(d, env, cls, loop)
            inner = dict(env)  # closures see the enclosing facts
            a = s.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
                if arg is not None:
                    inner.pop(arg.arg, None)
            self._block(s.body, inner, cls, 0)
        elif isinstance(s, ast.ClassDef):
            self._block(s.body, {}, s.name, 0)
        elif isinstance(s, ast.Assign):
            self._expr(s.value, env, cls, loop)
            for t in s.targets:
                self._bind(t, s.value, env, cls)
        elif isinstance(s, ast.AnnAssign):
            if s.value is not None:
                self._expr(s.value, env, cls, loop)
                self._bind(s.target, s.value, env, cls)
        elif isinstance(s, (ast.For, ast.AsyncFor)):
            self._expr(s.iter, env, cls, loop)
            self._bind_kind(s.target, self._elem_kind(s.iter, env, cls), env, cls)
            self._block(s.body, env, cls, loop + 1)
            self._block(s.orelse, env, cls, loop)
        elif isinstance(s, ast.While):
            self._expr(s.test, env, cls, loop + 1)
            self._block(s.body, env, cls, loop + 1)
            self._block(s.orelse, env, cls, loop)
        elif isinstance(s, (ast.With, ast.AsyncWith)):
            for item in s.items:
                self._expr(item.context_expr, env, cls, loop)
                if item.optional_vars is not None:
                    self._bind_kind(item.optional_vars, None, env, cls)
            self._block(s.body, env, cls, loop)
        else:
            # If, Try, Match, Return, Expr, AugAssign, ...: expressions, then nested blocks
            for field in ("test", "subject", "value", "exc", "target"):
                child = getattr(s, field, None)
                if isinstance(child, ast.expr) and not (
                    field == "target" and not isinstance(s, ast.AugAssign)
                ):
                    self._expr(child, env, cls, loop)
            for field in ("body", "orelse", "finalbody"):
                self._block(getattr(s, field, []) or [], env, cls, loop)
            for h in getattr(s, "handlers", []) or []:
                self._block(h.body, env, cls, loop)
            for case in getattr(s, "cases", []) or []:
                self._block(case.body, env, cls, loop)

    # ------------------------------------------------------------------ binding

    def _bind(self, target: ast.expr, value: ast.expr, env: dict[str, str],
              cls: str | None) -> None:
        if (isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List))
                and len(target.elts) == len(value.elts)):
            for t, v in zip(target.elts, value.elts, strict=True):
                self._bind(t, v, env, cls)
            return
        self._bind_kind(target, self._kind(value, env, cls), env, cls)

    def _bind_kind(self, target: ast.expr, kind: str | None, env: dict[str, str],
                   cls: str | None) -> None:
        if isinstance(target, ast.Name):
            if kind is None:
                env.pop(target.id, None)
            else:
                env[target.id] = kind
        elif isinstance(target, (ast.Tuple, ast.List)):
            elem = kind if kind in (PINNED, CUDA, DEVICE) else None
            for t in target.elts:
                self._bind_kind(t, elem, env, cls)
        elif isinstance(target, ast.Starred):
            self._bind_kind(target.value, kind, env, cls)
        elif isinstance(target, ast.Attribute) and kind is not None and not self.report:
            owner = cls if (isinstance(target.value, ast.Name) and target.value.id == "self"
                            and cls is not None) else None
            self.attr_facts.setdefault((owner, target.attr), set()).add(kind)
            if owner is not None:
                self.attr_facts.setdefault((None, target.attr), set()).add(kind)

    # ------------------------------------------------------------------ kinds

    def _is_torch(self, node: ast.expr) -> bool:
        return isinstance(node, ast.Name) and node.id in self.torch_names

    def _device_of(self, node: ast.expr | None, env: dict[str, str], cls: str | None) -> str:
        """'cuda', 'cpu' or 'other' for a device expression."""
        if node is None:
            return "other"
        k = self._kind(node, env, cls)
        if k == CUDA_DEV:
            return "cuda"
        if k == CPU_DEV:
            return "cpu"
        return "other"

    def _elem_kind(self, node: ast.expr, env: dict[str, str], cls: str | None) -> str | None:
        k = self._kind(node, env, cls)
        return k if k in (PINNED, CUDA) else None

    def _kind(self, node: ast.expr, env: dict[str, str], cls: str | None) -> str | None:
        if isinstance(node, ast.Name):
            return env.get(node.id)
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            v = node.value.split(":")[0]
            return CUDA_DEV if v == "cuda" else CPU_DEV if v == "cpu" else None
        if isinstance(node, ast.Attribute):
            owner = cls if (isinstance(node.value, ast.Name) and node.value.id == "self") else None
            facts = self.attr_facts.get((owner, node.attr))
            if facts is None and owner is not None:
                facts = self.attr_facts.get((None, node.attr))
            if facts is None:
                return None
            if facts & {CUDA_DEV, CPU_DEV} and not facts & set(_RANK):
                return CUDA_DEV if facts == {CUDA_DEV} else None
            return _strongest(facts)
        if isinstance(node, ast.Subscript):
            k = self._kind(node.value, env, cls)
            return k if k in (PINNED, CUDA, DEVICE) else None
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            kinds = {self._kind(e, env, cls) for e in node.elts}
            return kinds.pop() if len(kinds) == 1 and kinds <= {PINNED, CUDA} else None
        if isinstance(node, (ast.ListComp, ast.GeneratorExp)):
            inner = dict(env)
            for gen in node.generators:
                self._bind_kind(gen.target, self._elem_kind(gen.iter, inner, cls), inner, cls)
            k = self._kind(node.elt, inner, cls)
            return k if k in (PINNED, CUDA) else None
        if isinstance(node, ast.BinOp):
            k = _strongest([self._kind(node.left, env, cls), self._kind(node.right, env, cls)])
            return HOST if k == PINNED else k  # arithmetic makes a new tensor
        if isinstance(node, ast.UnaryOp):
            k = self._kind(node.operand, env, cls)
            return HOST if k == PINNED else k
        if isinstance(node, ast.IfExp):
            a, b = self._kind(node.body, env, cls), self._kind(node.orelse, env, cls)
            return a if a == b else None
        if isinstance(node, ast.NamedExpr):
            return self._kind(node.value, env, cls)
        if isinstance(node, ast.Call):
            return self._call_kind(node, env, cls)
        return None

    def _call_kind(self, call: ast.Call, env: dict[str, str], cls: str | None) -> str | None:
        f = call.func
        if not isinstance(f, ast.Attribute):
            return None
        m = f.attr
        if self._is_torch(f.value):
            return self._torch_call_kind(m, call, env, cls)
        rk = self._kind(f.value, env, cls)
        if m == "pin_memory":
            return PINNED
        if m == "cuda":
            return CUDA
        if m == "cpu":
            return HOST
        if m in _NOT_TENSOR:
            return None
        if m == "to":
            return self._to_kind(call, rk, env, cls)
        if m.endswith("_") and not m.startswith("_"):  # in-place ops return self
            return rk
        if rk == PINNED:
            return PINNED if m in _PINNED_VIEWS else HOST
        if rk in (CUDA, DEVICE):
            return rk
        return None

    def _to_target(self, call: ast.Call) -> ast.expr | None:
        dev = _kwarg(call, "device")
        if dev is not None:
            return dev
        if call.args:
            first = call.args[0]
            if isinstance(first, ast.Attribute) and first.attr in _DTYPE_NAMES:
                return None
            if isinstance(first, ast.Name) and first.id == "dtype":
                return None
            return first
        return None

    def _to_kind(self, call: ast.Call, rk: str | None, env: dict[str, str],
                 cls: str | None) -> str | None:
        target = self._to_target(call)
        if target is None:  # dtype-only conversion
            return HOST if rk == PINNED else rk
        dev = self._device_of(target, env, cls)
        if dev == "cuda":
            return CUDA
        if dev == "cpu":
            return rk if rk in (PINNED, HOST) else HOST
        return rk if rk in (CUDA, DEVICE) else DEVICE

    def _torch_call_kind(self, m: str, call: ast.Call, env: dict[str, str],
                         cls: str | None) -> str | None:
        if m == "device":
            arg = call.args[0] if call.args else _kwarg(call, "type")
            return self._kind(arg, env, cls) if arg is not None else None
        pin = _kwarg(call, "pin_memory")
        if pin is not None and not (isinstance(pin, ast.Constant) and pin.value in (False, None)):
            return PINNED
        dev = _kwarg(call, "device")
        if dev is not None:
            d = self._device_of(dev, env, cls)
            return CUDA if d == "cuda" else HOST if d == "cpu" else DEVICE
        args: list[ast.expr] = []
        for a in call.args:
            args.extend(a.elts if isinstance(a, (ast.List, ast.Tuple)) else [a])
        k = _strongest(self._kind(a, env, cls) for a in args)
        return k if k in (CUDA, DEVICE) else HOST

    # ------------------------------------------------------------------ checks

    def _expr(self, e: ast.expr, env: dict[str, str], cls: str | None, loop: int) -> None:
        if isinstance(e, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            inner = dict(env)
            for gen in e.generators:
                self._expr(gen.iter, inner, cls, loop)
                self._bind_kind(gen.target, self._elem_kind(gen.iter, inner, cls), inner, cls)
                for cond in gen.ifs:
                    self._expr(cond, inner, cls, loop)
            parts = [e.key, e.value] if isinstance(e, ast.DictComp) else [e.elt]
            for p in parts:
                self._expr(p, inner, cls, loop)
            return
        if isinstance(e, ast.Lambda):
            inner = dict(env)
            for arg in e.args.args:
                inner.pop(arg.arg, None)
            self._expr(e.body, inner, cls, 0)
            return
        if isinstance(e, ast.NamedExpr):
            self._expr(e.value, env, cls, loop)
            self._bind(e.target, e.value, env, cls)
            return
        if isinstance(e, ast.Call):
            self._check_call(e, env, cls, loop)
        for child in ast.iter_child_nodes(e):
            if isinstance(child, ast.keyword):
                self._expr(child.value, env, cls, loop)
            elif isinstance(child, ast.expr):
                self._expr(child, env, cls, loop)

    def _add(self, node: ast.AST, code: str, message: str) -> None:
        if self.report:
            self.findings.append(LintFinding(self.path, node.lineno, node.col_offset, code,
                                             message))

    def _check_call(self, call: ast.Call, env: dict[str, str], cls: str | None,
                    loop: int) -> None:
        f = call.func
        if not isinstance(f, ast.Attribute):
            return
        m = f.attr
        if m == "pin_memory" and loop > 0 and not self._is_torch(f.value):
            self._add(call, "HS102",
                      f"`{_src(call)}` inside a loop pins a fresh buffer every iteration; "
                      "allocate pinned staging once outside the loop and reuse it (guard reuse "
                      "with an event so a pending copy is never overwritten)")
            return
        if m in _HOST_READS:
            if self._kind(f.value, env, cls) == CUDA:
                self._add(call, "HS201",
                          f"`.{m}()` of `{_src(f.value)}`, a CUDA tensor, makes the host wait "
                          "for the device; keep the value on the device or compute it on the "
                          "host (e.g. in the plan)")
            return
        if m in ("to", "cuda"):
            extra = call.args[1:] if m == "to" else call.args[1:2]
            if not (_is_true(_kwarg(call, "non_blocking")) or any(_is_true(a) for a in extra)):
                return
            if m == "to":
                target = self._to_target(call)
                if target is None or self._device_of(target, env, cls) == "cpu":
                    return
            self._check_source(call, f.value, env, cls)
        elif m == "copy_":
            if not (_is_true(_kwarg(call, "non_blocking")) or
                    (len(call.args) > 1 and _is_true(call.args[1]))):
                return
            if self._kind(f.value, env, cls) not in (CUDA, DEVICE):
                return  # destination not known to be on a device
            src = call.args[0] if call.args else _kwarg(call, "src")
            if src is not None:
                self._check_source(call, src, env, cls)

    def _check_source(self, call: ast.Call, src: ast.expr, env: dict[str, str],
                      cls: str | None) -> None:
        if self._kind(src, env, cls) in (PINNED, CUDA, DEVICE):
            return
        self._add(call, "HS101",
                  f"non_blocking=True copy from `{_src(src)}`, which is not known to be "
                  "pinned: from pageable memory the host can block until all queued GPU work "
                  "finishes; allocate it with pin_memory=True or copy it into a pinned "
                  "staging buffer first")


def lint_tree(tree: ast.AST, path: str = "<string>") -> list[LintFinding]:
    """All findings of a parsed module, ignoring ``# noqa`` (flake8 applies those itself)."""
    return _Analyzer(tree, path).run()


def _suppressed(finding: LintFinding, lines: list[str]) -> bool:
    if not 0 < finding.line <= len(lines):
        return False
    match = _NOQA.search(lines[finding.line - 1])
    if match is None:
        return False
    codes = match.group("codes")
    if not codes:
        return True
    return any(finding.code.upper().startswith(c.upper()) for c in re.split(r"[,\s]+", codes)
               if c)


def lint_source(source: str, path: str = "<string>", *,
                select: Iterable[str] | None = None) -> list[LintFinding]:
    """Lint Python source text; ``# noqa`` comments are honoured.

    Parameters
    ----------
    source
        Module source.
    path
        Name used in the findings.
    select
        Code prefixes to keep (default: all ``HS`` codes).

    Raises
    ------
    SyntaxError
        If ``source`` does not parse.
    """
    tree = ast.parse(source, filename=path)
    lines = source.splitlines()
    prefixes = tuple(select) if select else ("HS",)
    return [f for f in lint_tree(tree, path)
            if f.code.startswith(prefixes) and not _suppressed(f, lines)]
