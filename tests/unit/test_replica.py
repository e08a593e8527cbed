"""The round on a replica alone: no Peer, no tokenizer, no corpus, no run dir of a peer.

A `Replica` is built from a model, a stream of random token batches and a metrics file; the round
(`RoundDriver`), the catch-up (`StateSync`) and the swarm (tests/unit/fake_swarm.py) are handed
the replica. Each test checks what a round must do to it: commit a whole new state with its
record and checkpoint, adopt the majority's whole state, or change nothing.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import torch

from p2p_diloco import config
from p2p_diloco.protocol import outer
from p2p_diloco.round.driver import RoundDriver, RoundEnd
from p2p_diloco.round.replica import Display, Replica
from p2p_diloco.round.sync import StateSync
from p2p_diloco.train import checkpoint, ranks
from p2p_diloco.train import model as model_mod
from p2p_diloco.train.inner import InnerTrainer
from p2p_diloco.train.metrics import MetricsLog, PeerLogger, Phase, ProgressBar
from tests.conftest import TINY
from tests.unit.fake_swarm import ME, FakeSwarm

VOCAB = 64
LR, MU = 0.7, 0.9  # the config's outer step


class RandomTokens:
    """A data stream of seeded random tokens; its state is how many batches it gave."""

    def __init__(self, batch: int, seq_len: int):
        self.shape, self.drawn = (batch, seq_len), 0

    def next_batch(self) -> torch.Tensor:
        self.drawn += 1
        return torch.randint(0, VOCAB, self.shape, generator=torch.Generator().manual_seed(self.drawn))

    def state_dict(self) -> dict:
        return {"drawn": self.drawn}

    def load_state_dict(self, state: dict) -> None:
        self.drawn = state["drawn"]


def make_round(tmp_path: Path, fake: FakeSwarm) -> tuple[Replica, RoundDriver]:
    cfg = config.load(None, {**TINY, "run.dir": str(tmp_path), "run.rounds": "1", "swarm.speed_aware": "false"})
    model = model_mod.init_model(model_mod.model_config(cfg.model, VOCAB), cfg.run.seed)
    state = outer.initial_state(dict(model.named_parameters()))
    trainer = InnerTrainer(model, cfg.inner, cfg.run.rounds * cfg.inner.steps, torch.device("cpu"))
    stream = RandomTokens(cfg.inner.batch_size, cfg.model.seq_len)
    display = Display(PeerLogger(logging.getLogger("test_replica"), ME[-4:]), Phase(), ProgressBar(False, ""))
    metrics = MetricsLog(tmp_path / "metrics.jsonl")
    replica = Replica(state, trainer, stream, ranks.Alone(), metrics, cfg, ME, display)
    sync = StateSync(replica, fake, cfg.swarm, cfg.outer)
    return replica, RoundDriver(replica, fake, sync, cfg)


def test_a_round_commits_the_outer_step_of_the_average_with_its_record_and_checkpoint(tmp_path):
    fake = FakeSwarm()
    fake.script = [fake.group("p1")]  # p1 sent Δ = 0: the average is half this peer's Δ
    replica, driver = make_round(tmp_path, fake)
    theta0 = replica.state.params
    assert driver.run_round(threading.Event()) is RoundEnd.COMMITTED
    lossy, exact = outer.split_exact(theta0)
    sent = {**outer.unflatten(fake.calls[0].delta, lossy), **outer.unflatten(fake.calls[0].exact, exact)}
    # θ(1) by hand: momentum = Δ̄ (it starts at zero), Nesterov step = Δ̄ + μ·Δ̄.
    average = {name: sent[name] / 2 for name in theta0}
    by_hand = {name: theta0[name] - LR * (average[name] + MU * average[name]) for name in theta0}
    assert replica.state.round == 1
    assert all(torch.equal(replica.state.params[name], by_hand[name]) for name in theta0)
    [record] = list(replica.records())
    assert (record["round"], record["group_size"], record["digest"]) == (1, 2, replica.state.digest())
    assert record["total_tokens"] == replica.totals.tokens == 2 * 4 * 32  # H x batch x seq_len
    saved = checkpoint.load(checkpoint.latest(tmp_path), None)
    assert (saved["round"], saved["digest"]) == (1, replica.state.digest())
    assert saved["data"] == {"drawn": 2} and saved["totals"]["inner_steps"] == 2
    assert fake.published[-1].digest == replica.state.digest()


def test_a_stopped_round_changes_nothing(tmp_path):
    fake = FakeSwarm()
    replica, driver = make_round(tmp_path, fake)
    before = replica.state
    stop = threading.Event()
    stop.set()
    assert driver.run_round(stop) is RoundEnd.STOPPED
    assert replica.state is before and replica.served is before and replica.totals.tokens == 0
    assert list(replica.records()) == [] and checkpoint.latest(tmp_path) is None
    assert fake.calls == [] and fake.published == []


def test_a_minority_adopts_the_majority_state_whole(tmp_path):
    fake = FakeSwarm()
    replica, driver = make_round(tmp_path, fake)
    theta0 = replica.state
    majority = outer.GlobalState(
        1,
        {n: t + 0.01 for n, t in theta0.params.items()},
        {n: torch.full_like(t, 0.01) for n, t in theta0.params.items()},
    )

    def outvoted(call):
        result = fake.group("p1", "p2")(call)
        for other in ("p1", "p2"):
            fake.publish_other(other, majority)
        return result

    fake.script = [outvoted]
    assert driver.run_round(threading.Event()) is RoundEnd.ADOPTED
    assert replica.state.digest() == majority.digest()
    assert all(torch.equal(replica.state.momentum[n], majority.momentum[n]) for n in theta0.params)
    [record] = list(replica.records())
    assert (record["digest"], record["adopted"]) == (majority.digest(), True)
    assert replica.totals.tokens == 2 * 4 * 32  # the phase it trained counts, though its state is the majority's
    assert checkpoint.load(checkpoint.latest(tmp_path), None)["digest"] == majority.digest()
