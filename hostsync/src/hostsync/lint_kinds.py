"""Kinds of expressions for the static lint: where the value of an expression lives.

:class:`KindModel` answers "what kind (see :mod:`hostsync.lint_where`) does this
expression have, in this scope?" from the flow facts of the current function (a
:class:`Scope`), module facts gathered by earlier passes (:class:`Facts`: attributes, return
values, module globals) and engine naming conventions. ``None`` means unknown or not a tensor.
"""

from __future__ import annotations

import ast
import dataclasses
import re

from hostsync.lint_where import (
    ACC_DEV,
    ARG,
    CPU_DEV,
    DEV_CALL,
    DEVICE,
    HOST,
    HOST_KINDS,
    NONE,
    PAGEABLE,
    PINNED,
    SAME_DEV,
    TENSOR_KINDS,
    UNKNOWN,
    join,
    name_kind,
    op_result,
)

__all__ = [
    "COLLECTIVES",
    "COLLECTIVE_KEYWORDS",
    "LIST",
    "STRICT",
    "Arg",
    "Facts",
    "Imported",
    "KindModel",
    "Scope",
    "Site",
    "bind_item",
    "bound_locals",
    "device_kind_of_str",
    "dotted",
    "is_dtype_expr",
    "kwarg",
    "merge_shape",
    "named_attribute",
    "truthy_pin",
]

#: torch.distributed collectives and the positions of their tensor (or tensor list)
#: arguments, which a NCCL/HCCL process group requires on the device; keywords by name
COLLECTIVES: dict[str, tuple[int, ...]] = {
    "all_reduce": (0,), "broadcast": (0,), "reduce": (0,), "all_gather": (0, 1),
    "all_gather_into_tensor": (0, 1), "_all_gather_base": (0, 1), "all_to_all": (0, 1),
    "all_to_all_single": (0, 1), "reduce_scatter": (0, 1), "reduce_scatter_tensor": (0, 1),
    "_reduce_scatter_base": (0, 1), "gather": (0, 1), "scatter": (0, 1),
}
COLLECTIVE_KEYWORDS = frozenset({
    "tensor", "tensor_list", "output", "input", "output_tensor", "input_tensor",
    "output_tensor_list", "input_tensor_list", "gather_list", "scatter_list",
})
LIST = "list"  # env marker: a Python list; its element kind is stored under "[]" + name
STRICT = "!"  # env prefix: the kind a binding has strictly (KindModel.strictly)

_FACTORIES = frozenset({
    "arange", "range", "linspace", "logspace", "zeros", "ones", "empty", "full", "eye", "rand",
    "randn", "randint", "randperm", "tensor", "empty_strided", "frombuffer", "scalar_tensor",
    # legacy constructors: torch.Tensor(list) is a fresh CPU tensor in pageable memory
    "Tensor", "FloatTensor", "DoubleTensor", "HalfTensor", "BFloat16Tensor", "LongTensor",
    "IntTensor", "ShortTensor", "CharTensor", "ByteTensor", "BoolTensor",
})
_NOT_TENSOR_TORCH = frozenset({
    "is_tensor", "numel", "finfo", "iinfo", "get_default_dtype", "is_floating_point",
    "manual_seed", "is_grad_enabled", "no_grad", "inference_mode", "Size", "dtype",
    "equal", "allclose", "result_type", "promote_types", "can_cast",
})
# Views share storage: a view of pinned memory is pinned. Transposes and expands are views
# too, but a non-dense pinned source is staged through a pageable temporary by torch, so
# they count as pageable (as the runtime audit's strided_pinned_h2d does).
_VIEWS = frozenset({
    "view", "view_as", "reshape", "reshape_as", "narrow", "flatten", "unflatten", "unsqueeze",
    "squeeze", "select", "detach", "split", "chunk", "unbind", "tensor_split", "__getitem__",
})
_NOT_TENSOR_METHODS = frozenset({
    "size", "dim", "numel", "stride", "data_ptr", "element_size", "is_contiguous", "is_pinned",
    "nelement", "storage_offset", "untyped_storage", "get_device", "tolist", "item",
    "record_stream", "append", "extend", "insert", "pop", "get", "keys", "items", "values",
    "update", "setdefault", "index", "count", "join", "format", "startswith", "endswith",
    "is_floating_point", "is_complex", "type", "__len__", "equal", "allclose",
})
_NEW_LIKE = frozenset({"new_zeros", "new_ones", "new_empty", "new_full", "new_tensor"})
_SAME_KIND_ATTRS = frozenset({"values", "indices", "data", "real", "imag"})
_NON_TENSOR_ATTRS = frozenset({
    "shape", "dtype", "ndim", "is_cuda", "is_cpu", "layout", "requires_grad", "grad_fn",
    "is_leaf", "names", "itemsize", "nbytes",
})
_DTYPE_NAMES = frozenset({
    "float32", "float", "float64", "double", "float16", "half", "bfloat16", "int8", "int16",
    "short", "int32", "int", "int64", "long", "uint8", "uint16", "uint32", "uint64", "bool",
    "complex64", "complex128", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
})
# Builtins whose result is not a tensor that lives where their argument does.
_BUILTINS = frozenset({
    "len", "isinstance", "issubclass", "int", "float", "bool", "str", "repr", "max", "min", "sum",
    "abs", "list", "tuple", "dict", "set", "frozenset", "range", "zip", "enumerate", "sorted",
    "reversed", "getattr", "hasattr", "setattr", "print", "type", "id", "any", "all", "iter",
    "next", "round", "divmod", "hash", "format", "callable", "super", "map", "filter", "vars",
})
_ACC_PREFIXES = ("cuda", "meta", "xpu", "mps", "hip", "npu", "xla", "hpu", "privateuseone")
# Callee names that say the result is placed on purpose (pinned, on a device).
_PLACING_NAME = re.compile(r"pin|gpu|cuda|device|upload|stage|async|share|to_dev|npu|xpu")
_CAMEL = re.compile(r"^_?[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*$")


def device_kind_of_str(value: str) -> str | None:
    """``cpu-dev`` / ``acc-dev`` for a device string, None for anything else."""
    head = value.split(":")[0].strip().lower()
    if head == "cpu":
        return CPU_DEV
    if head in _ACC_PREFIXES:
        return ACC_DEV
    return None


