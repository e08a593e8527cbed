"""The inner loop: schedule by hand, accumulation equals one big batch, early stop."""

import math

import pytest
import torch

from p2p_diloco import config
from p2p_diloco.train.inner import InnerTrainer, lr_at


def inner_cfg(**values):
    return config.load().replace("inner", **values).inner


def test_schedule_by_hand():
    cfg = inner_cfg(lr=1.0, warmup_steps=4, min_lr_ratio=0.1, batch_size=8, micro_batch_size=8)
    # warm-up: (step + 1) / 4
    assert [lr_at(s, cfg, 14) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    # cosine over the 10 steps after warm-up, from 1.0 to 0.1
    assert lr_at(4, cfg, 14) == pytest.approx(1.0)
    assert lr_at(9, cfg, 14) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(14, cfg, 14) == pytest.approx(0.1)
    assert lr_at(100, cfg, 14) == pytest.approx(0.1)


class TinyLM(torch.nn.Module):
    """A stand-in with the transformers call signature (model(input_ids=, labels=).loss)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(16, 8)
        self.out = torch.nn.Linear(8, 16)

    def forward(self, input_ids, labels):
        logits = self.out(self.emb(input_ids[:, :-1]))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 16), labels[:, 1:].reshape(-1))
        return type("Out", (), {"loss": loss})()


def batch():
    return torch.randint(0, 16, (8, 6), generator=torch.Generator().manual_seed(1))


def test_accumulation_matches_one_big_batch():
    results = []
    for micro in (8, 2):
        model = TinyLM()
        trainer = InnerTrainer(
            model, inner_cfg(batch_size=8, micro_batch_size=micro, warmup_steps=0), 10, torch.device("cpu")
        )
        loss = trainer.train_step(batch())
        results.append((float(loss), [p.detach().clone() for p in model.parameters()]))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-6)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_phase_counts_steps_tokens_and_stops_early():
    trainer = InnerTrainer(
        TinyLM(), inner_cfg(batch_size=8, micro_batch_size=4, warmup_steps=2), 10, torch.device("cpu")
    )
    seen = []
    result = trainer.run_phase(
        batch, steps=5, should_stop=lambda: len(seen) >= 3, on_step=lambda s, _loss, t: seen.append((s, t))
    )
    assert result.stopped and result.steps == 3 and result.tokens == 3 * 8 * 6
    assert seen == [(1, 48), (2, 96), (3, 144)]
    assert result.lr_sum == pytest.approx(
        lr_at(0, trainer.cfg, 10) + lr_at(1, trainer.cfg, 10) + lr_at(2, trainer.cfg, 10)
    )
    assert trainer.step == 3
    full = trainer.run_phase(batch, steps=2)
    assert not full.stopped and full.steps == 2 and trainer.step == 5


def test_a_phase_ends_early_when_the_swarm_says_the_round_is_done():
    trainer = InnerTrainer(
        TinyLM(), inner_cfg(batch_size=8, micro_batch_size=4, warmup_steps=2), 10, torch.device("cpu")
    )
    asked = []

    def should_end(steps, tokens):
        asked.append((steps, tokens))
        return tokens >= 100

    result = trainer.run_phase(batch, steps=50, should_end=should_end)
    # Asked before steps 2, 3 (never before the first: a phase always has something to contribute).
    assert asked == [(1, 48), (2, 96), (3, 144)]
    assert not result.stopped and result.steps == 3 and result.tokens == 144
    assert trainer.run_phase(batch, steps=5, should_end=lambda s, t: True).steps == 1


def test_training_lowers_the_loss_on_a_fixed_batch():
    trainer = InnerTrainer(
        TinyLM(), inner_cfg(batch_size=8, micro_batch_size=8, warmup_steps=0, lr=1e-2), 50, torch.device("cpu")
    )
    before = trainer.evaluate(batch())
    trainer.run_phase(batch, steps=30)
    assert trainer.evaluate(batch()) < before - 0.5


def test_state_dict_round_trip_continues_identically():
    def run(split):
        model = TinyLM()
        t = InnerTrainer(model, inner_cfg(batch_size=8, micro_batch_size=8, warmup_steps=1), 10, torch.device("cpu"))
        t.run_phase(batch, steps=2)
        if split:
            state = t.state_dict()
            params = [p.detach().clone() for p in model.parameters()]
            model = TinyLM()
            with torch.no_grad():
                for p, q in zip(model.parameters(), params):
                    p.copy_(q)
            t = InnerTrainer(model, t.cfg, 10, torch.device("cpu"))
            t.load_state_dict(state)
        t.run_phase(batch, steps=2)
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b)
