"""The layering rules of docs/design.md, held by a test: who may import what."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "p2p_diloco"
PURE = [
    "protocol.agreement",
    "protocol.outer",
    "protocol.budget",
    "protocol.codecs",
    "protocol.links",
    "protocol.pending",
    "faults",
]  # no network, no peer


def imports(path: Path) -> set[str]:
    """Every module `path` imports, at any depth of the file (lazy imports included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def test_only_the_swarm_package_imports_hivemind():
    outside = [p for p in PACKAGE.rglob("*.py") if "swarm" not in p.relative_to(PACKAGE).parts]
    offenders = [p.name for p in outside if any(m.split(".")[0] == "hivemind" for m in imports(p))]
    assert not offenders, offenders


def test_the_pure_modules_know_nothing_of_the_network_or_the_peer():
    for name in PURE:
        found = {m for m in imports(PACKAGE / f"{name.replace('.', '/')}.py") if m.startswith("p2p_diloco.")}
        banned = [
            m
            for m in found
            if any(
                f"{m}.".startswith(f"p2p_diloco.{b}.")
                for b in ("swarm", "peer", "protocol.round", "protocol.sync", "protocol.averaging")
            )
        ]
        assert not banned, (name, banned)


def test_the_round_logic_reaches_the_network_only_through_the_swarm_protocol():
    for name in ("protocol.round", "protocol.averaging", "protocol.sync", "protocol.agreement"):
        found = imports(PACKAGE / f"{name.replace('.', '/')}.py")
        assert not [m for m in found if m.startswith("p2p_diloco.swarm")], name


def module_graph() -> dict[str, set[str]]:
    """{module: the package's modules it imports}, counting imports inside functions and under
    TYPE_CHECKING (`imports` walks the whole file)."""
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return {name: imported_modules(path, set(names)) - {name} for name, path in names.items()}


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The package's modules `path` imports: `from p2p_diloco.swarm import records` is an edge to
    `swarm.records`, not to the package `swarm` (whose __init__ imports its modules back)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            out.update(n if n in modules else node.module for n in names if n in modules or node.module in modules)
    return out


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The graph's strongly connected components of more than one module."""
    reach = {m: set() for m in graph}
    for start in graph:
        todo = list(graph[start])
        while todo:
            m = todo.pop()
            if m not in reach[start]:
                reach[start].add(m)
                todo.extend(graph[m])
    found: list[set[str]] = []
    for m in graph:
        component = {m} | {n for n in reach[m] if m in reach[n]}
        if len(component) > 1 and component not in found:
            found.append(component)
    return found


def test_no_import_cycles():
    assert cycles(module_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [{"a", "b", "c"}]
