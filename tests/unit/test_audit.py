"""Reducer accountability (trust/audit.py, swarm/averaging/ledger.py): the pure checks, with values by hand, and
the signatures with real identity keys."""

from collections import Counter

import pytest
import torch
from hivemind.averaging.allreduce import AllreduceException
from hivemind.proto import runtime_pb2
from hivemind.utils.crypto import RSAPrivateKey

from p2p_diloco.protocol import codecs
from p2p_diloco.swarm.averaging.ledger import Ledger
from p2p_diloco.swarm.transport import identity
from p2p_diloco.trust import audit

FP32 = codecs.get("fp32")
MEAN = ("mean", 1.0, 2.0)
CLIP = ("clip", 1.0, 2.0)


def test_an_honest_average_passes_and_a_scaled_or_random_one_is_caught():
    parts = [torch.tensor([1.0, 1.0]), torch.tensor([3.0, 3.0])]
    # mean of [1, 1] and [3, 3] with weights 1, 1: [2, 2], norm 2.83; 1 % of it is 0.028.
    assert audit.disagreement(parts, [1.0, 1.0], MEAN, FP32, torch.tensor([2.0, 2.0])) is None
    assert audit.disagreement(parts, [1.0, 1.0], MEAN, FP32, torch.tensor([2.01, 2.0])) is None  # off by 0.01
    assert "off by 0.1" in audit.disagreement(parts, [1.0, 1.0], MEAN, FP32, torch.tensor([2.1, 2.0]))
    assert "off by" in audit.disagreement(parts, [1.0, 1.0], MEAN, FP32, torch.tensor([200.0, 200.0]))
    assert "non-finite" in audit.disagreement(parts, [1.0, 1.0], MEAN, FP32, torch.tensor([float("nan"), 2.0]))
    assert "shape" in audit.disagreement(parts, [1.0, 1.0], MEAN, FP32, torch.tensor([2.0, 2.0, 2.0]))


def test_the_check_recomputes_the_runs_aggregator_not_the_mean():
    # clip: norms 1.41 and 4.24, the lower median 1.41; [3, 3] is scaled to [1, 1]: the answer is [1, 1].
    parts = [torch.tensor([1.0, 1.0]), torch.tensor([3.0, 3.0])]
    assert audit.disagreement(parts, [1.0, 1.0], CLIP, FP32, torch.tensor([1.0, 1.0])) is None
    assert audit.disagreement(parts, [1.0, 1.0], CLIP, FP32, torch.tensor([2.0, 2.0])) is not None


def test_the_audited_part_depends_on_every_average_and_every_lot_and_stays_in_range():
    outputs = [audit.digest(bytes([i])) for i in range(5)]
    lots = [b"lot x", b"lot y", b"lot z"]
    seed = audit.seed(b"group", outputs, lots)
    assert seed == audit.seed(b"group", list(outputs), list(lots))
    assert seed != audit.seed(b"group", outputs[:4] + [audit.digest(b"changed")], lots)
    assert seed != audit.seed(b"other group", outputs, lots)
    assert seed != audit.seed(b"group", outputs, lots[:2] + [b"another lot z"])  # any member's lot
    assert seed != audit.seed(b"group", outputs[:4], [outputs[4]] + lots)  # an average is not a lot
    picks = {audit.audited_parts(audit.seed(b"g", [bytes([i])], lots), "reducer", 7)[0] for i in range(200)}
    assert picks == set(range(7))  # every part can be picked, none outside


