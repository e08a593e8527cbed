"""One span's owner in a process of its own, for tests/swarm/test_assembly.py: a hivemind DHT with its
own p2pd on 127.0.0.1 (NAT probing off, hivemind's identity check too: it starts a p2pd of its own
with AutoNAT and UPnP) and the real `Assembly` over it.

    python -m tests.swarm.assembly_worker INDEX OWNERS GROUPS FOLDER [forge]

Owner INDEX owns span 0 of group INDEX mod GROUPS: its identity key and its two members' keys are
drawn until they hash into bucket INDEX mod GROUPS of the round (twolevel.bucket_of), as the
members of a group made from that bucket would. Its members seal the group's layout; with `forge`,
the owner makes up a group of itself and one member of its own (both seal, a majority of it).
Owner 0 is the DHT's first node and writes FOLDER/0.addr; every owner writes FOLDER/INDEX.ready
once its DHT is up and waits for every owner's, assembles under the span's key, and writes
FOLDER/INDEX.json: the assembly's members, the owners `claims.plan_owners` made of it and
`claims.plan_key`; or the error. It then waits for FOLDER/done (so that no leader leaves early).
"""

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import hivemind

from p2p_diloco.protocol import claims, twolevel
from p2p_diloco.protocol.claims import Claim, GroupLayout
from p2p_diloco.swarm.averaging import stage2
from p2p_diloco.swarm.averaging.assembly import Assembly, AssemblyError
from p2p_diloco.swarm.transport import identity
from p2p_diloco.trust.wire import WireError

NO_NAT = {"auto_nat": False, "nat_port_map": False, "use_relay": False, "use_auto_relay": False}
ROUND_KEY = b"round 7 digest"
SEED = ROUND_KEY.hex()
SPANS = 4
WAIT_S = 2.0
BARRIER_S = 60.0


def wait_for_files(paths: list[Path]) -> None:
    deadline = time.monotonic() + BARRIER_S
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {[str(p) for p in paths if not p.exists()]}")
        time.sleep(0.05)  # a poll interval, bounded by the deadline above


def key_in_bucket(folder: Path, name: str, bucket: int, groups: int) -> tuple[Path, str]:
    """An identity key whose peer id hashes into `bucket` of the round's `groups`."""
    for attempt in range(200):
        path = folder / f"{name}-{attempt}.key"
        peer = identity.peer_id_of(path)
        if twolevel.bucket_of(SEED, peer, groups) == bucket:
            return path, peer
    raise SystemExit(f"no key in bucket {bucket} in 200 tries")


def make_claim(folder: Path, me: tuple[Path, str], bucket: int, groups: int, forge: bool) -> bytes:
    members = [me] + [key_in_bucket(folder, f"member{i}", bucket, groups) for i in range(1 if forge else 2)]
    layout = GroupLayout(ROUND_KEY, tuple(p for _, p in members), (me[1],) * SPANS)
    seals = {peer: stage2.seal(identity.load_identity(path), ROUND_KEY, layout.statement()) for path, peer in members}
    return Claim(me[1], layout, seals).encode()


def holds(member: str, statement: bytes, seal: bytes) -> bool:
    return stage2.sealed_by(member, ROUND_KEY, statement, seal)


async def assemble(dht: hivemind.DHT, claim: bytes, owners: int, groups: int) -> dict:
    assembly = Assembly(await dht.replicate_p2p(), dht, "assembly-test", WAIT_S)
    await assembly.start()
    try:
        gathered = await assembly.assemble(f"run-r7-span0of{SPANS}", claim, owners)
    except AssemblyError as e:
        return {"error": str(e)}
    shown = []
    for by, raw in gathered:
        try:
            shown.append(claims.parse_claim(raw, by, ROUND_KEY, SPANS))
        except WireError:
            pass
    plan = claims.plan_owners(SEED, groups, 0, shown, holds)
    return {
        "members": sorted(by for by, _ in gathered),
        "owners": list(plan),
        "plan_key": claims.plan_key(ROUND_KEY, 0, shown).hex(),
    }


def main(index: int, owners: int, groups: int, folder: Path, forge: bool) -> None:
    keys = Path(tempfile.mkdtemp(prefix=f"owner{index}-", dir=folder))
    bucket = index % groups
    me = key_in_bucket(keys, "identity", bucket, groups)
    claim = make_claim(keys, me, bucket, groups, forge)
    initial: list[str] = []
    if index > 0:
        wait_for_files([folder / "0.addr"])
        initial = json.loads((folder / "0.addr").read_text())
    dht = hivemind.DHT(
        start=True,
        initial_peers=initial,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        identity_path=str(me[0]),
        check_if_identity_free=False,
        **NO_NAT,
    )
    try:
        if index == 0:
            (folder / "0.addr").write_text(json.dumps([str(a) for a in dht.get_visible_maddrs()]))
        (folder / f"{index}.peer").write_text(me[1])
        (folder / f"{index}.ready").touch()
        wait_for_files([folder / f"{i}.ready" for i in range(owners)])
        result = asyncio.run(assemble(dht, claim, owners, groups))
        (folder / f"{index}.json").write_text(json.dumps(result))
        wait_for_files([folder / "done"])
    finally:
        dht.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]), sys.argv[5:] == ["forge"])
