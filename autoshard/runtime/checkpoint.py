"""Checkpoints of compiled modules: save under one plan, resume under another; single-device interop.

A compiled module's parameters are DTensors in their storage placement, under the model's names
(plain full tensors on one device, which DCP saves as one chunk and loads into any plan's shards),
so torch.distributed.checkpoint (DCP) saves each rank's shards and loads them into any other plan,
mesh or world size, resharding on the way. Optimizer state goes through
``torch.distributed.checkpoint.state_dict.get_state_dict`` / ``set_state_dict``, which key it by
parameter name with DTensor values, so it reshards the same way. Every function here is collective:
call it on every rank. Example (each rank of a process group)::

    import autoshard.runtime.checkpoint as ckpt

    ckpt.save("ckpt/step100", dmodel, opt)          # under the plan it was trained with
    ...                                             # later: another plan, mesh or world size
    ckpt.load("ckpt/step100", dmodel2, opt2)        # names and global shapes must match
    full = ckpt.full_state_dict(dmodel2)            # rank 0: plain CPU tensors; {} elsewhere
    ckpt.load_full_state_dict(dmodel2, torch.load("single_device.pt"))

A checkpoint saved for another model raises :class:`~autoshard.errors.RuntimeMismatchError`
naming the missing, unexpected and misshapen entries on both sides, before anything is loaded.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from autoshard.errors import RuntimeMismatchError
from autoshard.runtime.module import DistributedModule, check_against, non_persistent

__all__ = ["full_state_dict", "load", "load_full_state_dict", "load_state_dict", "save", "state_dict"]


def state_dict(module: DistributedModule, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """``{"model": ..., "optim": ...}`` with DTensor values keyed by parameter name: what
    ``dcp.save`` writes and ``dcp.load`` fills in place. Initializes the optimizer's state
    (a zero step) when it has none yet, so a fresh optimizer can be loaded into."""
    if optimizer is None:
        return {"model": get_model_state_dict(module)}
    for p in [p for p, st in optimizer.state.items() if not st]:
        del optimizer.state[p]  # empty entries (optimizer.state is a defaultdict) would stop
        # get_state_dict from initializing the state, and dcp.load would then load none of it
    msd, osd = get_state_dict(module, optimizer)
    return {"model": msd, "optim": osd}


def load_state_dict(module: DistributedModule, optimizer: torch.optim.Optimizer | None, sd: dict) -> None:
    """Put a :func:`state_dict`-shaped dict (after ``dcp.load`` filled it) into the module and
    optimizer."""
    if optimizer is None:
        module.load_state_dict(sd["model"])
    else:
        set_state_dict(module, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def save(path: str | os.PathLike, module: DistributedModule, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Save the module (and optimizer) state under ``path``, a directory every rank can write;
    each rank writes its own shards."""
    dcp.save(state_dict(module, optimizer), checkpoint_id=path)


