"""All-reduce time against the butterfly bound, on emulated internet links (bench/netlab.py).

For k peers and each codec: k real peers (bench/allreduce_worker.py), each in a network namespace
of its own with `--rate` Mbit/s up and down, average a random pseudo-gradient of NUMEL fp32 values
`--repeats` times. The time of one all-reduce is the slowest member's; the bound is

    2 (k - 1) / k · bytes_on_wire / rate,    bytes_on_wire = one peer's Δ after encoding,

with bytes_on_wire = NUMEL · the codec's bytes per value (p2p_diloco/protocol/codecs.py). Ethernet and TCP/IP
headers (1514 bytes per 1448 of payload) and libp2p framing are not in the bound, so a perfect run
scores ~1.05. With `--up` and `--down` (a home link), the slower direction's rate. The all-reduce
of a real run includes the audit of the other reducers (swarm/averaging/auditor.py), which the bound
leaves out: `ratio` is the whole all-reduce's, `butterfly_ratio` the butterfly's alone, and
`audit_median_s` and `audit_bytes_per_peer` what the audit cost. Two checks of what really
travelled, per value of Δ, in the same units (bytes_on_wire / NUMEL): `wire_bytes_per_value` from
each peer's veth counters (which count one header per GSO packet of up to 64 KiB: ~0.5 % above
the payload; the audit's bytes included), and `reported_bytes_per_value` from the bytes_sent that
p2p_diloco/swarm/averaging/allreduce.py reports (the butterfly's only).

    .venv/bin/python bench/allreduce.py                   # as root; k = 2, 4, 8; all codecs; ~13 min here
    .venv/bin/python bench/allreduce.py --ks 2 4 --codecs fp32 scaled-fp16 --repeats 3
    .venv/bin/python bench/allreduce.py --ks 4 --codecs fp32 --up 10 --down 50 --numel 2.5e6 --repeats 12 \
        --out bench/results/allreduce_home    # a home link: 10 Mbit/s up, 50 down
    .venv/bin/python bench/allreduce.py --ks 4 --codecs int8 --aggregators mean clip centered-clip trimmed-mean \
        --out bench/results/allreduce_aggregators    # what robust reduction costs (issue 14)
    .venv/bin/python bench/allreduce.py --ks 4 --codecs fp32 int8 --rate 20 --numel 5e6 --rtt-ms 0 20 80 \
        --out bench/results/allreduce_rtt    # the same links with round trips of 20 and 80 ms (bench/delaylink.py)

The hosts' TCP runs cubic (`--cc`), most volunteers' default (Linux, Windows and macOS). This
machine's is bbr, which the labs inherited until session 35: on the connections p2pd keeps between
all-reduces, an all-reduce after the first took 1.0-1.5 s longer under bbr (docs/benchmarks.md,
"The lab's congestion control").

Writes bench/results/allreduce.json and allreduce.png. Needs root (namespaces). On a 2-core
machine the CPUs, not the links, limit all-reduce above a few hundred Mbit/s in total; timings are
noisy when anything else runs. A codec the config does not know is skipped with a note.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from p2p_diloco import config
from p2p_diloco.errors import ConfigError
from p2p_diloco.protocol import links
from p2p_diloco.swarm.transport import leftovers

if __package__:  # imported as bench.allreduce (the tests)
    from .netlab import NetLab, available, line_reader, namespaces, next_line
    from .pacing import pace_tree
    from .uplinks import Uplinks, busy_share, timeline, used_share
else:  # run as a script, bench/ on sys.path
    from pacing import pace_tree
    from uplinks import Uplinks, busy_share, timeline, used_share

    from netlab import NetLab, available, line_reader, namespaces, next_line

ROOT = Path(__file__).resolve().parents[1]
SUBNET_PREFIX = "10.201."  # the lab's addresses (bench/netlab.py)
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}  # k peers share 2 cores
CODECS = ["fp32", "scaled-fp16", "bf16", "int8", "int4", "int2"]
# p2p_diloco/protocol/codecs.py: int8 has one fp32 scale per 128 values, int4 one per 64
NOMINAL_BYTES_PER_VALUE = {
    "fp32": 4,
    "scaled-fp16": 2,
    "bf16": 2,
    "int8": 1 + 4 / 128,
    "int4": 0.5 + 4 / 64,
    "int2": 0.25 + 4 / 128,
}
MATCHMAKING_S = 5  # the worker's swarm.matchmaking_time_s


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=100, help="each peer's upload and download, Mbit/s")
    p.add_argument("--up", type=float, help="each peer's upload, Mbit/s (default: --rate)")
    p.add_argument("--down", type=float, help="each peer's download, Mbit/s (default: --rate)")
    p.add_argument("--numel", type=float, default=25e6, help="values in the pseudo-gradient (fp32)")
    p.add_argument("--numel-k8", type=float, default=10e6, help="values when k >= 8 (8 peers on 2 cores)")
    p.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8], help="group sizes")
    p.add_argument("--codecs", nargs="+", default=CODECS, help="pseudo-gradient codecs (swarm.compression)")
    p.add_argument("--aggregators", nargs="+", default=["clip"], help="how reducers combine parts (swarm.aggregator)")
    p.add_argument("--repeats", type=int, default=3, help="all-reduces per setting; the median is reported")
    p.add_argument("--quic", action="store_true", help="the workers also listen on QUIC (swarm.quic)")
    p.add_argument(
        "--rtt-ms",
        type=float,
        nargs="+",
        default=[0.0],
        help="round trips between peers to measure at, ms (bench/delaylink.py: a quarter each way at each peer)",
    )
    p.add_argument(
        "--timeline", action="store_true", help="keep each host's uplink, kB per 0.1 s, in the results (uplink_kB)"
    )
    p.add_argument(
        "--no-forwarders",
        action="store_true",
        help="at a round trip of 0, plain veths without bench/delaylink.py (whose per-frame CPU this machine shares)",
    )
    p.add_argument(
        "--pace",
        type=float,
        help="cap each of a worker's TCP connections at PACE x its upload / (k - 1) (bench/pacing.py)",
    )
    p.add_argument(
        "--cc", default="cubic", help="the hosts' TCP congestion control (bench/netlab.py; this machine's: bbr)"
    )
    p.add_argument(
        "--parts-per-member",
        type=int,
        help="the workers' protocol.links.PARTS_PER_MEMBER (how finely a vector under 2 MiB a member is cut)",
    )
    p.add_argument(
        "--averaging-timeout", type=float, help="the workers' swarm.averaging_timeout_s (default: 5x the bound, >= 60)"
    )
    p.add_argument(
        "--out", default=str(ROOT / "bench" / "results" / "allreduce"), help="path of the .json/.png, no suffix"
    )
    args = p.parse_args()
    args.up, args.down = args.up or args.rate, args.down or args.rate
    return args


def known_codecs(codecs: list[str]) -> list[str]:
    usable = []
    for codec in codecs:
        try:
            config.load(None, {"swarm.compression": codec})
            usable.append(codec)
        except ConfigError as e:
            print(f"skipping codec {codec}: {e}", flush=True)
    return usable


def bootstrap(lab: NetLab, host: int, folder: Path) -> str:
    """A bootstrap node in the lab; returns its multiaddr."""
    proc = lab.popen(
        host,
        [
            sys.executable,
            "-m",
            "p2p_diloco.cli",
            "bootstrap",
            "--host",
            lab.hosts[host].ip,
            "--port",
            "0",
            "--identity",
            str(folder / "bootstrap.key"),
        ],
        stdout=subprocess.PIPE,
        stderr=open(folder / "bootstrap.log", "w"),
        text=True,
        env=ENV,
        cwd=ROOT,
    )
    lines = line_reader(proc)
    deadline = time.monotonic() + 60
    while True:  # the node prints a heading, then its address as soon as it is up
        line = next_line(lines, max(0.0, deadline - time.monotonic()), "bootstrap node's address").strip()
        if line.startswith("--initial-peers"):
            return line.split()[1]


def bound_s(k: int, wire_bytes: float, up_mbit: float, down_mbit: float | None = None) -> float:
    """Butterfly all-reduce: each peer sends and receives 2 (k - 1) / k of one encoded Δ, at its
    upload and download rates: the slower direction bounds it."""
    return 2 * (k - 1) / k * wire_bytes * 8 / (min(up_mbit, down_mbit or up_mbit) * 1e6)


def run_setting(
    lab: NetLab, maddr: str, k: int, codec: str, numel: int, args: argparse.Namespace, folder: Path, aggregator: str
) -> dict:
    """k workers, `args.repeats` all-reduces; every member must hold the same bytes after each."""
    # The swarm's averaging deadline: generous, this measures the all-reduce, it does not police it.
    name = f"k{k}-{codec}-{aggregator}-rtt{lab.hosts[0].delay_ms * 4:g}"  # its workers' folders and logs
    timeout_s = args.averaging_timeout or max(
        60.0, 5 * bound_s(k, numel * NOMINAL_BYTES_PER_VALUE[codec], args.up, args.down)
    )
    workers = [
        lab.popen(
            i,
            [
                sys.executable,
                str(ROOT / "bench" / "allreduce_worker.py"),
                maddr,
                lab.hosts[i].ip,
                str(i),
                str(k),
                codec,
                str(numel),
                str(folder / f"{name}-w{i}"),
                str(timeout_s),
                aggregator,
                "quic" if args.quic else "tcp",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**ENV, "PARTS_PER_MEMBER": str(args.parts_per_member or "")},
            cwd=ROOT,
            stderr=open(folder / f"{name}-w{i}.log", "w"),
        )
        for i in range(k)
    ]
    outs = [line_reader(w) for w in workers]
    try:
        for i, out in enumerate(outs):
            if (line := next_line(out, 120, f"worker {i} ready")) != "ready":
                raise RuntimeError(f"worker {i} printed {line!r}")
        deadline_s = timeout_s + 3 * MATCHMAKING_S + 30
        runs = [one_allreduce(lab, workers, outs, deadline_s, args) for _ in range(args.repeats)]
        tcp_peers = tcp_peers_of(lab, 0)
    except RuntimeError as e:  # a worker died or fell silent: note it and go on with the next setting
        print(f"  setting abandoned: {e}; see {folder}/{name}-w*.log", flush=True)
        return {"k": k, "codec": codec, "numel": numel, "up_mbit": args.up, "down_mbit": args.down, "error": str(e)}
    finally:
        for w in workers:  # EOF on stdin: the worker leaves the swarm; then its process group ends
            w.stdin.close()
        for w in workers:
            lab.end(w, grace_s=20)
    summary = summarize(k, codec, numel, (args.up, args.down), runs)
    parts = args.parts_per_member or links.PARTS_PER_MEMBER
    return {
        **summary,
        "aggregator": aggregator,
        "quic": args.quic,
        "parts_per_member": parts,
        "tcp_peers_of_host0": tcp_peers,
    }


def tcp_peers_of(lab: NetLab, host: int) -> list[str]:
    """The lab addresses host `host` holds established TCP connections to (the workers', over QUIC,
    should not be among them; the bootstrap node's DHT connection is)."""
    out = subprocess.run(
        ["ip", "netns", "exec", lab.hosts[host].netns, "ss", "-tnH", "state", "established"],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    peers = {line.split()[-1].rsplit(":", 1)[0] for line in out.splitlines() if line.strip()}
    return sorted(p for p in peers if p.startswith(SUBNET_PREFIX))


def cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of this machine's CPUs since boot (/proc/stat): every peer of the lab
    shares them, so their busy share during an all-reduce says whether it waited on the links or
    on the CPUs."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle and iowait
    return sum(fields) - idle, sum(fields)


def one_allreduce(lab: NetLab, workers: list, outs: list, timeout_s: float, args: argparse.Namespace) -> dict:
    sent_before = [lab.link_bytes(i)[0] for i in range(len(workers))]
    busy_before, total_before = cpu_ticks()
    if args.pace:
        paced = sum(pace_tree(w.pid, int(args.pace * args.up * 1e6 / 8 / (len(workers) - 1))) for w in workers)
        print(f"  {paced} TCP sockets paced", flush=True)
    uplinks = Uplinks([w.pid for w in workers]).start()
    for w in workers:
        w.stdin.write("go\n")
        w.stdin.flush()
    try:
        replies = [json.loads(next_line(out, timeout_s, f"worker {i} result")) for i, out in enumerate(outs)]
    finally:
        samples = uplinks.stop()
    errors = [r["error"] for r in replies if "error" in r]
    if not errors and {r["group"] for r in replies} != {len(workers)}:
        errors = [f"group sizes {[r['group'] for r in replies]}"]
    if not errors and len({r["sha256"] for r in replies}) != 1:
        errors = ["members hold different bytes"]
    busy, total = (now - before for now, before in zip(cpu_ticks(), (busy_before, total_before)))
    if errors:
        print(f"  failed: {errors}", flush=True)
        return {"error": errors}
    run = {
        "cpu_busy": busy / max(total, 1),  # the machine's CPUs, all peers together, over the all-reduce
        "allreduce_s": max(r["allreduce_s"] for r in replies),  # the all-reduce ends with its slowest member
        "bytes_sent": [r["bytes_sent"] for r in replies],
        "butterfly_s": max(r["butterfly_s"] for r in replies),
        "audit_s": max(r["audit_s"] for r in replies),
        "audit_bytes": [r["audit_bytes"] for r in replies],
        "bandwidth": [r.get("bandwidth") for r in replies],
        "link_sent": [lab.link_bytes(i)[0] - sent_before[i] for i in range(len(workers))],
        **uplink_figures(samples, replies, uplinks.started, args.up * 1e6 / 8, args.timeline),
    }
    print(f"  {run['allreduce_s']:.2f} s, the CPUs {100 * run['cpu_busy']:.0f} % busy", flush=True)
    return run


def uplink_figures(samples: list, replies: list[dict], started: float, up_bps: float, keep_timeline: bool) -> dict:
    """Where each member's uplink stood idle: its butterfly's window on the sampler's clock (it ends
    where the audit begins, which ends the all-reduce), the share of it in which the uplink ran at
    >= 90 % of its rate, the mean utilisation over it, and with `keep_timeline` the samples (kB per
    interval, per host)."""
    windows = []
    for r in replies:
        end = r["ended_at"] - r["audit_s"] - started
        windows.append((round(end - r["butterfly_s"], 2), round(end, 2)))
    figures = {
        "butterfly_window_s": windows,
        "uplink_busy": [busy_share(samples, i, up_bps, window) for i, window in enumerate(windows)],
        "uplink_used": [used_share(samples, i, up_bps, window) for i, window in enumerate(windows)],
    }
    return {**figures, "uplink_kB": timeline(samples)} if keep_timeline else figures


def summarize(k: int, codec: str, numel: int, rate: tuple[float, float], runs: list[dict]) -> dict:
    ok = [r for r in runs if "error" not in r]
    out = {
        "k": k,
        "codec": codec,
        "numel": numel,
        "up_mbit": rate[0],
        "down_mbit": rate[1],
        "runs": len(runs),
        "failed": len(runs) - len(ok),
        "failures": [str(r["error"])[:600] for r in runs if "error" in r],
        "nominal_bytes_per_value": NOMINAL_BYTES_PER_VALUE[codec],
    }
    if not ok:
        return out

    def per_value(sent: str) -> float:
        """Bytes of one encoded Δ per value: a peer sends 2 (k - 1) / k of it on average, whatever the spans."""
        return statistics.median(statistics.mean(r[sent]) for r in ok) * k / (2 * (k - 1)) / numel

    times = [r["allreduce_s"] for r in ok]
    bound = bound_s(k, numel * NOMINAL_BYTES_PER_VALUE[codec], *rate)
    butterfly = statistics.median(r["butterfly_s"] for r in ok)
    return {
        **out,
        # the butterfly alone against the bound, and the audit that follows it, apart
        "butterfly_ratio": butterfly / bound,
        "audit_median_s": statistics.median(r["audit_s"] for r in ok),
        "cpu_busy_median": statistics.median(r["cpu_busy"] for r in ok),
        "audit_bytes_per_peer": statistics.median(statistics.mean(r["audit_bytes"]) for r in ok),
        "wire_bytes_per_value": per_value("link_sent"),
        "reported_bytes_per_value": per_value("bytes_sent"),
        "times_s": times,
        "median_s": statistics.median(times),
        "bound_s": bound,
        "ratio": statistics.median(times) / bound,
        "per_run": ok,
    }


def plot(results: list[dict], path: Path, up: float, down: float) -> None:
    """Time and ratio per group size k, or per round trip where several were measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    by_rtt = len({r.get("rtt_ms", 0.0) for r in results}) > 1
    x_of = (lambda r: r.get("rtt_ms", 0.0)) if by_rtt else (lambda r: r["k"])

    def setting(r: dict) -> tuple[str, str]:
        return r["codec"], r.get("aggregator", "clip")

    settings = dict.fromkeys(setting(r) for r in results)
    for key in settings:
        rows = [r for r in results if setting(r) == key and "median_s" in r]
        xs = [x_of(r) for r in rows]
        label = key[0] if len({a for _, a in settings}) == 1 else f"{key[0]}, {key[1]}"
        (line,) = left.plot(xs, [r["median_s"] for r in rows], "o-", label=label)
        left.plot(xs, [r["bound_s"] for r in rows], "--", color=line.get_color(), alpha=0.6)
        right.plot(xs, [r["ratio"] for r in rows], "o-", color=line.get_color(), label=label)
        right.plot(xs, [r["butterfly_ratio"] for r in rows], "s:", color=line.get_color(), alpha=0.7)
    right.axhline(1.0, color="gray", ls=":", label="bound")
    link = f"{up:g} Mbit/s" if up == down else f"{up:g} up / {down:g} down Mbit/s"
    xlabel = "round trip between peers, ms" if by_rtt else "peers k"
    left.set(xlabel=xlabel, ylabel="all-reduce time, s (dashed: bound)", title=f"time at {link} per peer")
    right.set(
        xlabel=xlabel,
        ylabel="measured / bound (dotted: the butterfly alone, no audit)",
        title="ratio to 2(k-1)/k · bytes on wire / slower rate",
    )
    right.set_ylim(bottom=0)
    numel = {r["k"]: r["numel"] for r in results}  # k = 8 may average a smaller Δ
    for ax in (left, right):
        if not by_rtt:
            ax.set_xticks(sorted(numel), [f"{k}\n{numel[k] / 1e6:g}M values" for k in sorted(numel)])
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_lab(args: argparse.Namespace, rtt_ms: float, codecs: list[str], folder: Path) -> list[dict]:
    """Every setting in one lab whose peers are `rtt_ms` apart (a round trip)."""
    results = []
    kmax = max(args.ks)
    # hosts 0..kmax-1: peers at --up/--down; host kmax: the bootstrap node, unlimited (only DHT traffic)
    delays = None if args.no_forwarders and rtt_ms == 0 else [rtt_ms / 4] * kmax + [0.0]
    with NetLab([(args.up, args.down)] * kmax + [(None, None)], delays_ms=delays, cc=args.cc) as lab:
        maddr = bootstrap(lab, kmax, folder)
        cc = lab.congestion_control()
        for k in args.ks:
            numel = int(args.numel_k8 if k >= 8 else args.numel)
            for codec in codecs:
                for aggregator in args.aggregators:
                    print(f"k={k} {codec} {aggregator} numel={numel:,} rtt={rtt_ms:g} ms", flush=True)
                    result = run_setting(lab, maddr, k, codec, numel, args, folder, aggregator)
                    results.append({**result, "rtt_ms": rtt_ms, "congestion_control": cc})
                    print(f"  -> {json.dumps(results[-1])}", flush=True)
        prefix = lab.prefix
    assert not namespaces(prefix), f"namespaces left behind: {namespaces(prefix)}"
    return results


def main() -> int:
    args = parse_args()
    if (why := available()) is not None:
        print(f"cannot build a network lab: {why}")
        return 1
    codecs = known_codecs(args.codecs)
    folder = Path(tempfile.mkdtemp(prefix="allreduce-"))
    print(f"logs in {folder}", flush=True)
    try:
        results = [result for rtt_ms in args.rtt_ms for result in run_lab(args, rtt_ms, codecs, folder)]
    finally:
        leftovers.sweep_below(folder)  # the shared memory of the workers the labs killed (leftovers.py)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "up_mbit": args.up,
        "down_mbit": args.down,
        "repeats": args.repeats,
        "cpus": os.cpu_count(),
        "note": "time: the slowest member's allreduce_s (from group formed to result); "
        "the 2-core machine was shared with other work: noisy",
    }
    # Appended, not with_suffix: a name such as allreduce_25_pace1.5 keeps its ".5" (with_suffix
    # wrote allreduce_25_pace1.json while this line said .5).
    json_path, png_path = Path(f"{out}.json"), Path(f"{out}.png")
    json_path.write_text(json.dumps({**meta, "results": results}, indent=1) + "\n")
    plot(results, png_path, args.up, args.down)
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
