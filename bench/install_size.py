"""`python bench/install_size.py`: what the bootstrap image installs, against the full package.

No docker here: the image's Python packages are what pip resolves for its two installs, the CPU
build of torch first, then `bootstrap/requirements.txt` (the node-only image) or the whole package
(the image before, and every peer). pip resolves each without installing (`--dry-run --report`);
each distribution's size is that of its files as installed in this venv, which holds the same
versions. The base image (python:3.11-slim) comes on top of both.

Writes bench/results/install_size.json.
"""

import importlib.metadata as md
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"


def resolved(*requirements: str) -> set[str]:
    """The distributions pip would install for `requirements`, by normalised name."""
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "report.json"
        command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q", "--report"]
        subprocess.run([*command, str(report), *requirements], cwd=ROOT, check=True, capture_output=True)
        found = json.loads(report.read_text())["install"]
    return {entry["metadata"]["name"].lower().replace("_", "-") for entry in found}


def installed_bytes(name: str) -> int:
    dist = md.distribution(name)
    return sum(os.path.getsize(p) for f in dist.files or [] if os.path.isfile(p := dist.locate_file(f)))


def main() -> None:
    full = resolved(TORCH, ".")
    node = resolved(TORCH, "-r", "bootstrap/requirements.txt")
    sizes = {name: installed_bytes(name) for name in full | node}
    mib = lambda names: round(sum(sizes[n] for n in names) / 2**20)  # noqa: E731
    result = {
        "full_package": {"distributions": len(full), "mib": mib(full)},
        "node_only": {"distributions": len(node), "mib": mib(node)},
        "torch_mib": mib({"torch"}),
        "left_out_mib": {n: round(sizes[n] / 2**20, 1) for n in sorted(full - node, key=lambda n: -sizes[n])},
    }
    out = ROOT / "bench" / "results" / "install_size.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
