"""Imports point down and close no cycle.

The package's modules are read as source (nothing is imported): every ``import`` and ``from ... import``, at module
level and inside functions alike, is an edge from the importing module to the module it names (``from pkg import
name`` names ``pkg.name`` when that is a module, else ``pkg``). A module may import modules of its own top-level
package and of any lower layer of :data:`LAYERS`, never of a higher one, and no chain of imports may lead from a
module back to itself. Imports by a computed name (``importlib.import_module`` of a string) are not seen.

A failure names each offending import with its file and line; a cycle is printed as the chain that closes it.
"""

from __future__ import annotations

import ast
import collections
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "rlhf_jax"

# Lowest first. A name is a top-level module or package of rlhf_jax ("" is rlhf_jax/__init__.py). Packages in one
# layer may import each other (no cycle allowed); names not created yet hold their place in the target layout.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("",),
    ("algos",),  # pure losses, advantages, KL: imports nothing else of the package
    ("config",),
    ("parallel",),
    # run services and small host tools: leaves that any layer above config may use
    ("runtime", "tools", "console", "hostmem"),
    ("models",),
    ("types",),  # the typed hand-offs between stages
    ("rewards",),
    ("data",),
    ("rollout",),
    ("agents", "batch"),
    ("engine",),
    ("rl",),
    ("trainers", "train"),  # train/: today's trainers and their engine, while it exists
    ("plan",),
    ("main", "generate", "evaluate", "export", "plot", "verl_cli", "cli"),  # entry points
)

# Imports that break the rules today and are being removed, by (importing module, imported module). Each must still
# exist (test_pending_imports_are_still_there), so the list stays exact: delete an entry once its import is gone.
PENDING: dict[tuple[str, str], str] = {
}


def layer_index() -> dict[str, int]:
    return {name: i for i, names in enumerate(LAYERS) for name in names}


def top_name(module: str) -> str:
    """``rlhf_jax.models.lora`` -> ``models``; the package itself -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def package_modules(root: pathlib.Path, package: str = PACKAGE) -> dict[str, pathlib.Path]:
    """Dotted module name -> source file, for every ``.py`` file of ``package`` under ``root``."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _imported_names(node: ast.AST, module: str, is_package: bool, modules) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:  # relative: from the module's package, one level up per extra dot
        base = module if is_package else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            base = base.rpartition(".")[0]
        source = f"{base}.{node.module}" if node.module else base
    else:
        source = node.module or ""
    return [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source for alias in node.names]


def _owning_module(name: str, modules) -> str | None:
    """The longest prefix of ``name`` that is a module of the package (None outside it)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_edges(modules: dict[str, pathlib.Path], package: str = PACKAGE) -> dict[str, dict[str, int]]:
    """importing module -> {imported module: line of the first such import}, over module-level and in-function
    imports."""
    edges: dict[str, dict[str, int]] = collections.defaultdict(dict)
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            for name in _imported_names(node, module, is_package, modules):
                if name != package and not name.startswith(package + "."):
                    continue
                target = _owning_module(name, modules)
                if target is not None and target != module:
                    edges[module][target] = min(edges[module].get(target, node.lineno), node.lineno)
    return dict(edges)


def strongly_connected(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """The groups of two or more modules that reach each other (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups = []
    nodes = sorted(set(edges) | {t for targets in edges.values() for t in targets})
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, {}))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return groups


