"""Untrusted input as a class: hostile values in every field of every DHT record kind,
fed through the real readers (swarm/trust/records.py over trust/wire.py's parsers) and the callers that act on
what they return: the round wait and catch-up (protocol/agreement.py), the heartbeat, run identity, the
observer and `status` (run_view.RunLog, service.status_lines, the dashboard's JSON) and the
bootstrap node's status line. Pass: nothing raises out of them; the hostile record is dropped
(logged once), and the honest peers' records still read as published.

The DHT is a stand-in (it answers `get` from a dict: what hivemind hands the readers after its
signature check); the subkeys are real RSA identities (identity.make_validator), so records are
attributed to their signers exactly as in a swarm. Hostile values come from hypothesis: every
msgpack type, huge and non-finite numbers, long and odd strings, deep nesting, missing keys.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import Future
from dataclasses import asdict
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2p_diloco import config as config_mod
from p2p_diloco.errors import RunConfigMismatch
from p2p_diloco.observe import service
from p2p_diloco.protocol import agreement
from p2p_diloco.protocol.network import RoundRecord
from p2p_diloco.swarm.bootstrap import rounds_seen
from p2p_diloco.swarm.heartbeat import Heartbeat
from p2p_diloco.swarm.run_identity import RunIdentity
from p2p_diloco.swarm.run_reader import RunReader
from p2p_diloco.swarm.transport import entry
from p2p_diloco.swarm.transport.identity import make_validator, owner_peer_id
from p2p_diloco.swarm.trust import records
from p2p_diloco.swarm.trust.gate import Gate
from p2p_diloco.swarm.trust.run_dht import RunDHT

# Cases per test; the suite's run is the same every time (derandomize: CI never meets a new
# case by chance). P2P_DILOCO_FUZZ=N runs N fresh random cases per test instead.
FUZZ_N = int(os.environ.get("P2P_DILOCO_FUZZ", "0"))
EXAMPLES = FUZZ_N or 300
NOW = time.time()
D1, D2 = "1" * 32, "2" * 32

# Every value msgpack can carry, the edges of each type first: hypothesis also shrinks to them.
EDGES = st.sampled_from([2**63, 2**64, -(2**63) - 1, 10**30, float("nan"), float("inf"), -float("inf"), 1e308, -0.0])
LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats()
    | st.text(max_size=40)
    | st.binary(max_size=40)
    | EDGES
    | st.just("x" * 5000)
)
HOSTILE = st.recursive(
    LEAVES,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


class Deep(list):
    """Lists nested `depth` deep (msgpack unpacks up to about 1000): printed short, as hypothesis
    prints a failing example."""

    def __repr__(self) -> str:
        return f"<lists nested {self.depth} deep>"


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    deep = Deep([value])
    deep.depth = depth
    return deep


HOSTILE = HOSTILE | st.just(nested(900)) | st.builds(lambda: {"a": nested(900)})


@st.composite
def mutated(draw, base: dict):
    """`base` with some fields replaced by hostile values, some removed, maybe one added."""
    record = dict(base)
    keys = sorted(base)
    for key in draw(st.lists(st.sampled_from(keys), unique=True, max_size=3)):
        record[key] = draw(HOSTILE)
    for key in draw(st.lists(st.sampled_from(keys), unique=True, max_size=1)):
        if draw(st.booleans()):
            del record[key]
    return record


def hostile_like(base: dict):
    return st.one_of(HOSTILE, mutated(base), mutated(base))


class Entry:
    def __init__(self, value, expiration_time):
        self.value, self.expiration_time = value, expiration_time


class FakeDHT:
    """Answers `get` from {key: {subkey: value}}, as hivemind's DHT answers after its checks;
    `store` keeps what the reader publishes (its own records)."""

    def __init__(self, entries: dict[str, dict[bytes, object]], expiration: float = NOW + 60):
        self.entries, self.expiration = entries, expiration
        self.peer_id = "QmObserverOfTheFuzzer"

    def get(self, key, latest=True, beam_size=None, num_workers=None):  # hivemind's lookup bounds, as it takes them
        found = self.entries.get(key)
        if found is None:
            return None
        return SimpleNamespace(value={sk: Entry(v, self.expiration) for sk, v in found.items()})

    def store(self, key, value, expiration_time, subkey=None, return_future=False, beam_size=None):
        self.entries.setdefault(key, {})[subkey] = value
        if not return_future:
            return True
        done = Future()  # the heartbeat does not wait for its stores
        done.set_result(True)
        return done

    def is_alive(self):
        return True


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Three identities (two honest peers, one attacker) and the run they are in."""
    folder = tmp_path_factory.mktemp("keys")
    keys = [make_validator(folder / f"{name}.key") for name in ("a", "b", "m")]
    ids = [owner_peer_id(v.local_public_key) for v in keys]
    config = config_mod.load(None, {"run.rounds": "8"})
    prefix = records.run_prefix(config.run.run_id, config.fingerprint())
    return SimpleNamespace(keys=keys, ids=ids, config=config, prefix=prefix)


