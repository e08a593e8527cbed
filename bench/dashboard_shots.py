"""`python bench/dashboard_shots.py`: the dashboard of a real certified run, mid-run and at its end,
with one peer revoked, as an organiser sees it (the README's and docs/observer.md's screenshots).

The organiser makes a run key, signs the run config and admits three peers and the bootstrap node
(whose observer then downloads and evaluates the agreed state every 5 rounds, the last included).
A bootstrap node with `--observe-port` and three peer processes train ROUNDS rounds of the tiny
preset on 127.0.0.1; after round REVOKE_AT the organiser revokes c with `admission revoke`. Headless
Chromium draws the page at round MID and once a and b finished. Writes docs/dashboard-mid.png,
docs/dashboard.png and bench/results/dashboard_run.json (the API's view at the end). About 3
minutes on 2 cores. Everything it starts is ended on exit, by process group.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from p2p_diloco import config
from p2p_diloco.swarm.transport.identity import peer_id_of
from p2p_diloco.trust import admission

from lab import CLI, ENV, ROOT, TINY_FIXED_H

ROUNDS, MID, REVOKE_AT = 30, 12, 16
RUN = {
    **TINY_FIXED_H,
    "run.run_id": "dashboard-demo",
    "run.rounds": str(ROUNDS),
    "swarm.host": "127.0.0.1",
    "swarm.linger_s": "30",  # the final state is served after the end: the observer evaluates it
    "log.progress": "false",
}
BROWSER = shutil.which("chromium") or shutil.which("chromium-browser") or "chromium"


def organiser(folder: Path, names: list[str]) -> dict[str, str]:
    """The run's signed config (run.toml) and a certificate per identity (<name>.cert)."""
    public = admission.make_run_key(folder / "run.key")
    run = {**RUN, "admission.mode": "certified", "admission.organiser_key": public}
    cfg = config.load(None, run)
    signed = admission.sign_config(folder / "run.key", cfg.run.run_id, public, cfg.fingerprint())
    run["admission.config_signature"] = signed.signature
    config.save(config.load(None, run), folder / "run.toml")
    key = admission.load_run_key(folder / "run.key")
    for name in names:
        cert = admission.issue(key, cfg.run.run_id, peer_id_of(folder / f"{name}.key"), name, 2_000_000_000)
        (folder / f"{name}.cert").write_text(cert.to_json())
    return run


def start(folder: Path, name: str, args: list[str], procs: list[subprocess.Popen]) -> subprocess.Popen:
    log = open(folder / f"{name}.log", "w")
    proc = subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE if name == "entry" else log, stderr=log,
                            text=True, env=ENV, start_new_session=True)  # fmt: skip
    procs.append(proc)
    return proc


def rounds_done(folder: Path, name: str) -> int:
    path = folder / name / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return max((json.loads(line)["round"] for line in lines if line.endswith("}")), default=-1)


def wait(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:g} s")
        time.sleep(0.5)  # a poll, bounded by the deadline


def api(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url + "api/v1/run", timeout=10).read())


def screenshot(url: str, out: Path) -> None:
    cmd = [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1280,1700"]
    subprocess.run([*cmd, "--virtual-time-budget=6000", f"--screenshot={out}", url], capture_output=True, timeout=120)
    print(f"wrote {out}", flush=True)


def run(folder: Path, procs: list[subprocess.Popen]) -> None:
    peers = ["a", "b", "c"]
    organiser(folder, [*peers, "entry"])
    toml = str(folder / "run.toml")
    node = ["bootstrap", "--identity", str(folder / "entry.key"), "--host", "127.0.0.1", "--port", "0"]
    node += ["--config", toml, "--observe-port", "0", "--observe-poll-s", "2", "--observe-eval-every", "5"]
    entry = start(folder, "entry", [*node, "--certificate", str(folder / "entry.cert")], procs)
    lines = [entry.stdout.readline() for _ in range(3)]
    maddr = lines[1].split()[1]
    url = re.search(r"dashboard (http://\S+/)", lines[2]).group(1)
    for name in peers:
        options = {
            "swarm.identity_path": str(folder / f"{name}.key"),
            "admission.certificate": str(folder / f"{name}.cert"),
        }
        options["run.dir"] = str(folder / name)
        start(folder, name, ["peer", "--config", toml, *[f"--{k}={v}" for k, v in options.items()],
                             "--initial-peers", maddr], procs)  # fmt: skip
    wait(lambda: rounds_done(folder, "a") >= MID, 600, f"round {MID}")
    screenshot(url, ROOT / "docs" / "dashboard-mid.png")
    wait(lambda: rounds_done(folder, "a") >= REVOKE_AT, 600, f"round {REVOKE_AT}")
    revoke = ["admission", "revoke", "--key", str(folder / "run.key"), "--config", toml, "--folder", str(folder)]
    revoke += ["--peer-id", peer_id_of(folder / "c.key"), "--reason", "ran a modified client", "--initial-peers", maddr]
    print(subprocess.run([*CLI, *revoke], capture_output=True, text=True, env=ENV, timeout=120).stdout.strip())
    wait(lambda: all(p.poll() is not None for p in procs[1:3]), 900, "a and b finish")
    # the peers linger 30 s serving the final state: the observer evaluates it meanwhile
    wait(lambda: api(url)["run"]["eval_round"] == ROUNDS, 30, "the observer's evaluation of the last round")
    screenshot(url, ROOT / "docs" / "dashboard.png")
    view = api(url)
    out = ROOT / "bench" / "results" / "dashboard_run.json"
    out.write_text(json.dumps(view, indent=1) + "\n")
    print(f"wrote {out}: rounds {len(view['rounds'])}, eval round {view['run']['eval_round']}")


def main() -> None:
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as folder:
        try:
            run(Path(folder), procs)
        finally:
            for proc in procs:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


if __name__ == "__main__":
    main()
