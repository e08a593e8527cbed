"""The observer with a real swarm: the dashboard in a real browser, its JSON API and Prometheus
metrics against the peers' own metrics.jsonl, and `status` on a live swarm and an unreachable one."""

import json
import re
import shutil
import signal
import subprocess
import time
import urllib.request

import pytest

from p2p_diloco import config
from tests.swarm.conftest import CLI, ENV, SWARM, wait_until
from tests.swarm.procs import signal_tree

BROWSER = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
SILENT = "no heartbeat during the round (stopped, asleep or gone)"


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return answer.read()


def api(url: str) -> dict:
    return json.loads(get(url + "api/v1/run"))


def observer_url(node: subprocess.Popen) -> str:
    """The line the bootstrap node prints after its --initial-peers line."""
    line = node.stdout.readline()
    found = re.search(r"dashboard (http://\S+/)", line)
    assert found, line
    return found.group(1)


def browser_dom(url: str) -> str:
    """The page as a real browser renders it: headless Chromium, given virtual time to fetch and draw."""
    cmd = [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=8000", "--dump-dom", url]
    return subprocess.run(cmd, timeout=120, capture_output=True, text=True, check=True).stdout


def credited_by_hand(view: dict, swarm, names: dict) -> dict:
    """Each peer's verified tokens from its own metrics.jsonl: the tokens of the rounds the API
    says it was counted in, where its own record holds the round's agreed digest."""
    out = {}
    for peer, name in names.items():
        mine = swarm.records(name)
        counted = [r for r in view["rounds"] if peer in r["counted"]]
        # A peer publishes its round before it writes the round's metrics line: the sleeper may have
        # been stopped in between, so its last published round can be missing from its file.
        unlogged = [r for r in counted if r["round"] not in mine]
        assert len(unlogged) <= (1 if name == "c" else 0), (
            f"{name}: {[r['round'] for r in unlogged]} not in {sorted(mine)}"
        )
        assert all(r["round"] > max(mine) for r in unlogged), (name, sorted(mine))
        for r in counted:
            if r["round"] in mine:
                assert mine[r["round"]]["digest"] == r["digest"], (name, r["round"])
        out[peer] = sum(mine[r["round"]]["tokens"] for r in counted if r["round"] in mine)
        out[peer] += sum(r["tokens"] - sum(mine_of(swarm, q, r) for q in r["counted"] if q != peer) for r in unlogged)
    return out


@pytest.mark.timeout(300)
@pytest.mark.skipif(BROWSER is None, reason="no Chromium: .ci/run installs it with apt-get (apt-get install chromium)")
def test_the_dashboard_and_status_show_the_swarm_and_why_a_stopped_peer_is_not_counted(tmp_path):
    from tests.swarm.conftest import Swarm

    swarm, peers = Swarm(tmp_path), {}
    try:
        extra = {"run.rounds": "1000", "swarm.speed_aware": "false", "inner.steps": "6"}  # rounds of about 1.5 s
        swarm.bootstrap(observe=True, run=extra)
        url = observer_url(swarm.nodes["bootstrap"])
        peers = {name: swarm.peer(name, extra) for name in ("a", "b", "c")}
        wait_until(lambda: all(len(swarm.records(n)) >= 3 for n in peers), list(peers.values()), 120, "3 rounds each")
        signal_tree(peers["c"].pid, signal.SIGSTOP)  # c sleeps through rounds: its heartbeat stops
        wait_until(lambda: any(_silent(r, "c", swarm) for r in api(url)["rounds"]), [peers["a"]], 90, "c not counted")
        wait_until(lambda: api(url)["run"]["eval_loss"] is not None, [peers["a"]], 60, "the observer's own loss")
        dom = browser_dom(url)
        (tmp_path / "dashboard.html").write_text(dom)  # what the browser drew, kept for a failed run
        export = start_export(swarm, extra, tmp_path / "model")  # a and b serve the agreed state
        status = run_status(swarm, extra, "--run-dir", str(swarm.folder / "c"))  # meanwhile
        exported = finish_export(export, tmp_path / "model")
        for name in ("a", "b"):  # they leave; the observer's figures then stop changing (c stays asleep)
            peers[name].send_signal(signal.SIGINT)
        wait_until(lambda: all(peers[n].poll() is not None for n in "ab"), [swarm.nodes["bootstrap"]], 60, "stop")
        view, metrics = settled(url)
    finally:
        if "c" in peers:
            signal_tree(peers["c"].pid, signal.SIGKILL)  # asleep: it would not answer a Ctrl+C
        swarm.end_all()
    names = {peer["peer"]: _name_of(peer["peer"], swarm) for peer in view["peers"]}
    c = next(peer for peer, name in names.items() if name == "c")
    assert re.search(r'id="peers-online">2<', dom), dom[:2000]  # c is asleep
    assert len(re.findall(r'<tr class="contributor" data-peer="Qm', dom)) == 3  # a row per peer: each was counted
    assert re.search(
        rf'class="not-counted" data-peer="{c}"><code>{c[-8:]}</code>: not counted: {re.escape(SILENT)}', dom
    )
    assert len(re.findall(r'<tr class="round" data-round="\d', dom)) >= 5
    by_hand = credited_by_hand(view, swarm, names)
    assert {c["peer"]: c["tokens"] for c in view["contributors"]} == {p: t for p, t in by_hand.items() if t}
    for contributor in view["contributors"]:
        peer, tokens = contributor["peer"], contributor["tokens"]
        assert f'p2p_diloco_peer_verified_tokens{{run_id="p2p-diloco",peer="{peer}"}} {tokens}' in metrics
    check_own_evaluations(view, dom, swarm)
    check_export(exported, swarm, names)
    assert status[0].startswith("run 'p2p-diloco' (config ") and " of 1000" in status[0]
    assert status[1].startswith("peers online: 2 (0 in client mode)")
    # The closed round status sums up, with the observer's digest. Its count is what status saw in its
    # 3-s window: a peer whose record of that round was replaced by its next one before status read
    # it confirms nobody (2 when status saw the whole round; 0 seen once in a fresh-clone run).
    summary = re.match(r"round (\d+): digest ([0-9a-f]{12}), every peer agrees, ([0-2]) counted", status[2])
    assert summary, status
    (same,) = [r for r in view["rounds"] if r["round"] == int(summary[1])]  # a view holds the latest 200
    assert same["digest"][:12] == summary[2], status  # counts: each reader's partial view (see the note)
    assert re.match(rf"peer {c[-8:]}: [\d,]+ tokens credited in the rounds seen", status[3]), status
    assert any(line.endswith(f"not counted: {SILENT}") for line in status[4:]), status


def check_own_evaluations(view: dict, dom: str, swarm) -> None:
    """The observer's held-out loss of a round (the agreed state it downloaded and verified) is the
    loss each peer computed of its own state of that round: same batch, same code, same CPU."""
    evaluated = {r["round"]: r["eval_loss"] for r in view["rounds"] if r["eval_loss"] is not None}
    assert len(evaluated) >= 2, view["rounds"]
    for name in "ab":
        mine = swarm.records(name)
        for round_, loss in evaluated.items():
            if (
                round_ in mine
                and mine[round_]["digest"] == next(r for r in view["rounds"] if r["round"] == round_)["digest"]
            ):
                assert mine[round_]["eval_loss"] == pytest.approx(loss, rel=1e-6), (name, round_)
    assert (view["run"]["eval_round"], view["run"]["eval_loss"]) == (max(evaluated), evaluated[max(evaluated)])
    assert re.search(r'<td class="num">\d+\.\d{4}</td><td class="num">\d+\.\d{4}</td></tr>', dom)  # train, held-out


def start_export(swarm, extra: dict, out) -> subprocess.Popen:
    """`export OUT --initial-peers`: the agreed state downloaded from a peer, verified, exported."""
    toml = swarm.folder / "export.toml"
    config.save(config.load(None, {**SWARM, **extra}), toml)
    command = [*CLI, "export", str(out), "--config", str(toml), "--initial-peers", swarm.maddr, "--wait", "60"]
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, start_new_session=True
    )
    swarm.procs.append(proc)  # ended with the swarm, its DHT and p2pd too, if the test fails first
    swarm.sessions.add(proc.pid)
    return proc


