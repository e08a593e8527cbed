"""The observer's own held-out loss and `export --initial-peers` (p2p_diloco/observe/evaluate.py): states
downloaded from peers that may lie, verified against the agreed digest, evaluated as a peer does.
The peers here are scripted sources (whole states, manifests and their chunks); the real download
over libp2p is in tests/swarm/test_observer.py."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from p2p_diloco import config
from p2p_diloco.errors import StateDownloadError
from p2p_diloco.observe.evaluate import RETRY_S, Evaluations, HeldOut, RunModel, download_agreed
from p2p_diloco.observe.run_view import Target
from p2p_diloco.observe.service import fetch_agreed
from p2p_diloco.protocol import chunks, outer
from p2p_diloco.protocol.budget import ProgressReport
from p2p_diloco.protocol.network import Assembled, RoundRecord, download_verified
from p2p_diloco.train import data
from p2p_diloco.train import model as model_mod
from tests.conftest import TINY

A, B, C = "QmAAAA", "QmBBBB", "QmCCCC"


@pytest.fixture(scope="module")
def cfg():
    return config.load(None, TINY)


@pytest.fixture(scope="module")
def held(cfg):
    return HeldOut(cfg)


def served(cfg, round_: int, seed: int) -> tuple[dict, list[torch.Tensor], str]:
    """A state of the run's model as a peer serves it (θ of another seed, a momentum), and its digest."""
    tokenizer = model_mod.load_tokenizer(cfg.model.tokenizer)
    params = dict(
        model_mod.init_model(model_mod.model_config(cfg.model, tokenizer.vocab_size), seed).named_parameters()
    )
    theta = {k: v.detach().clone() for k, v in params.items()}
    momentum = {k: torch.full_like(v, 0.01) for k, v in theta.items()}
    state = ({"round": round_, "digest": "claimed, never read"}, [outer.flatten(theta), outer.flatten(momentum)])
    return state[0], state[1], outer.digest(round_, theta, momentum)


def test_the_held_out_loss_is_the_models_mean_loss_on_the_runs_held_out_batch(cfg, held):
    metadata, tensors, _ = served(cfg, 3, seed=7)
    # By hand: the same model from the served θ, on the held-out rows a peer evaluates, one forward pass.
    model = model_mod.init_model(held.model_config, 7)
    corpus = data.open_corpus(cfg.data)
    tokenizer = model_mod.load_tokenizer(cfg.model.tokenizer)
    batch = data.heldout_batch(corpus, tokenizer, cfg.model.seq_len, cfg.run.eval_sequences, cfg.data.heldout_fraction)
    with torch.no_grad():
        expected = float(model.eval()(input_ids=batch, labels=batch).loss)
    assert held.loss((metadata, tensors)) == pytest.approx(expected, rel=1e-5)
    assert held.loss((metadata, tensors)) != pytest.approx(held.loss(served(cfg, 3, seed=8)[:2]), rel=1e-3)


def test_the_digest_of_a_served_state_is_computed_not_read_and_a_malformed_one_is_named(cfg, held):
    metadata, tensors, digest = served(cfg, 3, seed=7)
    assert held.digest(metadata, tensors) == digest
    tampered = [tensors[0].clone(), tensors[1]]
    tampered[0][0] += 1e-6
    assert held.digest(metadata, tampered) != digest
    assert held.digest(metadata, [tensors[0][:-1], tensors[1]]) is None  # malformed: not this model's shape
    assert held.digest({"round": "x"}, tensors) is None
    assert held.digest(metadata, [tensors[0]]) is None


class Source:
    """Scripted holders: `answers[peer]` is what it sends whole (a state, None, or an exception to
    raise); `chunked[peer]`, the state whose manifest and chunks it serves, if any. Chunks come as a
    ChunkFetcher assembles them: each checked against the manifest, so a holder's chunks make
    exactly the state it built its manifest of."""

    def __init__(self, answers, chunked=None, rounds=None):
        """`rounds[peer]`, if given: the one round whose manifest the peer serves (it moved on)."""
        self.answers, self.chunked, self.rounds, self.closed = answers, chunked or {}, rounds or {}, False
        self.asked: list[tuple] = []

    def fetch(self, peer, timeout):
        self.asked.append(("whole", peer))
        answer = self.answers[peer]
        if isinstance(answer, Exception):
            raise answer
        return answer

    def manifests(self, peers, wanted):
        self.asked.append(("manifests", tuple(peers)))
        serving = [p for p in peers if p in self.chunked and self.rounds.get(p, wanted[0]) == wanted[0]]
        return {p: self._manifest(p, wanted) for p in serving}

    def _manifest(self, peer, wanted):
        metadata, tensors = self.chunked[peer]
        return chunks.manifest_of(*wanted, [memoryview(t.numpy()).cast("B") for t in tensors])

    def download_chunks(self, manifest, holders, timeout):
        self.asked.append(("chunks", tuple(holders)))
        return Assembled([t.clone() for t in self.chunked[holders[0]][1]], "", {}, frozenset())

    def close(self):
        self.closed = True


