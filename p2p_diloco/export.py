"""`p2p-diloco export`: θ of a run's checkpoint as a `transformers` model folder."""

from __future__ import annotations

from pathlib import Path

from p2p_diloco import checkpoint
from p2p_diloco import config as config_mod
from p2p_diloco import model as model_mod
from p2p_diloco.errors import CheckpointError


def export_run(run_dir: str | Path, out_dir: str | Path, round_: int | None = None) -> Path:
    """Write θ of the latest (or the given round's) checkpoint to `out_dir`, loadable by
    `AutoModelForCausalLM.from_pretrained(out_dir)`. The checkpoint is verified first."""
    path = checkpoint.latest(run_dir) if round_ is None else checkpoint.path_for(run_dir, round_)
    if path is None or not path.exists():
        found = ", ".join(p.name for p in checkpoint.list_checkpoints(run_dir)) or "none"
        which = "latest checkpoint" if round_ is None else f"checkpoint of round {round_}"
        raise CheckpointError(f"no {which} in {checkpoint.checkpoint_dir(run_dir)} (found: {found})")
    payload = checkpoint.load(path)
    cfg = config_mod.from_mapping(payload["config"], where=str(path))
    tokenizer = model_mod.load_tokenizer(cfg.model.tokenizer)
    model_config = model_mod.model_config(cfg.model, tokenizer.vocab_size)
    return model_mod.export_model(payload["params"], model_config, cfg.model.tokenizer, out_dir)
