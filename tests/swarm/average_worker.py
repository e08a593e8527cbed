"""One swarm member that averages a known pseudo-gradient once and prints what it got.

    python -m tests.swarm.average_worker MADDR INDEX WEIGHT CODEC RUN_DIR [NUMEL] [die-as-reducer]
Prints "ready" once joined, waits for "go" on stdin, then prints one JSON line: the averaged
values (through the codec) and exact values (EXACT of them, norms and biases), the sha256 of their
bytes, the group size, and what the error-feedback residual holds; or the error, and whether this
peer's own pseudo-gradient is still intact in the averaging buffer.

With `die-as-reducer` the peer SIGKILLs itself (its main process, then its averager process) as soon
as a second part of its span arrives from another peer: a reducer dying in the middle of the
all-reduce, after it already answered for its first part.

With `probe` the peer waits for the probe sweep its all-reduce started and averages again, and
reports what it measured of the others' links (bytes/s) and the figure it then announced.

With `mean` the reducers take the plain weighted mean (swarm.aggregator), else `clip`.

With `lie-on-first-part` the peer, as a reducer, answers its span's first part x 100 and the rest
true: a lie on one audited chunk, which only that chunk's checkers see themselves (trust/audit.py).

With `vouch-all` the peer signs PASS on every item of the audit it was dealt, whatever it found: a
checker that lies for a reducer.

With `kill-averager` the peer SIGKILLs its own averager process right after handing it the step:
the averaging process dying under a peer that is waiting for its result.

With `two-level` the peer prints "ready PEER_ID" and waits for "go ROUND_KEY_HEX GROUPS SPANS
GROUP_SIZE": it then averages in a two-level round of those levels (docs/design.md §3, "Past one
group"), in the group of its bucket, expecting GROUP_SIZE members there. With `die-in-stage2` as
well, it SIGKILLs itself (its averager process, then its main process) as a stage-2 primary that
summed a sub-span and is about to push it: a span owner dying in the middle of stage 2. Where
the test wrote a number of seconds into RUN_DIR/late before "go", the peer starts its step that
much later (a delay hook: a slower inner phase), and its group's stage 1 ends that much later.
"""

import hashlib
import json
import os
import select
import signal
import sys
import time
from pathlib import Path

import torch

from p2p_diloco import config, faults
from p2p_diloco.errors import AveragingError, SwarmError
from p2p_diloco.protocol import codecs, twolevel
from p2p_diloco.protocol.twolevel import Levels
from p2p_diloco.swarm import HivemindSwarm
from p2p_diloco.swarm.averaging.allreduce import ConsistentAllReduceRunner
from p2p_diloco.swarm.averaging.averager import DiLoCoAverager
from p2p_diloco.swarm.averaging.ledger import Ledger
from p2p_diloco.swarm.averaging.stage2 import Stage2
from p2p_diloco.trust import audit

NUMEL = 1000
EXACT = 10


def die_as_reducer() -> None:
    """Patch the reducer side (it runs in the averager process) to die at the second part it receives."""
    original = ConsistentAllReduceRunner._accumulate_parts_streaming

    async def dying(self, stream, sender_index):
        async def parts():
            count = 0
            async for message in stream:
                count += 1
                if count == 2:
                    os.kill(os.getppid(), signal.SIGKILL)
                    os.kill(os.getpid(), signal.SIGKILL)
                yield message

        async for reply in original(self, parts(), sender_index):
            yield reply

    ConsistentAllReduceRunner._accumulate_parts_streaming = dying


def lie_on_first_part() -> None:
    """Patch the reducer side to answer its span's part 0 x 100."""
    original = ConsistentAllReduceRunner._encode_average

    def encode_average(self, part_index, averaged):
        return original(self, part_index, averaged * 100 if part_index == 0 else averaged)

    ConsistentAllReduceRunner._encode_average = encode_average


def vouch_for_all() -> None:
    """Patch this member's verdicts to PASS on every item it was dealt."""
    original = Ledger.own_verdicts

    def vouching(self, me, verdicts):
        return original(self, me, {item: audit.PASS for item in verdicts})

    Ledger.own_verdicts = vouching


