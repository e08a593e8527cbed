"""Compute utilisation of a swarm on emulated 100 Mbit/s links: blocking against overlapped rounds.

Two real peers (`p2p-diloco peer`), each on a host of a NetLab with --rate Mbit/s up and down, and
a bootstrap node on an unlimited host, train a 3.4M-parameter Llama (hidden 256, 4 layers) on the
embedded corpus. Utilisation = inner-compute time / wall time per peer, over the steady rounds
(the first round, which starts the swarm, and the last, after which no phase can overlap anything,
are left out; the whole-run figure is in the json too). The setting is chosen so that one round's
compute is far above the ideal transfer time of its all-reduce: 2 (k-1)/k · |Δ encoded| / rate.

Evaluation is off (it is not training), checkpoints are written every round as in any run.

    .venv/bin/python bench/utilization.py            # as root; about 8 minutes on 2 cores

Writes bench/results/utilization.json and utilization.png (--out: another name; --rate, --steps: the
setting of docs/benchmarks.md "When the link is as slow as the compute").
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path

from p2p_diloco.protocol import codecs

from netlab import NetLab, available
from netswarm import NetSwarm

HERE = Path(__file__).resolve().parent
MODEL = dict(
    model_type="llama",
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    intermediate_size=704,
    vocab_size=264,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)
MODES = {"blocking": {"swarm.overlap": "off"}, "overlapped (eager)": {"swarm.overlap": "eager"}}


def overrides(model_dir: Path, args: argparse.Namespace) -> dict[str, str]:
    return {
        "run.run_id": "utilization",
        "run.rounds": str(args.rounds),
        "run.eval_every_rounds": "0",
        "model.config_path": str(model_dir),
        "model.seq_len": "128",
        "data.num_shards": "8",
        "inner.steps": str(args.steps),
        "inner.batch_size": "16",
        "inner.micro_batch_size": "16",
        "inner.lr": "1e-3",
        "inner.warmup_steps": "10",
        "inner.precision": "fp32",
        "swarm.compression": args.codec,
        "swarm.matchmaking_time_s": "5",
        "swarm.averaging_timeout_s": "60",
    }


def utilisation(records: dict[int, dict], rounds: range) -> float:
    compute = sum(records[r]["compute_s"] for r in rounds)
    return compute / sum(records[r]["wall_s"] for r in rounds)


def run_mode(name: str, extra: dict[str, str], args: argparse.Namespace, folder: Path) -> dict:
    print(f"{name}:", flush=True)
    with NetLab([(args.rate, args.rate)] * args.peers + [(None, None)]) as lab:
        swarm = NetSwarm(lab, folder, {**overrides(folder.parent / "model", args), **extra}, bootstrap_host=args.peers)
        wall = swarm.run_peers(list(range(args.peers)), timeout_s=60 * 30)
        per_peer = []
        for host in range(args.peers):
            records = swarm.records(host)
            steady = range(2, args.rounds)
            trained = [records[r] for r in range(1, args.rounds + 1)]
            per_peer.append(
                {
                    "steady_utilisation": utilisation(records, steady),
                    "run_utilisation": sum(r["compute_s"] for r in trained) / wall,
                    "compute_s_per_round": sum(records[r]["compute_s"] for r in steady) / len(steady),
                    "blocked_s_per_round": sum(records[r].get("blocked_s", 0.0) for r in steady) / len(steady),
                    "allreduce_s_per_round": sum(records[r]["allreduce_s"] for r in steady) / len(steady),
                    "group_sizes": [records[r]["group_size"] for r in range(1, args.rounds + 1)],
                    "bytes_sent_per_round": sum(records[r]["bytes_sent"] for r in steady) / len(steady),
                }
            )
            print(
                f"  peer {host}: {per_peer[-1]['steady_utilisation']:.3f} steady, "
                f"blocked {per_peer[-1]['blocked_s_per_round']:.2f} s of {per_peer[-1]['compute_s_per_round']:.1f} s "
                f"compute per round",
                flush=True,
            )
        digests = [[swarm.records(h)[r]["digest"] for h in range(args.peers)] for r in range(args.rounds + 1)]
        return {
            "mode": name,
            "overrides": extra,
            "wall_s": wall,
            "peers": per_peer,
            "agreed_every_round": all(len(set(d)) == 1 for d in digests),
        }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    names = [m["mode"] for m in result["modes"]]
    for i, mode in enumerate(result["modes"]):
        for j, peer in enumerate(mode["peers"]):
            ax.bar(
                i + (j - 0.5) * 0.35,
                peer["steady_utilisation"] * 100,
                width=0.33,
                color=f"C{j}",
                label=f"peer {j}" if i == 0 else None,
            )
    ax.axhline(95, color="grey", ls=":", label="target blocking 95 %")
    ax.axhline(99, color="black", ls="--", lw=0.8, label="target overlapped 99 %")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylim(80, 100.5)
    ax.set_ylabel("compute utilisation, steady rounds (%)")
    s = result["setting"]
    ax.set_title(
        f"{s['peers']} peers, {s['rate_mbit']} Mbit/s links, {s['parameters'] / 1e6:.1f}M params, "
        f"H = {s['inner_steps']}, {s['codec']}",
        fontsize=9,
    )
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=100.0, help="Mbit/s up and down per peer")
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20, help="H, inner steps per round")
    parser.add_argument("--codec", default=codecs.DEFAULT)
    parser.add_argument("--out", default="utilization", help="results/<out>.json and .png")
    args = parser.parse_args()
    if (why := available()) is not None:
        print(f"cannot build the network lab: {why}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="utilization-") as tmp:
        folder = Path(tmp)
        (folder / "model").mkdir()
        (folder / "model" / "config.json").write_text(json.dumps(MODEL))
        modes = [run_mode(name, extra, args, folder / f"mode{i}") for i, (name, extra) in enumerate(MODES.items())]
    parameters = _parameters()
    encoded = codecs.get(args.codec).encoded_size(parameters)
    ideal_s = 2 * (args.peers - 1) / args.peers * encoded * 8 / (args.rate * 1e6)
    compute = min(p["compute_s_per_round"] for m in modes for p in m["peers"])
    result = {
        "setting": {
            "peers": args.peers,
            "rate_mbit": args.rate,
            "parameters": parameters,
            "inner_steps": args.steps,
            "rounds": args.rounds,
            "codec": args.codec,
            "batch": "16 x 128 tokens",
            "cpus": 2,
            "ideal_transfer_s": ideal_s,
            "compute_over_ideal_transfer": compute / ideal_s,
            "machine": platform.processor() or platform.machine(),
        },
        "modes": modes,
    }
    out = HERE / "results" / f"{args.out}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, HERE / "results" / f"{args.out}.png")
    print(f"wrote {out}; compute per round / ideal transfer = {compute / ideal_s:.2f}x")
    return 0


def _parameters() -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    return sum(
        p.numel()
        for p in LlamaForCausalLM(LlamaConfig(**{k: v for k, v in MODEL.items() if k != "model_type"})).parameters()
    )


if __name__ == "__main__":
    sys.exit(main())