def test_statements_bind_every_field():
    base = audit.part_statement(b"g", "r", 0, 1.0, b"bytes")
    assert base != audit.part_statement(b"g", "r", 0, 2.0, b"bytes")  # the weight
    assert base != audit.part_statement(b"g", "r", 1, 1.0, b"bytes")  # the part
    assert base != audit.part_statement(b"g", "s", 0, 1.0, b"bytes")  # the reducer
    assert base != audit.part_statement(b"h", "r", 0, 1.0, b"bytes")  # the group
    assert base != audit.part_statement(b"g", "r", 0, 1.0, b"other")  # the bytes
    assert base != audit.part_statement(b"g", "r", 0, 1.0, b"bytes", 2)  # how many values they hold
    assert base != audit.part_statement(b"g", "r", 0, 1.0, b"bytes", 0, "int4")  # their codec
    assert base != audit.output_statement(b"g", "r", 0, b"bytes")  # a part is not an average


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """Two peers' real identity keys, with their peer ids."""
    out = []
    for name in ("x", "y"):
        path = tmp_path_factory.mktemp(name) / "identity.key"
        key = identity.load_identity(path)
        out.append((identity.peer_id_of(path), key))
    return out


def test_a_shown_key_counts_only_for_its_own_peer_id(keys):
    (x, kx), (y, _) = keys
    shown = identity.public_key_bytes(kx)
    assert identity.key_of(x, shown) is not None
    assert identity.key_of(y, shown) is None  # x's key shown as y's
    assert identity.key_of(x, b"garbage") is None and identity.key_of(x, None) is None


def test_the_ledger_keeps_only_parts_and_averages_their_signers_signed(keys):
    (x, kx), (y, ky) = keys
    public = {
        x: identity.key_of(x, identity.public_key_bytes(kx)),
        y: identity.key_of(y, identity.public_key_bytes(ky)),
    }
    at_x = Ledger(b"group", [x, y], [x, y], kx, public)
    at_y = Ledger(b"group", [x, y], [x, y], ky, public)
    part = runtime_pb2.Tensor(buffer=b"\x00" * 8, size=[2], dtype="fp32")
    decoded = torch.zeros(2)
    signed = at_y.sign_part(0, 0, 1.0, part, decoded)  # y sends x (reducer 0) its part 0
    at_x.accept_part(0, 1, 0, 1.0, part, signed)
    assert at_x.parts[0][1].sealed() == signed
    with pytest.raises(AllreduceException, match="valid signature"):  # the weight was changed on the way
        at_x.accept_part(0, 1, 0, 5.0, part, signed)
    with pytest.raises(AllreduceException, match="valid signature"):  # x cannot sign for y
        at_x.accept_part(0, 1, 0, 1.0, part, at_x.sign_part(0, 0, 1.0, part, decoded))
    with pytest.raises(AllreduceException, match="valid signature"):  # its norms changed on the way
        at_x.accept_part(0, 1, 0, 1.0, part, audit.pack_seal((1.0,), (), audit.unpack_seal(signed)[2]))
    with pytest.raises(AllreduceException, match="valid signature"):  # no seal at all
        at_x.accept_part(0, 1, 0, 1.0, part, b"\x00")
    average = runtime_pb2.Tensor(buffer=b"\x01" * 8, size=[2], dtype="fp32")
    at_y.accept_average(0, 0, average, at_x.sign_average(0, 0, average))
    with pytest.raises(AllreduceException, match="valid signature"):
        at_y.accept_average(
            0, 0, runtime_pb2.Tensor(buffer=b"\x02" * 8, size=[2], dtype="fp32"), at_x.sign_average(0, 0, average)
        )
    with pytest.raises(AllreduceException, match=f"no audit lot from {x}, {y}"):
        at_x.seed()  # no seed before every member's lot is in
    assert at_y.lots.accept(x, at_x.own_lot(x)) and at_x.lots.accept(y, at_y.own_lot(y))
    assert at_x.seed() == at_y.seed()  # both hold the same average and the same lots: the same audit
    assert isinstance(kx, RSAPrivateKey)


