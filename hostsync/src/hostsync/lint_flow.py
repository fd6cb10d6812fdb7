"""Flow analysis of the static lint: statements, branches, loops, facts and the checks.

Each function is walked in statement order with an environment ``name -> kind`` (also
``"obj.attr"`` paths assigned in the function). ``if``/``try``/``match`` branches start from the
same environment and are merged with :func:`~hostsync.lint_where.join`; a branch that
returns, raises, breaks or continues does not reach the merge. Loop bodies are walked a second
time from the merge of the entry state and the first iteration's exit state.

The module is walked three times: the first two passes gather module facts (kinds assigned to
attributes, returned by functions and methods, bound at module level), the third reports.
"""

from __future__ import annotations

import ast
import copy
import re
from collections.abc import Callable

from hostsync.lint_kinds import (
    COLLECTIVE_KEYWORDS,
    COLLECTIVES,
    LIST,
    STRICT,
    Facts,
    Imported,
    KindModel,
    Scope,
    bind_item,
    bound_locals,
    device_kind_of_str,
    dotted,
    is_dtype_expr,
    kwarg,
    named_attribute,
)
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
    TENSOR_KINDS,
    UNKNOWN,
    join,
)

__all__ = ["Report", "analyze", "summarize"]

# (node, code, message) -> None
Report = Callable[[ast.AST, str, str], None]

_HOST_READS = ("item", "tolist", "cpu", "numpy")
_SCALAR_CASTS = ("bool", "int", "float", "complex")
#: Tensor comparisons that return a Python bool (``torch.equal(a, b)``, ``a.allclose(b)``)
_COMPARISONS = ("equal", "allclose")
_TERMINATORS = (ast.Return, ast.Raise, ast.Continue, ast.Break)
#: Tensor methods that engines test as if they were properties (``if not x.is_pinned:``)
_UNCALLED_METHODS = frozenset({"is_pinned"})
_VALUE_TYPES = frozenset({
    "None", "Tensor", "ndarray", "Parameter", "Any", "int", "float", "bool", "str", "bytes",
    "list", "tuple", "dict", "set", "List", "Tuple", "Dict", "Set", "Sequence", "Iterable",
})


def _src(node: ast.AST, limit: int = 48) -> str:
    """Short source of ``node`` for a message: whole if it fits, else with the argument lists
    and subscripts of its calls written ``...`` (``torch.tensor(...).to(...)``), so that the
    message names the whole chained call rather than a cut-off first argument."""
    text = ast.unparse(node)
    if len(text) <= limit:
        return text
    text = ast.unparse(_Elide().visit(copy.deepcopy(node)))
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Elide(ast.NodeTransformer):
    _DOTS = ast.Name(id="...")

    def visit_Call(self, node: ast.Call) -> ast.AST:
        node.func = self.visit(node.func)
        if node.args or node.keywords:
            node.args, node.keywords = [self._DOTS], []
        return node

    def visit_Subscript(self, node: ast.Subscript) -> ast.AST:
        node.value = self.visit(node.value)
        node.slice = self._DOTS
        return node


