"""A conviction's case (swarm/averaging/evidence.py) judged again by anyone, with real identity keys, and
the peer process's handling of accusations (swarm/trust/convictions.py)."""

from concurrent.futures import Future

import pytest
import torch
from hivemind.proto import averaging_pb2

from p2p_diloco import config
from p2p_diloco.protocol import codecs
from p2p_diloco.swarm.averaging.allreduce import WireCodec
from p2p_diloco.swarm.averaging.evidence import Case, judge
from p2p_diloco.swarm.averaging.ledger import part_statement
from p2p_diloco.swarm.transport import identity
from p2p_diloco.swarm.trust.convictions import MAX_PENDING, Convictions
from p2p_diloco.swarm.trust.gate import Gate
from p2p_diloco.trust import audit
from tests.conftest import TINY

CLIP = ("clip", 1.0, 2.0)
CODEC = WireCodec("fp32")


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """Three members with real keys: ([peer ids], {id: private key}, {id: public key})."""
    ids, private = [], {}
    for name in ("x", "y", "z"):
        path = tmp_path_factory.mktemp(name) / "identity.key"
        ids.append(identity.peer_id_of(path))
        private[ids[-1]] = identity.load_identity(path)
    public = {p: identity.key_of(p, identity.public_key_bytes(k)) for p, k in private.items()}
    return ids, private, public


def case_of(group, values, average, forge_sender=None):
    """Reducer x's part 0: each member's signed part (values), x's signed average."""
    ids, private, public = group
    shown = []
    for peer, value in zip(ids, values):
        encoded = CODEC.compress(torch.tensor(value), info=_Info())
        signer = private[forge_sender or peer] if peer == ids[1] else private[peer]
        shown.append(averaging_pb2.AveragingData(tensor_part=encoded, weight=1.0, peer_id=sealed(signer, ids, encoded)))
    answer = CODEC.compress(torch.tensor(average), info=_Info())
    signature = private[ids[0]].sign(audit.output_statement(b"g", ids[0], 0, answer.buffer))
    return Case(b"g", ids, ids, public, 0, 0, shown, answer, signature)


class _Info:
    key = 1  # an exact tensor: fp32 on the wire


def sealed(signer, ids, encoded, weight=1.0, norms=None):
    """A part's seal as its sender sends it (ledger.Ledger.sign_part): its chunk norms (those of
    its values unless given), signed with the part for reducer x's part 0."""
    norms = audit.chunk_norms(CODEC.extract(encoded)) if norms is None else norms
    return audit.pack_seal(norms, (), signer.sign(part_statement(b"g", ids[0], 0, weight, encoded, norms)))


def test_an_honest_reducers_case_does_not_hold(group):
    # clip: norms 1.41, 2.83, 4.24 x [1, 1]; the lower median 2.83 scales [3, 3] to [2, 2]: mean [5/3, 5/3].
    values = [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]
    assert judge(case_of(group, values, [5 / 3, 5 / 3]), CODEC, CLIP) is None


def test_a_wrong_average_convicts_its_reducer_for_anyone(group):
    verdict = judge(case_of(group, [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]], [500 / 3, 500 / 3]), CODEC, CLIP)
    assert verdict is not None and verdict[0] is False and "off by" in verdict[1]


def test_a_part_its_sender_did_not_sign_proves_nothing_against_the_reducer(group):
    ids = group[0]
    # z signed y's part: in an audit that is the reducer's doing; in someone's case, a forgery.
    verdict = judge(case_of(group, [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]], [9.0, 9.0], forge_sender=ids[2]), CODEC, CLIP)
    assert verdict is not None and verdict[0] is True and "did not sign" in verdict[1]


def _done(value):
    future = Future()
    future.set_result(value)
    return future


def test_each_accusation_is_judged_once_and_convicts_only_when_its_case_holds():
    gate = Gate(config.load(None, TINY), "me")
    convictions = Convictions(gate, "me")
    asked = []

    def verify(accuser, accused):
        asked.append((accuser, accused))
        return _done(accused == "liar")

    convictions.verify = verify
    accusations = {"a": ["liar", "honest", "me"], "b": ["liar"], "me": ["x"]}
    convictions._check(accusations)
    convictions._collect()
    assert sorted(asked) == [("a", "honest"), ("a", "liar")]  # never about itself, nor its own list
    assert gate.convicted == {"liar"} and gate.admitted({"liar", "honest"}) == {"honest"}
    convictions._check(accusations)  # b's accusation of a peer already convicted, a's tried pairs: nothing new
    assert len(asked) == 2


