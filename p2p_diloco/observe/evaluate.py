"""The held-out loss of a run's agreed state, computed by someone who trains nothing: the observer.

A peer's own record carries its training loss, a claim. The observer downloads the agreed state
of a round from a peer that holds it, checks it against the digest the round's counted peers
published (I1, I4), and computes the held-out loss itself, on the same held-out batch and with the
same code as every peer's `eval_loss` (data.heldout_batch, InnerTrainer.evaluate): on one device
type the two agree exactly, which is how the tests check it.

`HeldOut` is the local work (model, batch, digest, loss); `Evaluations` the background thread that
picks which round to evaluate (run_view.RunLog.to_evaluate), downloads and evaluates it, and
notes the loss in the run's log. The download itself is the caller's (swarm/state_client.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from p2p_diloco.config import Config
from p2p_diloco.errors import DataError, StateDownloadError
from p2p_diloco.observe.run_view import Target
from p2p_diloco.protocol import deadlines, outer
from p2p_diloco.protocol.network import ServedState, StateSource, download_chunked, download_verified
from p2p_diloco.train import data
from p2p_diloco.train import model as model_mod
from p2p_diloco.train.inner import InnerTrainer

logger = logging.getLogger(__name__)

RETRY_S = 10.0  # a round whose state no holder served is asked for again after this long
NEWER_WAIT_S = 3.0  # how long the observer's log is given to show a round past one whose holders moved on
NEWER_POLL_S = 0.25


class RunModel:
    """A run's model on CPU, as θ(0) makes it: checks the digest of a served state, and reads its θ."""

    def __init__(self, config: Config):
        self.tokenizer = model_mod.load_tokenizer(config.model.tokenizer)
        self.model_config = model_mod.model_config(config.model, self.tokenizer.vocab_size)
        self.model = model_mod.init_model(self.model_config, config.run.seed)
        self.like = {name: p.detach() for name, p in self.model.named_parameters()}
        self.numel = sum(t.numel() for t in self.like.values())

    def digest(self, metadata: dict[str, Any], tensors: list[torch.Tensor]) -> str | None:
        """The digest of a served state, or None if it is malformed (outer.served_digest)."""
        return outer.served_digest(metadata, tensors, self.like)

    def params(self, state: ServedState) -> outer.Tensors:
        """θ of a verified served state, by parameter name."""
        return outer.unflatten(state[1][0].float(), self.like)


class HeldOut(RunModel):
    """The run's model and its held-out batch: the held-out loss of a served state."""

    def __init__(self, config: Config):
        super().__init__(config)
        d = config.data
        self.batch = data.heldout_batch(
            data.open_corpus(d), self.tokenizer, config.model.seq_len, config.run.eval_sequences, d.heldout_fraction
        )
        self._trainer = InnerTrainer(self.model, config.inner, 1, torch.device("cpu"))

    def loss(self, state: ServedState) -> float:
        """The held-out loss of θ of a verified served state."""
        return self.loss_of(self.params(state))

    def loss_of(self, params: outer.Tensors) -> float:
        """The held-out loss of θ, by parameter name."""
        with torch.no_grad():
            for name, value in params.items():
                self.like[name].copy_(value)
        return self._trainer.evaluate(self.batch)


def held_out_loss(config: Config, params: outer.Tensors) -> tuple[float | None, str]:
    """The held-out loss of θ on the run's held-out batch, as every peer computes its `eval_loss`,
    or (None, why not): the run's data is not readable here."""
    try:
        held = HeldOut(config)
    except DataError as e:
        return None, str(e)
    return held.loss_of(params), ""


Pick = Callable[[], "Target | None"]
Newer = Callable[[int], "Target | None"]  # a target past the given round, if one is known (soon)
Accepts = Callable[[int, str], bool]
Note = Callable[[int, str, float], None]


@dataclass(frozen=True)
class Agreed:
    """An agreed state, downloaded and verified: its round and digest, who served it (the holders
    whose chunks made it, or the one that sent it whole), and the state."""

    round: int
    digest: str
    served_by: tuple[str, ...]
    state: ServedState


