"""The layering of docs/design.md §2, held by a test: which folder may import which, no import
cycles, and hivemind only in swarm/.

A module's place is its folder (swarm/'s subfolders are places of their own), or one of the
LEAVES: modules that import nothing of the package but other leaves, so every place may use them.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "p2p_diloco"

# The vocabulary everything shares: errors, fault points, and the names and formats that config
# validates (codecs, aggregators, organiser keys, the wire parsers).
LEAVES = {"", "errors", "faults", "protocol.codecs", "trust.robust", "trust.admission", "trust.wire"}
BASE = {"leaves", "config"}
# Who may import whom, bottom up. A place always may import itself.
ALLOWED = {
    "leaves": set(),
    "config": {"leaves"},
    "protocol": BASE,
    "trust": BASE | {"protocol"},
    "train": BASE | {"protocol"},
    "round": BASE | {"protocol", "trust", "train"},
    "observe": BASE | {"protocol", "trust", "train"},
    "swarm.transport": BASE | {"protocol", "train"},
    "swarm.trust": BASE | {"protocol", "trust", "swarm.transport"},
    "swarm.averaging": BASE | {"protocol", "trust", "train", "swarm.transport", "swarm.trust"},
    "swarm": BASE | {"protocol", "trust", "train", "swarm.transport", "swarm.trust", "swarm.averaging"},
    "peer": BASE | {"protocol", "trust", "train", "round", "observe", "swarm", "swarm.transport"},
    "demo": BASE | {"protocol", "train", "observe", "swarm", "swarm.transport"},
    "cli": BASE | {"protocol", "trust", "train", "observe", "peer", "demo", "swarm", "swarm.transport", "swarm.trust"},
}
PLACES = sorted((p for p in ALLOWED if p not in ("leaves",)), key=len, reverse=True)  # longest prefix first


def place(module: str) -> str:
    """The place of `module` (dotted, without the leading p2p_diloco)."""
    if module in LEAVES:
        return "leaves"
    return next(p for p in PLACES if module == p or module.startswith(f"{p}."))


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


def module_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """{module: the package's modules it imports}, counting imports inside functions and under
    TYPE_CHECKING (`imports` walks the whole file). Names are dotted, p2p_diloco included."""
    names = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return {name: imported_modules(path, set(names)) - {name} for name, path in names.items()}


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The package's modules `path` imports: `from p2p_diloco.swarm.trust import records` is an
    edge to `swarm.trust.records`, not to the package `swarm.trust`."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            out.update(n if n in modules else node.module for n in names if n in modules or node.module in modules)
    return out


def back_arrows(graph: dict[str, set[str]], place_of=place) -> list[tuple[str, str]]:
    """The imports that go against ALLOWED: (importer, imported)."""
    out = []
    for module, found in graph.items():
        mine = place_of(short(module))
        out += [(module, m) for m in found if place_of(short(m)) not in ALLOWED[mine] | {mine}]
    return sorted(out)


def short(module: str) -> str:
    return module.removeprefix("p2p_diloco").removeprefix(".")


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


def test_every_import_follows_the_folders_rules():
    assert back_arrows(module_graph()) == []


def test_no_import_cycles():
    assert cycles(module_graph()) == []


def test_only_the_swarm_package_imports_hivemind():
    outside = [p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] != "swarm"]
    offenders = [p.name for p in outside if any(m.split(".")[0] == "hivemind" for m in imports(p))]
    assert not offenders, offenders


def test_the_top_level_keeps_the_entry_points_and_what_everything_shares():
    top = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert top == ["__init__", "cli", "config", "demo", "errors", "faults", "peer"]
    assert all(place(short(m)) for m in module_graph())  # every module has a place


def test_the_rules_find_a_back_arrow_and_a_cycle():
    graph = {"p2p_diloco.protocol.a": {"p2p_diloco.round.b"}, "p2p_diloco.round.b": {"p2p_diloco.protocol.a"}}
    assert back_arrows(graph) == [("p2p_diloco.protocol.a", "p2p_diloco.round.b")]
    assert cycles(graph) == [set(graph)]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}) == [{"a", "b", "c"}]
