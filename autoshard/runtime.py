"""The emitted module: a plan's forward and backward graphs behind a normal nn.Module.

Parameters are DTensors in their storage placement, registered under the original model's
names (``state_dict()`` works with torch.distributed.checkpoint). ``forward`` takes this rank's
local inputs (``shard_inputs`` cuts them from the global batch) and returns the outputs in full,
identical on every rank; ``backward`` fills each parameter's ``.grad`` (a DTensor in the
parameter's storage placement), so any torch optimizer steps it.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

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
                 input_meta: list):
        super().__init__()
        self.plan = plan
        self.mesh = mesh
        self._fw, self._bw, self._num_outputs = fw, bw, num_outputs
        self._param_names = list(params)
        self._buffer_names = list(buffers)
        for name, p in params.items():
            _register(self, name, nn.Parameter(p), "param")
        for name, b in buffers.items():
            _register(self, name, b, "buffer")
        self._input_placements = input_placements
        self._input_meta = input_meta  # global (shape, dtype) per input

    def _local_shape(self, shape, placements):
        shape = list(shape)
        for p, m in zip(placements, self.mesh.shape):
            if not isinstance(p, Replicate):
                shape[p.dim] //= m
        return tuple(shape)

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
            want = self._local_shape(shape, pl)
            if tuple(t.shape) != want or t.dtype != dtype:
                raise RuntimeMismatchError(
                    f"input {i}: expected the local shard of shape {list(want)} and dtype {dtype} on each rank "
                    f"(global {list(shape)} placed {pl}), got {list(t.shape)} {t.dtype}; use "
                    f"module.shard_inputs(*global_inputs) to cut the global batch")
        params = [p.to_local() for p in (self.get_parameter(n) for n in self._param_names)]
        buffers = [self.get_buffer(n) for n in self._buffer_names]
        outs = _PlanStep.apply(self, *params, *buffers, *local_inputs)
        return outs[0] if len(outs) == 1 else outs