def finish_export(proc: subprocess.Popen, out) -> dict:
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert re.match(r"downloaded the agreed state of round \d+ \(digest [0-9a-f]{12}\) from Qm", stdout)
    assert (out / "model.safetensors").exists() and "downloaded from peer" in (out / "README.md").read_text()
    return json.loads((out / "provenance.json").read_text())


def check_export(provenance: dict, swarm, names: dict) -> None:
    """What was exported is the state of its round that its server, and the other live peer, hold."""
    server = names[provenance["served_by"]]
    assert swarm.records(server)[provenance["round"]]["digest"] == provenance["digest"]
    for name in "ab":  # (one that caught up past the round has no line of it)
        if provenance["round"] in swarm.records(name):
            assert swarm.records(name)[provenance["round"]]["digest"] == provenance["digest"], name


def run_status(swarm, extra: dict, *args: str) -> list[str]:
    toml = swarm.folder / "peers.toml"
    config.save(config.load(None, {**SWARM, **extra}), toml)  # the peers' run
    result = subprocess.run(
        [*CLI, "status", "--config", str(toml), "--initial-peers", swarm.maddr, "--wait", "3", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=ENV,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def mine_of(swarm, peer: str, round_view: dict) -> int:
    """The tokens `peer` logged for the round (the round's total less the others' gives the sleeper's)."""
    name = _name_of(peer, swarm)
    return swarm.records(name)[round_view["round"]]["tokens"]


def settled(url: str) -> tuple[dict, str]:
    """The API's view and /metrics once two reads 1.5 s apart agree (the observer polls every second)."""
    deadline, last = time.monotonic() + 30, None
    while True:
        view = api(url)
        if last is not None and view["contributors"] == last["contributors"] and view["rounds"] == last["rounds"]:
            return view, get(url + "metrics").decode()
        assert time.monotonic() < deadline, "the observer's view kept changing"
        last = view
        time.sleep(1.5)  # a poll interval, bounded by the deadline above


def _name_of(peer: str, swarm) -> str:
    """Which of a, b, c has this peer id (from its log's peer tag, the id's last 4 characters)."""
    return next(n for n in ("a", "b", "c") if f"[peer {peer[-4:]} " in swarm.log(n))


def _silent(round_view: dict, name: str, swarm) -> bool:
    return any(
        n["reason"] == SILENT and f"[peer {n['peer'][-4:]} " in swarm.log(name) for n in round_view["not_counted"]
    )