def honest_round(peer: str, round_: int = 3, digest: str = D1) -> dict:
    record = RoundRecord(peer, round_, digest, 100, 2.5, ("/ip4/1.2.3.4/tcp/1",), group=(peer,), outcome="averaged")
    return {**asdict(record), "addrs": list(record.addrs)}


def honest_progress(peer: str) -> dict:
    return {"peer": peer, "round": 4, "tokens": 64, "tokens_per_s": 100.0, "time": NOW, "convicted": []}


def run_entries(world, rounds_m, progress_m) -> dict:
    a, b, m = world.keys
    ia, ib, im = world.ids
    return {
        records.rounds_key(world.prefix): {
            a.local_public_key: honest_round(ia),
            b.local_public_key: honest_round(ib),
            m.local_public_key: rounds_m,
            b"[owner:not a key]": rounds_m,
        },
        records.progress_key(world.prefix): {
            a.local_public_key: honest_progress(ia),
            b.local_public_key: honest_progress(ib),
            m.local_public_key: progress_m,
        },
    }


def assert_honest_read(world, found: dict) -> None:
    ia, ib, _ = world.ids
    assert found[ia] == RoundRecord.parse(honest_round(ia)) and found[ib] == RoundRecord.parse(honest_round(ib))


FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not FUZZ_N,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
M = "Qm" + "m" * 44  # the attacker's id, until the fixture knows its key's: signed_as_m
PAST_M = {"round": 8, "digest": D2, "tokens": 100, "loss": 2.5, "copied": False, "group": [M], "outcome": "averaged"}
ROUND_M = honest_round(M, 9, D2)
ROUNDS_M = hostile_like(ROUND_M) | hostile_like(PAST_M).map(lambda past: {**ROUND_M, "history": [past]})
PROGRESS_M = honest_progress(M)


def signed_as_m(world, *values) -> None:
    """The attacker signs with its own key: a record that names it (where the fuzzer left its id)
    names its key's id, so the record is read, not dropped as forged."""
    for value in values:
        if isinstance(value, dict) and value.get("peer") == M:
            value["peer"] = world.ids[2]


@FUZZ
@given(rounds_m=ROUNDS_M, progress_m=hostile_like(PROGRESS_M))
def test_the_round_wait_catch_up_and_heartbeat_survive_any_round_or_progress_record(world, rounds_m, progress_m):
    ia = world.ids[0]
    signed_as_m(world, rounds_m, progress_m)
    dht = FakeDHT(run_entries(world, rounds_m, progress_m))
    found = records.read_rounds(dht, world.prefix)
    assert_honest_read(world, found)
    counted = agreement.counted(found, set(), set())
    state = agreement.backed(found, counted, ia)
    agreement.catch_up_target(state, 3, D1, False)
    agreement.runs_ahead(state, found, counted, 3, D1)
    agreement.still_finishing(found, set(), 8, D1)
    entry.addresses_of(found, ia)
    beat = Heartbeat(RunDHT(dht, world.keys[0], world.prefix), ia, Gate(world.config, ia), _NoEntries())
    beat._beat()
    progress = beat.round_progress(4, 10, 1000, 2.0)
    assert 10 <= progress.tokens < float("inf") and progress.peers in (1, 2, 3)
    beat.stale_peers(), beat.fresh_peers(), beat.swarm_round()
    assert "run" not in rounds_seen(found, beat._reports, time.time())  # one line, of rounds and peers


@FUZZ
@given(rounds_m=ROUNDS_M, progress_m=hostile_like(PROGRESS_M), expiration=st.floats())
def test_the_observer_status_and_dashboard_survive_any_round_or_progress_record(
    world, rounds_m, progress_m, expiration
):
    signed_as_m(world, rounds_m, progress_m)
    dht = FakeDHT(run_entries(world, rounds_m, progress_m), expiration)
    reader = RunReader(
        world.config, RunDHT.of_run(dht, world.keys[0], world.config), Gate(world.config, dht.peer_id, member=False)
    )
    poll = reader.poll()
    assert_honest_read(world, poll[0])
    log = service.run_log(world.config)
    log.ingest(*poll, now=NOW)
    view = log.view(NOW + 1)
    json.dumps(view, allow_nan=False)  # what the dashboard's /api/view sends
    service.status_lines(view, world.ids[0])
    log.to_evaluate(1, NOW + 1)


CONFIG_M = {"fingerprint": "e" * 16, "shared": {"run": {"rounds": 8}}, "signature": ""}
GENESIS_M = {
    "fingerprint": "e" * 16,
    "theta0": D1,
    "final_round": 8,
    "final_digest": D2,
    "signature": "",
    "shared": {"run": {"rounds": 8}},
}