def test_a_lot_is_the_one_value_its_members_key_gives_and_nobody_else_can_show_it(keys):
    (x, kx), (y, ky) = keys
    public = {p: identity.key_of(p, identity.public_key_bytes(k)) for p, k in ((x, kx), (y, ky))}
    at_x = Ledger(b"group", [x, y], [x, y], kx, public)
    lot = identity.draw_lot(ky, audit.lot_statement(b"group"))
    assert lot == identity.draw_lot(ky, audit.lot_statement(b"group"))  # fixed by key and group
    assert lot != identity.draw_lot(ky, audit.lot_statement(b"other group"))
    n = public[y]._public_key.public_numbers().n
    refused = [
        identity.draw_lot(kx, audit.lot_statement(b"group")),  # x's lot shown as y's
        ky.sign(audit.lot_statement(b"group")),  # y's salted (PSS) signature: one of many
        (int.from_bytes(lot, "big") + n).to_bytes(len(lot) + 1, "big"),  # the same value plus the modulus
        b"\x00" + lot,  # the same value, one byte longer
        b"",
    ]
    assert not any(at_x.lots.accept(y, other) for other in refused)
    assert not at_x.lots.accept("not a member", lot)
    assert at_x.lots.missing() == [x, y]
    assert at_x.lots.accept(y, lot) and at_x.lots.missing() == [x]


def test_a_silent_reducer_is_left_out_for_a_period_that_doubles_up_to_an_hour():
    assert [audit.bench_s(n) for n in (1, 2, 3, 4)] == [120.0, 240.0, 480.0, 960.0]
    assert audit.bench_s(6) == 3600.0 and audit.bench_s(50) == 3600.0  # capped, no overflow


def test_left_out_names_convictions_and_benches_until_they_expire(monkeypatch):
    import time as clock

    from p2p_diloco.swarm.averaging.auditor import Auditor

    audits = Auditor(stub=None, evidence=None, left_out_changed=lambda: None)
    audits.convict("liar")
    now = [1000.0]
    monkeypatch.setattr(clock, "monotonic", lambda: now[0])
    assert audits.left_out("liar") == "it failed an audit as a reducer"
    assert audits.left_out("slow") is None
    audits.bench("slow", "no answer")
    assert "left out for 120 s more" in audits.left_out("slow")
    now[0] += 121
    assert audits.left_out("slow") is None  # served its period
    audits.bench("slow", "no answer again")
    now[0] += 121
    assert "left out for 119 s more" in audits.left_out("slow")  # the second period is 240 s


def test_a_small_model_s_span_is_audited_whole_and_a_big_model_s_one_part_at_a_time():
    mib = 2 * 1024 * 1024
    assert audit.parts_to_audit(mib) == 1  # a big model: one 2 MiB part of each span
    assert audit.parts_to_audit(78_606) == 26  # the tiny preset's parts: every one of a span
    seed = audit.seed(b"g", [b"x"], [b"lot"])
    assert audit.audited_parts(seed, "r", 4, audit.parts_to_audit(78_606)) == [0, 1, 2, 3]
    picked = audit.audited_parts(seed, "r", 10, 3)
    assert len(set(picked)) == 3 and all(0 <= p < 10 for p in picked) and picked == sorted(picked)
    assert audit.audited_parts(seed, "r", 10, 3) == picked  # every member picks the same
    assert audit.audited_parts(seed, "r", 10, 0) == audit.audited_parts(seed, "r", 10, 1)  # at least one


def test_the_audits_wait_follows_what_the_reducer_must_upload_at_the_butterflys_pace():
    # Measured at 10 Mbit/s up (bench/allreduce.py, k = 4, 10 MB of fp32): 625 KB parts, 3 audited
    # per reducer, 4 senders, 3 auditors: 22.5 MB through the reducer's upload. The butterfly
    # delivered 15 MB to each member in 13.6 s (1.1 MB/s): 3 x 20.4 s, not the fixed 15 s that let
    # 1 all-reduce in 6 fail.
    volume = audit.answers_bytes(checks=3 * 3, senders=4, part_bytes=625_000)
    assert volume == 22_500_000
    assert audit.reply_timeout_s(15.0, volume, 15e6 / 13.6) == pytest.approx(3 * 22.5e6 / (15e6 / 13.6))
    # a small group on a fast link keeps the all-reduce's own wait; no pace measured: the same
    assert audit.reply_timeout_s(15.0, 1_000_000, 100e6) == 15.0
    assert audit.reply_timeout_s(15.0, volume, 0.0) == 15.0