def dotted(node: ast.expr) -> str | None:
    """``"a.b.c"`` for an attribute chain rooted at a name, else None."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def kwarg(call: ast.Call, name: str) -> ast.expr | None:
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    return None


def truthy_pin(node: ast.expr | None) -> bool:
    """``pin_memory=`` anything but a literal False/None: a flag such as ``pin_memory=pin``
    requests pinning whenever pinning is available, which is when it matters."""
    return node is not None and not (isinstance(node, ast.Constant)
                                     and node.value in (False, None))


def bound_locals(fn: ast.FunctionDef | ast.AsyncFunctionDef
                 ) -> tuple[frozenset[str], dict[str, ast.Call]]:
    """Two facts of ``fn``'s local names from one walk of it, each for a name that is not a
    parameter, not global or nonlocal, and bound no other way anywhere in ``fn``:

    * falsy: names every binding of which is ``name = False`` / ``name = None`` (and not
      imported);
    * zips: names bound once, by ``name = zip(...)`` (or ``enumerate(...)``), with that call:
      iterating the name later iterates it (``iterator = zip(reqs, logits)`` ... ``for r, l
      in iterator:``)."""
    stores: dict[str, int] = {}
    literal: dict[str, int] = {}
    zips: dict[str, ast.Call] = {}
    other: set[str] = set()
    imported: set[str] = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            stores[node.id] = stores.get(node.id, 0) + 1
        elif isinstance(node, ast.arg):
            other.add(node.arg)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            other.update(node.names)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            imported.update((a.asname or a.name).split(".")[0] for a in node.names)
        if not isinstance(node, ast.Assign):
            continue
        if isinstance(node.value, ast.Constant) and (node.value.value is False
                                                     or node.value.value is None):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    literal[t.id] = literal.get(t.id, 0) + 1
        elif len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name) \
                and node.value.func.id in ("zip", "enumerate"):
            zips[node.targets[0].id] = node.value
    falsy = frozenset(n for n, c in literal.items()
                      if stores.get(n) == c and n not in other and n not in imported)
    return falsy, {n: z for n, z in zips.items()
                   if stores.get(n) == 1 and n not in other and ast.unparse(z.func) not in stores}


def is_dtype_expr(node: ast.expr) -> bool:
    """``torch.int32``, ``x.dtype``, ``dtype``, ``positions_dtype``: a dtype, not a device."""
    if isinstance(node, ast.Attribute):
        return node.attr in _DTYPE_NAMES or node.attr.endswith("dtype")
    return isinstance(node, ast.Name) and node.id.endswith("dtype")


@dataclasses.dataclass(slots=True)
class Scope:
    """Flow state of one function (or class/module body) during a pass."""

    env: dict[str, str]
    types: dict[str, str]
    cls: str | None = None
    hints: frozenset[str] = frozenset()
    loop: int = 0
    class_body: bool = False
    function: str | None = None
    # the attributes this function uses of each name (``step_context.q_seqlens`` ->
    # ``{"step_context": {"q_seqlens", ...}}``); None at module or class level
    uses: dict[str, frozenset[str]] | None = None
    # local names every binding of which in this function is a literal ``False`` / ``None``
    # (``pin_memory = False`` ... ``torch.empty(n, pin_memory=pin_memory)``)
    falsy: frozenset[str] = frozenset()
    # local names bound once to a ``zip(...)`` / ``enumerate(...)`` (see :func:`bound_locals`)
    zips: dict[str, ast.Call] = dataclasses.field(default_factory=dict)
    # the string keys this function subscripts each name with (``d["k"]``); None outside one
    key_uses: dict[str, frozenset[str]] | None = None

    def branch(self, env: dict[str, str] | None = None, *, loop: int | None = None) -> Scope:
        """The same scope over another env (a copy of this one by default)."""
        return dataclasses.replace(self, env=dict(self.env) if env is None else env,
                                   loop=self.loop if loop is None else loop)


@dataclasses.dataclass(slots=True)
class Facts:
    """Module-wide knowledge from a whole pass: ``attrs[(class or None, attr)]`` and
    ``returns[(class or None, function)]`` hold the join of every known kind assigned, and
    the kind every return of the function gives (see :meth:`add_return`); ``globals`` the
    module body's names at its end."""

    attrs: dict[tuple[str | None, str], str] = dataclasses.field(default_factory=dict)
    returns: dict[tuple[str | None, str], str] = dataclasses.field(default_factory=dict)
    globals: dict[str, str] = dataclasses.field(default_factory=dict)
    # what constructor calls were given by keyword: ``fields[callee]`` its keyword names,
    # ``positional[callee]`` the most positional arguments of a call, ``given[(callee, kw)]``
    # the join of the keyword's kinds (see :meth:`KindModel.given_fact`)
    fields: dict[str, set[str]] = dataclasses.field(default_factory=dict)
    positional: dict[str, int] = dataclasses.field(default_factory=dict)
    given: dict[tuple[str, str], str] = dataclasses.field(default_factory=dict)
    # ``strict_attrs[(class, attr)]``: what every assignment of ``self.attr`` in the class's
    # methods gives strictly; ``(None, attr)``: assigned on another object too (no fact then)
    strict_attrs: dict[tuple[str | None, str], str] = dataclasses.field(default_factory=dict)
    # call sites of names some linted module defines (see :mod:`hostsync.lint_modules`), by
    # ``(lineno, col)``: ``(is_attribute, callee name, positional (kind, strict) pairs or None
    # where a ``*`` / ``**`` argument hides them, keyword (name, (kind, strict)) pairs)``
    sites: dict[tuple[int, int], Site] = dataclasses.field(default_factory=dict)
    # ``items[(class or None, function)]``: per position, the (kind, strict kind) of the
    # tuple every return of the function writes out (``return dev, n, host``); None where
    # a return gives something else or a tuple of another length (see :meth:`add_items`)
    items: dict[tuple[str | None, str], tuple[Arg, ...] | None] = dataclasses.field(
        default_factory=dict)
    # ``shapes[keys][key]``: what every dict written out with exactly those string keys
    # (``{"k": v, ...}``, ``dict(k=v)``) in the module gives entry ``key`` strictly (see
    # :meth:`add_shape`); ``host_keys``: keys a ``d["key"] = v`` store gives a non-device value
    shapes: dict[frozenset[str], dict[str, str]] = dataclasses.field(default_factory=dict)
    host_keys: set[str] = dataclasses.field(default_factory=set)

    def add_strict_attr(self, owner: str | None, attr: str, kind: str | None) -> None:
        """What an assignment of ``attr`` gives it strictly (see :meth:`KindModel.strictly`):
        a kind only when every assignment in the module gives that kind (``None`` aside)."""
        if kind == NONE:
            return
        key = (owner, attr)
        kind = kind if kind in TENSOR_KINDS else UNKNOWN
        prev = self.strict_attrs.get(key)
        self.strict_attrs[key] = kind if prev in (None, kind) else UNKNOWN

    def add_shape(self, entries: dict[str, str | None]) -> None:
        """A dict written out with ``entries`` (key -> strict kind of its value): an entry is
        ``device`` only while every dict of those keys gives it a device tensor (``None``
        values aside)."""
        merge_shape(self.shapes.setdefault(frozenset(entries), {}), entries)

    def add_given(self, callee: str, call: ast.Call, kinds: dict[str, str | None]) -> None:
        self.fields.setdefault(callee, set()).update(kinds)
        self.positional[callee] = max(self.positional.get(callee, 0), len(call.args))
        for kw, kind in kinds.items():
            if kind in (None, NONE, UNKNOWN, LIST):
                continue
            key = (callee, kw)
            self.given[key] = join(self.given.get(key), kind) or kind

    def add_attr(self, owner: str | None, attr: str, kind: str | None) -> None:
        if kind in (None, NONE, UNKNOWN, LIST):
            return
        key = (owner, attr)
        self.attrs[key] = join(self.attrs.get(key), kind) or kind

    def add_items(self, owner: str | None, name: str,
                  items: tuple[Arg, ...] | None) -> None:
        """What one return gives per position (None: not a written-out tuple; a bare
        ``return`` / ``return None`` adds nothing). A position has a kind only when every
        return gives it that kind, as for :meth:`add_return`."""
        key = (owner, name)
        if key in self.items and self.items[key] is None:
            return
        prev = self.items.get(key)
        if items is None or (prev is not None and len(prev) != len(items)):
            self.items[key] = None
            return
        if prev is None:
            self.items[key] = tuple((k or UNKNOWN, sk or UNKNOWN) for k, sk in items)
            return
        self.items[key] = tuple(
            (pk if pk == (k or UNKNOWN) else UNKNOWN, psk if psk == (sk or UNKNOWN) else UNKNOWN)
            for (pk, psk), (k, sk) in zip(prev, items, strict=True))

    def add_return(self, owner: str | None, name: str, kind: str | None) -> None:
        """A function's summary is a tensor kind only when *every* return gives it (``None``
        returns aside): ``return torch.zeros(n)`` on one path and ``return x`` of an unknown
        ``x`` on another says nothing about the call's result (unlike a local name, whose
        unknown paths are merely unseen ones, see :func:`~hostsync.lint_where.join`)."""
        key = (owner, name)
        kind = kind or UNKNOWN
        prev = self.returns.get(key)
        if prev is None or prev == NONE:
            self.returns[key] = kind
        elif kind != NONE:
            self.returns[key] = prev if prev == kind else \
                HOST if prev in HOST_KINDS and kind in HOST_KINDS else UNKNOWN


