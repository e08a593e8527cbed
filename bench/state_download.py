"""A joiner's state download from 1 holder against 3 at once, and a lying holder, on emulated home
links (bench/netlab.py; issue 30).

Four holders serve the same state (θ and momentum of `--numel` values each: 8 bytes a value),
each in a network namespace of its own with `--up` Mbit/s up; the third is a liar, which sends
the honest manifest but zeros for every chunk. The joiner's link is not limited.
bench/state_download_worker.py runs each. The joiner downloads, `--repeats` times each:
- `whole`: the whole state from one holder, one stream (rpc_download_state: as before issue 30);
- `chunks x1`, `chunks x2`, `chunks x3`: in chunks (rpc_download_chunk) from 1, 2 and 3 honest
  holders at once;
- `liar x3`: from two honest holders and the liar, which must be dropped after its first chunk
  (`liars`; what it cost: against `chunks x2`), the state still arriving whole.
Every download is checked against the state's digest (`ok`). `speedup` = median whole time /
median `chunks x3` time; the bound at `--up` is 3 (the joiner's link and the CPUs aside).

    .venv/bin/python bench/state_download.py                      # as root; 32 MB at 20 Mbit/s up: ~3 min
    .venv/bin/python bench/state_download.py --numel 2e6 --repeats 1

Writes bench/results/state_download.json. Needs root (namespaces). On a 2-core machine shared
with other work, timings are noisy.
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

if __package__:  # imported as bench.state_download
    from .allreduce import bootstrap
    from .netlab import NetLab, available, line_reader, namespaces, next_line
else:  # run as a script, bench/ on sys.path
    from allreduce import bootstrap
    from netlab import NetLab, available, line_reader, namespaces, next_line

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
WORKER = str(ROOT / "bench" / "state_download_worker.py")
HOLDERS = 4  # lab hosts 0-3: hosts 0, 1 and 3 honest, host 2 the liar; 4 the joiner, 5 the bootstrap node
LIAR = 2


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=float, default=4e6, help="values of θ (and of the momentum): 8 bytes each")
    p.add_argument("--up", type=float, default=20.0, help="each holder's upload, Mbit/s")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "state_download.json"))
    return p.parse_args()


def worker(lab: NetLab, host: int, args: list[str], folder: Path, name: str) -> tuple[subprocess.Popen, object]:
    proc = lab.popen(
        host,
        [sys.executable, WORKER, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=open(folder / f"{name}.log", "w"),
        text=True,
        env=ENV,
        cwd=ROOT,
    )
    return proc, line_reader(proc)


def ask(joiner: subprocess.Popen, lines, command: str, timeout_s: float) -> dict:
    joiner.stdin.write(command + "\n")
    joiner.stdin.flush()
    return json.loads(next_line(lines, timeout_s, command))


def measure(joiner, lines, ids: list[str], repeats: int, timeout_s: float) -> dict[str, list[dict]]:
    """Each download `repeats` times, in turns (a slow moment of the machine spreads over all)."""
    h0, h1, liar, h3 = ids
    commands = {
        "whole": f"whole {h0}",
        "chunks x1": f"chunks {h0}",
        "chunks x2": f"chunks {h0},{h1}",
        "chunks x3": f"chunks {h0},{h1},{h3}",
        "liar x3": f"chunks {h0},{h1},{liar}",
    }
    print(json.dumps(ask(joiner, lines, f"manifests {','.join(ids)}", timeout_s)), flush=True)
    runs: dict[str, list[dict]] = {name: [] for name in commands}
    for _ in range(repeats):
        for name, command in commands.items():
            runs[name].append(ask(joiner, lines, command, timeout_s))
            print(f"{name}: {json.dumps(runs[name][-1])}", flush=True)
    return runs


def summary(runs: dict[str, list[dict]], state_bytes: int, ids: list[str]) -> dict:
    out = {}
    for name, done in runs.items():
        seconds = statistics.median(r["s"] for r in done)
        out[name] = {"median_s": round(seconds, 2), "mbit_s": round(state_bytes * 8 / seconds / 1e6, 1), "runs": done}
    out["speedup_x3"] = round(out["whole"]["median_s"] / out["chunks x3"]["median_s"], 2)
    out["liar_dropped_every_time"] = all(r["liars"] == [ids[LIAR]] for r in runs["liar x3"])
    out["all_ok"] = all(r.get("ok") for done in runs.values() for r in done)
    return out


def main() -> int:
    args = parse_args()
    if (why := available()) is not None:
        print(f"cannot build a network lab: {why}")
        return 1
    numel = int(args.numel)
    folder = Path(tempfile.mkdtemp(prefix="state-download-"))
    print(f"logs in {folder}", flush=True)
    links = [(args.up, None)] * HOLDERS + [(None, None), (None, None)]
    joiner_host, node_host = HOLDERS, HOLDERS + 1
    with NetLab(links) as lab:
        maddr = bootstrap(lab, node_host, folder)
        holders = []
        for i in range(HOLDERS):
            lie = ["lie"] if i == LIAR else []
            holders.append(
                worker(
                    lab, i, ["holder", maddr, lab.hosts[i].ip, str(numel), str(folder / f"h{i}"), *lie], folder, f"h{i}"
                )
            )
        addrs = [next_line(lines, 120, f"holder {i} ready").split()[1] for i, (_, lines) in enumerate(holders)]
        ids = [a.rsplit("/p2p/", 1)[1] for a in addrs]
        joiner, lines = worker(
            lab,
            joiner_host,
            ["joiner", maddr, lab.hosts[joiner_host].ip, str(numel), str(folder / "j"), ",".join(addrs)],
            folder,
            "joiner",
        )
        if (line := next_line(lines, 120, "joiner ready")) != "ready":
            raise RuntimeError(f"the joiner printed {line!r}")
        timeout_s = 8 * numel * 8 / (args.up * 1e6) * 2 + 60
        runs = measure(joiner, lines, ids, args.repeats, timeout_s)
        joiner.stdin.close()
        for proc, _ in holders:
            proc.stdin.close()
        prefix = lab.prefix
    assert not namespaces(prefix), f"namespaces left behind: {namespaces(prefix)}"
    result = {
        "numel": numel,
        "state_bytes": 8 * numel,
        "holder_up_mbit": args.up,
        "joiner_link": "not limited",
        "cpus": os.cpu_count(),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "note": "median of --repeats; the 2-core machine was shared with other work: noisy",
        **summary(runs, 8 * numel, ids),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"speedup from 3 holders: {result['speedup_x3']}x; liar dropped every time: {result['liar_dropped_every_time']}"
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
