"""One span's owner in a process of its own, for tests/swarm/test_assembly.py: a hivemind DHT with its
own p2pd on 127.0.0.1 (NAT probing off, hivemind's identity check too: it starts a p2pd of its own
with AutoNAT and UPnP) and the real `Assembly` over it.

    python -m tests.swarm.assembly_worker INDEX OWNERS GROUPS FOLDER [forge]

Owner INDEX owns span 0 of group INDEX mod GROUPS: its identity key and its two members' keys are
drawn until they hash into bucket INDEX mod GROUPS of the round (twolevel.bucket_of), as the
members of a group made from that bucket would. Its members seal the group's layout; with `forge`,
the owner makes up a group of itself and one member of its own (both seal, a majority of it).
Owner 0 is the DHT's first node and writes FOLDER/0.addr; every owner writes FOLDER/INDEX.ready
once its DHT and handlers are up and waits for every owner's, assembles under the span's key, and,
where the owners `claims.plan_owners` made of the assembly include it, runs stage 2 of span 0 with
`claims.plan_key` as its key and its group's partial (tests/swarm/stage2_worker.py's `partial_of`
of its bucket, which is its group's index in the plan; its layout seals that partial's root). It
writes FOLDER/INDEX.json: the assembly's members, the owners, the key, and each sub-span's decided
statement's sha256, the groups it names and the average; or the error. It then serves until
FOLDER/done. With TOLD_LESS in its environment, it computes the stage-2 key as if the leader had
not shown it the claims that count for nothing (a leader that tells owners different things): the
same owners, another key.
"""

import asyncio
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

import hivemind
from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

from p2p_diloco.protocol import claims, twolevel
from p2p_diloco.protocol.claims import Claim, GroupLayout
from p2p_diloco.swarm.averaging import stage2
from p2p_diloco.swarm.averaging.assembly import Assembly, AssemblyError
from p2p_diloco.swarm.averaging.stage2 import Plan, Stage2, Stage2Error, Stage2Servicer
from p2p_diloco.swarm.transport import identity
from p2p_diloco.trust.wire import WireError
from tests.swarm.stage2_worker import partial_of, root_of, wait_for_files

NO_NAT = {"auto_nat": False, "nat_port_map": False, "use_relay": False, "use_auto_relay": False}
ROUND_KEY = b"round 7 digest"
SEED = ROUND_KEY.hex()
SPANS = 4
NUMEL = 10  # span 0's values: sub-spans of 3, 3 and 4 among 3 groups
KEY = f"run-r7-span0of{SPANS}"  # the assembly's DHT key: the run, the round and the span
WAIT_S = 2.0


def key_in_bucket(folder: Path, name: str, bucket: int, groups: int) -> tuple[Path, str]:
    """An identity key whose peer id hashes into `bucket` of the round's `groups`."""
    for attempt in range(200):
        path = folder / f"{name}-{attempt}.key"
        peer = identity.peer_id_of(path)
        if twolevel.bucket_of(SEED, peer, groups) == bucket:
            return path, peer
    raise SystemExit(f"no key in bucket {bucket} in 200 tries")


def make_claim(folder: Path, me: tuple[Path, str], bucket: int, groups: int, forge: bool) -> Claim:
    members = [me] + [key_in_bucket(folder, f"member{i}", bucket, groups) for i in range(1 if forge else 2)]
    if bucket == 0 and not forge and os.environ.get("WITH_MEMBER"):  # the member process, in group 0
        wait_for_files([folder.parent / "member.key", folder.parent / "member.peer"])
        members[-1] = (Path((folder.parent / "member.key").read_text()), (folder.parent / "member.peer").read_text())
    roots = (root_of(bucket, NUMEL),) + (bytes(32),) * (SPANS - 1)  # span 0's partial: its bucket's
    layout = GroupLayout(ROUND_KEY, tuple(p for _, p in members), (me[1],) * SPANS, roots)
    seals = {peer: stage2.seal(identity.load_identity(path), ROUND_KEY, layout.statement()) for path, peer in members}
    return Claim(me[1], layout, seals)


def holds(member: str, statement: bytes, seal: bytes) -> bool:
    return stage2.sealed_by(member, ROUND_KEY, statement, seal)


async def assemble(assembly: Assembly, claim: bytes, owners: int, groups: int) -> tuple[list, tuple, bytes]:
    """(the members' peer ids, the claims that count of what they showed, the stage-2 key)."""
    gathered = await assembly.assemble(KEY, claim, owners)
    shown = []
    for by, raw in gathered:
        try:
            shown.append(claims.parse_claim(raw, by, ROUND_KEY, SPANS))
        except WireError:
            pass
    counted = claims.counted(SEED, groups, 0, shown, holds)
    if os.environ.get("TOLD_LESS"):  # as if the leader had not shown it the made-up claim (which counts for nothing)
        shown = [c for c in shown if c in counted]
    return sorted(by for by, _ in gathered), counted, claims.plan_key(ROUND_KEY, 0, shown)


async def wait_for(paths: list[Path]) -> None:
    await asyncio.get_running_loop().run_in_executor(None, wait_for_files, paths)


