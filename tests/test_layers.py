"""The import direction of the package: plan <- stage <- run <- api <- {bench, cli}.

Read from the source (every ``import`` statement, function-level ones included; only those
under ``if TYPE_CHECKING:`` are left out, since they never run), so a new arrow the wrong way
fails here, not in a user's import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "mlaprefill"
HOSTSYNC_SRC = Path(__file__).resolve().parents[1] / "hostsync" / "src"

#: Each module's layer; a module may import only modules of its own layer or below. Prefixes
#: name a package and everything in it; the longest matching prefix wins.
LAYERS = {
    "mlaprefill": 0, "mlaprefill._env": 0, "mlaprefill.config": 0, "mlaprefill.batch": 0,
    "mlaprefill.plan": 1, "mlaprefill.prefix": 1, "mlaprefill.dcp": 1, "mlaprefill.dcp.layout": 1,
    "mlaprefill.dcp.plan": 1,
    "mlaprefill.staging": 2,
    "mlaprefill.kernels": 3, "mlaprefill.backends": 3, "mlaprefill.graphs": 3,
    "mlaprefill.weights": 3, "mlaprefill.validation": 3, "mlaprefill.replay": 3,
    "mlaprefill.prefill": 3, "mlaprefill.reference": 3, "mlaprefill.dcp.forward": 3,
    "mlaprefill.dcp.shard": 3, "mlaprefill.kvcache": 3,
    "mlaprefill.api": 4,
    "mlaprefill.bench": 5, "mlaprefill.cli": 5, "mlaprefill.plan_cli": 5,
    "mlaprefill.__main__": 5, "mlaprefill.stallmap": 5,
}
NAMES = {0: "base", 1: "plan", 2: "stage", 3: "run", 4: "api", 5: "bench/cli"}
#: The host-sync tool is its own distribution (hostsync/): it imports nothing of the library,
#: and only the command line and the package's lazy exports import it.
AUDIT = "hostsync"


def module_name(path: Path, src: Path = SRC) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, here: str, is_package: bool, modules: set[str]) -> set[str]:
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".") if is_package else here.split(".")[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {m for m in found if m.split(".")[0] in ("mlaprefill", AUDIT)}


def import_graph(src: Path = SRC, package: str = "mlaprefill") -> dict[str, set[str]]:
    paths = sorted((src / package).rglob("*.py"))
    modules = {module_name(p, src) for p in paths}
    graph = {}
    for p in paths:
        name = module_name(p, src)
        tree = ast.parse(p.read_text(encoding="utf-8"), filename=str(p))
        graph[name] = _imports(tree, name, p.name == "__init__.py", modules) - {name}
    return graph


def layer(module: str) -> int | None:
    best = None
    for prefix in LAYERS:
        if (module == prefix or module.startswith(prefix + ".")) and (
                best is None or len(prefix) > len(best)):
            best = prefix
    return None if best is None else LAYERS[best]


GRAPH = import_graph()
HOSTSYNC_GRAPH = import_graph(HOSTSYNC_SRC, AUDIT)


def test_the_graph_is_read():
    # the test can fail: these arrows exist
    assert "mlaprefill.plan" in GRAPH["mlaprefill.staging"]
    assert "mlaprefill.prefill" in GRAPH["mlaprefill.api"]


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if not m.startswith(AUDIT)))
def test_imports_point_down(module):
    here = layer(module)
    assert here is not None, f"{module} has no layer in LAYERS: add it"
    up = sorted(f"{m} ({NAMES[layer(m)]})" for m in GRAPH[module]
                if not m.startswith(AUDIT) and layer(m) is not None and layer(m) > here)
    assert not up, f"{module} ({NAMES[here]}) imports a higher layer: {up}"


def test_hostsync_imports_only_itself():
    assert "hostsync.lint_flow" in HOSTSYNC_GRAPH["hostsync.lint"]  # the test can fail
    for module, targets in HOSTSYNC_GRAPH.items():
        outside = sorted(t for t in targets if t.split(".")[0] != AUDIT)
        assert not outside, f"{module} imports {outside}"


def test_only_the_cli_and_the_root_import_hostsync():
    for module, targets in GRAPH.items():
        if module not in ("mlaprefill.cli", "mlaprefill"):
            inside = sorted(t for t in targets if t.split(".")[0] == AUDIT)
            assert not inside, f"{module} imports the host-sync tool: {inside}"


def test_no_import_cycle():
    seen: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def walk(m: str) -> None:
        seen[m] = 1
        stack.append(m)
        for t in sorted(GRAPH.get(m, ())):
            if seen.get(t) == 1:
                cycle = [*stack[stack.index(t):], t]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if t not in seen:
                walk(t)
        stack.pop()
        seen[m] = 2

    for m in sorted(GRAPH):
        if m not in seen:
            walk(m)