def _is_true(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _join_envs(envs: list[dict[str, str]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for key in {k for e in envs for k in e}:
        kind: str | None = None
        for e in envs:
            kind = join(kind, e.get(key))
        out[key] = kind or UNKNOWN
    return out


def _annotation_class(node: ast.expr | None) -> str | None:
    """``C`` for an annotation ``C``, ``"C"``, ``C | None``, ``Optional[C]``, ``mod.C``."""
    if node is None:
        return None
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            node = ast.parse(node.value, mode="eval").body
        except SyntaxError:
            return None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        left, right = _annotation_class(node.left), _annotation_class(node.right)
        return left or right
    if isinstance(node, ast.Subscript) and isinstance(node.value, (ast.Name, ast.Attribute)):
        outer = node.value.id if isinstance(node.value, ast.Name) else node.value.attr
        return _annotation_class(node.slice) if outer == "Optional" else None
    name = node.id if isinstance(node, ast.Name) else \
        node.attr if isinstance(node, ast.Attribute) else None
    # a tensor or array annotation says nothing about where the value lives
    return None if name in _VALUE_TYPES else name


class _Flow:
    """One module's analysis; see the module docstring."""

    def __init__(self, tree: ast.Module, report: Report,
                 imported: Imported | None = None) -> None:
        self.tree = tree
        self.model = KindModel(tree, imported)
        self._report = report
        self.reporting = False
        self.exporting = False  # summarizing for other modules (see summarize)
        self.raising = False  # in a raise statement or an assert message (an error path)
        self.pending = Facts()

    def run(self, passes: tuple[bool, ...] = (False, False, True)) -> None:
        for final in passes:
            self.reporting = final
            self.pending = Facts()
            scope = Scope(env={}, types={})
            self._block(self.tree.body, scope)
            self.pending.globals = {k: v for k, v in scope.env.items() if "." not in k}
            if not final:
                self.model.facts = self.pending

    def _add(self, node: ast.AST, code: str, message: str) -> None:
        if self.reporting and not (self.raising and code == "HS201"):
            self._report(node, code, message)

    def _error_path(self, e: ast.expr, scope: Scope) -> None:
        """Walk ``e``, built only on the way to an exception (a ``raise``'s exception, an
        ``assert``'s message): a host read there waits once, as the program fails, so it is
        no HS201 (``raise ValueError(f"got {n}")`` after ``if n != m:``)."""
        raising, self.raising = self.raising, True
        try:
            self._expr(e, scope)
        finally:
            self.raising = raising

    # ------------------------------------------------------------------ statements

    def _block(self, stmts: list[ast.stmt], scope: Scope) -> bool:
        """Walk ``stmts``; False when the block never falls through (return, raise, ...)."""
        return all(self._stmt(s, scope) for s in stmts)  # stops at the first that does not

    def _stmt(self, s: ast.stmt, scope: Scope) -> bool:
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)):
            self._function(s, scope)
        elif isinstance(s, ast.ClassDef):
            for d in s.decorator_list:
                self._expr(d, scope)
            self._block(s.body, Scope(env={}, types={}, cls=s.name, class_body=True))
        elif isinstance(s, ast.Assign):
            self._expr(s.value, scope)
            for t in s.targets:
                self._assign(t, s.value, scope)
        elif isinstance(s, ast.AnnAssign):
            if s.value is not None:
                self._expr(s.value, scope)
                self._assign(s.target, s.value, scope)
        elif isinstance(s, ast.AugAssign):
            self._expr(s.value, scope)
            self._expr(s.target, scope)
        elif isinstance(s, (ast.For, ast.AsyncFor, ast.While)):
            self._loop(s, scope)
        elif isinstance(s, ast.If):
            self._expr(s.test, scope)
            self._check_truth(s.test, "if", scope)
            constant = _bound_method_test(s.test)
            if constant is not None:  # `if not x.is_pinned:` never runs its body
                return self._block(s.body if constant else s.orelse, scope)
            return self._branches([s.body, s.orelse], scope, fallthrough_env=False,
                                  refine=_guards(s.test))
        elif isinstance(s, (ast.With, ast.AsyncWith)):
            for item in s.items:
                self._expr(item.context_expr, scope)
                if item.optional_vars is not None:
                    self._bind(item.optional_vars, None, scope)
            return self._block(s.body, scope)
        elif isinstance(s, (ast.Try, ast.TryStar)):
            return self._try(s, scope)
        elif isinstance(s, ast.Match):
            self._expr(s.subject, scope)
            return self._branches([c.body for c in s.cases], scope, fallthrough_env=True)
        elif isinstance(s, ast.Return):
            if s.value is not None:
                self._expr(s.value, scope)
            if scope.function is not None:
                kind = self.model.kind(s.value, scope) if s.value is not None else NONE
                self.pending.add_return(scope.cls, scope.function, kind)
                if kind != NONE:
                    self.pending.add_items(scope.cls, scope.function,
                                           self._written_tuple(s.value, scope))
            return False
        elif isinstance(s, ast.Expr):
            self._expr(s.value, scope)
        elif isinstance(s, ast.Assert):
            self._expr(s.test, scope)
            self._check_truth(s.test, "assert", scope)
            if s.msg is not None:
                self._error_path(s.msg, scope)
        elif isinstance(s, ast.Raise):
            for child in ast.iter_child_nodes(s):
                if isinstance(child, ast.expr):
                    self._error_path(child, scope)
        elif isinstance(s, ast.Delete):
            for child in ast.iter_child_nodes(s):
                if isinstance(child, ast.expr):
                    self._expr(child, scope)
        return not isinstance(s, _TERMINATORS)

    def _branches(self, blocks: list[list[ast.stmt]], scope: Scope, *,
                  fallthrough_env: bool,
                  refine: tuple[dict[str, str], ...] = ()) -> bool:
        """Walk alternative blocks from one state and merge the ones that fall through;
        ``refine[i]``: what the test proves of paths in block ``i`` (see :func:`_guards`).
        A refinement holds after the statement only when its block alone falls through
        (``if not x.is_cuda: return``); else each block's refined paths not rebound in it
        merge as they were before the test."""
        outs: list[tuple[int, dict[str, str]]] = [(-1, dict(scope.env))] \
            if fallthrough_env else []
        before = dict(scope.env)
        for i, block in enumerate(blocks):
            inner = scope.branch()
            if i < len(refine):
                _refine(inner, refine[i])
            if self._block(block, inner):
                outs.append((i, inner.env))
        if not outs:
            return False
        if len(outs) > 1:
            for i, env in outs:
                for path, kind in (refine[i] if 0 <= i < len(refine) else {}).items():
                    for key in (path, STRICT + path):
                        if env.get(key) == kind:
                            if key in before:
                                env[key] = before[key]
                            else:
                                del env[key]
        scope.env.clear()
        scope.env.update(_join_envs([env for _, env in outs]))
        return True

    def _try(self, s: ast.Try, scope: Scope) -> bool:
        body = scope.branch()
        falls = self._block(s.body, body)
        if falls and s.orelse:
            falls = self._block(s.orelse, body)
        outs = [body.env] if falls else []
        for h in s.handlers:
            # an exception can come from any statement of the body: start from either end
            handler = scope.branch(_join_envs([scope.env, body.env]))
            if h.type is not None:
                self._expr(h.type, handler)
            if h.name:
                handler.env[h.name] = UNKNOWN
            if self._block(h.body, handler):
                outs.append(handler.env)
        scope.env.clear()
        scope.env.update(_join_envs(outs) if outs else body.env)
        return self._block(s.finalbody, scope) and bool(outs)

    def _loop(self, s: ast.For | ast.AsyncFor | ast.While, scope: Scope) -> None:
        head = s.iter if isinstance(s, (ast.For, ast.AsyncFor)) else s.test
        self._expr(head, scope)
        if isinstance(s, ast.While):
            self._check_truth(s.test, "while", scope)
        entry = dict(scope.env)
        state = entry
        for _ in range(2):  # the first iteration, then any later one
            body = scope.branch(dict(state), loop=scope.loop + 1)
            if isinstance(s, (ast.For, ast.AsyncFor)):
                self.model.bind_loop_target(s.target, s.iter, body)
            else:
                self._expr(s.test, body)
            self._block(s.body, body)
            merged = _join_envs([entry, body.env])
            if merged == state:
                break
            state = merged
        scope.env.clear()
        scope.env.update(state)
        self._block(s.orelse, scope)

    def _function(self, fn: ast.FunctionDef | ast.AsyncFunctionDef, scope: Scope) -> None:
        for d in fn.decorator_list:
            self._expr(d, scope)
        args = fn.args
        params = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
        is_method = scope.class_body
        own = {p.arg for p in params if p is not None}
        # A closure (a function defined in a function) sees what its enclosing function
        # established: names, their strict kinds, list items, and the attribute paths
        # (``step_context.q_seqlens``, ``self.buf``) and classes of its free names; its own
        # parameters shadow them. A module-level function sees the module's names only.
        closure = scope.uses is not None and not is_method
        env = {k: v for k, v in scope.env.items()
               if (closure or "." not in k) and _root(k) not in own}
        types = {k: v for k, v in scope.types.items() if k not in own} if closure else {}
        # A free function's device parameter is the caller's choice (device-agnostic
        # helpers, CPU in tests); a method's is the device its component serves.
        marker = UNKNOWN if is_method else ARG
        for p in params:
            if p is None:
                continue
            env[p.arg] = marker  # bound, unknown: conventions and hints apply, not globals
            cls_name = _annotation_class(p.annotation)
            if cls_name is not None:
                types[p.arg] = cls_name
        if id(fn) in self.model.top_defs:
            # what every call site of the linted modules passes (lint_modules' call-site facts)
            given = self.model.imported.params.get((scope.cls if is_method else None, fn.name))
            for name, (kind, strict) in (given or {}).items():
                if kind is not None:
                    env[name] = kind
                if strict is not None:
                    env[STRICT + name] = strict
        for default in [*args.defaults, *(d for d in args.kw_defaults if d is not None)]:
            self._expr(default, scope)
        hints = self.model.function_hints(fn)
        if closure:
            hints = hints | (scope.hints - own)
        if self.exporting and not is_method:
            # `device=x.device` of its own parameter x: in the function, x is on the device,
            # but what it returns to another module's caller lives where that caller's x does
            hints = hints - {p.arg for p in params if p is not None}
        falsy, zips = bound_locals(fn)
        inner = Scope(env=env, types=types, cls=scope.cls, hints=hints,
                      function=fn.name if is_method or (scope.cls is None and
                      scope.function is None) else None, uses=_attribute_uses(fn),
                      falsy=falsy, zips=zips, key_uses=_key_uses(fn))
        if is_method and any(isinstance(d, ast.Name) and d.id == "staticmethod"
                             for d in fn.decorator_list):
            inner.cls = None
            inner.function = None
        self._block(fn.body, inner)

    # ------------------------------------------------------------------ binding

    def _assign(self, target: ast.expr, value: ast.expr, scope: Scope) -> None:
        if isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List)) \
                and len(target.elts) == len(value.elts):
            for t, v in zip(target.elts, value.elts, strict=True):
                self._assign(t, v, scope)
            return
        self._bind(target, value, scope)

    def _bind(self, target: ast.expr, value: ast.expr | None, scope: Scope) -> None:
        model = self.model
        kind = model.kind(value, scope) if value is not None else None
        strict = model.strictly(value, scope) if value is not None else None
        if isinstance(target, ast.Name):
            name = target.id
            for key in [k for k in scope.env
                        if k.startswith((name + ".", STRICT + name + "."))]:
                del scope.env[key]
            scope.env.pop("[]" + name, None)
            scope.env[STRICT + name] = strict or UNKNOWN
            if _is_list_value(value):
                scope.env[name] = LIST
                scope.env["[]" + name] = kind or UNKNOWN
            else:
                scope.env[name] = kind or UNKNOWN
            cls_name = self._constructed_class(value, scope)
            if cls_name is not None:
                scope.types[name] = cls_name
            if scope.class_body and scope.cls is not None:
                self.pending.add_attr(scope.cls, name, kind)
        elif isinstance(target, (ast.Tuple, ast.List)):
            # the tuple a plain function call given device tensors returns, or a summarized
            # one (every return a device call's results), or a callable held by another
            # object (`ids, probs = batch.chooser(logits)`): each item is such a result; not
            # so for a method of this object whose kind is only guessed from its arguments,
            # as for the host-call rule (`_, n_cpu, mode = self.sync(dev, ...)` may hold host
            # items)
            item = kind if kind in TENSOR_KINDS or (kind == DEV_CALL and (
                (isinstance(value, ast.Call) and isinstance(value.func, ast.Name))
                or model.summarized(value, scope)
                or model.foreign_callable(value, scope))) else None
            items = model.returned_items(value, scope)
            if items is None or len(items) != len(target.elts) or any(
                    isinstance(t, ast.Starred) for t in target.elts):
                for t in target.elts:
                    self._bind_kind(t, item, scope)
                return
            # `ids, n, lens = self._plan(...)` of a function of this module whose every
            # return writes out such a tuple: each item what that position holds, strictly
            # too; a position of unknown kind takes the item kind above
            for t, (k, sk) in zip(target.elts, items, strict=True):
                k = k if k in TENSOR_KINDS else item
                if isinstance(t, ast.Name):
                    bind_item(t, k, sk, scope)
                else:
                    self._bind_kind(t, k, scope)
        elif isinstance(target, ast.Starred):
            self._bind(target.value, value, scope)
        elif isinstance(target, ast.Attribute):
            path = dotted(target)
            if path is not None:
                scope.env[path] = kind or UNKNOWN
                scope.env[STRICT + path] = strict or UNKNOWN
            owner = target.value
            if isinstance(owner, ast.Name) and owner.id == "self" and scope.cls is not None:
                self.pending.add_attr(scope.cls, target.attr, kind)
                if strict in TENSOR_KINDS or not _derived_from_self(value, target.attr):
                    # `self.free = torch.cat([self.free, x])` lives where `self.free` does
                    self.pending.add_strict_attr(scope.cls, target.attr, strict)
            else:
                self.pending.add_strict_attr(None, target.attr, UNKNOWN)
                owner_type = model.type_of(owner, scope)
                if owner_type is not None:
                    self.pending.add_attr(owner_type, target.attr, kind)
                self.pending.add_attr(None, target.attr, kind)
        elif isinstance(target, ast.Subscript):
            self._add_to_list(target.value, kind, scope)
            if isinstance(target.slice, ast.Constant) and isinstance(target.slice.value, str) \
                    and strict not in (DEVICE, NONE):
                self.pending.host_keys.add(target.slice.value)

    def _written_tuple(self, value: ast.expr | None, scope: Scope) -> tuple | None:
        """(kind, strict kind) of each item of a returned tuple written out without ``*``."""
        if not isinstance(value, ast.Tuple) or any(isinstance(e, ast.Starred)
                                                   for e in value.elts):
            return None
        model = self.model
        return tuple((model.kind(e, scope), model.strictly(e, scope)) for e in value.elts)

    def _bind_kind(self, target: ast.expr, kind: str | None, scope: Scope) -> None:
        if isinstance(target, ast.Name):
            scope.env[target.id] = kind or UNKNOWN
            scope.env.pop("[]" + target.id, None)
            scope.env.pop(STRICT + target.id, None)
        elif isinstance(target, (ast.Tuple, ast.List)):
            for t in target.elts:
                self._bind_kind(t, kind, scope)
        elif isinstance(target, ast.Starred):
            self._bind_kind(target.value, kind, scope)
        elif isinstance(target, ast.Attribute):
            path = dotted(target)
            if path is not None:
                scope.env[path] = kind or UNKNOWN

    def _add_to_list(self, container: ast.expr, kind: str | None, scope: Scope) -> None:
        """``lst[i] = x`` / ``lst.append(x)``: the list's items may now be ``x``'s kind."""
        if isinstance(container, ast.Name) and scope.env.get(container.id) == LIST:
            key = "[]" + container.id
            scope.env[key] = join(scope.env.get(key), kind or UNKNOWN) or UNKNOWN

    def _constructed_class(self, value: ast.expr | None, scope: Scope) -> str | None:
        if not isinstance(value, ast.Call):
            return None
        f = value.func
        if isinstance(f, ast.Name) and (f.id in self.model.classes
                                        or f.id in self.model.imported.classes):
            return f.id
        if isinstance(f, ast.Name) and f.id == "cls" and scope.cls is not None:
            return scope.cls
        return None

    # ------------------------------------------------------------------ expressions

    def _expr(self, e: ast.expr, scope: Scope) -> None:
        if isinstance(e, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            inner = scope.branch()
            for gen in e.generators:
                self._expr(gen.iter, inner)
                self.model.bind_loop_target(gen.target, gen.iter, inner)
                for cond in gen.ifs:
                    self._expr(cond, inner)
                    self._check_truth(cond, "if", inner)
            for part in ([e.key, e.value] if isinstance(e, ast.DictComp) else [e.elt]):
                self._expr(part, inner)
            return
        if isinstance(e, ast.Lambda):
            inner = scope.branch(loop=0)
            for arg in e.args.args:
                inner.env[arg.arg] = UNKNOWN
            self._expr(e.body, inner)
            return
        if isinstance(e, ast.NamedExpr):
            self._expr(e.value, scope)
            self._bind(e.target, e.value, scope)
            return
        if isinstance(e, ast.IfExp):  # `x.cpu() if x.is_cuda else x`: x is on the device there
            self._expr(e.test, scope)
            self._check_truth(e.test, "if", scope)
            then, orelse = _guards(e.test)
            body = scope.branch()
            _refine(body, then)
            self._expr(e.body, body)
            other = scope.branch()
            _refine(other, orelse)
            self._expr(e.orelse, other)
            return
        for child in ast.iter_child_nodes(e):
            if isinstance(child, ast.keyword):
                self._expr(child.value, scope)
            elif isinstance(child, ast.expr):
                self._expr(child, scope)
        if isinstance(e, ast.Call):
            self._call(e, scope)
        if isinstance(e, (ast.Dict, ast.Call)):
            entries = _dict_entries(e)
            if entries:
                self.pending.add_shape({k: self.model.strictly(v, scope) for k, v in entries})
        elif isinstance(e, ast.Compare):
            self._check_contains(e, scope)
        elif isinstance(e, ast.FormattedValue) and self.model.strictly(e.value, scope) == DEVICE:
            self._add(e.value, "HS201",
                      f"formatting `{_src(e.value)}`, a device tensor, in an f-string copies it "
                      "to the host and waits for the device; format a host copy (or only its "
                      "shape and dtype)")

    def _site(self, call: ast.Call, scope: Scope) -> None:
        """Record what this call passes, when it may call a function a linted module defines
        (``f(x)``, ``obj.m(x)``; not ``torch.*`` / ``np.*``): see lint_modules' call-site
        parameter facts."""
        model = self.model
        f = call.func
        if isinstance(f, ast.Name):
            is_attr, name = False, f.id
        elif isinstance(f, ast.Attribute) and not model.is_torch(f.value) and not (
                isinstance(f.value, ast.Name) and f.value.id in model.numpy_names):
            is_attr, name = True, f.attr
        else:
            return
        if name not in model.imported.callees:
            return
        hidden = any(isinstance(a, ast.Starred) for a in call.args) or any(
            kw.arg is None for kw in call.keywords)
        pos = None if hidden else tuple(self._site_arg(a, scope) for a in call.args)
        kws = tuple((kw.arg, self._site_arg(kw.value, scope))
                    for kw in call.keywords if kw.arg is not None)
        self.pending.sites[(call.lineno, call.col_offset)] = (is_attr, name, pos, kws)

    def _site_arg(self, a: ast.expr, scope: Scope) -> tuple[str | None, str | None]:
        """(kind, strict kind) of an argument, the kind without naming conventions: what the
        code shows (a name ``device`` or ``x_gpu`` alone is no device tensor); none for a
        list or tuple of tensors (``if tensors:`` of a list is no device read)."""
        model = self.model
        if isinstance(a, (ast.List, ast.Tuple, ast.Set, ast.ListComp, ast.GeneratorExp,
                          ast.SetComp, ast.DictComp, ast.Dict)) or (
                isinstance(a, ast.Name) and scope.env.get(a.id) == LIST) or (
                (a.attr if isinstance(a, ast.Attribute) else getattr(a, "id", None))
                == "device"):
            return None, None  # a list, or a device object (`self.device`), is no tensor
        model.names_off = True
        try:
            kind = model.kind(a, scope)
        finally:
            model.names_off = False
        return kind, model.strictly(a, scope)

    def _call(self, call: ast.Call, scope: Scope) -> None:
        model = self.model
        f = call.func
        self._site(call, scope)
        collective = model.collective(call)
        if collective is not None:
            self._collective(call, collective, scope)
        cls_name = model.is_class_call(f)
        if cls_name == "cls" and scope.cls is not None:
            cls_name = scope.cls  # cls(...) in a classmethod
        if cls_name is not None:  # Metadata(seq_lens=...): what its fields will hold
            given = {kw.arg: model.kind(kw.value, scope) for kw in call.keywords if kw.arg}
            self.pending.add_given(cls_name, call, given)
            if cls_name in model.classes:
                for name, kind in given.items():
                    self.pending.add_attr(cls_name, name, kind)
        if isinstance(f, ast.Name) and f.id in _SCALAR_CASTS and len(call.args) == 1 \
                and f.id not in scope.env and model.strictly(call.args[0], scope) == DEVICE:
            self._add(call, "HS201",
                      f"`{f.id}({_src(call.args[0])})` of a device tensor reads its value on the "
                      "host, which waits for the device; keep the decision on the device "
                      "(torch.where) or compute it from host values (e.g. in the plan)")
            return
        if isinstance(f, ast.Name) and f.id in ("min", "max") and f.id not in scope.env:
            compared = _compared(call)
            if any(model.strictly(a, scope) == DEVICE for a in compared):
                self._add(call, "HS201",
                          f"`{f.id}()` of device tensors compares them on the host (`bool(a < "
                          "b)`), which waits for the device; use torch.minimum/torch.maximum "
                          "(or .amin()/.amax()) on the device, or compare host values")
                return
        target = named_attribute(call, "setattr")
        if target is not None and len(call.args) == 3 and "setattr" not in scope.env:
            self._bind(target, call.args[2], scope)  # `setattr(obj, "a", v)` is `obj.a = v`
            return
        if not isinstance(f, ast.Attribute):
            return
        m = f.attr
        if m == "register_buffer":
            self._register_buffer(call, scope)
        if m in ("append", "extend", "insert") and call.args:
            item = call.args[-1]
            kind = model.kind(item, scope)
            if m == "extend":
                kind = kind if kind in TENSOR_KINDS else None
            self._add_to_list(f.value, kind, scope)
            return
        if scope.loop > 0 and (
            (m == "pin_memory" and not model.is_torch(f.value))
            or (model.is_torch(f.value) and _is_true(kwarg(call, "pin_memory")))
        ):
            self._add(call, "HS102",
                      f"`{_src(call)}` inside a loop pins a fresh buffer every iteration; "
                      "allocate pinned staging once outside the loop and reuse it (guard reuse "
                      "with an event so a pending copy is never overwritten)")
            return
        if m in _COMPARISONS:
            # `torch.equal(a, b)` / `a.allclose(b)`: a Python bool, computed on the device
            module = model.is_torch(f.value) or (isinstance(f.value, ast.Name)
                                                 and f.value.id in model.numpy_names)
            operands = [*call.args[:2]] if module else [f.value, *call.args[:1]]
            for operand in operands:
                if model.kind(operand, scope) in (DEVICE, DEV_CALL):
                    self._check_host_read(call, operand, f"{_src(f, 24)}()", scope)
                    break
            return
        if model.is_torch(f.value):
            return
        if m in _HOST_READS:
            self._check_host_read(call, f.value, f".{m}()", scope)
        elif m == "to":
            self._check_to(call, scope)
        elif m == "cuda" and (_is_true(kwarg(call, "non_blocking"))
                              or any(_is_true(a) for a in call.args[1:2])):
            self._check_upload(call, f.value, scope, dest_known=True)
        elif m == "copy_" and (_is_true(kwarg(call, "non_blocking")) or (
                len(call.args) > 1 and _is_true(call.args[1]))):
            src = call.args[0] if call.args else kwarg(call, "src")
            dst_kind = model.kind(f.value, scope)
            if src is not None and _host_copy_of_device(src, model, scope):
                return  # `dst.copy_(dev.cpu(), ...)`: the read drained the queue, no HS101
            if src is not None and dst_kind not in HOST_KINDS:
                self._check_upload(call, src, scope, dest_known=dst_kind == DEVICE)

    def _collective(self, call: ast.Call, name: str, scope: Scope) -> None:
        """``dist.all_reduce(t)``, ``dist.all_gather(outs, t)``, ...: the tensors a collective
        reads and writes are on the device from here on (NCCL and HCCL take device tensors
        only), unless the process group is a CPU one (``group=cpu_group``, gloo) or the
        tensor is known to be on the host."""
        targets = [call.args[i] for i in COLLECTIVES[name] if i < len(call.args)]
        targets += [kw.value for kw in call.keywords if kw.arg in COLLECTIVE_KEYWORDS]
        others = [a for a in [*call.args, *(kw.value for kw in call.keywords)]
                  if not any(a is t for t in targets)]
        if any(re.search(r"cpu|gloo|host", ast.unparse(a).lower()) for a in others):
            return
        for t in targets:
            self._on_device(t, scope)

    def _on_device(self, t: ast.expr, scope: Scope) -> None:
        model = self.model
        if isinstance(t, (ast.List, ast.Tuple)):
            for e in t.elts:
                self._on_device(e, scope)
            return
        while isinstance(t, ast.Subscript):
            t = t.value
        if isinstance(t, ast.Name) and scope.env.get(t.id) == LIST:
            if model.kind(t, scope) not in HOST_KINDS:  # a list of output tensors
                scope.env["[]" + t.id] = DEVICE
            return
        path = dotted(t)
        if path is None or model.kind(t, scope) in HOST_KINDS:
            return
        scope.env[path] = DEVICE
        scope.env[STRICT + path] = DEVICE

    def _register_buffer(self, call: ast.Call, scope: Scope) -> None:
        """``self.register_buffer("name", tensor)`` assigns ``self.name``: a device tensor
        stays one, but a host buffer is moved by ``module.to(device)`` / ``.cuda()`` with its
        module, so where it lives after construction is unknown."""
        f = call.func
        assert isinstance(f, ast.Attribute)
        name = call.args[0] if call.args else kwarg(call, "name")
        value = call.args[1] if len(call.args) > 1 else kwarg(call, "tensor")
        if not (isinstance(f.value, ast.Name) and f.value.id == "self" and scope.cls
                and isinstance(name, ast.Constant) and isinstance(name.value, str)
                and value is not None):
            return
        target = ast.Attribute(value=ast.Name(id="self", ctx=ast.Load()), attr=name.value,
                               ctx=ast.Store())
        self._bind(target, value if self.model.kind(value, scope) == DEVICE else None, scope)

    # ------------------------------------------------------------------ checks

    def _check_host_read(self, call: ast.Call, value: ast.expr, what: str, scope: Scope) -> None:
        kind = self.model.kind(value, scope)
        if kind in (DEVICE, DEV_CALL):
            what_it_is = "a device tensor" if kind == DEVICE else \
                "the result of a call given device tensors"
            self._add(call, "HS201",
                      f"`{what}` of `{_src(value)}`, {what_it_is}, makes the host wait for "
                      "the device; keep the value on the device, or keep a host copy of it "
                      "(compute it on the host, e.g. in the plan)")

    def _check_truth(self, test: ast.expr, where: str, scope: Scope) -> None:
        """``if``/``while``/``assert`` (and comprehension/conditional-expression) tests: the
        truth value of a device tensor is read on the host (``bool(t)``)."""
        if isinstance(test, ast.BoolOp):
            for value in test.values:
                self._check_truth(value, where, scope)
            return
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            self._check_truth(test.operand, where, scope)
            return
        if isinstance(test, ast.NamedExpr):
            test = test.value
        if self.model.strictly(test, scope) == DEVICE:
            self._add(test, "HS201",
                      f"`{where} {_src(test)}` reads the truth value of a device tensor on the "
                      "host, which waits for the device; keep the branch on the device "
                      "(torch.where, masks) or decide from host values (e.g. in the plan)")

    def _check_contains(self, test: ast.Compare, scope: Scope) -> None:
        """``x in t`` / ``x not in t`` of a device tensor ``x`` in a tensor ``t``, both
        strictly on the device: ``Tensor.__contains__`` is ``bool((t == x).any())``, a read of
        the device. A key or a string tested against what the lint takes for a device value
        (``key in state_dict`` of a checkpoint mapped to the device, ``"norm" in name``) is
        a test of a container, not of a tensor."""
        left = test.left
        model = self.model
        for op, right in zip(test.ops, test.comparators, strict=True):
            if isinstance(op, (ast.In, ast.NotIn)) and not (
                    isinstance(right, ast.Name) and scope.env.get(right.id) == LIST) \
                    and model.strictly(left, scope) == DEVICE \
                    and model.strictly(right, scope) == DEVICE:
                word = "in" if isinstance(op, ast.In) else "not in"
                self._add(test, "HS201",
                          f"`{_src(left, 20)} {word} {_src(right)}` tests membership in a device "
                          "tensor, `bool((t == x).any())`, which waits for the device; keep "
                          "the test on the device (torch.isin, masks) or test a host copy")
                return
            left = right

    def _check_to(self, call: ast.Call, scope: Scope) -> None:
        model = self.model
        f = call.func
        assert isinstance(f, ast.Attribute)
        target = model.to_target(call)
        if target is None:
            return
        nb_kw = kwarg(call, "non_blocking")
        extra = [a for a in call.args[1:] if not is_dtype_expr(a)]
        non_blocking = _is_true(nb_kw) or any(_is_true(a) for a in extra)
        dest = model.device_kind(target, scope)
        if dest == CPU_DEV:
            if not non_blocking:
                self._check_host_read(call, f.value, f".to({_src(target, 20)})", scope)
            return
        if non_blocking:
            self._check_upload(call, f.value, scope, dest_known=True)

    def _check_upload(self, call: ast.Call, src: ast.expr, scope: Scope, *,
                      dest_known: bool) -> None:
        """A non_blocking copy of ``src`` to a destination not known to be the host.

        ``dest_known``: the copy is meant to reach a device (``.to(dev)``, ``.cuda()``, a
        ``copy_`` into a device tensor); only then is an unplaceable source worth HS103.
        """
        kind = self.model.kind(src, scope)
        if kind == PAGEABLE:
            self._add(call, "HS101",
                      f"non_blocking=True copy of `{_src(src)}`, pageable host memory: the "
                      "host can block until all queued GPU work finishes; allocate it with "
                      "pin_memory=True or copy it into a pinned staging buffer first")
        elif kind in (None, HOST) and dest_known:
            where = "host memory of unknown pinnedness" if kind == HOST else \
                "memory the lint cannot place"
            self._add(call, "HS103",
                      f"non_blocking=True copy of `{_src(src)}`, {where}: if it is pageable "
                      "host memory the host can block until all queued GPU work finishes; "
                      "make sure it is pinned (or on the device)")


def _host_copy_of_device(src: ast.expr, model: KindModel, scope: Scope) -> bool:
    """``src`` is a host copy just made of a device tensor (``dev.cpu()``,
    ``dev.to("cpu")``): that blocking read (HS201 itself) has drained the queue, so copying
    it on (into a host buffer: a staged device-to-host transfer; into a device one: a round
    trip) has no queued work left to wait for, and is no HS101 of its own."""
    if not (isinstance(src, ast.Call) and isinstance(src.func, ast.Attribute)):
        return False
    m = src.func.attr
    if m == "to":
        target = model.to_target(src)
        if target is None or model.device_kind(target, scope) != CPU_DEV:
            return False
    elif m != "cpu":
        return False
    return model.kind(src.func.value, scope) in (DEVICE, DEV_CALL)


def _dict_entries(e: ast.Dict | ast.Call) -> list[tuple[str, ast.expr]]:
    """The entries of ``{"k": v, ...}`` / ``dict(k=v, ...)`` with every key a string written
    out (none for a ``**`` entry: its keys are not seen)."""
    if isinstance(e, ast.Dict):
        if not all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in e.keys):
            return []
        return [(k.value, v) for k, v in zip(e.keys, e.values, strict=True)]
    if isinstance(e.func, ast.Name) and e.func.id == "dict" and not e.args \
            and all(k.arg is not None for k in e.keywords):
        return [(k.arg, k.value) for k in e.keywords]
    return []