async def run(
    dht: hivemind.DHT, me: tuple[Path, str], claim: bytes, index: int, sizes: tuple[int, int], folder: Path
) -> None:
    """Assemble with the other owners (`sizes`: how many, and the round's groups), then run stage 2
    of span 0 as the plan made of the assembly says (an owner the plan leaves out runs none), and
    write the result."""
    owners, groups = sizes
    p2p = await dht.replicate_p2p()
    assembly = Assembly(p2p, dht, "assembly-test", WAIT_S)
    await assembly.start()
    signer = identity.load_identity(me[0])
    desk = Stage2(me[1], signer, lambda peer: Stage2Servicer.get_stub(p2p, PeerID.from_base58(peer)), WAIT_S)
    await Stage2Servicer(desk).add_p2p_handlers(p2p)
    (folder / f"{index}.ready").touch()
    await wait_for([folder / f"{i}.ready" for i in range(owners)])
    result: dict = {}
    try:
        result["members"], counted, key = await assemble(assembly, claim, owners, groups)
        result["owners"], result["plan_key"] = [c.by for c in counted], key.hex()
        if me[1] in result["owners"]:
            plan = Plan.of(key, 0, SPANS, counted, NUMEL)
            outputs = await desk.run(plan, partial_of(index % groups, NUMEL))
            result["subs"] = [hashlib.sha256(o.statement()).hexdigest() for o in outputs]
            result["groups"] = [list(o.groups) for o in outputs]
            result["average"] = twolevel.final(outputs).tolist()
    except (AssemblyError, Stage2Error) as e:
        result["error"] = str(e)
    (folder / f"{index}.json").write_text(json.dumps(result))
    await wait_for([folder / "done"])  # serve the others' stage-2 fetches until every owner is done


async def run_member(dht: hivemind.DHT, me: tuple[Path, str], owners: int, groups: int, folder: Path) -> None:
    """A member of group 0 that owns nothing of span 0: once its owner ended stage 2, it asks it
    what the assembly showed, checks its group's claim is the layout it sealed, makes the plan
    itself and fetches every sub-span through its owner, which relays what it is no replica of
    (stage 3). It notes whom it asked."""
    p2p = await dht.replicate_p2p()
    for i in range(owners):  # dialled by address, as a member knows its group's owner and finds the replicas
        shown = json.loads((folder / f"{i}.maddrs").read_text())
        await p2p._client.connect(PeerID.from_base58(shown["id"]), [Multiaddr(a) for a in shown["addrs"]])
    signer = identity.load_identity(me[0])
    asked: set[str] = set()

    def stub(peer: str):
        asked.add(peer)
        return Stage2Servicer.get_stub(p2p, PeerID.from_base58(peer))

    desk = Stage2(me[1], signer, stub, WAIT_S)
    owner = (folder / "0.peer").read_text()
    sealed = claims.parse_layout(bytes.fromhex((folder / "0.layout").read_text()), ROUND_KEY, SPANS)
    result: dict = {}
    assembly = Assembly(p2p, dht, "assembly-test", WAIT_S)
    try:
        await assembly.shown_by(owner, f"run-r7-span3of{SPANS}")  # no assembly of span 3 was held
    except AssemblyError as e:
        result["unheld"] = str(e)
    try:
        shown = []
        for by, raw in await assembly.shown_by(owner, KEY):
            try:
                shown.append(claims.parse_claim(raw, by, ROUND_KEY, SPANS))
            except WireError:
                pass
        counted, key = claims.plan_for_member(shown, owner, sealed, SEED, groups, 0, holds)
        result["owners"], result["plan_key"] = [c.by for c in counted], key.hex()
        outputs = await desk.fetch_decided(Plan.of(key, 0, SPANS, counted, NUMEL), via=owner)
        result["asked"] = sorted(asked)
        result["subs"] = [hashlib.sha256(o.statement()).hexdigest() for o in outputs]
        result["average"] = twolevel.final(outputs).tolist()
    except (AssemblyError, Stage2Error, WireError) as e:
        result["error"] = str(e)
    (folder / "member.json").write_text(json.dumps(result))


def start_dht(me: tuple[Path, str], folder: Path, first: bool) -> hivemind.DHT:
    initial: list[str] = []
    if not first:
        wait_for_files([folder / "0.addr"])
        initial = json.loads((folder / "0.addr").read_text())
    return hivemind.DHT(
        start=True,
        initial_peers=initial,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        identity_path=str(me[0]),
        check_if_identity_free=False,
        **NO_NAT,
    )


def member(owners: int, groups: int, folder: Path) -> None:
    keys = Path(tempfile.mkdtemp(prefix="member-", dir=folder))
    me = key_in_bucket(keys, "identity", 0, groups)
    (folder / "member.key").write_text(str(me[0]))
    (folder / "member.peer").write_text(me[1])
    wait_for_files([folder / "0.json"])  # its owner has ended stage 2 (and wrote its layout before)
    dht = start_dht(me, folder, first=False)
    try:
        asyncio.run(run_member(dht, me, owners, groups, folder))
    finally:
        dht.shutdown()


def main(index: int, owners: int, groups: int, folder: Path, forge: bool) -> None:
    keys = Path(tempfile.mkdtemp(prefix=f"owner{index}-", dir=folder))
    bucket = index % groups
    me = key_in_bucket(keys, "identity", bucket, groups)
    made = make_claim(keys, me, bucket, groups, forge)
    claim = made.encode()
    (folder / f"{index}.layout").write_text(made.layout.statement().hex())
    dht = start_dht(me, folder, first=index == 0)
    addrs = [str(a).split("/p2p/")[0] for a in dht.get_visible_maddrs()]
    (folder / f"{index}.maddrs").write_text(json.dumps({"id": me[1], "addrs": addrs}))
    try:
        if index == 0:
            (folder / "0.addr").write_text(json.dumps([str(a) for a in dht.get_visible_maddrs()]))
        (folder / f"{index}.peer").write_text(me[1])
        asyncio.run(run(dht, me, claim, index, (owners, groups), folder))
    finally:
        dht.shutdown()


if __name__ == "__main__":
    if sys.argv[1] == "member":
        member(int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
    else:
        main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]), sys.argv[5:] == ["forge"])