def die_in_stage2() -> None:
    """A hook, inherited by the averager process, that kills the peer at its first stage-2 push."""

    def die(**context) -> None:
        os.kill(os.getppid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    faults.install(faults.FaultPoint.STAGE2, die)


def forge_partial() -> None:
    """Patch stage 2, inherited by the averager process: as a span's owner, this peer sends 100
    times its group's partial under the digests its group sealed."""
    original = Stage2.run

    async def forging(self, plan, partial):
        return await original(self, plan, twolevel.Partial(partial.values * 100, partial.weight, partial.digests))

    Stage2.run = forging


def show_double_weight() -> None:
    """Patch the step's hand-over: this peer shows twice its weight in the all-gather (a two-level
    round's group weight is made of what members show) and sends its parts with its own."""
    original = DiLoCoAverager.start_step

    def showing(self, weight, timeout, gather, init_timeout):
        return original(self, weight, timeout, {**gather, "weight": 2 * gather["weight"]}, init_timeout)

    DiLoCoAverager.start_step = showing


def kill_averager_after_start() -> None:
    """Patch the step's hand-over so that the averager process is killed once it took the step."""
    original = DiLoCoAverager.start_step

    def start_then_die(self, *args, **kwargs):
        control = original(self, *args, **kwargs)
        os.kill(self.pid, signal.SIGKILL)
        self.join(timeout=10)
        return control

    DiLoCoAverager.start_step = start_then_die


def known_delta(index: int, numel: int = NUMEL) -> torch.Tensor:
    """Δ_i[j] = (i + 1) · (1 + j / 1000)."""
    return (index + 1) * (1 + torch.arange(numel, dtype=torch.float32) / 1000)


def known_exact(index: int) -> torch.Tensor:
    """e_i[j] = (i + 1) · (j + 1) / 1000: small values that a coarse codec would round away."""
    return (index + 1) * (torch.arange(EXACT, dtype=torch.float32) + 1) / 1000


def describe_residual(swarm: HivemindSwarm, delta: torch.Tensor, codec: str) -> str:
    """What error feedback kept: nothing (this peer reduced its own values), exactly the codec's
    loss on Δ (it sent Δ to a reducer), or something else (a bug)."""
    if swarm.residual is None:
        return "none"
    if not bool(swarm.residual.any()):
        return "zero"
    return "codec-loss" if torch.equal(swarm.residual, codecs.residual(delta, codecs.get(codec))) else "other"


def main(maddr: str, index: int, weight: float, codec: str, run_dir: str, numel: int = NUMEL) -> None:
    cfg = config.load(
        None,
        {
            "swarm.host": "127.0.0.1",
            "swarm.initial_peers": maddr,
            "swarm.compression": codec,
            "swarm.matchmaking_time_s": "4",
            "swarm.averaging_timeout_s": "20",
            "swarm.aggregator": "mean" if "mean" in sys.argv else "clip",
            "run.dir": run_dir,
            **({"swarm.reachability": "private"} if "private" in sys.argv else {}),  # as behind a home router's NAT
        },
    )
    Path(run_dir).mkdir(parents=True)
    swarm = HivemindSwarm(cfg, Path(run_dir), numel, lambda: ({}, []), exact_numel=EXACT)
    try:
        two_level = "two-level" in sys.argv
        print(f"ready {swarm.peer_id}" if two_level else "ready", flush=True)
        go = sys.stdin.readline().split()
        assert go[0] == "go"
        levels, expected = None, 0
        if two_level:
            levels, expected = Levels(0, bytes.fromhex(go[1]), int(go[2]), int(go[3])), int(go[4])
        delta = known_delta(index, numel)
        late = Path(run_dir) / "late"
        if late.exists():
            time.sleep(float(late.read_text()))  # the delay hook above, not a synchronisation
        try:
            result = swarm.average(
                delta, weight, round_=0, exact=known_exact(index), expected_group=expected, levels=levels
            )
        except (AveragingError, SwarmError) as e:
            print(
                json.dumps(
                    {
                        "error": str(e),
                        "kind": type(e).__name__,
                        "own_delta_intact": bool(torch.equal(swarm.buffer, delta)),
                        "convicted": sorted(swarm.step.convicted()),
                    }
                ),
                flush=True,
            )
            if two_level:  # a peer whose round failed serves on what it decided, as a running peer does
                select.select([sys.stdin], [], [], 60)
            return
        if "probe" in sys.argv:
            # The first all-reduce started a probe sweep of the others' links; once it is over, a
            # second all-reduce of the same values announces the figure, vouched for by the others.
            probes = swarm.probes.result(timeout=60)
            result = swarm.average(delta, weight, round_=1, exact=known_exact(index))
            report = {"probes": probes, "link_bps": result.link_bps}
        else:
            report = {}
        values = torch.cat([result.delta, result.exact])
        print(
            json.dumps(
                {
                    "values": result.delta.tolist(),
                    "exact": result.exact.tolist(),
                    "sha256": hashlib.sha256(values.numpy().tobytes()).hexdigest(),
                    "group": len(result.group),
                    "bytes_sent": result.bytes_sent,
                    "bytes_received": result.bytes_received,
                    "audit_bytes": result.audit_bytes,
                    "audit_s": result.audit_s,
                    "butterfly_s": result.butterfly_s,
                    "groups": result.groups,
                    "across_s": result.across_s,
                    "across_bytes": list(result.across_bytes),
                    "residual": describe_residual(swarm, delta, codec),
                    **report,
                }
            ),
            flush=True,
        )
        # The others audit this member's span after their last average arrived (swarm/averaging/auditor.py): stay
        # until the test closes stdin, once it has every member's result (at most a minute).
        select.select([sys.stdin], [], [], 60)
    finally:
        swarm.close()


if __name__ == "__main__":
    if "die-as-reducer" in sys.argv:
        die_as_reducer()
    if "kill-averager" in sys.argv:
        kill_averager_after_start()
    if "lie-on-first-part" in sys.argv:
        lie_on_first_part()
    if "vouch-all" in sys.argv:
        vouch_for_all()
    if "die-in-stage2" in sys.argv:
        die_in_stage2()
    if "forge-partial" in sys.argv:
        forge_partial()
    if "show-double-weight" in sys.argv:
        show_double_weight()

    numel = int(sys.argv[6]) if len(sys.argv) > 6 and sys.argv[6].isdigit() else NUMEL
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5], numel)
