"""A joiner on a slow home link downloads the run's state (issue 25, deadlines that follow the work).

Peer a (unlimited link) trains the tiny run of tests/swarm alone and lingers with its final state;
then a joiner on a host whose download is `--mbps` Mbit/s starts and must download that state
(θ and momentum, 8 bytes a parameter: 3.8 MB here, about 31 s at 1 Mbit/s). Two runs, same lab:

    fixed    the deadline of before: the whole download within swarm.join_timeout_s (10 s here),
             obtained by swarm.min_download_mbps = 1e6 (protocol/deadlines.py then gives its floor)
    derived  swarm.min_download_mbps = 0.5: the state's size at 0.5 Mbit/s (77 s); a serving peer
             silent for join_timeout_s is still given up

Writes bench/results/slow_join.json: per run, the joiner's exit code, whether it caught up, how
long from its start, its last line. Needs root, `ip` and `tc` (bench/netlab.py).

    python bench/slow_join.py [--mbps 1]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from netlab import NetLab, available
from netswarm import CLI, ENV, ROOT, NetSwarm

sys.path.insert(0, str(ROOT))
from tests.swarm.conftest import SWARM  # noqa: E402

HERE = Path(__file__).resolve().parent
JOIN_TIMEOUT_S = "10"
RUN = {
    **{k: v for k, v in SWARM.items() if k != "swarm.host"},
    "run.run_id": "slow-join",
    "run.rounds": "3",
    "swarm.join_timeout_s": JOIN_TIMEOUT_S,
    "swarm.linger_s": "150",  # a lingers with the final state while the joiner downloads it
}
MODES = {"fixed": "1e6", "derived": "0.5"}


def start(swarm: NetSwarm, host: int, name: str, extra: dict[str, str]) -> subprocess.Popen:
    cmd = [*CLI, "peer", "--config", str(swarm.run_toml), f"--run.dir={swarm.folder / name}"]
    cmd += [f"--swarm.host={swarm.lab.hosts[host].ip}", "--initial-peers", swarm.maddr]
    cmd += [f"--{k}={v}" for k, v in extra.items()]
    log = open(swarm.folder / f"{name}.log", "w")
    return swarm.lab.popen(host, cmd, stdout=log, stderr=subprocess.STDOUT, env=ENV, cwd=ROOT)


def wait(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout_s:g} s")
        time.sleep(0.5)  # a poll interval, bounded by the deadline above


def one_run(mode: str, mbps: float, folder: Path) -> dict:
    with NetLab([(None, None), (mbps, mbps), (None, None)]) as lab:
        swarm = NetSwarm(lab, folder, RUN, bootstrap_host=2)
        a = start(swarm, 0, "a", {})
        metrics = folder / "a" / "metrics.jsonl"
        wait(lambda: metrics.exists() and '"round": 3' in metrics.read_text(), 180, "a's last round")
        began = time.monotonic()
        extra = {"swarm.min_download_mbps": MODES[mode], "swarm.linger_s": "0", "log.level": "debug"}
        joiner = start(swarm, 1, "joiner", extra)
        code = joiner.wait(timeout=300)
        took = time.monotonic() - began
        log = (folder / "joiner.log").read_text()
        lab.end(a)
    caught = "caught up with the swarm at round 3" in log
    return {
        "mode": mode,
        "min_download_mbps": float(MODES[mode]),
        "exit": code,
        "caught_up": caught,
        "joiner_s": round(took, 1),
        "failed_downloads": log.count("state download from"),
        "last_line": (log.strip().splitlines() or [""])[-1][:400],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mbps", type=float, default=1.0, help="the joiner's link, both ways")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "slow_join.json")
    parser.add_argument("--keep", type=Path, default=None, help="keep the runs' logs here")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, of " + ", ".join(MODES))
    args = parser.parse_args()
    if (why := available()) is not None:
        sys.exit(f"no lab here: {why}")
    runs = []
    with tempfile.TemporaryDirectory(prefix="slow-join-") as tmp:
        for mode in args.modes.split(","):
            runs.append(one_run(mode, args.mbps, (args.keep or Path(tmp)) / mode))
            print(json.dumps(runs[-1]), flush=True)
    result = {"joiner_link_mbps": args.mbps, "join_timeout_s": float(JOIN_TIMEOUT_S), "config": RUN, "runs": runs}
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
