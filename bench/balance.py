"""Bandwidth-aware reduction: one slow peer among fast ones.

k peers on NetLab hosts, k-1 of them at --fast Mbit/s and one at --slow Mbit/s (up and down),
average a pseudo-gradient of NUMEL fp32 values --repeats times in a row. The first all-reduce has
no figures yet (equal spans); after it the peers probe each other's links (protocol/links.py; the worker
waits for the sweep before the next all-reduce) and announce what they measured, vouched for by
the others' measurements of their probes. Per all-reduce: the time, each peer's announced figure
(bytes/s) and bytes sent (a peer that reduces nothing sends exactly its own |Δ|).

Bounds, per peer i with span fraction f_i: it moves |Δ| (1 + (k-2) f_i) bytes each way, so
    equal shares:   |Δ| (1 + (k-2)/k) / slow_rate
    best possible:  the load balancer's optimum for the true rates (scipy LP, as hivemind solves it)

    .venv/bin/python bench/balance.py            # as root; about 4 minutes on 2 cores

Writes bench/results/balance.json and balance.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from allreduce import bootstrap, run_setting
from netlab import NetLab, available

HERE = Path(__file__).resolve().parent


def bound_s(k: int, numel: int, rates_mbit: list[float], fractions: list[float]) -> float:
    """The slowest peer's time to move its bytes for the given span fractions (fp32 values)."""
    return max(4 * numel * (1 + (k - 2) * f) * 8 / (r * 1e6) for r, f in zip(rates_mbit, fractions))


def best_fractions(numel: int, rates_mbit: list[float]) -> list[float]:
    from hivemind.averaging.load_balancing import load_balance_peers

    sizes = load_balance_peers(numel, [r * 1e6 / 8 for r in rates_mbit])
    return [s / numel for s in sizes]


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    times = [run["allreduce_s"] for run in result["runs"]]
    ax.bar(range(1, len(times) + 1), times, color=["C1"] + ["C0"] * (len(times) - 1))
    ax.axhline(result["bound_equal_s"], color="C1", ls=":", label="bound, equal spans")
    ax.axhline(result["bound_best_s"], color="C0", ls="--", label="bound, optimal spans")
    ax.set_xlabel("all-reduce (1: no figures yet, equal spans; then probed figures)")
    ax.set_ylabel("time (s)")
    s = result["setting"]
    ax.set_title(
        f"k = {s['k']}: {s['k'] - 1} peers at {s['fast_mbit']:g} Mbit/s, one at {s['slow_mbit']:g}; "
        f"{s['numel'] / 1e6:g}M fp32 values",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--fast", type=float, default=100.0)
    parser.add_argument("--slow", type=float, default=20.0)
    parser.add_argument("--numel", type=int, default=10_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if (why := available()) is not None:
        print(f"cannot build the network lab: {why}", file=sys.stderr)
        return 2
    rates = [args.fast] * (args.k - 1) + [args.slow]
    args.rate = args.slow  # run_setting sizes its deadlines from the slowest link
    folder = Path(tempfile.mkdtemp(prefix="balance-"))
    with NetLab([(r, r) for r in rates] + [(None, None)]) as lab:
        maddr = bootstrap(lab, args.k, folder)
        setting = run_setting(lab, maddr, args.k, "fp32", args.numel, args, folder)
    if "per_run" not in setting:
        print(f"all-reduces failed: {setting}; logs in {folder}", file=sys.stderr)
        return 1
    best = best_fractions(args.numel, rates)
    result = {
        "setting": {"k": args.k, "fast_mbit": args.fast, "slow_mbit": args.slow, "numel": args.numel, "codec": "fp32"},
        "bound_equal_s": bound_s(args.k, args.numel, rates, [1 / args.k] * args.k),
        "bound_best_s": bound_s(args.k, args.numel, rates, best),
        "best_fractions": best,
        "failed": setting["failed"],
        "runs": setting["per_run"],
    }
    for i, run in enumerate(result["runs"], 1):
        print(
            f"all-reduce {i}: {run['allreduce_s']:.1f} s, measured {run['bandwidth']}, bytes sent {run['bytes_sent']}"
        )
    print(f"bounds: equal spans {result['bound_equal_s']:.1f} s, optimal spans {result['bound_best_s']:.1f} s")
    out = HERE / "results" / "balance.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, HERE / "results" / "balance.png")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
