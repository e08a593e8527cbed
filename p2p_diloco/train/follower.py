"""A follower: rank r > 0 of a peer of several processes (ranks.py). It holds the peer's model, its
inner trainer and its own copy of the peer's data stream, and trains the inner phases rank 0 starts.
It knows nothing of the swarm, writes nothing, and exits when rank 0 says so."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from p2p_diloco.config import Config
from p2p_diloco.train import checkpoint, data
from p2p_diloco.train import model as model_mod
from p2p_diloco.train.inner import InnerTrainer, RankGroup
from p2p_diloco.train.prefetch import Prefetcher

logger = logging.getLogger(__name__)


class Ranks(RankGroup, Protocol):
    """The peer's processes as a follower sees them (ranks.Ranks): rank 0's words, and θ."""

    def receive(self) -> dict[str, Any]:
        """Rank 0's next word."""
        ...

    def share(self, model: torch.nn.Module, params: Mapping[str, torch.Tensor] | None = None) -> None:
        """Rank 0's θ into this rank's model."""
        ...


class Follower:
    """Built before the ranks meet (an error here is reported to rank 0, which refuses to start)."""

    def __init__(self, config: Config, device: torch.device, rank: int):
        self.config, self.device, self.rank = config, device, rank
        self.tokenizer = model_mod.load_tokenizer(config.model.tokenizer)
        model_config = model_mod.model_config(config.model, self.tokenizer.vocab_size)
        self.corpus = data.open_corpus(config.data)
        self.model = model_mod.init_model(model_config, config.run.seed).to(device)
        self.stream: Prefetcher | None = None
        self.heldout: torch.Tensor | None = None  # rank 0's held-out batch, made the same way when first needed

    def run(self, ranks: Ranks) -> None:
        """Set up as rank 0 says, then do what each word says until it says exit."""
        cfg = self.config
        trainer = InnerTrainer(self.model, cfg.inner, cfg.run.rounds * cfg.inner.steps, self.device, ranks)
        word = ranks.receive()
        if "exit" in word:
            return
        stream = self._open(word, trainer)
        while "exit" not in (word := ranks.receive()):
            if "phase" in word:
                self._phase(ranks, trainer, stream, word)
            elif "evaluate" in word:  # sharded: rank 0's held-out loss needs every rank's forward
                ranks.share(self.model)
                trainer.evaluate(self._heldout())
            elif "save" in word:  # sharded: AdamW's state gathered to rank 0
                trainer.state_dict()

    def _phase(self, ranks: Ranks, trainer: InnerTrainer, stream: Prefetcher, word: dict[str, Any]) -> None:
        ranks.share(self.model)
        trainer.step = word["step"]
        phase = trainer.run_phase(stream.next_batch, word["steps"])
        if not phase.stopped:
            ranks.gather(self.model)  # sharded: rank 0's pseudo-gradient needs the rows of every rank
        logger.debug(
            "rank %d: %d steps from step %d, mean loss %.4f", self.rank, phase.steps, word["step"], phase.mean_loss
        )

    def _heldout(self) -> torch.Tensor:
        if self.heldout is None:
            cfg = self.config
            self.heldout = data.heldout_batch(
                self.corpus, self.tokenizer, cfg.model.seq_len, cfg.run.eval_sequences, cfg.data.heldout_fraction
            )
        return self.heldout

    def _open(self, word: dict[str, Any], trainer: InnerTrainer) -> Prefetcher:
        """The peer's data stream (its shard) and, on a resumed peer, the state of its checkpoint."""
        cfg = self.config
        shard = int(word["shard"])
        stream = data.shard_stream(self.corpus, self.tokenizer, cfg.data, cfg.model.seq_len, cfg.run.seed, shard)
        self.stream = Prefetcher(stream, cfg.inner.batch_size, pin_memory=self.device.type == "cuda")
        if word["restore"] is not None:
            payload = checkpoint.load(Path(word["restore"]), cfg.shared_dict())
            trainer.load_state_dict(payload["trainer"])
            self.stream.load_state_dict(payload["data"])
            torch.set_rng_state(payload["rng"]["torch"])
        logger.info(
            "rank %d ready on %s: shard %d%s",
            self.rank,
            self.device,
            shard,
            f", resumed from {word['restore']}" if word["restore"] else "",
        )
        return self.stream

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