def test_an_answer_slower_than_the_chunk_wait_but_as_fast_as_its_volume_allows_is_waited_for(monkeypatch):
    """The home-link failure, reproduced with a delay in place of a busy upload: a reducer's answer
    whose messages come 0.3 s apart, while the all-reduce's chunk wait is 0.1 s. With the answers'
    volume at the butterfly's pace (3 x 2 MB / 8 MB/s x 3 = 2.25 s) the auditor waits for them;
    with no pace measured it keeps the chunk wait and gives up, as every auditor did before."""
    import asyncio
    from types import SimpleNamespace

    from hivemind.proto import averaging_pb2

    from p2p_diloco.swarm.averaging.inspection import Inspector

    senders = 3

    class SlowReducer:
        def __init__(self, _peer):
            pass

        async def rpc_audit(self, requests):
            async def answers():
                async for _ in requests:
                    for _ in range(senders):
                        await asyncio.sleep(0.3)  # its upload is busy with the other auditors' answers
                        yield averaging_pb2.AveragingData(code=averaging_pb2.PART_FOR_AVERAGING)
                    return

            return answers()

    container = SimpleNamespace(part_size_bytes=1_000_000, num_parts_by_peer=(1, 1))
    runner = SimpleNamespace(
        tensor_part_container=container,
        ordered_peer_ids=("me", "reducer", "other"),
        ledger=SimpleNamespace(senders=("me", "reducer", "other"), peers=("me", "reducer", "other")),
        aggregation=("centered-clip", 1.0, 2.0),  # audited whole parts, as before chunks
        sender_timeout=0.1,
        group_id=b"g",
    )
    inspector = Inspector(SlowReducer, evidence=None)
    monkeypatch.setattr(inspector, "_judge", lambda runner, j, part, shown: None if len(shown) == senders else "short")
    # volume: 2 auditors x 1 part x 3 senders x 1 MB = 6 MB, at 8 MB/s: 0.75 s, x 3 = 2.25 s
    item, received = (1, 0, audit.WHOLE_PART), []
    assert asyncio.run(inspector.check(runner, 1, [item], 2, received, pace_bytes_s=8e6)) == {item: (audit.PASS, "")}
    assert len(received) == 1
    found = asyncio.run(inspector.check(runner, 1, [item], 2, [], pace_bytes_s=0.0))
    assert found == {item: (audit.SILENT, "no answer to the audit of part 0 (TimeoutError)")}


def test_an_all_reduce_with_no_chunk_wait_keeps_no_limit_on_its_audit():
    assert audit.reply_timeout_s(None, 22_500_000, 1e6) is None


def test_a_seal_commits_to_every_chunks_digest_and_norm():
    seal = audit.Seal((b"a" * 32, b"b" * 32), (3.0, 4.0))
    assert seal.norm() == 5.0  # the part's norm from its chunks': sqrt(9 + 16)
    assert seal.root() != audit.Seal((b"a" * 32, b"c" * 32), (3.0, 4.0)).root()  # a chunk's bytes
    assert seal.root() != audit.Seal((b"a" * 32, b"b" * 32), (3.0, 4.5)).root()  # a chunk's norm
    assert seal.root() != audit.Seal((b"a" * 32,), (3.0, 4.0)).root()  # how many chunks
    packed = audit.pack_seal(seal.norms, seal.digests, b"signature")
    assert audit.unpack_seal(packed) == (seal.norms, seal.digests, b"signature")
    assert audit.unpack_seal(audit.pack_seal((1.5,), (), b"s")) == ((1.5,), (), b"s")  # as the butterfly sends it


