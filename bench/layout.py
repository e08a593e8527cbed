"""The package's floor plan, measured: modules, folders, import cycles, imports against the
layering rules (back-arrows), the largest class and function, and how often other modules reach
into the peer.

    python bench/layout.py [--tree PATH ...] [--label NAME ...]

Each `--tree` is a checkout (default: this one); `git worktree add /tmp/old <commit>` gives an
older one. The rules are tests/unit/test_layout.py's. A tree of the flat layout (before the
folders) is judged by where each of its modules lives now (FLAT_TO_NOW). Writes
bench/results/layout.json.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.unit.test_layout import back_arrows, cycles, module_graph, place, short  # noqa: E402

# Where each module of the flat layout (up to 4ba80be) lives now.
FLAT_TO_NOW = {
    **{m: f"protocol.{m}" for m in ("agreement", "deadlines", "genesis", "links", "network", "outer", "pending")},
    **{m: f"round.{m}" for m in ("averaging", "joining", "sync", "replica")},
    **{"round": "round.driver", "rounds": "protocol.budget", "codecs": "protocol.codecs"},
    **{m: f"train.{m}" for m in ("inner", "model", "data", "prefetch", "dataparallel", "fsdp", "ranks")},
    **{m: f"train.{m}" for m in ("follower", "checkpoint", "metrics", "sinks")},
    **{m: f"trust.{m}" for m in ("admission", "audit", "robust", "wire")},
    **{"export": "observe.export", "card": "observe.card", "evaluate": "observe.evaluate", "web": "observe.web"},
    **{"observe": "observe.service", "observatory": "observe.run_view", "swarm.observer": "swarm.run_reader"},
    **{f"swarm.{m}": f"swarm.transport.{m}" for m in ("node", "processes", "stacks", "streams", "in_use")},
    **{f"swarm.{m}": f"swarm.transport.{m}" for m in ("identity", "entry")},
    **{f"swarm.{m}": f"swarm.averaging.{m}" for m in ("averager", "allreduce", "step", "probes", "auditor")},
    **{f"swarm.{m}": f"swarm.averaging.{m}" for m in ("ledger", "gathered", "evidence", "served")},
    **{f"swarm.{m}": f"swarm.trust.{m}" for m in ("doors", "gate", "convictions", "records")},
}


def now_place(module: str) -> str:
    """The place of a module of either layout, by where it lives now."""
    name = short(module)
    return place(FLAT_TO_NOW.get(name, name))


def largest(package: Path, kind: type) -> tuple[int, str]:
    """(lines, name) of the longest class or function definition in the package."""
    best = (0, "")
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, kind) or (kind is ast.FunctionDef and isinstance(node, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                best = max(best, (lines, f"{path.relative_to(package).as_posix()}:{node.name}"))
    return best


def reaches_into_peer(package: Path) -> dict[str, int]:
    """Attribute reads and writes `peer.x` / `self.peer.x` outside the peer's own module, by module:
    the parts a peer hands itself to. A name `peer` that is not the Peer (a peer id in a loop)
    counts too, so the figure is an upper bound; 0 is exact."""
    counts: dict[str, int] = {}
    for path in package.rglob("*.py"):
        if path.name == "peer.py" and path.parent == package:
            continue
        n = sum(1 for node in ast.walk(ast.parse(path.read_text())) if _is_peer_reach(node))
        if n:
            counts[path.relative_to(package).as_posix()] = n
    return counts


def _is_peer_reach(node: ast.AST) -> bool:
    if not isinstance(node, ast.Attribute):
        return False
    value = node.value
    if isinstance(value, ast.Attribute) and value.attr == "peer" and isinstance(value.value, ast.Name):
        return value.value.id == "self"
    return isinstance(value, ast.Name) and value.id == "peer" and _holds_a_peer(node)


def _holds_a_peer(node: ast.Attribute) -> bool:
    # The attributes the Peer had that a string or a record never has.
    return node.attr in {"state", "config", "swarm", "log", "trainer", "sync", "totals", "phase", "metrics", "save"}


def measure(tree: Path) -> dict:
    package = tree / "p2p_diloco"
    graph = module_graph(package)
    top = sorted(p.stem for p in package.glob("*.py"))
    folders = sorted({p.parent.relative_to(package).as_posix() for p in package.rglob("*.py")} - {"."})
    reaches = reaches_into_peer(package)
    return {
        "modules": len(graph),
        "top_level_modules": len(top),
        "top_level": top,
        "folders": folders,
        "imports": sum(len(found) for found in graph.values()),
        "cycles": [sorted(short(m) for m in c) for c in cycles(graph)],
        "back_arrows": [[short(a), short(b)] for a, b in back_arrows(graph, now_place)],
        "largest_class": largest(package, ast.ClassDef),
        "largest_function": largest(package, ast.FunctionDef),
        "reaches_into_peer": sum(reaches.values()),
        "reaches_by_module": reaches,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", type=Path, help="a checkout (repeat); default: this one")
    parser.add_argument("--label", action="append", help="a name for each --tree (e.g. its commit)")
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/layout.json")
    args = parser.parse_args()
    trees = args.tree or [REPO]
    labels = args.label or [t.name for t in trees]
    results = {label: measure(tree.resolve()) for label, tree in zip(labels, trees, strict=True)}
    for label, r in results.items():
        print(
            f"{label}: {r['modules']} modules ({r['top_level_modules']} at the top, {len(r['folders'])} folders), "
            f"{len(r['cycles'])} cycles, {len(r['back_arrows'])} back-arrows, largest class {r['largest_class']}, "
            f"largest function {r['largest_function']}, {r['reaches_into_peer']} reaches into the peer"
        )
    args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
