"""The package's import graph, read from the sources: imports point down the tiers (the floor
<- routing, kv, http, limits <- discovery, serving <- server <- __main__ and the shipped
fakes), and no module imports itself back through others (no cycle)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Final

SRC: Final = Path(__file__).resolve().parent.parent / "src" / "trio_router"
# The tier of each top-level module or package of trio_router; a module may import its own
# tier's and lower ones'.
TIERS: Final = {
    "_version": 0,
    "asgi": 0,
    "config": 0,
    "errors": 0,
    "table": 0,
    "metrics": 0,
    "tracing": 0,
    "routing": 1,
    "kv": 1,
    "http": 1,
    "limits": 1,
    "discovery": 2,
    "serving": 2,
    "server": 3,
    "__main__": 4,
    "testing": 4,
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str) -> set[str]:
    """The trio_router modules `path` (module `name`) imports, anywhere in it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("trio_router"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            elif node.module and node.module.startswith("trio_router"):
                target = node.module
            else:
                continue
            found.add(target)
            # `from . import x` and `from .pkg import mod` may name modules too.
            for alias in node.names:
                candidate = f"{target}.{alias.name}"
                if (SRC.parent / Path(*candidate.split("."))).with_suffix(".py").exists():
                    found.add(candidate)
    return found - {name}


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in SRC.rglob("*.py")}
    return {name: _imports(path, name) & modules.keys() for name, path in modules.items()}


def _tier(module: str) -> int:
    """A module's tier: its top-level module's or package's; the package itself (whose
    `__init__` offers `run` to embedders) is above everything."""
    parts = module.split(".")
    return TIERS[parts[1]] if len(parts) > 1 else max(TIERS.values())


def test_every_top_level_module_has_a_tier() -> None:
    tops = {
        p.stem if p.is_file() else p.name
        for p in SRC.iterdir()
        if p.suffix == ".py" or (p.is_dir() and any(p.glob("*.py")))
    }
    assert tops - {"__init__"} == TIERS.keys()


def test_imports_point_down_the_tiers() -> None:
    upward = [
        f"{module} (tier {_tier(module)}) imports {target} (tier {_tier(target)})"
        for module, targets in sorted(_graph().items())
        for target in sorted(targets)
        if _tier(target) > _tier(module)
    ]
    assert upward == []


def test_no_module_imports_itself_back() -> None:
    graph = _graph()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert cycles == []


def test_the_graph_is_read() -> None:
    """The reading itself: known edges are found (so the checks above cannot pass on an
    empty graph)."""
    graph = _graph()
    assert "trio_router.serving.attempt" in graph["trio_router.serving.failover"]
    assert "trio_router.config" in graph["trio_router.server"]
    assert len(graph) > 50
