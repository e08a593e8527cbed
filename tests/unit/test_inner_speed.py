"""Inner-loop speed without changing what is trained: batches made ahead (and checkpointed where the
trainer is), fused AdamW on CUDA only, the CPU's bits kept, no per-step loss read, inner.compile."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch

from p2p_diloco.errors import ConfigError, DataError
from p2p_diloco.train import prefetch
from p2p_diloco.train.data import FiniteCorpus, TrainStream
from p2p_diloco.train.inner import InnerTrainer, adamw
from p2p_diloco.train.metrics import ProgressBar
from p2p_diloco.train.model import ByteTokenizer
from p2p_diloco.train.prefetch import Prefetcher
from tests.unit.test_inner import TinyLM, batch, inner_cfg

DEADLINE_S = 10.0


def corpus() -> FiniteCorpus:
    """60 documents of 5-40 bytes: batches of 3 x 16 tokens cross documents and, soon, epochs."""
    texts = {f"doc{i:02d}": f"{i:02d}" + "abcdefghij" * (i % 4) for i in range(60)}
    return FiniteCorpus("hand-made", list(texts), texts.__getitem__)


def stream() -> TrainStream:
    return TrainStream(corpus(), ByteTokenizer(), seq_len=16, shard=1, num_shards=2, seed=0, heldout_fraction=0.1)


@pytest.fixture
def prefetcher():
    made = Prefetcher(stream(), batch_size=3, depth=2)
    yield made
    made.close()


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "p2p-diloco-prefetch"]


# --- batches made ahead ----------------------------------------------------------------------


def test_the_prefetcher_yields_the_streams_batches_in_order_and_its_state_after_each(prefetcher):
    plain = stream()
    for _ in range(40):  # several epochs of the shard
        assert torch.equal(prefetcher.next_batch(), plain.next_batch(3))
        assert prefetcher.state_dict() == plain.state_dict()


def test_its_state_is_the_last_batch_taken_not_the_batches_made_ahead(prefetcher):
    taken = [prefetcher.next_batch() for _ in range(5)]
    deadline = time.monotonic() + DEADLINE_S
    while not prefetcher._queue.full() and time.monotonic() < deadline:  # the thread is 2 batches ahead
        time.sleep(0.01)
    assert prefetcher._queue.full()
    resumed = stream()
    resumed.load_state_dict(prefetcher.state_dict())  # what a checkpoint saved now continues with
    assert torch.equal(resumed.next_batch(3), prefetcher.next_batch())
    plain = stream()
    assert all(torch.equal(batch, plain.next_batch(3)) for batch in taken)


def test_loading_a_state_drops_the_batches_made_ahead(prefetcher):
    plain = stream()
    plain.next_batch(3)
    early = plain.state_dict()
    expected = plain.next_batch(3)
    for _ in range(6):
        prefetcher.next_batch()
    prefetcher.load_state_dict(early)
    assert prefetcher.state_dict() == early
    assert torch.equal(prefetcher.next_batch(), expected)


def test_a_bad_state_is_refused_and_the_prefetcher_goes_on_from_where_it_was(prefetcher):
    plain = stream()
    for _ in range(4):
        assert torch.equal(prefetcher.next_batch(), plain.next_batch(3))
    with pytest.raises(DataError):
        prefetcher.load_state_dict({"epoch": 0, "index": 10**6, "offset": 0, "tokens_consumed": 0})
    assert prefetcher.state_dict() == plain.state_dict()
    assert torch.equal(prefetcher.next_batch(), plain.next_batch(3))


class FailingStream:
    """Two good batches, then the error a stream raises when its corpus cannot be read."""

    def __init__(self):
        self.inner, self.made = stream(), 0

    def next_batch(self, n: int) -> torch.Tensor:
        self.made += 1
        if self.made > 2:
            raise DataError("cannot read doc17: disk gone")
        return self.inner.next_batch(n)

    def state_dict(self) -> dict:
        return self.inner.state_dict()


def test_an_error_of_the_stream_reaches_the_trainer_where_it_wanted_the_batch():
    failing = Prefetcher(FailingStream(), batch_size=3)
    try:
        failing.next_batch(), failing.next_batch()
        for _ in range(2):  # and again at every call after it
            with pytest.raises(DataError, match="disk gone"):
                failing.next_batch()
    finally:
        failing.close()


def test_close_ends_the_thread_even_with_the_queue_full(prefetcher):
    prefetcher.next_batch()
    assert len(prefetch_threads()) == 1
    deadline = time.monotonic() + DEADLINE_S
    while not prefetcher._queue.full() and time.monotonic() < deadline:  # the thread now waits to put
        time.sleep(0.01)
    started = time.monotonic()
    prefetcher.close()
    assert prefetch_threads() == []
    assert time.monotonic() - started < 2 * prefetch.POLL_S + 1.0
    prefetcher.close()  # twice is harmless


def test_a_prefetcher_not_yet_used_has_no_thread():
    made = Prefetcher(stream(), batch_size=3)
    assert prefetch_threads() == []
    made.close()


# --- the optimizer ---------------------------------------------------------------------------


def test_fused_adamw_is_chosen_on_cuda_only():
    cfg = inner_cfg(batch_size=8, micro_batch_size=8)
    # Built, never stepped, so no GPU is needed: the choice is made from the device named.
    on_cuda = adamw(TinyLM(), cfg, torch.device("cuda")).defaults
    on_cpu = adamw(TinyLM(), cfg, torch.device("cpu")).defaults
    assert on_cuda["fused"] is True and not on_cuda["foreach"]
    assert not on_cpu["fused"] and on_cpu["foreach"] is True


def test_the_cpu_optimizer_gives_the_bits_of_the_per_parameter_loop():
    def train(make_optimizer):
        model = TinyLM()
        optimizer = make_optimizer(model)
        for _ in range(5):
            model(input_ids=batch(), labels=batch()).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return [p.detach().clone() for p in model.parameters()]

    cfg = inner_cfg(batch_size=8, micro_batch_size=8, lr=1e-2)
    ours = train(lambda model: adamw(model, cfg, torch.device("cpu")))
    # What the trainer built before: torch's default for CPU tensors, one parameter at a time.
    loop = train(lambda model: loop_adamw(model, cfg))
    assert all(torch.equal(a, b) for a, b in zip(ours, loop))


def test_a_checkpoint_of_another_kernel_resumes_with_this_devices_kernel():
    cfg = inner_cfg(batch_size=8, micro_batch_size=8)
    before = InnerTrainer(TinyLM(), cfg, 10, torch.device("cpu"))
    before.optimizer = loop_adamw(before.model, cfg)  # as the trainer built it before it chose kernels
    before.train_step(batch())
    resumed = InnerTrainer(TinyLM(), cfg, 10, torch.device("cpu"))
    resumed.load_state_dict(before.state_dict())
    assert all(g["foreach"] is True and not g["fused"] for g in resumed.optimizer.param_groups)
    assert resumed.optimizer.state_dict()["state"][0]["exp_avg"].equal(
        before.optimizer.state_dict()["state"][0]["exp_avg"]
    )


def loop_adamw(model: torch.nn.Module, cfg) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), foreach=False)


# --- no loss read per step -------------------------------------------------------------------


def test_the_phase_mean_is_the_mean_of_the_step_losses_as_each_step_would_read_them():
    trainer = InnerTrainer(
        TinyLM(), inner_cfg(batch_size=8, micro_batch_size=4, warmup_steps=2), 10, torch.device("cpu")
    )
    read = []
    result = trainer.run_phase(batch, steps=7, on_step=lambda step, loss, tokens: read.append(float(loss)))
    assert result.mean_loss == sum(read) / len(read)  # exactly: summed in the same order, as floats


class CountingLoss:
    def __init__(self):
        self.reads = 0

    def __float__(self) -> float:
        self.reads += 1
        return 2.5


class Bar:
    def __init__(self):
        self.steps, self.postfix = 0, ""

    def set_postfix_str(self, text: str, refresh: bool) -> None:
        self.postfix = text

    def update(self, n: int) -> None:
        self.steps += n


def test_the_progress_bar_reads_the_loss_at_most_twice_a_second():
    progress, loss = ProgressBar(False, "ab12"), CountingLoss()
    progress.start(0, 100)
    progress.bar = Bar()  # a terminal's bar, without the terminal
    for _ in range(100):
        progress.update(loss, 1000.0)
    assert progress.bar.steps == 100 and loss.reads == 1 and progress.bar.postfix.startswith("loss 2.500")


# --- inner.compile ---------------------------------------------------------------------------


def test_compiled_inner_steps_train_as_the_eager_ones_and_see_theta_copied_in_place():
    """A real compile (inductor, C++ on the CPU): 20-25 s the first time on 2 cores, 3 s once
    torch's compile cache (/tmp/torchinductor_$USER) holds it."""
    pytest.importorskip("torch._inductor")
    cfg = inner_cfg(batch_size=8, micro_batch_size=8, warmup_steps=0, lr=1e-2)
    eager_model, compiled_model = TinyLM(), TinyLM()
    eager = InnerTrainer(eager_model, cfg, 10, torch.device("cpu"))
    compiled_cfg = inner_cfg(batch_size=8, micro_batch_size=8, warmup_steps=0, lr=1e-2, compile=True)
    compiled = InnerTrainer(compiled_model, compiled_cfg, 10, torch.device("cpu"))
    for _ in range(3):
        assert float(compiled.train_step(batch())) == pytest.approx(float(eager.train_step(batch())), rel=1e-4)
    for a, b in zip(eager_model.parameters(), compiled_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    theta = {name: torch.randn_like(p) * 0.1 for name, p in eager_model.named_parameters()}
    for model in (eager_model, compiled_model):  # as Peer.load does at the start of a phase
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(theta[name])
    assert compiled.evaluate(batch()) == eager.evaluate(batch())  # evaluation is eager: the same bits
    assert float(compiled.train_step(batch())) == pytest.approx(float(eager.train_step(batch())), rel=1e-4)


def test_a_failed_compile_says_to_turn_inner_compile_off(monkeypatch):
    import torch._dynamo.exc

    trainer = InnerTrainer(TinyLM(), inner_cfg(batch_size=8, micro_batch_size=8, compile=True), 10, torch.device("cpu"))

    def no_compiler(**inputs):
        raise torch._dynamo.exc.TorchDynamoException("InvalidCxxCompiler: No working C++ compiler found")

    monkeypatch.setattr(trainer, "train_model", no_compiler)
    with pytest.raises(ConfigError, match=r"No working C\+\+ compiler.*--inner.compile=false"):
        trainer.train_step(batch())


def test_the_mean_of_no_steps_is_nan():
    trainer = InnerTrainer(TinyLM(), inner_cfg(batch_size=8, micro_batch_size=8), 10, torch.device("cpu"))
    assert math.isnan(trainer.run_phase(batch, steps=3, should_stop=lambda: True).mean_loss)