Arg = tuple[str | None, str | None]  # (kind, strict kind) of an argument at a call site
Site = tuple[bool, str, tuple[Arg, ...] | None, tuple[tuple[str, Arg], ...]]


@dataclasses.dataclass(slots=True)
class Imported:
    """What the other linted modules say about the names this module imports from them (see
    :mod:`hostsync.lint_modules`): ``functions[local]`` the return kind of an imported function,
    by its local name (``f`` for ``from m import f``) or dotted path (``m.f`` / ``alias.f`` for
    ``import m``); ``classes`` the local names of imported classes, with their methods' return
    kinds ``methods[(local class, method)]`` and attribute kinds ``attrs[(local class, attr)]``.
    """

    functions: dict[str, str] = dataclasses.field(default_factory=dict)
    classes: set[str] = dataclasses.field(default_factory=set)
    methods: dict[tuple[str, str], str] = dataclasses.field(default_factory=dict)
    attrs: dict[tuple[str, str], str] = dataclasses.field(default_factory=dict)
    # what every call site in the linted modules passes to a parameter of this module's
    # top-level functions and methods: ``params[(class or None, function)][param] = (kind,
    # strict kind)``; ``callees``: the function and method names the linted modules define
    # (whose call sites are recorded, :attr:`Facts.sites`)
    params: dict[tuple[str | None, str], dict[str, Arg]] = dataclasses.field(
        default_factory=dict)
    callees: frozenset[str] = dataclasses.field(default_factory=frozenset, compare=False)
    # the dicts the other linted modules write out (:attr:`Facts.shapes`, merged) and the
    # keys they store non-device values under (:attr:`Facts.host_keys`)
    shapes: dict[frozenset[str], dict[str, str]] = dataclasses.field(default_factory=dict)
    host_keys: set[str] = dataclasses.field(default_factory=set)


