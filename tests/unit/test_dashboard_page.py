"""The dashboard page in a real browser (headless Chromium) over a run log built by hand: what an
organiser reads at a glance. The page over a real swarm: tests/swarm/test_observer.py."""

from __future__ import annotations

import re
import shutil
import subprocess
from functools import partial

import pytest

from p2p_diloco.observe.run_view import REASONS, RunLog
from p2p_diloco.observe.web import ObserverServer
from p2p_diloco.protocol.budget import ProgressReport
from p2p_diloco.protocol.network import RoundRecord
from p2p_diloco.trust.robust import weighed_tokens

BROWSER = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
pytestmark = pytest.mark.skipif(BROWSER is None, reason="no Chromium: .ci/run installs it (apt-get install chromium)")
A, B, C = "QmAlice" + "a" * 39, "QmBob" + "b" * 41, "QmCarol" + "c" * 39
ROUNDS, REVOKED_AT = 12, 8


def digest(r: int) -> str:
    return f"{r:064x}"


def run_log() -> RunLog:
    """alice and bob average every round of 12, bob training three times alice's tokens; carol too
    until the organiser revokes it as round 8 begins; its last record stays in the DHT two rounds
    more. The observer evaluates every 5 rounds, and the last."""
    log = RunLog("shown", "fp", ROUNDS, partial(weighed_tokens, how="aligned-clip", weight_cap=2.0))
    log.names.update({A: "alice", B: "bob", C: "carol"})
    for r in range(ROUNDS + 1):
        members = (A, B, C) if r < REVOKED_AT else (A, B)
        records = {
            p: RoundRecord(
                p,
                r,
                digest(r),
                0 if r == 0 else 300 if p == B else 100,
                3.0 - r / 10,
                group=members if r else (),
                outcome="averaged" if r else "start",
            )
            for p in members
        }
        if REVOKED_AT <= r < REVOKED_AT + 2:
            records[C] = RoundRecord(C, 7, digest(7), 100, 2.3, group=(A, B, C), outcome="averaged")
        revoked = {C: ("sold its slot twice", 10.0 * REVOKED_AT - 1)} if r >= REVOKED_AT else {}
        reports = [ProgressReport(p, r, 0, 30.0 if p == B else 10.0, 10.0 * r) for p in members]
        log.ingest(records, reports, {}, revoked=revoked, now=10.0 * r)
        if r in (5, 10, ROUNDS):
            log.note_evaluation(r, digest(r), 2.5 - r / 20)
    log.eval_every, log.eval_off = 5, ""
    return log


def rendered(log: RunLog) -> str:
    server = ObserverServer(lambda: log.view(10.0 * ROUNDS + 1), lambda: (True, ""), "127.0.0.1", 0)
    try:
        cmd = [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000", "--dump-dom"]
        return subprocess.run([*cmd, server.url], timeout=120, capture_output=True, text=True, check=True).stdout
    finally:
        server.close()


def svg(dom: str, id_: str) -> str:
    return re.search(rf'<svg id="{id_}".*?</svg>', dom, re.S).group(0)


def test_the_plots_have_titles_axes_and_legends_train_loss_per_round_and_held_out_points_to_the_last_round():
    dom = rendered(run_log())
    loss, tokens = svg(dom, "plot-loss"), svg(dom, "plot-tokens")
    assert '<text class="title" x="62" y="16">Loss per round</text>' in loss
    assert (
        ">train loss (mean of counted peers)</text>" in loss
        and ">held-out loss (observer, agreed state)</text>" in loss
    )
    assert re.findall(r'class="axis-label"[^>]*>([^<]+)<', loss) == ["round", "loss (cross-entropy)"]
    assert re.findall(r"<title>round (\d+): [\d.]+</title></circle>", loss.split('class="point"', 1)[1]) == [
        "5",
        "10",
        "12",
    ]
    assert len(re.findall(r'<circle class="vertex"', loss)) == ROUNDS  # a train loss per trained round, not θ(0)
    assert '<text class="title" x="62" y="16">Credited tokens per round</text>' in tokens
    bars = re.findall(r"<title>round (\d+): ([\d,]+)</title></rect>", tokens)
    # bob's 300 tokens weighed at 2 x the group's median 100: 400 a round with carol, 300 without
    assert bars == [(str(r), "400" if r < REVOKED_AT else "300") for r in range(1, ROUNDS + 1)]
    assert re.search(r'id="tokens-per-s">40<', dom)  # alice 10 + bob 30; carol is revoked
    assert re.search(r'id="eval-loss">1\.9000<', dom) and re.search(r'id="eval-round">round 12<', dom)


def test_a_revoked_peer_is_marked_with_the_reason_in_the_peers_the_rounds_and_the_contributors():
    dom = rendered(run_log())
    carol = re.search(rf'<tr class="peer" data-peer="{C}">(.*?)</tr>', dom).group(1)
    assert '<span class="revoked">revoked: sold its slot twice</span>' in carol
    rows = dict(re.findall(r'<tr class="contributor" data-peer="(\w+)">(.*?)</tr>', dom))
    assert "revoked by the organiser: sold its slot twice" in rows[C] and "revoked" not in rows[A] + rows[B]
    assert re.findall(r'<td class="num">([\d,]+)</td>', rows[B])[:2] == ["2,400", "3,600"]  # credited, trained
    why = f"carol</code>: not counted: {REASONS['revoked']}: sold its slot twice"
    marked = [int(r) for r, row in re.findall(r'<tr class="round" data-round="(\d+)">(.*?)</tr>', dom) if why in row]
    assert sorted(marked) == [REVOKED_AT, REVOKED_AT + 1]  # while its record was in the DHT


def test_the_page_says_why_the_held_out_loss_is_off():
    log = run_log()
    log.evaluated.clear()
    log.eval_off = "held-out loss off: a certified run's peers serve their state to admitted peers only"
    dom = rendered(log)
    assert re.search(r'id="eval-loss">off<', dom)
    assert f'id="eval-off">{log.eval_off}<' in dom.replace("&#x27;", "'").replace("&#39;", "'")


def test_a_two_level_round_shows_its_groups_and_spans_and_a_flat_round_says_flat():
    log = RunLog("levels", "fp", 2, partial(weighed_tokens, how="mean", weight_cap=2.0))
    log.names.update({A: "alice", B: "bob", C: "carol"})
    D = "QmDave" + "d" * 40
    for r, levels in ((1, True), (2, False)):
        groups = ((A, B), (C, D)) if levels else ((A, B, C, D),)
        records = {
            p: RoundRecord(p, r, digest(r), 100, 2.0, group=g, outcome="averaged", groups=len(groups), spans=4 * levels)
            for g in groups
            for p in g
        }
        log.ingest(records, [ProgressReport(p, r, 0, 10.0, 10.0 * r) for p in records], {}, now=10.0 * r)
    dom = rendered(log)
    cells = dict(re.findall(r'<tr class="round" data-round="(\d+)">.*?<td class="levels">(.*?)</td>', dom, re.S))
    assert cells["2"] == '<span class="muted">flat</span>'
    assert cells["1"].startswith("2 groups × 4 spans<br>")
    assert re.findall(r'<span class="group" title="([^"]*)">(\d): (\d) peers</span>', cells["1"]) == [
        ("alice, bob", "1", "2"),
        ("carol, " + D[-8:], "2", "2"),
    ]
