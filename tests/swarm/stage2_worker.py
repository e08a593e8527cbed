"""One span's owner in a process of its own, for tests/swarm/test_stage2.py: its own p2pd on
127.0.0.1 (NAT probing off), the real `Stage2` over real streams.

    python -m tests.swarm.stage2_worker INDEX GROUPS NUMEL FOLDER

It writes FOLDER/INDEX.addr (its peer id and addresses), waits for every owner's, connects to
them, registers its handlers, writes FOLDER/INDEX.ready, waits for every owner's, runs stage 2 on
its group's partial (group g: values (g + 1) x [1, 2, ..., NUMEL] / 8, weight g + 1: exact in
fp32) and writes FOLDER/INDEX.json: each sub-span's decided statement's sha256 and the groups it
names, the average, and whom it convicted; or the error. FAULT (environment):
- `lie`: as a primary, the sum it pushes is 100 times the true one (it checks the decision honestly);
- `kill`: as a primary, it SIGKILLs its p2pd and itself just before it pushes its sum;
- `kill-decider`: the same, as a decider, once it decided a sub-span and before it told anyone;
- `forge`: it sends its replicas 100 times its group's partial, with the digests its group sealed;
- `forge-decide`: the same, and as a decider it decides its own sum whatever its primary sent.
"""

import asyncio
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from p2p_diloco import faults
from p2p_diloco.protocol import partials, twolevel
from p2p_diloco.swarm.averaging.stage2 import Plan, Stage2, Stage2Error, Stage2Servicer
from p2p_diloco.swarm.transport import identity

NO_NAT = {"auto_nat": False, "nat_port_map": False, "use_relay": False, "use_auto_relay": False}
WAIT_S = 3.0  # a replica's wait for the partials
BARRIER_S = 60.0
LINGER_S = 4 * WAIT_S  # past every wait of stage 2 (stage2.FETCH_UNTIL of them)


def partial_of(group: int, numel: int) -> twolevel.Partial:
    """Group `group`'s partial of span 0, with its pieces' digests as its members sealed them."""
    values = (group + 1) * torch.arange(1, numel + 1, dtype=torch.float32) / 8
    return twolevel.Partial(values, float(group + 1), partials.digests(values))


def root_of(group: int, numel: int) -> bytes:
    """The root group `group`'s members sealed of its partial of span 0 (in its layout)."""
    partial = partial_of(group, numel)
    return partials.root(0, partial.weight, partial.digests)


def wait_for_files(paths: list[Path]) -> None:
    deadline = time.monotonic() + BARRIER_S
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {[str(p) for p in paths if not p.exists()]}")
        time.sleep(0.05)  # a poll interval, bounded by the deadline above


def install_fault(fault: str, p2p: P2P, me: str) -> None:
    if fault == "lie":
        honest, lying = twolevel.reduce_sub_span, []

        def sum_once_times_100(span, sub, bounds, partials, by):
            out = honest(span, sub, bounds, partials, by)
            if not lying:
                return out
            lying.clear()
            return twolevel.Output(out.span, out.sub, out.groups, out.values * 100, out.weight, out.by)

        twolevel.reduce_sub_span = sum_once_times_100
        faults.install(faults.FaultPoint.STAGE2, lambda **context: lying.append(True))  # its push's sum, only
    elif fault == "forge-decide":  # as a decider, always its own sum (its forged partial in it)

        def own_sum(primary, span, sub, bounds, held, secondary) -> twolevel.Settled:
            return twolevel.Settled(twolevel.reduce_sub_span(span, sub, bounds, held, secondary) if held else None)

        twolevel.settle = own_sum
    elif fault in ("kill", "kill-decider"):

        def die(**context) -> None:
            os.kill(p2p._child.pid, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)

        point = faults.FaultPoint.STAGE2 if fault == "kill" else faults.FaultPoint.STAGE2_DECIDED
        faults.install(point, die)


async def main(index: int, groups: int, numel: int, folder: Path) -> None:
    key_path = folder / f"{index}.key"
    signer = identity.load_identity(key_path)
    p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity_path=str(key_path), **NO_NAT)
    me = str(p2p.peer_id)
    addrs = [str(a).split("/p2p/")[0] for a in await p2p.get_visible_maddrs()]
    (folder / f"{index}.addr").write_text(json.dumps({"id": me, "addrs": addrs}))
    wait_for_files([folder / f"{g}.addr" for g in range(groups)])
    owners = []
    for g in range(groups):
        shown = json.loads((folder / f"{g}.addr").read_text())
        owners.append(shown["id"])
        if g != index:
            await p2p._client.connect(PeerID.from_base58(shown["id"]), [Multiaddr(a) for a in shown["addrs"]])
    desk = Stage2(me, signer, lambda peer: Stage2Servicer.get_stub(p2p, PeerID.from_base58(peer)), WAIT_S)
    await Stage2Servicer(desk).add_p2p_handlers(p2p)
    install_fault(os.environ.get("FAULT", ""), p2p, me)
    (folder / f"{index}.ready").write_text("")
    wait_for_files([folder / f"{g}.ready" for g in range(groups)])
    plan = Plan(b"round 7", 0, 1, tuple(owners), numel, tuple(root_of(g, numel) for g in range(groups)))
    result: dict = {"id": me}
    partial = partial_of(index, numel)
    if os.environ.get("FAULT", "").startswith("forge"):  # its group's digests, values its group did not compute
        partial = twolevel.Partial(partial.values * 100, partial.weight, partial.digests)
    try:
        outputs = await desk.run(plan, partial)
        result["subs"] = [
            {"sha256": hashlib.sha256(o.statement()).hexdigest(), "groups": list(o.groups)} for o in outputs
        ]
        result["average"] = twolevel.final(outputs).tolist()
    except Stage2Error as e:
        result["error"] = str(e)
    result["convicted"] = sorted(desk.convicted)
    (folder / f"{index}.json").write_text(json.dumps(result))
    # Serve the others' fetches until every owner holds a result or died (the test then writes
    # FOLDER/done), at most LINGER_S.
    deadline = time.monotonic() + LINGER_S
    while time.monotonic() < deadline and not (folder / "done").exists():
        await asyncio.sleep(0.05)  # a poll interval, bounded by the deadline above
    await p2p.shutdown()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])))