def _key_uses(fn: ast.AST) -> dict[str, frozenset[str]]:
    """The string keys ``fn`` subscripts each name with: ``{"cache": {"k", "end"}}``."""
    out: dict[str, set[str]] = {}
    for node in ast.walk(fn):
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) \
                and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
            out.setdefault(node.value.id, set()).add(node.slice.value)
    return {k: frozenset(v) for k, v in out.items()}


def _bound_method_test(test: ast.expr) -> bool | None:
    """The truth value of a test that is a tensor method left uncalled, ``x.is_pinned`` (or
    ``not x.is_pinned``): a bound method is always true, so ``if not x.is_pinned: x =
    x.pin_memory()`` never pins; None for any other test."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = _bound_method_test(test.operand)
        return None if inner is None else not inner
    if isinstance(test, ast.Attribute) and test.attr in _UNCALLED_METHODS:
        return True
    return None


def _guards(test: ast.expr) -> tuple[dict[str, str], dict[str, str]]:
    """What ``test`` proves where it holds and where it does not, as ``{path: kind}`` for
    names or ``a.b`` paths: ``x.is_cuda`` and ``x.device.type == "cuda"`` (or another
    accelerator) put tensor ``x`` on the device where they hold; ``x.is_cpu`` and
    ``x.device.type == "cpu"`` put it on the host where they hold and on the device where
    they do not; ``d.type == "cpu"`` of a device object ``d`` (``self.device.type`` too) makes
    ``d`` the CPU or an accelerator. ``not`` swaps them, ``and`` joins what holds, ``or``
    what does not."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        then, orelse = _guards(test.operand)
        return orelse, then
    if isinstance(test, ast.BoolOp):
        parts = [_guards(v) for v in test.values]
        i = 0 if isinstance(test.op, ast.And) else 1
        out: dict[str, str] = {}
        for part in parts:
            out.update(part[i])
        return (out, {}) if i == 0 else ({}, out)
    if isinstance(test, ast.Attribute) and test.attr in ("is_cuda", "is_cpu"):
        path = dotted(test.value)
        if path is None or path in ("self", "cls"):
            return {}, {}
        if test.attr == "is_cuda":
            return {path: DEVICE}, {}
        return {path: HOST}, {path: DEVICE}
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1
            and isinstance(test.ops[0], (ast.Eq, ast.NotEq))
            and isinstance(test.left, ast.Attribute) and test.left.attr == "type"
            and isinstance(test.comparators[0], ast.Constant)
            and isinstance(test.comparators[0].value, str)):
        return {}, {}
    where = device_kind_of_str(test.comparators[0].value)
    obj = test.left.value
    tensor = obj.value if isinstance(obj, ast.Attribute) and obj.attr == "device" else None
    if tensor is not None and isinstance(tensor, ast.Name) and tensor.id in ("self", "cls"):
        tensor = None  # `self.device.type`: the device an object serves
    path = dotted(tensor if tensor is not None else obj)
    if path is None or where is None:
        return {}, {}
    if tensor is not None:
        then, orelse = ({path: HOST}, {path: DEVICE}) if where == CPU_DEV else \
            ({path: DEVICE}, {})
    else:
        then, orelse = ({path: CPU_DEV}, {path: ACC_DEV}) if where == CPU_DEV else \
            ({path: ACC_DEV}, {})
    return (then, orelse) if isinstance(test.ops[0], ast.Eq) else (orelse, then)


