"""The emitted module: a plan's forward and backward graphs behind a normal nn.Module.

Parameters are DTensors in their storage placement, registered under the original model's
names (``state_dict()`` works with torch.distributed.checkpoint). ``forward`` takes this rank's
local inputs (``shard_inputs`` cuts them from the global batch) and returns the outputs in full,
identical on every rank; ``backward`` fills each parameter's ``.grad`` (a DTensor in the
parameter's storage placement), so any torch optimizer steps it.

``load_state_dict`` takes DTensor values in any placement (redistributed to this plan's) or plain
full tensors (each rank keeps its shard), and names every missing, unexpected or misshapen entry
in a :class:`~autoshard.errors.RuntimeMismatchError`; ``autoshard.checkpoint`` builds on it.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.nn.modules.module import _IncompatibleKeys

from autoshard.costmodel import local_shape
from autoshard.errors import RuntimeMismatchError


class _PlanStep(torch.autograd.Function):
    """Forward graph in forward, backward graph in backward: what AOTAutograd's runtime does,
    without compiling, so the graphs run as written."""

    @staticmethod
    def forward(ctx, module: "DistributedModule", *primals):
        outs = module._fw(*primals)
        n = module._num_outputs
        saved = outs[n:]
        tensors = [s for s in saved if isinstance(s, torch.Tensor)]
        ctx.save_for_backward(*tensors)
        ctx.layout = [isinstance(s, torch.Tensor) for s in saved]
        ctx.others = [s for s in saved if not isinstance(s, torch.Tensor)]
        ctx.module = module
        return tuple(outs[:n])

    @staticmethod
    def backward(ctx, *grad_outputs):
        tensors, others = iter(ctx.saved_tensors), iter(ctx.others)
        saved = [next(tensors) if is_t else next(others) for is_t in ctx.layout]
        grads = ctx.module._bw(*saved, *[g.contiguous() if g is not None else g for g in grad_outputs])
        n_params = len(ctx.module._param_names)
        n_rest = len(ctx.module._buffer_names) + len(ctx.module._input_meta)
        return (None, *grads[:n_params], *([None] * n_rest))


def _register(root: nn.Module, fqn: str, value, kind: str) -> None:
    *path, leaf = fqn.split(".")
    mod = root
    for part in path:
        if not hasattr(mod, part) or not isinstance(getattr(mod, part), nn.Module):
            mod.add_module(part, nn.Module())
        mod = getattr(mod, part)
    if kind == "param":
        mod.register_parameter(leaf, value)
    else:
        mod.register_buffer(leaf, value)


class DistributedModule(nn.Module):
    def __init__(self, plan, mesh, fw: fx.GraphModule, bw: fx.GraphModule, num_outputs: int,
                 params: dict[str, DTensor], buffers: dict[str, torch.Tensor], input_placements: list,
                 input_meta: list, aliases: dict[str, str] | None = None):
        super().__init__()
        self.plan = plan
        self.mesh = mesh
        # The graphs are code, not state: kept out of the submodules so that their constants do
        # not show up in state_dict(), parameters() or a checkpoint.
        self.__dict__["_fw"], self.__dict__["_bw"] = fw, bw
        self._num_outputs = num_outputs
        self._param_names = list(params)
        self._buffer_names = list(buffers)
        for name, p in params.items():
            _register(self, name, nn.Parameter(p), "param")
        for name, b in buffers.items():
            _register(self, name, b, "buffer")
        self._aliases: dict[str, str] = {}
        self.tie(aliases or {})
        self._input_placements = input_placements
        self._input_meta = input_meta  # global (shape, dtype) per input

    def tie(self, aliases: dict[str, str]) -> None:
        """Register tied weights (``{"head.weight": "wte.weight"}``: GPT-2's LM head is its
        token embedding) as the same Parameter under both names, so ``named_parameters()`` lists
        it once and ``state_dict()`` has both keys, as the single-device model's does."""
        for alias, primary in aliases.items():
            if alias != primary and primary in self._param_names and alias not in self._aliases:
                self._aliases[alias] = primary
                _register(self, alias, self.get_parameter(primary), "param")

    def shard_inputs(self, *global_inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's local piece of each global input, as the plan places it (no communication)."""
        if len(global_inputs) != len(self._input_meta):
            raise RuntimeMismatchError(f"expected {len(self._input_meta)} inputs, got {len(global_inputs)}")
        rep = [Replicate()] * self.mesh.ndim
        return tuple(DTensor.from_local(t, self.mesh, rep, run_check=False).redistribute(self.mesh, pl).to_local()
                     for t, pl in zip(global_inputs, self._input_placements))

    def forward(self, *local_inputs: torch.Tensor):
        if len(local_inputs) != len(self._input_meta):
            raise RuntimeMismatchError(f"the compiled module takes {len(self._input_meta)} inputs, got {len(local_inputs)}")
        for i, (t, (shape, dtype), pl) in enumerate(zip(local_inputs, self._input_meta, self._input_placements)):
            want = local_shape(shape, pl, self.mesh.shape)
            if tuple(t.shape) != want or t.dtype != dtype:
                raise RuntimeMismatchError(
                    f"input {i}: expected the local shard of shape {list(want)} and dtype {dtype} on each rank "
                    f"(global {list(shape)} placed {pl}), got {list(t.shape)} {t.dtype}; use "
                    f"module.shard_inputs(*global_inputs) to cut the global batch")
        params = [p.to_local() for p in (self.get_parameter(n) for n in self._param_names)]
        buffers = [self.get_buffer(n) for n in self._buffer_names]
        outs = _PlanStep.apply(self, *params, *buffers, *local_inputs)
        return outs[0] if len(outs) == 1 else outs

    # --- state dict --------------------------------------------------------------------------
    def expected_state(self, optional=None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Every state-dict key with its global shape and dtype (what a checkpoint must hold).
        Given the keys a source holds (``optional``), a tied alias it lacks is left out: its
        primary carries the same tensor (checkpoints saved before the tie was known load)."""
        return {k: (tuple(v.shape), v.dtype) for k, v in self.state_dict().items() if isinstance(v, torch.Tensor)
                and (optional is None or k not in self._aliases or k in optional)}

    def check_state_dict(self, state_dict, *, strict: bool = True, source: str = "the state dict") -> None:
        """Raise RuntimeMismatchError naming every global shape that differs from this module's
        and, with ``strict``, every key missing from ``state_dict`` or in it but not here."""
        found = {k: (tuple(v.shape), v.dtype) for k, v in state_dict.items() if isinstance(v, torch.Tensor)}
        check_against(self.expected_state(optional=found), found, strict=strict, source=source)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load DTensors in any placement (redistributed to this plan's storage) or plain full
        tensors (every rank passes the same; each keeps its shard, no communication)."""
        self.check_state_dict(state_dict, strict=strict)
        own = self.state_dict()
        converted = {}
        for key in own:  # module order, so every rank runs the same redistributions
            if key not in state_dict:
                continue
            value = state_dict[key]
            if isinstance(own[key], DTensor):
                converted[key] = _to_placements(value, self.mesh, own[key].placements)
            else:
                converted[key] = value.full_tensor() if isinstance(value, DTensor) else value
        super().load_state_dict(converted, strict=False, assign=assign)
        missing = [k for k in own if k not in state_dict and k not in self._aliases]
        return _IncompatibleKeys(missing, [k for k in state_dict if k not in own])


def _to_placements(value: torch.Tensor, mesh, placements) -> DTensor:
    """``value`` as a DTensor on ``mesh`` in ``placements``: a DTensor is redistributed (gathered
    first when it lives on another mesh); a plain tensor is the full value, cut locally."""
    if isinstance(value, DTensor):
        if value.device_mesh == mesh:
            return value.redistribute(mesh, placements) if tuple(value.placements) != tuple(placements) else value
        value = value.full_tensor()
    value = value.detach().to(mesh.device_type)
    rep = [Replicate()] * mesh.ndim
    return DTensor.from_local(value, mesh, rep, run_check=False).redistribute(mesh, placements)


def _fmt(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def check_against(expected: dict, found: dict, *, strict: bool = True, source: str = "the state dict",
                  limit: int = 8) -> None:
    """Compare ``{key: (shape, dtype)}`` maps; raise one RuntimeMismatchError naming both sides.
    Without ``strict`` only the shapes of the keys both hold must agree."""
    missing = [k for k in expected if k not in found] if strict else []
    unexpected = [k for k in found if k not in expected] if strict else []
    shapes = [k for k in expected if k in found and tuple(found[k][0]) != tuple(expected[k][0])]
    if not (missing or unexpected or shapes):
        return

    def some(keys):
        more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
        return ", ".join(keys[:limit]) + more

    lines = [f"{source} does not match this compiled module ({len(expected)} entries expected, "
             f"{len(found)} found):"]
    if missing:
        lines.append(f"  missing from {source} ({len(missing)}): " + some(missing))
    if unexpected:
        lines.append(f"  in {source} but not in the module ({len(unexpected)}): " + some(unexpected))
    for k in shapes[:limit]:
        lines.append(f"  {k}: the module expects global shape {_fmt(expected[k][0])}, "
                     f"{source} has {_fmt(found[k][0])}")
    if len(shapes) > limit:
        lines.append(f"  ... and {len(shapes) - limit} more shape mismatches")
    lines.append("Was it saved for another model or configuration? Names and global shapes must match "
                 "(placements, plan and world size may differ).")
    raise RuntimeMismatchError("\n".join(lines))