def test_many_accusations_are_judged_a_few_at_a_time():
    gate = Gate(config.load(None, TINY), "me")
    convictions = Convictions(gate, "me")
    convictions.verify = lambda accuser, accused: Future()  # never answers
    convictions._check({f"accuser{i}": [f"peer{i}"] for i in range(20)})
    assert len(convictions._pending) == MAX_PENDING
    assert codecs.get("fp32")  # the case's codec travels by name


def signed_part(group, values, signer_index=1, weight=1.0, norms=None):
    """Member 1's part 0 for reducer 0 (x), signed by member `signer_index`."""
    ids, private, _ = group
    encoded = CODEC.compress(torch.tensor(values), info=_Info())
    seal = sealed(private[ids[signer_index]], ids, encoded, weight, norms)
    return averaging_pb2.AveragingData(tensor_part=encoded, weight=weight, peer_id=seal)


def against_sender(group, message):
    ids, _, public = group
    return Case(b"g", ids, ids, public, 0, 0, [message], averaging_pb2.AveragingData().tensor_part, b"", 1)


def test_a_signed_non_finite_part_convicts_its_sender_for_anyone(group):
    verdict = judge(against_sender(group, signed_part(group, [1.0, float("nan")])), CODEC, CLIP)
    assert verdict == (False, "signed a part 0 with non-finite values")
    assert judge(against_sender(group, signed_part(group, [1.0, 2.0])), CODEC, CLIP) is None  # a fine part


@pytest.mark.parametrize("weight", [float("nan"), -1.0, float("inf")])
def test_a_signed_weight_that_is_not_finite_and_positive_convicts_its_sender_for_anyone(group, weight):
    # It took the same path as a NaN part and was never convicted: +12.5 % held-out loss, live (issue 27).
    verdict = judge(against_sender(group, signed_part(group, [1.0, 2.0], weight=weight)), CODEC, CLIP)
    assert verdict == (False, f"signed a malformed part 0 (weight {weight})")


def test_the_reducer_keeps_a_case_against_every_malformed_signed_part_and_refuses_a_misfit(group):
    """ConsistentAllReduceRunner._take_part on a reducer (member 0, x) with a real ledger: a signed
    part with a bad weight is a case anyone can judge; one of another size than x's layout makes x
    refuse its sender (only x knows its layout); a fine part passes."""
    from types import SimpleNamespace

    from hivemind.averaging.allreduce import AllreduceException

    from p2p_diloco.swarm.averaging.allreduce import ConsistentAllReduceRunner
    from p2p_diloco.swarm.averaging.ledger import Ledger

    ids, private, public = group
    like = torch.zeros(2)

    def take(message):
        runner = SimpleNamespace(
            sender_peer_ids=ids, _my_index=0, ledger=Ledger(b"g", ids, ids, private[ids[0]], public)
        )
        decoded = CODEC.extract(message.tensor_part)
        try:
            return ConsistentAllReduceRunner._take_part(runner, 1, 0, decoded, message, like), runner.ledger
        except AllreduceException as e:
            return str(e), runner.ledger

    fine, ledger = take(signed_part(group, [1.0, 2.0]))
    assert torch.equal(fine, torch.tensor([1.0, 2.0])) and not ledger.garbage and not ledger.misfits
    why, ledger = take(signed_part(group, [1.0, 2.0], weight=-1.0))
    assert why == f"{ids[1]} signed and sent a malformed part (weight -1.0)" and set(ledger.garbage) == {ids[1]}
    why, ledger = take(signed_part(group, [1.0, 2.0, 3.0]))
    assert "sent a part of shape (3,), expected (2,)" in why and ledger.misfits == {ids[1]} and not ledger.garbage


def test_a_signed_norm_that_is_not_its_parts_convicts_its_sender_for_anyone(group):
    # [3, 4] has norm 5; a sender that signs 1 would escape clip's scale in the audit of a chunk,
    # where the auditor takes the norms from the seal (trust/audit.py): it signed a malformed part.
    verdict = judge(against_sender(group, signed_part(group, [3.0, 4.0], norms=(1.0,))), CODEC, CLIP)
    assert verdict == (False, "signed a malformed part 0 (chunk 0 signed with norm 1, its values' is 5)")
    assert judge(against_sender(group, signed_part(group, [3.0, 4.0], norms=(5.0,))), CODEC, CLIP) is None
    two = judge(against_sender(group, signed_part(group, [3.0, 4.0], norms=(5.0, 0.0))), CODEC, CLIP)
    assert two == (False, "signed a malformed part 0 (2 chunk norms for 1 chunks)")