def _refine(scope: Scope, facts: dict[str, str]) -> None:
    for path, kind in facts.items():
        scope.env[path] = kind
        scope.env[STRICT + path] = kind


def _is_list_value(value: ast.expr | None) -> bool:
    if isinstance(value, (ast.List, ast.ListComp)):
        return True
    return (isinstance(value, ast.BinOp) and isinstance(value.op, ast.Mult)
            and isinstance(value.left, ast.List))


def analyze(tree: ast.AST, report: Report, imported: Imported | None = None) -> None:
    """Run the lint's flow analysis over a parsed module, calling ``report`` per finding;
    ``imported``: what other linted modules say about the names this one imports."""
    if isinstance(tree, ast.Module):
        _Flow(tree, report, imported).run()


def summarize(tree: ast.Module, imported: Imported | None = None) -> Facts:
    """The module facts of ``tree`` (return kinds of its functions and methods, attribute kinds
    per class) from the two fact-gathering passes of :func:`analyze`, reporting nothing, for
    other modules: a free function's ``device=x.device`` of its own parameter ``x`` does not
    place ``x`` here (the importing caller chooses where ``x`` lives)."""
    flow = _Flow(tree, lambda *_: None, imported)
    flow.exporting = True
    flow.run((False, False))
    return flow.model.facts