def test_a_lying_holder_is_skipped_and_the_next_ones_verified_state_is_taken(cfg, held):
    metadata, tensors, digest = served(cfg, 4, seed=7)
    lie = served(cfg, 4, seed=9)  # a state of its own, claimed as round 4
    source = Source({A: lie[:2], B: None, C: (metadata, tensors)})  # holders that serve no chunks
    found = download_agreed(held, source, Target(4, digest, (A, B, C)), lambda r, d: (r, d) == (4, digest), 5.0)
    assert (found.round, found.digest, found.served_by) == (4, digest, (C,))
    assert source.asked == [("manifests", (A, B, C)), ("whole", A), ("whole", B), ("whole", C)]
    with pytest.raises(StateDownloadError) as error:
        download_agreed(held, source, Target(4, digest, (A, B)), lambda r, d: (r, d) == (4, digest), 5.0)
    assert "QmAAAA: state of round 4 digest" in str(error.value) and "QmBBBB: sent nothing" in str(error.value)


def test_a_state_of_another_shape_is_named_malformed_and_the_next_holders_state_is_taken(cfg, held):
    metadata, tensors, digest = served(cfg, 4, seed=7)
    answers = {A: (metadata, [tensors[0][:-1], tensors[1]]), C: (metadata, tensors)}
    said = []
    fetch = lambda peer, timeout: answers[peer]  # noqa: E731
    wanted = lambda r, d: (r, d) == (4, digest)  # noqa: E731
    found = download_agreed(held, Source(answers), Target(4, digest, (A, C)), wanted, 5.0)
    assert (found.round, found.digest, found.served_by) == (4, digest, (C,))
    with pytest.raises(StateDownloadError) as error:
        download_verified(fetch, [A], 5.0, held.digest, wanted, "round 4", lambda *a: said.append(a[0] % a[1:]))
    assert "QmAAAA: state of round 4 malformed (not this model's shape) does not match round 4" in str(error.value)
    assert said == ["rejected the state offered by QmAAAA: round 4 malformed (not this model's shape)"]
    assert error.value.served == {A: (4, None)}  # a catch-up asks that holder for that state no more


def test_evaluations_note_the_loss_of_the_round_and_say_a_failure_only_when_it_repeats(cfg, held, caplog, monkeypatch):
    metadata, tensors, digest = served(cfg, 5, seed=7)
    noted = []
    source = Source({A: ConnectionError("gone"), B: (metadata, tensors)})
    target = Target(5, digest, (A,))
    evaluations = Evaluations(held, source, lambda: target, lambda r, d: d == digest, lambda *a: noted.append(a), 5.0)
    clock = [100.0]
    monkeypatch.setattr("p2p_diloco.observe.evaluate.time.monotonic", lambda: clock[0])
    # No holder serves chunks: each try also asks `pick` for a newer round, for NEWER_WAIT_S of a
    # clock that stands still here (none comes: `pick` names round 5 throughout).
    monkeypatch.setattr("p2p_diloco.observe.evaluate.NEWER_WAIT_S", 0.0)
    with caplog.at_level(logging.DEBUG, logger="p2p_diloco.observe.evaluate"):
        assert not evaluations.once()
        assert not evaluations.once()  # not asked again before RETRY_S
        clock[0] += RETRY_S
        assert not evaluations.once()
    failures = [r for r in caplog.records if "not computed" in r.getMessage()]
    assert [r.levelno for r in failures] == [logging.DEBUG, logging.WARNING]
    target, clock[0] = Target(5, digest, (A, B)), clock[0] + RETRY_S  # B holds it now
    assert evaluations.once()
    assert noted == [(5, digest, pytest.approx(held.loss((metadata, tensors))))]
    evaluations.close()
    assert source.closed