def test_a_part_header_of_any_size_has_a_statement(group):
    # A part's header is the sender's word: sizes (uint32 each) whose product passes 64 bits made
    # struct.pack raise while the reducer checked the signature.
    ids, _, _ = group
    message = signed_part(group, [1.0, 2.0])
    for size in ([2**32 - 1] * 3, [2**31, 2**31, 8], [0]):
        message.tensor_part.size[:] = size
        assert part_statement(b"g", ids[0], 0, 1.0, message.tensor_part, (1.0,))


def test_nobody_can_make_a_senders_honest_part_look_malformed(group):
    message = signed_part(group, [1.0, 2.0])
    message.tensor_part.size[:] = [3]  # the reducer tells another size: the signature no longer covers it
    verdict = judge(against_sender(group, message), CODEC, CLIP)
    assert verdict is not None and verdict[0] is True  # forged: proof of nothing
    forged = signed_part(group, [1.0, float("nan")], signer_index=2)  # z signs garbage as if y sent it
    assert judge(against_sender(group, forged), CODEC, CLIP)[0] is True


def _served(case):
    """What `rpc_evidence` streams for `case` (`EvidenceDesk.answer`), and the desk that parses it."""
    import asyncio

    from hivemind.utils.serializer import MSGPackSerializer

    from p2p_diloco.swarm.averaging.evidence import EvidenceDesk, _case_complete
    from p2p_diloco.swarm.transport import streams

    evidence = EvidenceDesk(stub=None, serializer=MSGPackSerializer, codec=CODEC, aggregation=CLIP)
    evidence.file("accused", case)

    async def collect():
        # The asker's side of swarm/transport/streams.py: the handler lingers until the asker ends its request
        # stream, which it does once it holds the signed average; both ends well within 5 s.
        async def call(requests):
            return evidence.answer(requests, None)

        request = averaging_pb2.AveragingData(peer_id=b"accused")
        return await asyncio.wait_for(streams.ask(call, request, _case_complete, 10, 5), 5)

    return evidence, asyncio.run(collect())


def test_a_served_case_parses_back_into_the_same_verdict(group):
    ids = group[0]
    for case, accused in [
        (case_of(group, [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]], [500 / 3, 500 / 3]), ids[0]),  # a lying reducer
        (against_sender(group, signed_part(group, [1.0, float("nan")])), ids[1]),  # a sender of garbage
    ]:
        evidence, messages = _served(case)
        parsed = evidence._case_from(accused, messages)
        assert parsed is not None and judge(parsed, CODEC, CLIP) == judge(case, CODEC, CLIP)
        assert judge(parsed, CODEC, CLIP)[0] is False  # a conviction, for anyone
        assert evidence._case_from(ids[2], messages) is None  # the case names someone else


def test_a_served_case_of_any_form_is_a_case_or_none_never_an_error(group):
    """The case an accuser serves, its header fuzzed (tests/unit/test_untrusted_records.py's
    hostile values in every field) and its part index any float: `_case_from` returns a case or
    None; a malformed one is dropped, never raised into the averager's handler."""
    from hivemind.utils.serializer import MSGPackSerializer
    from hypothesis import given
    from hypothesis import strategies as st

    from tests.unit.test_untrusted_records import FUZZ, HOSTILE, mutated

    ids = group[0]
    evidence, messages = _served(against_sender(group, signed_part(group, [1.0, float("nan")])))
    header = MSGPackSerializer.loads(messages[0].peer_id)

    @FUZZ
    @given(fields=mutated(header) | HOSTILE, part=st.floats() | st.integers(0, 2**40))
    def fuzz(fields, part):
        try:
            raw = MSGPackSerializer.dumps(fields)
        except (TypeError, ValueError, OverflowError):  # not packable: no accuser can send it
            return
        first = averaging_pb2.AveragingData(group_id=messages[0].group_id, weight=float(part), peer_id=raw)
        found = evidence._case_from(ids[1], [first, *messages[1:]])
        assert found is None or found.senders[found.sender] == ids[1]

    fuzz()
