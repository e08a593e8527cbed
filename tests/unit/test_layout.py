"""The layering rules of docs/design.md, held by a test: who may import what."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "p2p_diloco"
PURE = ["agreement", "outer", "rounds", "codecs", "links", "pending", "faults"]  # no network, no peer


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
        found = {m for m in imports(PACKAGE / f"{name}.py") if m.startswith("p2p_diloco.")}
        banned = [m for m in found if m.split(".")[1] in ("swarm", "peer", "round", "sync", "averaging")]
        assert not banned, (name, banned)


def test_the_round_logic_reaches_the_network_only_through_the_swarm_protocol():
    for name in ("round", "averaging", "sync", "agreement"):
        found = imports(PACKAGE / f"{name}.py")
        assert not [m for m in found if m.startswith("p2p_diloco.swarm")], name