class KindModel:
    """Kinds of expressions in one module; see the module docstring."""

    def __init__(self, tree: ast.Module, imported: Imported | None = None) -> None:
        self.imported = imported or Imported()
        self.torch_names = {"torch"}
        self.numpy_names: set[str] = set()
        # local names of ``torch.distributed`` (``import torch.distributed as dist``) and of
        # its collectives imported by name (``from torch.distributed import all_reduce``)
        self.dist_names: set[str] = set()
        self.collective_names: dict[str, str] = {}
        # safetensors checkpoint readers: local names (or dotted paths) of ``load_file`` and
        # ``safe_open``, and the names a ``with safe_open(..., device=...) as f`` binds, with
        # the kind of the tensors ``f.get_tensor(k)`` returns (None: bound differently)
        self.st_load_file: set[str] = {"safetensors.torch.load_file"}
        self.st_safe_open: set[str] = {"safetensors.safe_open", "safetensors.torch.safe_open"}
        self.st_handles: dict[str, str | None] = {}
        # names and attributes assigned a ``.numpy()`` view of a tensor somewhere in the module
        # (``self.np = self.cpu.numpy()``): a NumPy array that may share a pinned buffer
        self.numpy_views: set[str] = set()
        self.classes: set[str] = set()
        self.functions: set[str] = set()
        self.top_defs: set[int] = set()  # id() of top-level functions and their classes' methods
        self.methods: set[tuple[str, str]] = set()
        self.identifiers: set[str] = set()
        self.hint_attrs: set[str] = set()
        # ``a`` of every ``self.a(...)`` call: a called attribute is a module, a method or
        # another callable, not a tensor (``self.encoder = self.encoder.to("cpu")`` moves a
        # module, which is no host read)
        self.called_attrs: set[str] = set()
        # keyword dicts written as literals (``CPU_KWARGS = {"pin_memory": True, ...}``,
        # ``self.kw = dict(device="cpu")``) by name or attribute; None where assigned twice
        # differently
        self.kwarg_dicts: dict[str, dict[str, ast.expr] | None] = {}
        self.facts = Facts()
        # Evidence of construction only (see :meth:`strictly`): no naming conventions, no
        # module facts of return values.
        self.strict = False
        # No naming conventions (``*_gpu``, ``*_cpu``), otherwise as usual: call-site facts
        self.names_off = False
        self._hints: dict[int, frozenset[str]] = {}  # by id() of the function node
        self._scan(tree)

    def strictly(self, node: ast.expr, scope: Scope) -> str | None:
        """The kind of ``node`` from what the code does, not from names: engines name flags
        ``has_cuda`` / ``on_device`` and devices ``device``, so a name says where a tensor lives
        only when the value is read as data (``.item()``), not when it is a condition."""
        return self.strictly_with(self.kind, node, scope)

    def strictly_with(self, fn, *args):
        """``fn(*args)`` judged strictly; re-entrant: a strict judgment made inside another one
        (a comprehension's loop target bound while its element is judged) leaves the outer
        one strict."""
        prev = self.strict
        self.strict = True
        try:
            return fn(*args)
        finally:
            self.strict = prev

    # ------------------------------------------------------------------ syntax, once

    def _scan(self, tree: ast.Module) -> None:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == "torch":
                        self.torch_names.add(alias.asname or "torch")
                    elif alias.name == "numpy":
                        self.numpy_names.add(alias.asname or "numpy")
                    elif alias.name == "torch.distributed" and alias.asname:
                        self.dist_names.add(alias.asname)
                    elif alias.name == "safetensors.torch" and alias.asname:
                        self.st_load_file.add(alias.asname + ".load_file")
            elif isinstance(node, ast.ImportFrom) and not node.level:
                for alias in node.names:
                    local = alias.asname or alias.name
                    if node.module == "torch" and alias.name == "distributed":
                        self.dist_names.add(local)
                    elif node.module == "torch.distributed" and alias.name in COLLECTIVES:
                        self.collective_names[local] = alias.name
                    elif node.module in ("safetensors", "safetensors.torch") \
                            and alias.name == "safe_open":
                        self.st_safe_open.add(local)
                    elif node.module == "safetensors.torch" and alias.name == "load_file":
                        self.st_load_file.add(local)
                    elif node.module == "safetensors" and alias.name == "torch":
                        self.st_load_file.add(local + ".load_file")
            elif isinstance(node, ast.ClassDef):
                self.classes.add(node.name)
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        self.methods.add((node.name, item.name))
            elif isinstance(node, ast.Name):
                self.identifiers.add(node.id)
            elif isinstance(node, ast.Attribute):
                self.identifiers.add(node.attr)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"):
                self.called_attrs.add(node.func.attr)
            elif isinstance(node, ast.arg) or (isinstance(node, ast.keyword) and node.arg):
                self.identifiers.add(node.arg)
            if isinstance(node, ast.Assign) and _is_numpy_call(_strip_views(node.value)):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        self.numpy_views.add(t.id)
                    elif isinstance(t, ast.Attribute):
                        self.numpy_views.add("." + t.attr)
        for node in ast.walk(tree):
            if isinstance(node, (ast.With, ast.AsyncWith)):
                for item in node.items:
                    call = item.context_expr
                    if isinstance(call, ast.Call) and dotted(call.func) in self.st_safe_open \
                            and isinstance(item.optional_vars, ast.Name):
                        name = item.optional_vars.id
                        kind = _checkpoint_kind(kwarg(call, "device") or (
                            call.args[2] if len(call.args) > 2 else None), default_cpu=True)
                        self.st_handles[name] = kind if self.st_handles.get(
                            name, kind) == kind else None
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions.add(node.name)
                self.top_defs.add(id(node))
            elif isinstance(node, ast.ClassDef):
                self.top_defs.update(id(n) for n in node.body
                                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
        seen: dict[str, set[str]] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                key = _dict_key(node.targets[0])
                if key is not None:
                    lit = _dict_literal(node.value)
                    seen.setdefault(key, set()).add(
                        "?" if lit is None else repr({k: ast.dump(v) for k, v in lit.items()}))
                    self.kwarg_dicts.setdefault(key, lit)
        for key, forms in seen.items():
            if len(forms) > 1 or "?" in forms:  # one meaning only, or none
                self.kwarg_dicts[key] = None
        for arg in self._device_args(tree):
            if isinstance(arg, ast.Attribute) and arg.attr == "device" \
                    and isinstance(arg.value, ast.Attribute):
                self.hint_attrs.add(arg.value.attr)
        self._hint_sources(tree)

    @staticmethod
    def _device_args(node: ast.AST) -> list[ast.expr]:
        """Expressions used as a device: ``device=`` arguments and the target of ``.to()``."""
        out: list[ast.expr] = []
        for call in ast.walk(node):
            if not isinstance(call, ast.Call):
                continue
            dev = kwarg(call, "device")
            if dev is not None:
                out.append(dev)
            elif (isinstance(call.func, ast.Attribute) and call.func.attr == "to"
                  and call.args):
                out.append(call.args[0])
        return out

    def function_hints(self, fn: ast.AST) -> frozenset[str]:
        """Names ``x`` whose ``x.device`` this function uses as a device: engines write
        ``device=x.device`` for tensors that live on the accelerator, or through a local alias
        (``device = x.device`` ... ``torch.zeros(n, device=device)``)."""
        known = self._hints.get(id(fn))
        if known is None:
            known = self._hints[id(fn)] = self._function_hints(fn)
        return known

    def _function_hints(self, fn: ast.AST) -> frozenset[str]:
        aliases: dict[str, str] = {}
        for node in ast.walk(fn):
            if (isinstance(node, ast.Assign) and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Name)
                    and isinstance(node.value, ast.Attribute) and node.value.attr == "device"
                    and isinstance(node.value.value, ast.Name)):
                name = node.targets[0].id
                # one meaning only: a name aliased to two tensors' devices names neither
                aliases[name] = node.value.value.id if aliases.get(name, node.value.value.id) \
                    == node.value.value.id else ""
        out: set[str] = set()
        for a in self._device_args(fn):
            if (isinstance(a, ast.Attribute) and a.attr == "device"
                    and isinstance(a.value, ast.Name)):
                out.add(a.value.id)
            elif isinstance(a, ast.Name) and aliases.get(a.id):
                out.add(aliases[a.id])
        # ``self.device`` is the device an object serves, not that of a tensor ``self``
        return frozenset(out - {"self", "cls"})

    def _hint_sources(self, tree: ast.Module) -> None:
        """``x = obj.attr`` in a function that uses ``x.device`` as a device: ``attr`` is a
        device attribute elsewhere too."""
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            hinted = self.function_hints(fn)
            for node in ast.walk(fn):
                if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute)
                        and any(isinstance(t, ast.Name) and t.id in hinted
                                for t in node.targets)):
                    self.hint_attrs.add(node.value.attr)

    def kw(self, call: ast.Call, name: str) -> ast.expr | None:
        """Keyword ``name`` of ``call``, written out or in a ``**`` dict literal
        (``torch.tensor(x, **CPU_KWARGS)`` where ``CPU_KWARGS = {"pin_memory": True}``)."""
        explicit = kwarg(call, name)
        if explicit is not None:
            return explicit
        for k in call.keywords:
            if k.arg is None:
                lit = _dict_literal(k.value)
                if lit is None:
                    key = _dict_key(k.value)
                    lit = self.kwarg_dicts.get(key) if key is not None else None
                if lit is not None and name in lit:
                    return lit[name]
        return None

    def is_torch(self, node: ast.expr) -> bool:
        root = node
        while isinstance(root, ast.Attribute):
            root = root.value
        return isinstance(root, ast.Name) and root.id in self.torch_names

    def may_view_tensor(self, node: ast.expr, scope: Scope) -> bool:
        """Whether the NumPy array ``node`` may be a view of a tensor's memory (then pinned
        when that tensor is): anything but a local name bound in this function (not a
        parameter) that the module never assigns a ``.numpy()`` view, or a call other than
        ``.numpy()`` (``np.frombuffer(...)``, ``client.read(...)``: a fresh array)."""
        base = _strip_views(node)
        if isinstance(base, ast.Call):
            return _is_numpy_call(base)
        if isinstance(base, ast.Name):
            return STRICT + base.id not in scope.env or base.id in self.numpy_views
        return True

    def collective(self, call: ast.Call) -> str | None:
        """The name of the torch.distributed collective ``call`` calls (``dist.all_reduce``,
        ``torch.distributed.all_gather_into_tensor``, an imported ``all_reduce``), else None."""
        f = call.func
        if isinstance(f, ast.Name):
            return self.collective_names.get(f.id)
        if not isinstance(f, ast.Attribute) or f.attr not in COLLECTIVES:
            return None
        owner = dotted(f.value)
        if owner in self.dist_names or (owner is not None and owner.count(".") == 1 and (
                owner.split(".")[0] in self.torch_names and owner.endswith(".distributed"))):
            return f.attr
        return None

    def is_class_call(self, func: ast.expr) -> str | None:
        """The class name of a constructor-looking callee (``Meta(...)``, ``self.meta_cls``)."""
        name = func.attr if isinstance(func, ast.Attribute) else \
            func.id if isinstance(func, ast.Name) else None
        if name is None:
            return None
        if name in self.classes or _CAMEL.match(name) or name.endswith("cls"):
            return name
        return None

    # ------------------------------------------------------------------ names

    def convention(self, name: str, *, attribute: bool = False, hint: bool = False) -> str | None:
        """What the name alone says (suffixes, a ``.device`` used as a device, and for
        attributes a ``<name>_cpu`` / ``_host`` / ``_np`` twin in the module)."""
        if self.strict or self.names_off:
            return DEVICE if hint else None
        k = name_kind(name, attribute=attribute)
        if k is not None:
            return k
        if hint:
            return DEVICE
        if attribute and any(name + s in self.identifiers for s in ("_cpu", "_host", "_np")):
            return DEVICE
        return None

    def name(self, ident: str, scope: Scope) -> str | None:
        if ident in self.torch_names or ident in self.numpy_names:
            return None
        if self.strict:  # what the flow bound, judged strictly (``"!" + name``)
            v = scope.env.get(STRICT + ident)
            if v is None or v in (UNKNOWN, ARG, LIST):
                return DEVICE if ident in scope.hints else None
            return v
        v = scope.env.get(ident)
        if v == LIST:
            return _known(scope.env.get("[]" + ident))
        if v is None:
            v = self.facts.globals.get(ident)
        if v == DEV_CALL and ident in scope.hints:
            return DEVICE  # guessed from a call, shown by `device=x.device`: on the device
        if v is not None and v not in (UNKNOWN, ARG):
            return v if v != LIST else None
        return self.convention(ident, hint=ident in scope.hints)

    def type_of(self, node: ast.expr, scope: Scope) -> str | None:
        if isinstance(node, ast.Name):
            if node.id in ("self", "cls") and scope.cls is not None:
                return scope.cls
            return scope.types.get(node.id)
        return None

    def attribute(self, node: ast.Attribute, scope: Scope) -> str | None:
        a = node.attr
        if a in self.called_attrs and isinstance(node.value, ast.Name) \
                and node.value.id == "self":
            return None  # called somewhere in the module: not a tensor
        if self.strict and a == "device":
            return None
        if a == "device":
            k = self.kind(node.value, scope)
            if k in TENSOR_KINDS:
                return ACC_DEV if k == DEVICE else CPU_DEV
            if self.type_of(node.value, scope) is None and not _self_path(node.value):
                return SAME_DEV  # a tensor we cannot place: the device is unknown too
            # `self.embed.weight.device`: the device a method's component serves, as a
            # method's own device parameter is (and as the strict kind takes it)
            # else the device of an object (``self.device``): its facts or its name say
        if a in _NON_TENSOR_ATTRS:
            return None
        if a in _SAME_KIND_ATTRS:
            return self.kind(node.value, scope)
        if a in ("T", "mT", "H", "mH"):
            k = self.kind(node.value, scope)
            return PAGEABLE if k == PINNED else k
        path = dotted(node)
        if self.strict:
            v = scope.env.get(STRICT + path) if path is not None else None
            if v is not None and v not in (UNKNOWN, LIST):
                return v
            if (v is None and isinstance(node.value, ast.Name) and node.value.id == "self"
                    and scope.cls is not None and (None, a) not in self.facts.strict_attrs
                    and self.facts.strict_attrs.get((scope.cls, a)) == DEVICE):
                # allocated on the device by every assignment of the class (``__init__``'s
                # ``self.free = torch.arange(n, device=dev)``, its slices and cats after)
                return DEVICE
            return DEVICE if a in self.hint_attrs else None
        if path is not None and path in scope.env:
            v = scope.env[path]
            if v not in (UNKNOWN, LIST):
                return v
        base = self.kind(node.value, scope)
        if base == DEV_CALL:
            return DEV_CALL  # a field of what a call given device tensors returned
        if base == DEVICE:
            # a field of what was moved to the device whole (`enc = tokenizer(...).to(dev)`:
            # `enc.attention_mask`)
            return DEVICE
        owner = self.type_of(node.value, scope)
        if owner is None or owner in self.classes:
            # this module's class: its own facts, else what any constructor call was given
            fact = self.facts.attrs.get((owner, a)) if owner is not None else None
            if fact is None:
                fact = self.facts.attrs.get((None, a))
                given = self.given_fact(node, scope)
                fact = given if fact is None else join(fact, given) if given else fact
            if fact is not None:
                return _known(fact)
        elif owner in self.imported.classes:  # an imported class: what its module assigns
            fact = _known(self.imported.attrs.get((owner, a)))
            if fact is not None:
                return fact
        return self.convention(a, attribute=True, hint=a in self.hint_attrs)

    def given_fact(self, node: ast.Attribute, scope: Scope) -> str | None:
        """What constructor calls of this module gave keyword ``node.attr`` (``Meta(seq_lens=
        x)``), for a receiver of unknown class: only calls of a callee that could have built
        it, one whose keywords (and positional arguments, by count) cover every attribute
        this function uses of the receiver. ``step_context.q_seqlens`` of a context that has
        ``.model_config`` and ``.kv_caches`` too is not the ``q_seqlens=q_seqlens_cpu`` given
        to an attention-metadata constructor that takes neither."""
        a = node.attr
        uses = None
        if isinstance(node.value, ast.Name) and scope.uses is not None:
            uses = scope.uses.get(node.value.id)
        out: str | None = None
        for callee, fields in self.facts.fields.items():
            kind = self.facts.given.get((callee, a))
            if kind is None:
                continue
            if uses is not None and len(uses - fields) > self.facts.positional.get(callee, 0):
                continue
            out = join(out, kind) or kind
        return out

    # ------------------------------------------------------------------ devices

    def device_kind(self, node: ast.expr | None, scope: Scope) -> str | None:
        """``cpu-dev`` / ``acc-dev`` for a device expression, None when unknown."""
        if node is None or (isinstance(node, ast.Constant) and node.value is None):
            return CPU_DEV  # the default device
        if isinstance(node, ast.Constant):
            return device_kind_of_str(node.value) if isinstance(node.value, str) else None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "device" and self.is_torch(node.func.value):
            arg = node.args[0] if node.args else kwarg(node, "type")
            return self.device_kind(arg, scope) if arg is not None else None
        if isinstance(node, ast.IfExp):
            a, b = self.device_kind(node.body, scope), self.device_kind(node.orelse, scope)
            return a if a == b else None
        if isinstance(node, ast.Call) and _lookup_or_none(node):
            return SAME_DEV  # `kwargs.get("device", None)`: the CPU when absent, else unknown
        if isinstance(node, ast.Name) and scope.env.get(node.id) == ARG:
            return SAME_DEV  # the caller's device: the caller decides
        k = self.kind(node, scope)
        if k in (CPU_DEV, ACC_DEV, SAME_DEV):
            return k
        if k in HOST_KINDS:
            return CPU_DEV
        if k == DEVICE:
            return ACC_DEV
        return None

    def made_on(self, device: ast.expr, scope: Scope) -> str | None:
        """Kind of a tensor allocated with ``device=device``: anything not known to be the
        CPU is taken to be the accelerator (engines pass ``self.device``), except the device
        of a tensor whose place is unknown (the new tensor is wherever that one is)."""
        dk = self.device_kind(device, scope)
        return PAGEABLE if dk == CPU_DEV else None if dk == SAME_DEV else DEVICE

    def to_target(self, call: ast.Call) -> ast.expr | None:
        """The device (or tensor) argument of ``x.to(...)``; None for a dtype-only ``.to``."""
        dev = kwarg(call, "device")
        if dev is not None:
            return dev
        if call.args and not is_dtype_expr(call.args[0]):
            return call.args[0]
        return None

    # ------------------------------------------------------------------ expressions

    def kind(self, node: ast.expr, scope: Scope) -> str | None:
        """Kind of ``node`` (see :mod:`hostsync.lint_where`); None: unknown."""
        if isinstance(node, ast.Name):
            return self.name(node.id, scope)
        if isinstance(node, ast.Constant):
            if node.value is None:
                return NONE
            return device_kind_of_str(node.value) if isinstance(node.value, str) else None
        if isinstance(node, ast.Attribute):
            return self.attribute(node, scope)
        if isinstance(node, ast.Subscript):
            k = self.kind(node.value, scope)
            if k in HOST_KINDS and self.advanced_index(node.slice, scope):
                return PAGEABLE  # `pinned[idx_list]` gathers into a fresh tensor
            if k in TENSOR_KINDS or k == DEV_CALL:
                return k
            return self.key_fact(node, scope)
        if isinstance(node, ast.Call):
            return self.call(node, scope)
        if isinstance(node, ast.BinOp):
            if isinstance(node.left, (ast.List, ast.Tuple)) and isinstance(node.op, ast.Mult):
                return self.kind(node.left, scope)  # [None] * n
            return op_result([self.kind(node.left, scope), self.kind(node.right, scope)])
        if isinstance(node, ast.UnaryOp):
            if isinstance(node.op, ast.Not):
                return None
            return op_result([self.kind(node.operand, scope)])
        if isinstance(node, ast.Compare):
            if any(isinstance(op, (ast.Is, ast.IsNot, ast.In, ast.NotIn)) for op in node.ops):
                return None
            return op_result([self.kind(n, scope) for n in [node.left, *node.comparators]])
        if isinstance(node, ast.IfExp):
            return _known(join(self.kind(node.body, scope) or UNKNOWN,
                               self.kind(node.orelse, scope) or UNKNOWN))
        if isinstance(node, ast.NamedExpr):
            return self.kind(node.value, scope)
        if isinstance(node, ast.Starred):
            return self.kind(node.value, scope)
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            out: str | None = NONE
            for e in node.elts:
                out = join(out, self.kind(e, scope) or UNKNOWN)
            return _known(out) if node.elts else NONE
        if isinstance(node, (ast.ListComp, ast.GeneratorExp)):
            inner = scope.branch()
            for gen in node.generators:
                self.bind_loop_target(gen.target, gen.iter, inner)
            return self.kind(node.elt, inner)
        return None

    def key_fact(self, node: ast.Subscript, scope: Scope) -> str | None:
        """``d["key"]`` of a name ``d`` of unknown kind (a parameter: a cache dict a pipeline
        built): a device tensor when the linted modules write out dicts that could be ``d``
        (their keys cover every key this function subscripts ``d`` with), at least one, and
        each gives entry ``key`` a device tensor strictly, and no ``x["key"] = v`` store
        anywhere gives it another value (``{"end": torch.tensor([0], device=dev), ...}``)."""
        key = node.slice
        if not (isinstance(key, ast.Constant) and isinstance(key.value, str)
                and isinstance(node.value, ast.Name) and scope.key_uses is not None):
            return None
        k = key.value
        if k in self.facts.host_keys or k in self.imported.host_keys:
            return None
        uses = scope.key_uses.get(node.value.id, frozenset()) | {k}
        found = False
        for shapes in (self.facts.shapes, self.imported.shapes):
            for keys, entries in shapes.items():
                if uses <= keys:
                    if entries.get(k) != DEVICE:
                        return None
                    found = True
        return DEVICE if found else None

    def advanced_index(self, index: ast.expr, scope: Scope) -> bool:
        """Whether ``index`` (of ``x[index]``) is an advanced index, which copies the selected
        elements into a fresh tensor instead of viewing them: a Python list (written out, a
        comprehension or a name bound to a list) or a written-out comparison of host tensors (a
        boolean mask), also as one position of a tuple (``x[:, idx]``). Other tensor indexes
        are not taken: a 0-d integer tensor index selects a view."""
        if isinstance(index, ast.Tuple):
            return any(self.advanced_index(e, scope) for e in index.elts)
        if isinstance(index, (ast.List, ast.ListComp)):
            return True
        if isinstance(index, ast.Name) and scope.env.get(index.id) == LIST:
            return True
        return isinstance(index, ast.Compare) and self.kind(index, scope) in HOST_KINDS

    def inputs(self, call: ast.Call, scope: Scope) -> list[str | None]:
        """Kinds of the tensor inputs of a torch op (list arguments flattened)."""
        out: list[str | None] = []
        for a in [*call.args, *(kw.value for kw in call.keywords if kw.arg not in (
                "dtype", "device", "out", "pin_memory", "layout", "requires_grad"))]:
            if isinstance(a, (ast.List, ast.Tuple)):
                out.extend(self.kind(e, scope) for e in a.elts)
            else:
                out.append(self.kind(a, scope))
        return out

    def call(self, call: ast.Call, scope: Scope) -> str | None:
        f = call.func
        attr = named_attribute(call, "getattr")
        if attr is not None and "getattr" not in scope.env:
            # `getattr(obj, "a", None)` reads `obj.a`; not for a truth test, which asks
            # whether the attribute is there (`if getattr(self, "vae", None):`)
            return None if self.strict else self.kind(attr, scope)
        if isinstance(f, ast.Name):
            if f.id in ("min", "max") and f.id not in scope.env and len(call.args) > 1 \
                    and not call.keywords \
                    and not any(isinstance(a, ast.Starred) for a in call.args):
                # `max(start, t[0])` returns one of its arguments: a device one wins where
                # it compares greater, as in an op of them (the comparison is HS201 itself)
                return op_result([self.kind(a, scope) for a in call.args])
            if f.id in _BUILTINS or self.is_class_call(f) is not None:
                return None
            if f.id in self.st_load_file and f.id not in scope.env:
                return self.load_file(call, scope)
            if f.id in self.functions and not self.strict:
                known = _known(self.facts.returns.get((None, f.id)))
                if known is not None:
                    return known
            elif not self.strict:  # an imported function of another linted module
                known = _known(self.imported.functions.get(f.id))
                if known is not None:
                    return known
            return self.by_inputs(call, scope) or self.host_call(call, scope)
        if not isinstance(f, ast.Attribute):
            return None
        if isinstance(f.value, ast.Name) and f.value.id in self.torch_names:
            return self.torch_call(f.attr, call, scope)
        if self.is_torch(f.value):  # torch.nn.functional.pad(x, ...), torch.ops...
            return op_result(self.inputs(call, scope))
        if isinstance(f.value, ast.Name) and f.value.id in self.numpy_names:
            if f.attr in ("asarray", "ascontiguousarray") and call.args:
                k = self.kind(call.args[0], scope)
                return k if k in HOST_KINDS else PAGEABLE
            return PAGEABLE
        if dotted(f) in self.st_load_file:  # safetensors.torch.load_file(path)
            return self.load_file(call, scope)
        if f.attr in ("get_tensor", "get_slice") and isinstance(f.value, ast.Name) \
                and f.value.id in self.st_handles:  # `with safe_open(...) as fh:` fh.get_tensor
            return self.st_handles[f.value.id]
        if not self.strict:  # module.f(...) of another linted module
            path = dotted(f)
            known = _known(self.imported.functions.get(path)) if path is not None else None
            if known is not None:
                return known
        owner = self.type_of(f.value, scope)
        if owner is not None and not self.strict and owner not in self.classes:
            known = _known(self.imported.methods.get((owner, f.attr)))
            if known is not None:
                return known
        if owner is not None and (owner, f.attr) in self.methods:
            if self.strict:
                return self.by_inputs(call, scope)
            known = _known(self.facts.returns.get((owner, f.attr)))
            return known if known is not None else self.by_inputs(call, scope)
        return self.method(f.attr, call, f.value, scope)

    def returned_items(self, value: ast.expr | None, scope: Scope) -> tuple[Arg, ...] | None:
        """Per position, the (kind, strict kind) of the tuple that a call of this module's
        function or of a method of a known class of it (``self._plan(...)``) returns, when
        every return of it writes one out (see :attr:`Facts.items`); None otherwise."""
        if not isinstance(value, ast.Call):
            return None
        f = value.func
        if isinstance(f, ast.Name) and f.id in self.functions:
            key: tuple[str | None, str] = (None, f.id)
        elif isinstance(f, ast.Attribute):
            owner = self.type_of(f.value, scope)
            if owner is None or (owner, f.attr) not in self.methods:
                return None
            key = (owner, f.attr)
        else:
            return None
        return self.facts.items.get(key)

    def summarized(self, value: ast.expr | None, scope: Scope) -> bool:
        """Whether ``value`` is a call of a function or method with a known return summary
        (this module's or an imported one's), not a guess from its arguments."""
        if not isinstance(value, ast.Call):
            return False
        f = value.func
        if isinstance(f, ast.Name):
            if f.id in self.functions:
                return _known(self.facts.returns.get((None, f.id))) is not None
            return _known(self.imported.functions.get(f.id)) is not None
        if not isinstance(f, ast.Attribute):
            return False
        path = dotted(f)
        if path is not None and _known(self.imported.functions.get(path)) is not None:
            return True
        owner = self.type_of(f.value, scope)
        if owner is None:
            return False
        if (owner, f.attr) in self.methods:
            return _known(self.facts.returns.get((owner, f.attr))) is not None
        return _known(self.imported.methods.get((owner, f.attr))) is not None

    def foreign_callable(self, value: ast.expr | None, scope: Scope) -> bool:
        """Whether ``value`` calls something held by another object than ``self`` / ``cls``
        (``batch.next_token_chooser(...)``, ``outputs.sampler(...)``) that is no method this
        module or an imported one defines for that object's class: a callable component
        (sampler, chooser, model), whose outputs are computed from its tensor inputs."""
        if not isinstance(value, ast.Call) or not isinstance(value.func, ast.Attribute):
            return False
        recv = value.func.value
        if self.is_torch(recv) or (isinstance(recv, ast.Name) and (
                recv.id in ("self", "cls") or recv.id in self.numpy_names)):
            return False
        owner = self.type_of(recv, scope)
        return owner is None or ((owner, value.func.attr) not in self.methods
                                 and (owner, value.func.attr) not in self.imported.methods)

    def by_inputs(self, call: ast.Call, scope: Scope) -> str | None:
        """``dev-call`` for a call the lint cannot see into that is given device tensors and no
        host tensors (see :mod:`~hostsync.lint_where`); None otherwise."""
        if self.is_class_call(call.func) is not None:
            return None
        kinds = self.inputs(call, scope)
        if any(k in HOST_KINDS for k in kinds):
            return None
        return DEV_CALL if DEVICE in kinds or DEV_CALL in kinds else None

    def host_call(self, call: ast.Call, scope: Scope) -> str | None:
        """``pageable`` for a plain function call the lint cannot see into (imported, or of no
        known summary) that is given host tensors and no device ones: a helper that computes
        from host tensors (``prepare_chunk_indices(cu_seqlens_cpu, 64)``) returns a fresh host
        tensor, in pageable memory unless it pins, which a name such as ``pin_*`` / ``*_gpu``
        / ``*upload*`` would say (then None). Methods are not judged so: a receiver may be a
        buffer pool handing out pinned or device memory."""
        f = call.func
        if self.strict or not isinstance(f, ast.Name) or _PLACING_NAME.search(f.id.lower()):
            return None
        kinds = self.inputs(call, scope)
        if any(k in (DEVICE, DEV_CALL, SAME_DEV, ACC_DEV) for k in kinds):
            return None
        return PAGEABLE if any(k in HOST_KINDS for k in kinds) else None

    def pins(self, call: ast.Call, scope: Scope) -> bool:
        """Whether ``call`` asks for pinned memory: ``pin_memory=`` anything but a literal
        ``False`` / ``None`` or a local name bound only to one (see :func:`bound_locals`)."""
        pin = self.kw(call, "pin_memory")
        if isinstance(pin, ast.Name) and pin.id in scope.falsy:
            return False
        return truthy_pin(pin)

    def checkpoint(self, device: ast.expr | None, scope: Scope, *,
                   default_cpu: bool) -> str | None:
        """Kind of the tensors a checkpoint reader returns when it maps them to ``device``
        (``torch.load(..., map_location=)``, safetensors ``load_file(..., device=)``): read
        from a file into fresh pageable memory on the CPU, uploaded on an accelerator; None
        (where they were saved, or a mapping function) when unknown or absent without a
        CPU default."""
        if device is None:
            return PAGEABLE if default_cpu else None
        return _mapped_kind(self.device_kind(device, scope))

    def load_file(self, call: ast.Call, scope: Scope) -> str | None:
        """Kind of the tensors of safetensors' ``load_file(path, device="cpu")``."""
        return self.checkpoint(kwarg(call, "device") or (
            call.args[1] if len(call.args) > 1 else None), scope, default_cpu=True)

    def torch_call(self, m: str, call: ast.Call, scope: Scope) -> str | None:
        if m == "device":
            return self.device_kind(call, scope)
        if m == "load":  # torch.load(f, map_location="cpu"): a dict of pageable tensors
            return self.checkpoint(self.kw(call, "map_location") or (
                call.args[1] if len(call.args) > 1 else None), scope, default_cpu=False)
        if m in _NOT_TENSOR_TORCH:
            return None
        if self.pins(call, scope):
            return PINNED
        out = self.kw(call, "out")
        if out is not None:
            return self.kind(out, scope)
        dev = self.kw(call, "device")
        if dev is not None:
            return self.made_on(dev, scope)
        if m in _FACTORIES:
            return PAGEABLE
        first = call.args[0] if call.args else None
        if m.endswith("_like"):
            return op_result([self.kind(first, scope)]) if first is not None else None
        if m in ("as_tensor", "asarray") and first is not None:
            if isinstance(first, (ast.List, ast.Tuple, ast.ListComp)):
                return PAGEABLE
            k = self.kind(first, scope)
            return k if k in TENSOR_KINDS else None
        if m == "from_numpy" and first is not None:
            k = self.kind(first, scope)
            if k == HOST and not self.may_view_tensor(first, scope):
                return PAGEABLE  # a fresh NumPy array (`x_np = f(...)`): pageable memory
            return k if k in HOST_KINDS else PAGEABLE  # a NumPy array is pageable memory
        return op_result(self.inputs(call, scope))

    def method(self, m: str, call: ast.Call, recv: ast.expr, scope: Scope) -> str | None:
        if m in _NOT_TENSOR_METHODS:
            return None
        if m == "pin_memory":
            return PINNED
        if m == "cuda":
            return DEVICE
        rk = self.kind(recv, scope)
        if m in ("cpu", "numpy"):
            return PAGEABLE if rk in (DEVICE, DEV_CALL) else rk if rk in HOST_KINDS else HOST
        if m == "to":
            return self.to_result(call, rk, scope)
        if m in _NEW_LIKE:
            if self.pins(call, scope):
                return PINNED
            dev = self.kw(call, "device")
            return self.made_on(dev, scope) if dev is not None else op_result([rk])
        if m.endswith("_") and not m.startswith("_"):
            return rk  # in-place ops return self
        if m in _VIEWS:
            return rk if rk in TENSOR_KINDS or rk == DEV_CALL else None
        return op_result([rk]) or self.by_inputs(call, scope)

    def to_result(self, call: ast.Call, rk: str | None, scope: Scope) -> str | None:
        target = self.to_target(call)
        if target is None:  # dtype conversion: a new tensor where the source lives
            return PAGEABLE if rk == PINNED else rk
        dk = self.device_kind(target, scope)
        if dk == CPU_DEV:
            return PAGEABLE if rk in (DEVICE, DEV_CALL) else rk if rk in HOST_KINDS else HOST
        return None if dk == SAME_DEV else DEVICE

    # ------------------------------------------------------------------ loops

    def elem_kinds(self, it: ast.expr, scope: Scope) -> list | str | None:
        """Kind of the items of an iterable: a list per position for ``zip`` / ``enumerate``
        (nested for ``enumerate(zip(a, b))``). Iterating a tensor gives tensors of its kind
        (``for row in t``: a device tensor's rows are device tensors, a host one's host ones);
        iterating a list gives its items' kind."""
        if isinstance(it, ast.Name) and it.id in scope.zips:
            it = scope.zips[it.id]  # `iterator = zip(...)` ... `for ... in iterator:`
        if isinstance(it, ast.Call) and isinstance(it.func, ast.Name):
            if it.func.id == "zip":
                return [self.elem_kinds(a, scope) for a in it.args]
            if it.func.id == "enumerate" and it.args:
                return [None, self.elem_kinds(it.args[0], scope)]
            if it.func.id in ("range", "len", "sorted", "reversed", "list", "set"):
                return None
        if isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute) and not it.args \
                and it.func.attr in ("items", "values"):
            k = self.kind(it.func.value, scope)  # a dict of tensors of one kind
            if k in TENSOR_KINDS:
                return [None, k] if it.func.attr == "items" else k
            return None
        if isinstance(it, (ast.Tuple, ast.List, ast.Set)):
            return self._literal_items(it.elts, scope)
        k = self.kind(it, scope)
        return k if k in TENSOR_KINDS else None

    def _literal_items(self, elts: list[ast.expr], scope: Scope) -> list | str | None:
        """Kinds of the items of a written-out tuple or list: per position when every item is
        a tuple of one length (``for name, t in (("a", a), ("b", b))``: ``name`` is no
        tensor), else the items' joined kind when each is known to be a tensor's."""
        if elts and all(isinstance(e, (ast.Tuple, ast.List)) for e in elts) \
                and len({len(e.elts) for e in elts}) == 1:
            out: list = []
            for i in range(len(elts[0].elts)):
                k: str | None = None
                for e in elts:
                    k = join(k, self.kind(e.elts[i], scope) or UNKNOWN)
                out.append(_known(k))
            return out
        if any(isinstance(e, (ast.Tuple, ast.List, ast.Starred)) for e in elts):
            return None
        kinds = [self.kind(e, scope) for e in elts]
        if not kinds or any(k not in TENSOR_KINDS and k != NONE for k in kinds):
            return None
        out_kind: str | None = None
        for k in kinds:
            out_kind = join(out_kind, k)
        return out_kind if out_kind in TENSOR_KINDS else None

    def bind_loop_target(self, target: ast.expr, it: ast.expr, scope: Scope) -> None:
        """Bind a ``for`` / comprehension target in ``scope.env`` (no facts recorded), with
        the kind it has strictly too (see :meth:`strictly`): a loop variable of a tensor that
        is strictly on the device is so too, and a rebound one loses what it had before."""
        elems = self.elem_kinds(it, scope)
        strict = self.strictly_with(self.elem_kinds, it, scope)
        _bind_items(target, elems, strict, scope)