def load(path: str | os.PathLike, module: DistributedModule, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load a checkpoint written by :func:`save` (under any plan, mesh or world size), or by
    ``dcp.save(module.state_dict(), ...)``, into the module (and optimizer), resharding to this
    module's plan. Raises RuntimeMismatchError naming both sides when the checkpoint holds other
    names or global shapes, or no optimizer state when one is asked for; nothing changes then."""
    saved = _saved_shapes(path)
    source = f"checkpoint {os.fspath(path)!r}"
    nested = any(k.startswith("model.") for k in saved)  # save()'s layout, else a bare state_dict()
    skip = non_persistent(module)   # saved before the module left them out: not loaded
    found = {k: v for k, v in _section(saved, "model." if nested else "").items() if k not in skip}
    expected = module.expected_state(optional=found)
    if getattr(module, "partial_state", False):
        # a pipeline rank holds its stages' entries: it reads those, and what no rank holds is unexpected
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, sorted(expected))
        held_somewhere = set().union(*map(set, every))
        found = {k: v for k, v in found.items() if k in expected or k not in held_somewhere}
    check_against(expected, found, source=source)
    if not nested:
        if optimizer is not None:
            raise RuntimeMismatchError(f"{source} holds a model state dict alone, no optimizer state; "
                                       f"load it without the optimizer")
        sd = {k: v for k, v in module.state_dict().items() if k in expected}
        dcp.load(sd, checkpoint_id=path)
        module.load_state_dict(sd)
        return
    fresh = optimizer is not None and not any(optimizer.state.values())
    target = state_dict(module, optimizer)  # a fresh optimizer's state is initialized here
    target["model"] = {k: v for k, v in target["model"].items() if k in expected}  # tied aliases it lacks
    if optimizer is not None:
        want, have = _flat(target["optim"].get("state", {}), ""), _section(saved, "optim.state.")
        try:
            if not have:
                raise RuntimeMismatchError(f"{source} holds no optimizer state; load it without the optimizer")
            check_against(want, {k: v for k, v in have.items() if k in want}, source=f"{source} (optimizer state)")
        except RuntimeMismatchError:
            if fresh:
                optimizer.state.clear()  # leave it as it came
            raise
    dcp.load(target, checkpoint_id=path)
    load_state_dict(module, optimizer, target)


def checkpoint_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Global shape of every tensor in a DCP checkpoint, by flattened key (``model.wte.weight``,
    ``optim.state.wte.weight.exp_avg``), read from its metadata alone."""
    md = dcp.FileSystemReader(path).read_metadata()
    return {k: tuple(v.size) for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def _flat(d: dict, prefix: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        elif isinstance(v, torch.Tensor):
            out[f"{prefix}{k}"] = (tuple(v.shape), v.dtype)
    return out


def _saved_shapes(path) -> dict[str, tuple[int, ...]]:
    try:
        return checkpoint_shapes(path)
    except FileNotFoundError as exc:
        raise RuntimeMismatchError(f"no checkpoint at {os.fspath(path)!r} ({exc})") from exc


def _section(saved: dict, prefix: str) -> dict:
    return {k[len(prefix):]: (s, None) for k, s in saved.items() if k.startswith(prefix)}


# --- single-device interop ------------------------------------------------------------------------
@torch.no_grad()
def _whole(module, what: str) -> None:
    if getattr(module, "partial_state", False):
        raise RuntimeMismatchError(f"{what} needs every parameter on every rank's module; a pipeline rank holds its "
                                   "stages' only: save and load it with autoshard.runtime.checkpoint.save and load (DCP)")


def full_state_dict(module: DistributedModule, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The module's full state as plain CPU tensors under the model's names (tied weights stay
    one tensor): on rank 0 only (``{}`` elsewhere) unless ``rank0_only=False``. Every rank must
    call it (it gathers the shards)."""
    _whole(module, "full_state_dict")
    keep = not rank0_only or dist.get_rank() == 0
    out: dict[str, torch.Tensor] = {}
    seen: dict[int, torch.Tensor] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        if id(value) not in seen:
            full = value.full_tensor() if isinstance(value, DTensor) else value
            seen[id(value)] = full.detach().cpu().clone() if keep else None
        if keep:
            out[key] = seen[id(value)]
    return out


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.device == b.device and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and a.storage_offset() == b.storage_offset())


def _drop_tied(module: DistributedModule, sd: dict) -> dict:
    """Keys of a single-device state dict the module lacks because they are tied to one it has
    (GPT-2's ``head.weight`` shares ``wte.weight``'s storage): dropped. Anything else stays, to
    be reported."""
    own = module.state_dict(keep_vars=True)
    kept = {k: v for k, v in sd.items() if k in own}
    for k, v in sd.items():
        if k not in own and not any(isinstance(v, torch.Tensor) and _same_storage(v, w) for w in kept.values()):
            kept[k] = v
    return kept


def load_full_state_dict(module: DistributedModule, sd: dict | None, *, strict: bool = True,
                         from_rank0: bool = False) -> None:
    """Load a plain single-device ``state_dict`` (full tensors) into the compiled module: each
    rank keeps its shard of each tensor in the parameter's placement. Every rank passes the same
    ``sd``, or with ``from_rank0=True`` only rank 0 does (others pass ``None`` or ``{}``) and it
    is broadcast one tensor at a time. Names and shapes are checked first, on every rank alike."""
    _whole(module, "load_full_state_dict")
    if not from_rank0:
        module.load_state_dict(_drop_tied(module, sd), strict=strict)
        return
    rank = dist.get_rank()
    sd = _drop_tied(module, sd) if rank == 0 else {}
    box = [{k: (tuple(v.shape), v.dtype) for k, v in sd.items() if isinstance(v, torch.Tensor)}]
    dist.broadcast_object_list(box, src=0)
    meta = box[0]
    check_against(module.expected_state(), meta, strict=strict, source="rank 0's state dict")
    device = torch.device(module.mesh.device_type, torch.cuda.current_device()) \
        if module.mesh.device_type == "cuda" else torch.device("cpu")
    for key in module.expected_state():  # module order on every rank
        if key not in meta:
            continue
        shape, dtype = meta[key]
        t = sd[key].detach().to(device, dtype).contiguous() if rank == 0 else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(t, src=0)
        module.load_state_dict({key: t}, strict=False)