def shortest_cycle(edges: dict[str, dict[str, int]], group: list[str]) -> list[str]:
    """A shortest chain of imports from the group's first module back to it, within the group (breadth first)."""
    start, members = group[0], set(group)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(edges.get(node, {})):
                if child == start:
                    chain = [node]
                    while chain[-1] != start:
                        chain.append(parent[chain[-1]])
                    return chain[::-1] + [start]
                if child in members and child not in parent:
                    parent[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {group}")


def describe_chain(chain: list[str], edges, modules, root: pathlib.Path) -> str:
    """``a (a.py:12) -> b (b.py:30) -> a``: each step with the file and line of its import."""
    steps = [f"{a} ({modules[a].relative_to(root)}:{edges[a][b]})" for a, b in zip(chain, chain[1:])]
    return " -> ".join(steps + [chain[-1]])


def without(edges: dict[str, dict[str, int]], pairs) -> dict[str, dict[str, int]]:
    return {a: {b: n for b, n in targets.items() if (a, b) not in pairs} for a, targets in edges.items()}


def cycle_report(edges, modules, root: pathlib.Path) -> list[str]:
    """One shortest cycle per group of modules that reach each other, and the group when it holds more."""
    report = []
    for group in strongly_connected(edges):
        chain = shortest_cycle(edges, group)
        rest = f" (and the {len(group)} modules of its group: {', '.join(group)})" if len(group) > len(chain) - 1 else ""
        report.append(describe_chain(chain, edges, modules, root) + rest)
    return report


def upward_imports(edges, modules, root: pathlib.Path) -> list[str]:
    layers = layer_index()
    found = []
    for a, targets in sorted(edges.items()):
        for b, line in sorted(targets.items()):
            la, lb = layers[top_name(a)], layers[top_name(b)]
            if lb > la:
                found.append(f"{a} ({modules[a].relative_to(root)}:{line}) imports {b}: layer {top_name(a) or PACKAGE!r} "
                             f"({la}) is below {top_name(b)!r} ({lb})")
    return found


@pytest.fixture(scope="module")
def graph():
    modules = package_modules(REPO)
    return modules, import_edges(modules)


def test_every_module_has_a_layer(graph):
    modules, _ = graph
    unknown = sorted({top_name(m) for m in modules} - set(layer_index()))
    assert not unknown, f"top-level names missing from LAYERS in tests/test_imports.py (place them): {unknown}"


def test_imports_point_down(graph):
    modules, edges = graph
    found = upward_imports(without(edges, PENDING), modules, REPO)
    if found:
        pytest.fail("imports that point up the layer order:\n" + "\n".join(found), pytrace=False)


def test_no_import_cycle(graph):
    modules, edges = graph
    found = cycle_report(without(edges, PENDING), modules, REPO)
    if found:
        pytest.fail("import cycles (module-level and in-function imports):\n" + "\n".join(found), pytrace=False)


def test_pending_imports_are_still_there(graph):
    _, edges = graph
    gone = sorted(f"{a} -> {b}" for a, b in PENDING if b not in edges.get(a, {}))
    assert not gone, f"these imports are gone: delete them from PENDING in tests/test_imports.py: {gone}"


def _write_package(root: pathlib.Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_cycle_through_an_import_inside_a_function_is_found(tmp_path):
    _write_package(tmp_path, {
        "rlhf_jax/__init__.py": "",
        "rlhf_jax/models/__init__.py": "",
        "rlhf_jax/models/layers.py": "from rlhf_jax.models import lora\n",
        "rlhf_jax/models/lora.py": "import numpy\n\n\ndef build():\n    from .decoder import Decoder\n",
        "rlhf_jax/models/decoder.py": "from rlhf_jax.models.layers import Layer\nDecoder = 1\n",
        "rlhf_jax/models/plain.py": "from rlhf_jax.models import decoder\n",
    })
    modules = package_modules(tmp_path)
    edges = import_edges(modules)
    assert edges["rlhf_jax.models.lora"] == {"rlhf_jax.models.decoder": 5}
    assert cycle_report(edges, modules, tmp_path) == [
        "rlhf_jax.models.decoder (rlhf_jax/models/decoder.py:1) -> rlhf_jax.models.layers "
        "(rlhf_jax/models/layers.py:1) -> rlhf_jax.models.lora (rlhf_jax/models/lora.py:5) -> rlhf_jax.models.decoder"]


def test_an_upward_import_is_found(tmp_path):
    _write_package(tmp_path, {
        "rlhf_jax/__init__.py": "",
        "rlhf_jax/config/__init__.py": "def check():\n    import rlhf_jax.train.tasks as t\n",
        "rlhf_jax/train/__init__.py": "",
        "rlhf_jax/train/tasks.py": "from rlhf_jax import config\n",
    })
    modules = package_modules(tmp_path)
    layers = layer_index()
    assert upward_imports(import_edges(modules), modules, tmp_path) == [
        f"rlhf_jax.config (rlhf_jax/config/__init__.py:2) imports rlhf_jax.train.tasks: layer 'config' "
        f"({layers['config']}) is below 'train' ({layers['train']})"]