def named_attribute(call: ast.Call, builtin: str) -> ast.Attribute | None:
    """``obj.a`` for ``getattr(obj, "a"[, default])`` / ``setattr(obj, "a", v)`` (``builtin``
    names which) with the name written out: the attribute the call reads or writes."""
    f = call.func
    if not (isinstance(f, ast.Name) and f.id == builtin and len(call.args) >= 2
            and not call.keywords and isinstance(call.args[1], ast.Constant)
            and isinstance(call.args[1].value, str) and call.args[1].value.isidentifier()):
        return None
    ctx = ast.Store() if builtin == "setattr" else ast.Load()
    return ast.copy_location(ast.Attribute(value=call.args[0], attr=call.args[1].value,
                                           ctx=ctx), call)


def merge_shape(into: dict[str, str], entries: dict[str, str | None]) -> None:
    """Merge one written-out dict's entries (key -> strict kind) into ``into``: ``device``
    while every dict gives the entry a device tensor, else ``unknown``."""
    for key, kind in entries.items():
        if kind == NONE:
            continue
        kind = DEVICE if kind == DEVICE else UNKNOWN
        prev = into.get(key)
        into[key] = kind if prev in (None, kind) else UNKNOWN


def bind_item(target: ast.Name, kind: str | None, strict: str | None, scope: Scope) -> None:
    """Bind a name to a known (kind, strict kind) pair (``unknown`` for what is not known)."""
    _bind_plain(target, _known(kind), scope, _known(strict))