def test_a_seal_from_another_node_is_a_seal_or_a_wire_error():
    from hypothesis import given
    from hypothesis import strategies as st

    from p2p_diloco.trust import wire

    @given(raw=st.binary(max_size=200))
    def fuzz(raw):
        try:
            norms, digests, signature = audit.unpack_seal(raw)
        except wire.WireError:
            return
        assert all(len(d) == 32 for d in digests) and 2 + 8 * len(norms) + 2 + 32 * len(digests) + len(
            signature
        ) == len(raw)

    fuzz()
    with pytest.raises(wire.WireError, match="norms"):
        audit.unpack_seal(b"\x00\x05" + b"\x00" * 16)  # 5 norms in 16 bytes


def test_the_audited_chunks_spread_over_the_span_s_values_and_every_member_picks_the_same():
    C = codecs.CHUNK_VALUES
    sizes = [2 * C + 5, C, C + 282]  # a span of three parts: 6 chunks, two of them 5- and 282-value tails
    everything = [(0, 0), (0, 1), (0, 2), (1, 0), (2, 0), (2, 1)]
    assert audit.audited_chunks(b"seed", "r", sizes, 6) == everything
    assert audit.audited_chunks(b"seed", "r", sizes, 10) == everything  # no more than there are
    picked = audit.audited_chunks(b"seed", "r", sizes, 4)
    assert len(set(picked)) == 4 and set(picked) <= set(everything)  # one of each run of 2, 2, 1, 1 chunks
    assert audit.audited_chunks(b"seed", "r", sizes, 4) == picked
    seeds = [i.to_bytes(2, "big") for i in range(400)]
    seen = Counter(pick for seed in seeds for pick in audit.audited_chunks(seed, "r", sizes, 1))
    assert {(0, 0), (0, 1), (1, 0), (2, 0)} <= set(seen)  # the seed decides: every full chunk can be the one
    # A tail is picked as often as its values are: 287 of 82,207 (0.35 %, 1.4 of 400 expected).
    assert seen[(0, 2)] + seen[(2, 1)] <= 8, seen


def test_a_small_models_tails_do_not_take_the_audits_picks():
    # The fresh-clone failure: 800 kB of fp32 in 66,667-byte parts (links.part_bytes), each a full
    # chunk and a 282-value tail, and the 10 exact values as a part of their own. Picked by chunk
    # index, 4 picks over such a span found 1 full chunk for some seeds. Now one pick from each
    # quarter of the span's 11 chunks, each in proportion to its values: a tail is picked as often
    # as it holds values in its quarter. By hand, the quarters' chances of a tail or the 10 values:
    # 282 / 16,666, 282 / 33,332, 564 / 16,948 and 292 / 16,676: 0.0762 a seed, 152.4 in 2,000.
    sizes = [16_666] * 5 + [10]
    full = Counter()
    for i in range(2000):
        picked = audit.audited_chunks(i.to_bytes(2, "big"), "r", sizes)
        assert len(set(picked)) == 4 and picked == sorted(picked), (i, picked)
        full[sum(1 for part, chunk in picked if part < 5 and chunk == 0)] += 1
    tails = sum((4 - n) * seeds for n, seeds in full.items())
    assert 104 <= tails <= 200, full  # 152.4 expected, 4 standard deviations either side
    assert min(full) >= 2, full  # two tails in one audit: 0.2 % of seeds; three: about 1e-5


