"""θ sharded across the ranks of a peer (`run.fsdp`, FSDP2's `fully_shard`): each rank holds 1/N of
the parameters, of their gradients and of AdamW's moments, for a model whose training state does not
fit one GPU. Each decoder layer is a unit: its parameters are gathered for its forward and backward
only, and its gradients reduce-scattered.

What the peer needs whole is made whole here, on every rank at once (collectives): θ is loaded
row-wise (`load_params`: this rank's rows of the full tensors every rank holds), the trained
parameters gathered (`gather`) for the pseudo-gradient, AdamW's state gathered to rank 0 for a
checkpoint and loaded back whole on every rank (`optimizer_state`, `load_optimizer_state`), in
torch's own layout: a checkpoint is the same whole state as a one-process peer's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor


def shard(model: torch.nn.Module) -> torch.nn.Module:
    """`model` sharded in place: each decoder layer (a Llama's `model.layers`) a unit, then the rest."""
    for layer in getattr(getattr(model, "model", None), "layers", None) or []:
        fully_shard(layer)
    fully_shard(model)
    return model


def resharded(model: torch.nn.Module) -> None:
    """Every parameter back in its sharded form. A forward without a backward (an evaluation)
    leaves the root unit's parameters (embeddings, final norm, head) gathered, as plain tensors
    that the next reshard throws away: a copy into them would be lost."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def local_rows(full: torch.Tensor, param: DTensor) -> torch.Tensor:
    """This rank's rows of `full` as `param` shards it (dim 0, cut as torch.chunk cuts)."""
    mesh = param.device_mesh
    chunks = torch.chunk(full, mesh.size(), dim=0)
    index = mesh.get_local_rank()
    return chunks[index] if index < len(chunks) else full[:0]


def load_params(model: torch.nn.Module, params: Mapping[str, torch.Tensor]) -> None:
    """Copy full tensors into the model's parameters: whole into a whole parameter, this rank's
    rows into a sharded one."""
    resharded(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            load_param(p, params[name])


def load_param(param: torch.Tensor, full: torch.Tensor) -> None:
    """One full tensor into one parameter of a resharded model (`resharded`)."""
    with torch.no_grad():
        if isinstance(param, DTensor):
            param.to_local().copy_(local_rows(full, param))
        else:
            param.copy_(full)


def gather(model: torch.nn.Module, keep: bool) -> dict[str, torch.Tensor]:
    """The model's parameters whole, on the CPU in fp32 (sharded ones gathered one at a time: every
    rank must call this); with `keep` false, gathered and dropped (an empty dict)."""
    resharded(model)
    whole = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        if keep:
            whole[name] = full.to("cpu", torch.float32)
    return whole


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """AdamW's state whole, in torch's own layout (`torch.optim.Optimizer.state_dict`, what a
    one-process peer saves): every sharded moment gathered, by every rank in the same order."""
    state = optimizer.state_dict()
    whole = {
        i: {key: v.full_tensor().cpu() if isinstance(v, DTensor) else v for key, v in entry.items()}
        for i, entry in state["state"].items()
    }
    return {"state": whole, "param_groups": state["param_groups"]}


def load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a whole state (`optimizer_state`'s, or a one-process peer's): every rank keeps the rows
    of each moment that its parameter holds."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    sharded = {i: {key: _sharded_like(v, params[i]) for key, v in entry.items()} for i, entry in state["state"].items()}
    optimizer.load_state_dict({"state": sharded, "param_groups": state["param_groups"]})


def _sharded_like(value: Any, param: torch.Tensor) -> Any:
    """A moment shaped like a sharded parameter, sharded as it is; anything else (the step) as it is."""
    if not (isinstance(param, DTensor) and torch.is_tensor(value) and value.dim() and value.shape == param.shape):
        return value
    rows = local_rows(value, param).to(param.to_local().device)
    return DTensor.from_local(rows, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