def _bind_items(target: ast.expr, elems: list | str | None, strict: list | str | None,
                scope: Scope) -> None:
    """Bind ``target`` to items of the kinds ``elems`` (per position when a list, see
    :meth:`KindModel.elem_kinds`) and strict kinds ``strict``."""
    if isinstance(target, (ast.Tuple, ast.List)) and isinstance(elems, list) \
            and len(elems) == len(target.elts):
        strict_items = strict if isinstance(strict, list) and len(strict) == len(elems) \
            else [None] * len(elems)
        for t, k, sk in zip(target.elts, elems, strict_items, strict=True):
            _bind_items(t, k, sk, scope)
        return
    kind = elems if isinstance(elems, str) and elems in TENSOR_KINDS else None
    _bind_plain(target, kind, scope,
                strict if isinstance(strict, str) and strict in TENSOR_KINDS else None)


def _self_path(node: ast.expr) -> bool:
    """``self.a.b`` (two attributes at least under ``self``): a parameter or buffer of a
    submodule of the object, not one of its own tensors."""
    depth = 0
    while isinstance(node, ast.Attribute):
        node, depth = node.value, depth + 1
    return depth >= 2 and isinstance(node, ast.Name) and node.id == "self"


def _is_numpy_call(node: ast.expr) -> bool:
    """``t.numpy()`` (any receiver): a NumPy view of a tensor's memory."""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
        and node.func.attr == "numpy"


