"""What the outer optimizer and H do at the scale of bench/convergence.py: DiLoCo k = 4 alone, one
run per setting (same tokens, same shards), against that benchmark's data-parallel and
single-worker losses. The paper's outer lr 0.7 overshoots here; 0.2 is best.

    .venv/bin/python bench/convergence_sweep.py             # about 40 minutes on 2 cores
    .venv/bin/python bench/convergence_sweep.py --collect   # only re-read the runs' files and plot

Each setting writes bench/results/convergence_sweep_<tag>.json; this collects them with the
baselines into convergence_sweep.json and plots convergence_sweep.png.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
SETTINGS = {  # tag: convergence.py options
    "lr0.1": ["--outer-lr", "0.1"],
    "lr0.2": ["--outer-lr", "0.2"],
    "lr0.4": ["--outer-lr", "0.4"],
    "lr0.7": ["--outer-lr", "0.7"],
    "lr1.0": ["--outer-lr", "1.0"],
    "mu0.5": ["--outer-lr", "1.0", "--outer-momentum", "0.5"],
    "h10": ["--outer-lr", "0.7", "--steps", "10", "--rounds", "36"],
    "warmup60": ["--outer-lr", "0.2", "--warmup", "60"],
}


def collect() -> dict:
    out = (
        json.loads((RESULTS / "convergence_sweep.json").read_text())
        if (RESULTS / "convergence_sweep.json").exists()
        else {}
    )
    rows = {_key(r): r for r in out.get("runs", [])}
    for tag in SETTINGS:
        path = RESULTS / f"convergence_sweep_{tag}.json"
        if path.exists():
            j = json.loads(path.read_text())
            s, r = j["setting"], j["runs"][0]
            row = {
                "outer_lr": s["outer_lr"],
                "outer_momentum": s["outer_momentum"],
                "H": s["inner_steps"],
                "rounds": s["rounds"],
                "warmup": s.get("warmup", 20),
                "final_eval_loss": r["final_eval_loss"],
                "file": path.name,
            }
            rows[_key(row)] = row
    full = json.loads((RESULTS / "convergence.json").read_text())
    by_kind = {r["kind"]: r["final_eval_loss"] for r in full["runs"] if r["kind"] != "diloco"}
    out.update(
        {
            "what": (
                "DiLoCo k=4 on the tiny preset, the tokens of bench/convergence.py; "
                "only the outer optimizer or H changes"
            ),
            "data_parallel_4x_batch": by_kind.get("data-parallel", out.get("data_parallel_4x_batch")),
            "single_worker": by_kind.get("single", out.get("single_worker")),
            "runs": sorted(rows.values(), key=_key),
        }
    )
    return out


def _key(row: dict) -> tuple:
    return row["H"], row.get("warmup", 20), row["outer_momentum"], row["outer_lr"]


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    main = [r for r in result["runs"] if r["H"] == 30 and r["outer_momentum"] == 0.9 and r.get("warmup", 20) == 20]
    ax.plot(
        [r["outer_lr"] for r in main],
        [r["final_eval_loss"] for r in main],
        "o-",
        label="DiLoCo k=4, H=30, momentum 0.9",
    )
    for r in result["runs"]:
        if r not in main:
            ax.plot(
                [r["outer_lr"]],
                [r["final_eval_loss"]],
                "s",
                label=f"H={r['H']}, momentum {r['outer_momentum']}, warm-up {r.get('warmup', 20)}",
            )
    ax.axhline(result["data_parallel_4x_batch"], color="C3", ls="--", label="data-parallel, 4x batch")
    ax.axhline(result["single_worker"], color="grey", ls=":", label="single worker")
    ax.set_xlabel("outer lr (Nesterov)")
    ax.set_ylabel("final held-out loss")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--collect", action="store_true", help="do not run anything; collect and plot")
    parser.add_argument("--only", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    args = parser.parse_args()
    if not args.collect:
        for tag in args.only:
            subprocess.run(
                [
                    sys.executable,
                    str(HERE / "convergence.py"),
                    "--runs",
                    "diloco",
                    *SETTINGS[tag],
                    "--out",
                    f"convergence_sweep_{tag}",
                ],
                check=True,
            )
            (RESULTS / f"convergence_sweep_{tag}.png").unlink(missing_ok=True)
    result = collect()
    (RESULTS / "convergence_sweep.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, RESULTS / "convergence_sweep.png")
    for r in result["runs"]:
        print(
            f"H={r['H']} warm-up {r.get('warmup', 20)} momentum {r['outer_momentum']} outer lr {r['outer_lr']}: "
            f"{r['final_eval_loss']:.4f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