def _root(key: str) -> str:
    """The name an env key is about: ``x`` for ``x``, ``!x``, ``[]x``, ``x.a.b``."""
    return key.removeprefix(STRICT).removeprefix("[]").split(".")[0]


def _attribute_uses(fn: ast.AST) -> dict[str, frozenset[str]]:
    """The attributes ``fn`` uses (reads or writes) of each name: ``{"ctx": {"a", "b"}}``."""
    out: dict[str, set[str]] = {}
    for node in ast.walk(fn):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            out.setdefault(node.value.id, set()).add(node.attr)
    return {k: frozenset(v) for k, v in out.items()}


def _derived_from_self(value: ast.expr | None, attr: str) -> bool:
    """Whether ``value`` reads ``self.<attr>`` (a slice, cat or op of the attribute itself)."""
    return value is not None and any(
        isinstance(n, ast.Attribute) and n.attr == attr and isinstance(n.value, ast.Name)
        and n.value.id == "self" for n in ast.walk(value))


def _compared(call: ast.Call) -> list[ast.expr]:
    """What builtin ``min()`` / ``max()`` compares: its arguments when two or more; the items of
    a single iterable written out (a list, tuple or generator's element) or the iterable
    itself (a tensor iterates into its elements); a ``key=`` lambda's body."""
    out: list[ast.expr] = []
    args = [a for a in call.args if not isinstance(a, ast.Starred)]
    if len(call.args) >= 2:
        out.extend(args)
    elif args:
        a = args[0]
        if isinstance(a, (ast.List, ast.Tuple)):
            out.extend(a.elts)
        elif not isinstance(a, (ast.GeneratorExp, ast.ListComp)):
            out.append(a)
    key = kwarg(call, "key")
    if isinstance(key, ast.Lambda):
        out.append(key.body)
    return out
