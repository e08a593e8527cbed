"""The CPU figure of docs/benchmarks.md: the embedded default run (peers/cpu.toml), DiLoCo k = 1 against plain AdamW.

Plain AdamW is the same run with the outer step made a no-op: outer lr 1, momentum 0, no Nesterov
gives θ(r+1) = θ(r) − Δ = θ_i, so the inner model just keeps training. Same seed, same data, same
tokens. Writes bench/results/cpu_run.json and bench/results/cpu_run.png.

    python bench/cpu_run.py            # about 6 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from p2p_diloco import config
from p2p_diloco.peer import Peer
from p2p_diloco.train.metrics import MetricsLog, setup_logging

HERE = Path(__file__).resolve().parent
PROFILE = HERE.parent / "peers" / "cpu.toml"
RUNS = {
    "DiLoCo k=1 (outer Nesterov lr 0.7, mu 0.9)": {},
    "plain AdamW (outer step = identity)": {"outer.lr": "1.0", "outer.momentum": "0.0", "outer.nesterov": "false"},
}


def run(name: str, overrides: dict[str, str], folder: Path, extra: dict[str, str]) -> dict:
    cfg = config.load(PROFILE, {**overrides, **extra, "run.dir": str(folder), "log.progress": "false"})
    started = time.perf_counter()
    peer = Peer(cfg)
    try:
        peer.run()
    finally:
        peer.close()
    wall = time.perf_counter() - started
    records = list(MetricsLog(folder / "metrics.jsonl").records())
    compute = sum(r.get("compute_s", 0.0) for r in records)
    return {
        "name": name,
        "overrides": overrides,
        "fingerprint": cfg.fingerprint(),
        "wall_s": round(wall, 1),
        "compute_utilisation": round(compute / wall, 3),
        "final_eval_loss": records[-1]["eval_loss"],
        "rounds": [
            {k: r.get(k) for k in ("round", "total_tokens", "train_loss", "eval_loss", "digest")} for r in records
        ],
    }


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for res in results:
        rounds = [r for r in res["rounds"] if r["eval_loss"] is not None]
        ax.plot(
            [r["total_tokens"] or 0 for r in rounds], [r["eval_loss"] for r in rounds], marker=".", label=res["name"]
        )
    ax.set_xlabel("training tokens")
    ax.set_ylabel("held-out loss (nats/byte)")
    ax.set_title("peers/cpu.toml: tiny Llama (0.47M) on the stdlib corpus, 2-core CPU")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, help="fewer rounds for a quick check")
    args = parser.parse_args()
    extra = {"run.rounds": str(args.rounds)} if args.rounds else {}
    setup_logging("warning")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, overrides) in enumerate(RUNS.items()):
            results.append(run(name, overrides, Path(tmp) / f"run{i}", extra))
            print(f"{name}: held-out loss {results[-1]['final_eval_loss']:.4f} in {results[-1]['wall_s']} s")
    out = {
        "benchmark": "cpu_run",
        "profile": "peers/cpu.toml",
        "machine": {"cpus": torch.get_num_threads(), "python": platform.python_version(), "torch": torch.__version__},
        "runs": results,
    }
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "cpu_run.json").write_text(json.dumps(out, indent=1) + "\n")
    plot(results, HERE / "results" / "cpu_run.png")
    print(f"wrote {HERE / 'results' / 'cpu_run.json'} and cpu_run.png")


if __name__ == "__main__":
    main()