def test_a_lie_repeated_at_the_audits_spacing_is_caught_as_often_as_an_even_lie():
    # A span of 64 full chunks; the reducer lies on every other run of 8 chunks (half of them).
    # Picks evenly spaced from one drawn offset (the design before) fell all 4 on lied chunks or
    # all 4 on honest ones: caught 1 time in 2. Drawn one per quarter, each independently: caught
    # unless all 4 miss, 1 - (1/2)^4 = 93.75 %.
    C = codecs.CHUNK_VALUES
    lied = {(0, c) for c in range(64) if (c // 8) % 2 == 0}
    seeds = [audit.digest(i.to_bytes(2, "big")) for i in range(4096)]
    caught = sum(1 for seed in seeds if lied & set(audit.audited_chunks(seed, "r", [64 * C])))
    assert 0.92 <= caught / len(seeds) <= 0.955, caught  # 93.75 %, sd 0.38 %


def test_a_reducer_that_holds_every_other_average_cannot_grind_the_seed_without_the_lots():
    # The reducer answers last: it holds the others' averages (as a member) and tries variants of
    # its last average until the audit would spare its lie on half its span. On the averages alone
    # (the seed before lots), 16 variants are enough on average. With every member's lot in the
    # seed, it can only guess the honest lots; the variant its guess spares is caught as often as
    # any lie on half a span is, 15 times in 16.
    C = codecs.CHUNK_VALUES
    lied = {(0, c) for c in range(64) if c % 2 == 0}
    others = [audit.digest(b"average of another reducer")]
    honest_lots = [audit.digest(b"honest member's lot")]

    def spared(group: bytes, lots: list[bytes], variant: int) -> bool:
        seed = audit.seed(group, others + [audit.digest(b"last average %d" % variant)], lots)
        return not lied & set(audit.audited_chunks(seed, "liar", [64 * C]))

    tries, escaped = [], 0
    for gid in (i.to_bytes(2, "big") for i in range(256)):
        tries.append(1 + next(v for v in range(10_000) if spared(gid, honest_lots, v)))  # seed computable
        guessed = next(v for v in range(10_000) if spared(gid, [b"a guess"], v))
        escaped += spared(gid, honest_lots, guessed)
    assert 12 <= sum(tries) / len(tries) <= 20, sum(tries) / len(tries)  # 16 expected: grinding is cheap
    assert escaped <= 32, escaped  # 16 of 256 expected (1/16), sd 3.9


def test_a_chunk_is_combined_with_its_parts_signed_norms():
    # Three senders' chunks [1], [2], [3], their whole parts' norms 10, 1, 1: clip (1 x the lower
    # median, 1) scales the first by 1/10: (0.1 + 2 + 3) / 3 = 1.7. With the chunks' own norms it
    # would be (1 + 2 + 2) / 3: the chunk alone cannot tell clip's scales, the seal does.
    pieces = [torch.tensor([1.0]), torch.tensor([2.0]), torch.tensor([3.0])]
    norms = [10.0, 1.0, 1.0]
    assert audit.chunk_disagreement(pieces, [1.0] * 3, norms, CLIP, FP32, torch.tensor([1.7])) is None
    assert audit.chunk_disagreement(pieces, [1.0] * 3, norms, CLIP, FP32, torch.tensor([5 / 3])) is not None
    aligned = ("aligned-clip", 1.0, 2.0)  # checked as clip with every part kept
    assert audit.chunk_disagreement(pieces, [1.0] * 3, norms, aligned, FP32, torch.tensor([1.7])) is None


@pytest.fixture(scope="module")
def trio(tmp_path_factory):
    """Three members with real keys: (ids, {id: private key}, {id: public key})."""
    ids, private = [], {}
    for name in ("x", "y", "z"):
        path = tmp_path_factory.mktemp(name) / "identity.key"
        ids.append(identity.peer_id_of(path))
        private[ids[-1]] = identity.load_identity(path)
    return ids, private, {p: identity.key_of(p, identity.public_key_bytes(k)) for p, k in private.items()}


def _reduced(trio, parts, aggregation, lie=None):
    """Reducer x's part 0 of 40,000 values (3 chunks) from x, y and z, each signed, and x's signed
    average (`lie` applied to it); (x's ledger, y's ledger holding the average)."""
    from p2p_diloco.swarm.averaging.ledger import SignedAverage
    from p2p_diloco.trust import robust

    ids, private, public = trio
    at = {p: Ledger(b"g", ids, ids, private[p], public) for p in ids}
    for sender, (peer, values) in enumerate(zip(ids, parts)):
        encoded = runtime_pb2.Tensor(buffer=FP32.encode(values), size=[values.numel()], dtype="fp32")
        sealed = at[peer].sign_part(0, 0, 1.0, encoded, values)
        at[ids[0]].accept_part(0, sender, 0, 1.0, encoded, sealed)
    average = robust.aggregate(parts, [1.0] * 3, *aggregation)
    average = average if lie is None else lie(average)
    encoded = runtime_pb2.Tensor(buffer=FP32.encode(average), size=[average.numel()], dtype="fp32")
    at[ids[1]].averages[(0, 0)] = SignedAverage(encoded, at[ids[0]].sign_average(0, 0, encoded))
    return at[ids[0]], at[ids[1]]


def _chunk_verdicts(reducer, auditor, aggregation):
    from p2p_diloco.swarm.averaging.auditor import _shown
    from p2p_diloco.swarm.averaging.inspection import chunk_disagreement

    signed = reducer.parts[0]
    return [
        chunk_disagreement(auditor, aggregation, 0, 0, chunk, [_shown(signed[s], chunk) for s in range(3)])
        for chunk in range(3)
    ]


def test_the_audit_of_a_chunk_passes_an_honest_reducer_and_sees_a_lie_where_it_is(trio):
    """The auditor's check of one chunk (swarm/averaging/auditor.py), with real keys and seals:
    x reduces 40,000 values from x, y and z (clip); y checks each chunk as x shows it."""
    gen = torch.Generator().manual_seed(1)
    parts = [torch.randn(40_000, generator=gen) * scale for scale in (1.0, 2.0, 9.0)]  # z's is clipped
    assert _chunk_verdicts(*_reduced(trio, parts, CLIP), CLIP) == [None, None, None]

    def lie_in_the_last_chunk(average):
        average = average.clone()
        average[32_768:] *= 100
        return average

    verdicts = _chunk_verdicts(*_reduced(trio, parts, CLIP, lie_in_the_last_chunk), CLIP)
    assert verdicts[:2] == [None, None] and "off by" in verdicts[2]  # seen only where audited

    reducer, auditor = _reduced(trio, parts, CLIP)
    from p2p_diloco.swarm.averaging.auditor import _shown
    from p2p_diloco.swarm.averaging.inspection import chunk_disagreement

    signed = reducer.parts[0]
    swapped = [_shown(signed[s], 0) for s in range(3)]
    swapped[1].tensor_part.buffer = _shown(signed[1], 1).tensor_part.buffer  # another chunk's bytes
    assert "not its seal's" in chunk_disagreement(auditor, CLIP, 0, 0, 0, swapped)
    forged = [_shown(signed[s], 0) for s in range(3)]
    forged[2].weight = 5.0  # a weight its sender did not sign
    assert "not signed" in chunk_disagreement(auditor, CLIP, 0, 0, 0, forged)


def test_a_part_aligned_clip_dropped_fails_its_chunk_and_passes_whole(trio):
    """aligned-clip drops z's part, which points against the median: its chunks, checked as clip
    with every part kept, do not check; the whole part, which the auditor then asks for, does."""
    gen = torch.Generator().manual_seed(2)
    base = torch.randn(40_000, generator=gen)
    parts = [base + 0.1 * torch.randn(40_000, generator=gen), base * 1.1, -base]
    aligned = ("aligned-clip", 1.0, 2.0)
    reducer, auditor = _reduced(trio, parts, aligned)
    assert all(v is not None for v in _chunk_verdicts(reducer, auditor, aligned))
    whole = [reducer.parts[0][s].encoded for s in range(3)]
    decoded = [FP32.decode(e.buffer, 40_000) for e in whole]
    answered = FP32.decode(auditor.averages[(0, 0)].encoded.buffer, 40_000)
    assert audit.disagreement(decoded, [1.0] * 3, aligned, FP32, answered) is None