@FUZZ
@given(config_m=hostile_like(CONFIG_M), genesis_m=hostile_like(GENESIS_M), run_id_m=HOSTILE)
def test_run_identity_survives_any_config_genesis_or_run_id_record(world, config_m, genesis_m, run_id_m, monkeypatch):
    monkeypatch.setattr("p2p_diloco.swarm.run_identity.LOOKS", 0)  # no second look: nobody is live here
    run_id = world.config.run.run_id
    m = world.keys[2].local_public_key
    dht = FakeDHT(
        {
            records.run_prefix(run_id, "configs"): {m: config_m},
            records.run_prefix(run_id, "genesis"): {m: genesis_m},
            records.RUNS_KEY: {m: run_id_m},
        }
    )
    ia = world.ids[0]
    identity = RunIdentity(world.config, RunDHT(dht, world.keys[0], world.prefix), Gate(world.config, ia), ia)
    try:
        verdict = identity.check(D1)
    except RunConfigMismatch as e:  # a well-formed genesis of another config, nobody live: refused
        assert "another config" in str(e)
    else:
        assert verdict.kind in ("new", "dormant")
    identity.final_state()


@FUZZ
@given(value=hostile_like({"peer_id": M, "name": "m"}), revoked=HOSTILE, convicted=HOSTILE)
def test_certificates_revocations_and_accusations_survive_anything(world, value, revoked, convicted):
    m = world.keys[2].local_public_key
    text = as_json_text(value) if isinstance(value, dict) else value
    assert set(records.certificates_in(FakeDHT({"c": {m: text}}).get("c"))) <= {world.ids[2]}
    dht = FakeDHT(
        {
            f"{world.prefix}_revoked": {m: revoked},
            records.progress_key(world.prefix): {m: {**honest_progress(world.ids[2]), "convicted": convicted}},
        }
    )
    assert all(isinstance(t, str) for t in records.read_revocations(dht, world.prefix))
    records.revocation_holders(dht, world.prefix, "x")
    _, accusations = records.read_progress(dht, world.prefix)
    assert records.convicted_by(accusations).keys() <= {p for ps in accusations.values() for p in ps}


def test_in_a_certified_run_a_non_members_record_is_never_parsed(world):
    """Admission before parsing: the readers ask the gate which signers are members first, and
    hand only their records to a parser (here a spy); a non-member's is never read."""
    ia, ib, im = world.ids
    parsed = []

    def spy(value):
        parsed.append(value["peer"])
        return RoundRecord.parse(value)

    entries = list(run_entries(world, honest_round(im), honest_progress(im))[records.rounds_key(world.prefix)].items())
    members = lambda signers: signers & {ia, ib}  # noqa: E731 (a gate that admits a and b)
    assert [r.peer for r in records.signed_by_their_peer(entries, spy, members)] == [ia, ib]
    assert parsed == [ia, ib]
    dht = FakeDHT(run_entries(world, honest_round(im), {**honest_progress(im), "convicted": [ia]}))
    assert set(records.read_rounds(dht, world.prefix, members)) == {ia, ib}
    reports, accusations = records.read_progress(dht, world.prefix, members)
    assert {r.peer for r in reports} == {ia, ib} and accusations == {ia: [], ib: []}
    assert records.read_progress(dht, world.prefix)[1][im] == [ia]  # an open run reads everyone's


def as_json_text(value: dict) -> str:
    """A certificate as published: JSON text (bytes written as text; deep nesting as the text of
    it, which the reader's json.loads meets)."""
    try:
        return json.dumps(value, default=repr)
    except (RecursionError, ValueError):
        return "[" * 5000 + "]" * 5000


class _NoEntries:
    def tend(self, *args, **kwargs):
        pass


@pytest.mark.parametrize(
    "meta",
    [{"round": 2**64 - 1, "digest": D1}, {"round": -1, "digest": D1}, {"round": 3.0, "digest": D1}, {"round": 3}, [3]],
)
def test_a_served_state_with_malformed_metadata_is_one_problem_line_and_the_next_holder_is_asked(meta):
    # A round of 64 unsigned bits (msgpack carries it) killed every downloader: the state's digest
    # packs the round in 64 signed bits, and that check ran outside the download's error handling.
    import asyncio

    import torch

    from p2p_diloco.protocol import outer
    from p2p_diloco.protocol.network import download_verified
    from p2p_diloco.swarm.averaging.served import read_served_state
    from tests.unit.test_deadlines import served

    like = {"w": torch.zeros(4)}
    good = outer.GlobalState(3, {"w": torch.ones(4)}, {"w": torch.zeros(4)})
    metas = {"liar": meta, "honest": {"round": 3, "digest": good.digest()}}

    def fetch(peer, timeout):
        stream = served([torch.ones(4), torch.zeros(4)], 0.0, meta=metas[peer])
        return asyncio.run(read_served_state(stream, 1 << 20, peer, stall_s=1.0))

    said = []
    peer, (metadata, _) = download_verified(
        fetch,
        ["liar", "honest"],
        5.0,
        lambda m, t: outer.served_digest(m, t, like),
        lambda r, d: (r, d) == (3, good.digest()),
        "round 3",
        lambda *args: said.append(args[0] % args[1:]),
    )
    assert (peer, metadata["round"]) == ("honest", 3)
    assert len(said) == 1 and said[0].startswith("state download from liar failed: liar: WireError"), said