def download_agreed(
    model: RunModel,
    source: StateSource,
    target: Target,
    accepts: Accepts,
    timeout: float,
    newer: Newer = lambda r: None,
) -> Agreed:
    """A state `target`'s holders serve whose digest is the agreed one of its round: in chunks from
    all of them at once, as a joiner downloads (network.download_chunked). Where none serves chunks
    of it (holders that moved on to the next agreed round serve no manifest of this one), the newest
    agreed round `newer` knows past it, in chunks from its holders. Else whole, from one holder at a
    time, a holder's newer agreed state being as good."""
    deadline = time.monotonic() + timeout
    chunked = _download_chunked(model, source, target, timeout)
    if chunked is None and (later := newer(target.round)) is not None and later.round > target.round:
        logger.debug("round %d in chunks failed: its holders may have moved on; round %d", target.round, later.round)
        target = later
        chunked = _download_chunked(model, source, target, max(1.0, deadline - time.monotonic()))
    if chunked is not None and accepts(target.round, target.digest):
        logger.info(
            "downloaded round %d (digest %s) in chunks from %d holder(s)",
            target.round,
            target.digest[:12],
            len(chunked[0]),
        )
        return Agreed(target.round, target.digest, tuple(chunked[0]), chunked[1])
    found: list[tuple[int, str]] = []

    def agreed(round_: int, digest: str) -> bool:
        found.append((round_, digest))
        return accepts(round_, digest)

    describe = f"an agreed state (round {target.round} or later)"
    left, holders = max(1.0, deadline - time.monotonic()), list(target.holders)
    # Each peer's failure is in the error, which the caller says once: no warning per peer and poll.
    peer, state = download_verified(source.fetch, holders, left, model.digest, agreed, describe, logger.debug)
    return Agreed(*found[-1], (peer,), state)


def _download_chunked(
    model: RunModel, source: StateSource, target: Target, timeout: float
) -> tuple[list[str], ServedState] | None:
    """(its holders, the state) of `target` in chunks, or None where that failed or no holder sent a
    manifest of it: the whole-state path is asked next, and says why if it fails too."""
    wanted, deadline = (target.round, target.digest), time.monotonic() + timeout
    try:
        return download_chunked(
            lambda peers: source.manifests(peers, wanted),
            lambda manifest, some: source.download_chunks(manifest, some, max(1.0, deadline - time.monotonic())),
            list(target.holders),
            model.digest,
            wanted,
            logger.debug,
        )
    except StateDownloadError as e:
        logger.debug("round %d in chunks: %s; asking its holders one at a time", target.round, e)
        return None


class Evaluations:
    """The observer's evaluations, one at a time, in a thread of their own (a poll never waits on one)."""

    def __init__(self, held: HeldOut, source: StateSource, pick: Pick, accepts: Accepts, note: Note, timeout: float):
        self.held, self.source, self.pick, self.accepts, self.note = held, source, pick, accepts, note
        self.timeout = timeout
        self._failed: int | None = None  # the last round whose download failed: warned once, retried later
        self._retry_at = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="evaluations", daemon=True)

    def start(self, every_s: float) -> None:
        self.every_s = every_s
        self._thread.start()

    def once(self) -> bool:
        """Evaluate the round `pick` names, if any; whether one was evaluated."""
        target = self.pick()
        if target is None or (target.round == self._failed and time.monotonic() < self._retry_at):
            return False
        try:
            found = download_agreed(self.held, self.source, target, self.accepts, self.timeout, self._newer)
        except StateDownloadError as e:
            # Said at the second failure: a holder that just left or moved on is no news.
            say = logger.warning if self._failed == target.round else logger.debug
            say("held-out loss of round %d not computed: %s", target.round, e)
            self._failed, self._retry_at = target.round, time.monotonic() + RETRY_S
            return False
        loss = self.held.loss(found.state)
        self.note(found.round, found.digest, loss)
        logger.info("held-out loss of the agreed state of round %d: %.4f", found.round, loss)
        return True

    def _newer(self, round_: int) -> Target | None:
        """A target past `round_` once the polls that feed `pick` show one, within NEWER_WAIT_S."""
        past = lambda target: target is not None and target.round > round_  # noqa: E731
        return deadlines.poll_until(self.pick, past, time.monotonic() + NEWER_WAIT_S, NEWER_POLL_S, self._stop)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.once()
            except Exception:  # an evaluation must never take the observer down
                logger.exception("evaluation failed")

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30.0)
        self.source.close()