def _strip_views(node: ast.expr) -> ast.expr:
    """``a`` of ``a[i]``, ``a.reshape(...)``, ``a.view(...)``, ``a.ravel()``: what a view reads."""
    while True:
        if isinstance(node, ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in (*_VIEWS, "ravel"):
            node = node.func.value
        else:
            return node


def _dict_key(node: ast.expr) -> str | None:
    """Name of a keyword dict: ``NAME``, or ``.attr`` for ``obj.attr`` (any owner)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return "." + node.attr
    return None


def _dict_literal(node: ast.expr) -> dict[str, ast.expr] | None:
    """``{"k": v, ...}`` or ``dict(k=v, ...)`` with every key known, as a mapping."""
    if isinstance(node, ast.Dict):
        if all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.keys):
            return {k.value: v for k, v in zip(node.keys, node.values, strict=True)}
        return None
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict"
            and not node.args and all(k.arg for k in node.keywords)):
        return {k.arg: k.value for k in node.keywords}
    return None


def _lookup_or_none(call: ast.Call) -> bool:
    """``d.get(key)``, ``d.get(key, None)``, ``getattr(obj, name, None)``: None when absent."""
    f = call.func
    if isinstance(f, ast.Attribute) and f.attr == "get" and 1 <= len(call.args) <= 2:
        default = call.args[1] if len(call.args) == 2 else None
    elif isinstance(f, ast.Name) and f.id == "getattr" and len(call.args) == 3:
        default = call.args[2]
    else:
        return False
    return default is None or (isinstance(default, ast.Constant) and default.value is None)


def _checkpoint_kind(device: ast.expr | None, *, default_cpu: bool) -> str | None:
    """:meth:`KindModel.checkpoint` for a device written out (a literal, or absent)."""
    if device is None:
        return PAGEABLE if default_cpu else None
    if isinstance(device, ast.Constant) and isinstance(device.value, str):
        return _mapped_kind(device_kind_of_str(device.value))
    return None


def _mapped_kind(dk: str | None) -> str | None:
    """Kind of checkpoint tensors mapped to a device of kind ``dk``: fresh pageable memory on
    the CPU, uploaded on an accelerator, None (where they were saved) when unknown."""
    return PAGEABLE if dk == CPU_DEV else DEVICE if dk == ACC_DEV else None


def _known(kind: str | None) -> str | None:
    return None if kind in (UNKNOWN, LIST, ARG) else kind


def _bind_plain(target: ast.expr, kind: str | None, scope: Scope,
                strict: str | None = None) -> None:
    if isinstance(target, ast.Name):
        scope.env[target.id] = kind or UNKNOWN
        # the strict binding too: a stale one (``x = torch.zeros(n, device=d)`` before
        # ``for x in host_items:``) would make ``if x:`` a read of a device tensor
        scope.env[STRICT + target.id] = strict or UNKNOWN
        scope.env.pop("[]" + target.id, None)
    elif isinstance(target, (ast.Tuple, ast.List)):
        for t in target.elts:
            _bind_plain(t, kind if kind in TENSOR_KINDS else None, scope,
                        strict if strict in TENSOR_KINDS else None)
    elif isinstance(target, ast.Starred):
        _bind_plain(target.value, kind, scope, strict)