def test_export_from_the_swarm_takes_the_newest_agreed_state_within_its_wait(cfg):
    model = RunModel(cfg)
    metadata, tensors, digest = served(cfg, 2, seed=7)

    def poll():
        records = {p: RoundRecord(p, 2, digest, 10, 2.0, group=(A, B), outcome="averaged") for p in (A, B)}
        return records, [ProgressReport(A, 2, 0, 1.0, time.time())], {}  # B sends no heartbeat: not asked

    found = fetch_agreed(cfg, poll, Source({A: (metadata, tensors), B: None}), model, wait_s=5)
    assert (found.round, found.digest, found.served_by) == (2, digest, (A,))
    assert torch.equal(outer.flatten(model.params(found.state)), tensors[0])
    with pytest.raises(StateDownloadError, match="no round that counted peers agreed on was seen"):
        fetch_agreed(cfg, lambda: ({}, [], {}), Source({}), model, wait_s=0)  # a swarm with no agreed round


def test_export_after_the_holders_of_a_finished_run_left_says_so_at_once(cfg):
    model = RunModel(cfg)
    _, _, digest = served(cfg, cfg.run.rounds, seed=7)
    final = cfg.run.rounds

    def poll():  # the final round's records live on (90 s), but no peer beats any more
        return {p: RoundRecord(p, final, digest, 10, 2.0, group=(A, B), outcome="averaged") for p in (A, B)}, [], {}

    started = time.monotonic()
    with pytest.raises(StateDownloadError) as e:
        fetch_agreed(cfg, poll, Source({}), model, wait_s=30)
    assert time.monotonic() - started < 5, "nobody will serve it again: no point in waiting"
    assert str(e.value) == (
        f"run 'p2p-diloco' finished at round {final} (final digest {digest[:12]}); no peer serves it any more "
        "(they linger swarm.linger_s after the end): export from a peer's run dir, p2p-diloco export RUN_DIR OUT"
    )


def test_the_agreed_state_comes_in_chunks_from_every_holder_of_it_and_whole_only_where_none_serves_chunks(cfg, held):
    metadata, tensors, digest = served(cfg, 4, seed=7)
    wanted = lambda r, d: (r, d) == (4, digest)  # noqa: E731
    source = Source({A: None, B: None, C: None}, chunked={A: (metadata, tensors), C: (metadata, tensors)})
    found = download_agreed(held, source, Target(4, digest, (A, B, C)), wanted, 5.0)
    # B sent no manifest (a peer of an older version, or one that moved on): the chunks of A and C.
    assert (found.round, found.digest, found.served_by) == (4, digest, (A, C))
    assert source.asked == [("manifests", (A, B, C)), ("chunks", (A, C))]
    assert held.digest(*found.state) == digest
    # Chunks that assemble another state (holders that agree on a manifest of a lie) cost that
    # download; then the holders are asked whole, one at a time, and the honest one's state is taken.
    lie = served(cfg, 4, seed=9)
    source = Source({A: lie[:2], C: (metadata, tensors)}, chunked={A: lie[:2]})
    found = download_agreed(held, source, Target(4, digest, (A, C)), wanted, 5.0)
    assert (found.served_by, source.asked) == (
        (C,),
        [("manifests", (A, C)), ("chunks", (A,)), ("whole", A), ("whole", C)],
    )


def test_where_the_holders_moved_on_the_newest_agreed_round_comes_in_chunks_before_any_whole_download(cfg, held):
    """Rounds shorter than the observer's poll: the holders of the round it picked serve the next
    one by the time it asks. It asks for the newer round's chunks, not for one holder's whole state."""
    four, five = served(cfg, 4, seed=7), served(cfg, 5, seed=8)
    wanted = lambda r, d: (r, d) in {(4, four[2]), (5, five[2])}  # noqa: E731
    newer = lambda r: Target(5, five[2], (A, B)) if r == 4 else None  # noqa: E731

    def holders_at_five():
        return Source({A: five[:2], B: five[:2]}, chunked={A: five[:2], B: five[:2]}, rounds={A: 5, B: 5})

    source = holders_at_five()
    found = download_agreed(held, source, Target(4, four[2], (A, B)), wanted, 5.0, newer)
    assert (found.round, found.digest, found.served_by) == (5, five[2], (A, B))
    assert source.asked == [("manifests", (A, B)), ("manifests", (A, B)), ("chunks", (A, B))]
    assert held.digest(*found.state) == five[2]
    # Without a newer round to ask for (none seen yet): the whole path, one holder's newer state.
    source = holders_at_five()
    found = download_agreed(held, source, Target(4, four[2], (A, B)), wanted, 5.0)
    assert (found.round, found.served_by, source.asked) == (5, (A,), [("manifests", (A, B)), ("whole", A)])
    # A newer round that is not newer (the log saw nothing past the target) is not asked twice.
    source = holders_at_five()
    found = download_agreed(held, source, Target(4, four[2], (A, B)), wanted, 5.0, lambda r: Target(4, four[2], (A,)))
    assert source.asked == [("manifests", (A, B)), ("whole", A)]
