"""Bytes on the wire per peer per inner step, DiLoCo at H = 500 against data-parallel, per codec.

Two real peers on NetLab hosts (unlimited links: this counts bytes, it does not time them) train
the tiny preset (0.47M parameters) for 3 rounds of exactly H = 500 inner steps each (speed-aware
rounds off, so every peer runs H steps). Two figures per codec, per peer and inner step:

- **wire**: everything the peer's veth carried in both directions over the whole run, Ethernet and
  TCP/IP headers, libp2p framing, the DHT, heartbeats and matchmaking included;
- **payload**: the pseudo-gradient bytes the all-reduce sent and received (metrics.jsonl).

Data-parallel reference: k peers all-reducing fp32 gradients every step with a bandwidth-optimal
ring send and receive 2 (k-1)/k · 4 P bytes each way per step: 4 (k-1)/k · 4 P per peer, a lower
bound for any real data-parallel run (headers and protocol not counted), so the ratios are
conservative.

    .venv/bin/python bench/traffic.py           # as root; about 6 minutes on 2 cores

Writes bench/results/traffic.json and traffic.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from p2p_diloco.protocol import codecs

from netlab import NetLab, available
from netswarm import NetSwarm

HERE = Path(__file__).resolve().parent
PARAMETERS = 469_632  # the tiny preset (p2p-diloco prints it at start; checked against the log below)


def overrides(codec: str, args: argparse.Namespace) -> dict[str, str]:
    return {
        "run.run_id": "traffic",
        "run.rounds": str(args.rounds),
        "run.eval_every_rounds": "0",
        "model.preset": "tiny",
        "model.seq_len": "32",
        "data.num_shards": "8",
        "inner.steps": str(args.steps),
        "inner.batch_size": "4",
        "inner.micro_batch_size": "4",
        "inner.warmup_steps": "10",
        "inner.lr": "1e-3",
        "inner.precision": "fp32",
        "swarm.compression": codec,
        "swarm.speed_aware": "false",
        "swarm.matchmaking_time_s": "5",
        "swarm.averaging_timeout_s": "60",
    }


def run_codec(codec: str, args: argparse.Namespace, folder: Path) -> dict:
    with NetLab([(None, None)] * args.peers + [(None, None)]) as lab:
        swarm = NetSwarm(lab, folder, overrides(codec, args), bootstrap_host=args.peers)
        wall = swarm.run_peers(list(range(args.peers)), timeout_s=60 * 20)
        if f"{PARAMETERS:,} parameters" not in (folder / "peer0.log").read_text():
            raise RuntimeError(f"the tiny preset no longer has {PARAMETERS:,} parameters: update PARAMETERS")
        peers = []
        for host in range(args.peers):
            records = swarm.records(host)
            trained = [records[r] for r in range(1, args.rounds + 1)]
            steps = sum(r["inner_steps"] for r in trained)
            sent, received = lab.link_bytes(host)
            payload = sum(r["bytes_sent"] + r["bytes_received"] for r in trained)
            peers.append(
                {
                    "inner_steps": steps,
                    "wire_bytes": sent + received,
                    "payload_bytes": payload,
                    "wire_per_step": (sent + received) / steps,
                    "payload_per_step": payload / steps,
                    "group_sizes": [r["group_size"] for r in trained],
                }
            )
    return {"codec": codec, "wall_s": wall, "peers": peers}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    names = [c["codec"] for c in result["codecs"]]
    ax.bar(range(len(names)), [c["ratio_wire"] for c in result["codecs"]], width=0.4, label="all traffic (veth)")
    ax.bar(
        [i + 0.4 for i in range(len(names))],
        [c["ratio_payload"] for c in result["codecs"]],
        width=0.4,
        label="pseudo-gradient payload",
    )
    ax.axhline(1000, color="grey", ls=":", label="target scaled-fp16: 1000x")
    ax.axhline(2000, color="black", ls="--", lw=0.8, label="target int8: 2000x")
    ax.set_xticks([i + 0.2 for i in range(len(names))], names)
    ax.set_ylabel("data-parallel bytes / DiLoCo bytes")
    ax.set_yscale("log")
    s = result["setting"]
    ax.set_title(
        f"per peer per inner step, k = {s['peers']}, H = {s['inner_steps']}, {s['parameters']:,} params", fontsize=9
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=500, help="H")
    parser.add_argument("--codecs", nargs="+", default=list(codecs.CODECS))
    args = parser.parse_args()
    if (why := available()) is not None:
        print(f"cannot build the network lab: {why}", file=sys.stderr)
        return 2
    k = args.peers
    data_parallel = 4 * (k - 1) / k * 4 * PARAMETERS  # bytes per peer per step, both directions
    results = []
    with tempfile.TemporaryDirectory(prefix="traffic-") as tmp:
        for codec in args.codecs:
            run = run_codec(codec, args, Path(tmp) / codec)
            wire = sum(p["wire_per_step"] for p in run["peers"]) / k
            payload = sum(p["payload_per_step"] for p in run["peers"]) / k
            run.update(
                wire_per_step=wire,
                payload_per_step=payload,
                ratio_wire=data_parallel / wire,
                ratio_payload=data_parallel / payload,
            )
            print(
                f"{codec}: {wire:,.0f} B/step on the wire ({data_parallel / wire:,.0f}x below data-parallel), "
                f"{payload:,.0f} B/step payload ({data_parallel / payload:,.0f}x)",
                flush=True,
            )
            results.append(run)
    result = {
        "setting": {
            "peers": k,
            "inner_steps": args.steps,
            "rounds": args.rounds,
            "parameters": PARAMETERS,
            "data_parallel_bytes_per_step": data_parallel,
        },
        "codecs": results,
    }
    out = HERE / "results" / "traffic.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, HERE / "results" / "traffic.png")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
