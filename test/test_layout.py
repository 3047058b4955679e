"""The package's import graph: no circles, nothing imports upward, the core is ROS-free.

Layers, bottom first (a module may import its own sub-package and any lower layer)::

    core.format < core.options < core.selection < core.execution < core.profiling, core.serving
    < lab, ros < cli
    inside ros: plumbing, safe_action < nodes, client < behaviours, tools, bringup, langchain_chat
    < demo, examples
"""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "selectinfer_ros"

LAYERS = [  # (prefix, rank); the longest matching prefix wins
    ("core.format", 0), ("core.options", 1), ("core.selection", 2), ("core.execution", 3),
    ("core.profiling", 4), ("core.serving", 4), ("core", 0),
    ("ros", 5), ("data", 5), ("lab", 6), ("cli", 7),  # lab's benches may drive the ROS node
]
ROS_LAYERS = [("ros.plumbing", 0), ("ros.safe_action", 0), ("ros.nodes", 1), ("ros.client", 1),
              ("ros.behaviours", 2), ("ros.tools", 2), ("ros.bringup", 2),
              ("ros.langchain_chat", 2), ("ros.demo", 3), ("ros.examples", 3), ("ros", 0)]
ROS_MODULES = ("rclpy", "rcl_interfaces", "lifecycle_msgs", "action_msgs", "diagnostic_msgs",
               "selectinfer_msgs", "launch", "launch_ros", "py_trees")


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        mods[".".join(parts)] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> tuple[set[str], set[str]]:
    """(our modules imported, third-party top-level names imported) by one module, lazy
    imports inside functions included."""
    pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    ours, theirs = set(), set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for a in node.names:
                top = a.name.split(".")[0]
                if top == "selectinfer_ros":
                    ours.add(a.name.split(".", 1)[1])
                else:
                    theirs.add(top)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[:len(pkg) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").split(".")[0] == "selectinfer_ros":
                target = node.module.split(".", 1)[1] if "." in node.module else ""
            else:
                theirs.add((node.module or "").split(".")[0])
                continue
            for a in node.names:
                full = f"{target}.{a.name}" if target else a.name
                ours.add(full if full in mods else target)
    return {m for m in ours if m in mods and m != name and m}, theirs


def _rank(name: str, layers) -> int:
    best = max((p for p, _ in layers if name == p or name.startswith(p + ".")), key=len)
    return dict(layers)[best]


def _package(name: str) -> str:
    """The sub-package a module belongs to (imports inside it are free)."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] in ("core", "ros") and len(parts) > 2 else parts[0]


GRAPH = {name: _imports(name, path, _modules()) for name, path in _modules().items() if name}


def test_no_import_circles():
    index, low, stack, on, circles, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in GRAPH[v][0]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert circles == []


def test_nothing_imports_upward():
    upward = []
    for name, (ours, _) in GRAPH.items():
        for dep in ours:
            if _package(dep) == _package(name) and not name.startswith("ros"):
                continue
            if name.startswith("ros") and dep.startswith("ros"):
                if _package(dep) != _package(name) and _rank(dep, ROS_LAYERS) >= _rank(name, ROS_LAYERS):
                    upward.append(f"{name} -> {dep}")
            elif _rank(dep, LAYERS) >= _rank(name, LAYERS) and _package(dep) != _package(name):
                upward.append(f"{name} -> {dep}")
    assert upward == []


def test_core_imports_neither_ros_nor_lab():
    bad = [f"{name} -> {dep}" for name, (ours, theirs) in GRAPH.items() if name.startswith("core")
           for dep in sorted(theirs & set(ROS_MODULES)) + [d for d in sorted(ours)
                                                          if not d.startswith("core")]]
    assert bad == []


def test_every_module_sits_in_a_layer():
    assert all(any(n == p or n.startswith(p + ".") for p, _ in LAYERS) for n in GRAPH if n)
