"""Simulated ranks: every rank of a plan's emitted module in one process, under torch's
``LocalTensorMode``, trained next to the same model on one device.

Each rank of a real run compiles its own module, and the graphs it traces hold its own rank in
constants: which piece of a replicated tensor it keeps (DTensor's shard index), where its piece
sits in a bucketed gather's flat buffer, the names of its mesh dims' groups. So every simulated
rank is compiled as its real counterpart would be, on a ``"fake"`` process group of that rank
(no communication), and rank 0's module is then made to run them all: where the ranks' graphs
hold different integers, the graph gets one value per rank (a ``LocalIntNode``); a group name
stays rank 0's, as ``LocalTensorMode`` runs a collective over every group of the mesh dim its
group spans; its parameters and buffers become ``LocalTensor``s of every rank's pieces. Under the
mode each op runs once per rank and each collective moves the data between the ranks' tensors.
The ranks' graphs must agree in everything else (ops and their order); where they do not, the
plan is not SPMD and :func:`run_ranks` says which node differs.

What this checks that processes on gloo cannot: the same function runs with ``device="cuda"``,
where every rank's tensors, collectives included, live on the one GPU, so a tensor made on the
wrong device or in the wrong dtype fails as it would under NCCL.

>>> plan = autoshard.plan(model, autoshard.Cluster.local(4), batches[0])        # doctest: +SKIP
>>> sim, ref = run_ranks(model, plan, batches), single_device(model, batches)    # doctest: +SKIP
>>> max(abs(a - b) for a, b in zip(sim.losses, ref.losses))                      # doctest: +SKIP
"""

from __future__ import annotations

import copy
import math
import operator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.distributed.tensor import DTensor

from autoshard import _torch
from autoshard.api import compile as compile_plan
from autoshard.cluster import Cluster
from autoshard.errors import ClusterError, RuntimeMismatchError
from autoshard.planning.plan import Plan
from autoshard.runtime.module import DistributedModule


@dataclass
class Simulated:
    """A training run: the global loss of each step, and every parameter after the last step
    (full values, on CPU, under the model's names)."""
    losses: list[float]
    params: dict[str, torch.Tensor]


def run_ranks(model: nn.Module, plan: Plan, batches: list[tuple[torch.Tensor, ...]], *,
              steps: int | None = None, lr: float = 1e-3, device: str | torch.device = "cpu") -> Simulated:
    """Train a copy of ``model`` for ``steps`` AdamW steps (default: one per batch, the batches
    taken in turn) under ``plan``, every rank of its mesh simulated in this process on
    ``device``. ``batches`` are global batches, each the model's inputs (its forward returns the
    loss). Call it outside any process group: it makes its own, a fake one, and removes it."""
    if dist.is_available() and dist.is_initialized():
        raise ClusterError("run_ranks simulates every rank in this process on a process group of its own; "
                           "call it outside torch.distributed.init_process_group (or destroy that group first)")
    steps = _steps(batches, steps)
    device = torch.device(device)
    model = copy.deepcopy(model).to(device)
    batches = [tuple(t.to(device) for t in batch) for batch in batches]
    world = math.prod(plan.mesh_shape)
    cluster = Cluster.from_json(plan.cluster)
    modules: dict[int, DistributedModule] = {}
    try:
        # rank 0 last: its group stays for the run (its graphs name its groups)
        for rank in reversed(range(world)):
            if dist.is_initialized():
                dist.destroy_process_group()
            dist.init_process_group("fake", rank=rank, world_size=world)
            _torch.reset_sharding_caches()
            modules[rank] = compile_plan(model, cluster, batches[0], plan=plan)
        _torch.reset_sharding_caches()
        module = _spmd(modules)   # (outside the mode: a LocalTensor made under it nests)
        module.grad_accumulation = 1   # one batch per step, whatever the plan was priced for
        with _torch.simulated_ranks(world):
            losses = _train(module, batches, steps, lr, module.shard_inputs)
            params = {name: _same_on_every_rank(p.full_tensor() if isinstance(p, DTensor) else p, name).cpu()
                      for name, p in module.named_parameters()}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        _torch.reset_sharding_caches()   # (its specs hold this run's meshes)
    return Simulated(losses, params)


def single_device(model: nn.Module, batches: list[tuple[torch.Tensor, ...]], *, steps: int | None = None,
                  lr: float = 1e-3, device: str | torch.device = "cpu") -> Simulated:
    """The reference :func:`run_ranks` is held to: the same steps on a copy of ``model`` on
    one device."""
    steps = _steps(batches, steps)
    device = torch.device(device)
    model = copy.deepcopy(model).to(device)
    batches = [tuple(t.to(device) for t in batch) for batch in batches]
    losses = _train(model, batches, steps, lr, lambda *batch: batch)
    return Simulated(losses, {name: p.detach().cpu().clone() for name, p in model.named_parameters()})


def _steps(batches, steps: int | None) -> int:
    if not batches:
        raise RuntimeMismatchError("batches is empty; give at least one global batch (a tuple of the model's inputs)")
    steps = len(batches) if steps is None else steps
    if not (isinstance(steps, int) and steps >= 1):
        raise RuntimeMismatchError(f"steps must be a positive int, not {steps!r}")
    return steps


def _train(module: nn.Module, batches, steps: int, lr: float, shard) -> list[float]:
    """The loop both runs share: AdamW (torch's defaults but ``lr``), batch ``s % len(batches)``
    at step ``s``."""
    opt = torch.optim.AdamW(module.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        loss = module(*shard(*batches[step % len(batches)]))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(_same_on_every_rank(loss.detach(), f"the loss of step {step}").item())
    return losses


def _same_on_every_rank(t: torch.Tensor, what: str) -> torch.Tensor:
    """The value every simulated rank holds of a replicated tensor, checked equal across ranks."""
    values = _torch.rank_values(t)
    first = next(iter(values.values()))
    for rank, v in values.items():
        if not torch.equal(v, first):
            raise RuntimeMismatchError(f"{what} should be the same on every rank but rank {rank}'s differs from "
                                       f"rank 0's by up to {(v - first).abs().max().item():.3e}")
    return first


# --- one module for every rank ------------------------------------------------------------------
def _spmd(modules: dict[int, DistributedModule]) -> DistributedModule:
    """Rank 0's module, made to run every rank (see the module doc)."""
    ranks = sorted(modules)
    module = modules[0]
    for attr in ("_fw", "_bw", "_bw_sync"):
        if module.__dict__[attr] is not None:
            _per_rank_constants(attr, [modules[r].__dict__[attr] for r in ranks])
    new: dict[int, nn.Parameter] = {}   # tied weights: one Parameter under every name
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) not in new:
            local = _torch.local_tensor({r: _local(modules[r].get_parameter(name)).detach() for r in ranks})
            if isinstance(p, DTensor):
                local = DTensor.from_local(local, module.mesh, p.placements, run_check=False, shape=p.shape,
                                           stride=p.stride())
            new[id(p)] = nn.Parameter(local, requires_grad=p.requires_grad)
        _set(module, name, new[id(p)])
    for name, _ in module.named_buffers():
        _set(module, name, _torch.local_tensor({r: modules[r].get_buffer(name) for r in ranks}))
    return module


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _set(module: nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(module.get_submodule(owner), leaf, value)


def _per_rank_constants(what: str, graphs: list[fx.GraphModule]) -> None:
    """``graphs[0]`` (rank 0's) made to compute every rank's graph: each integer argument in
    which the ranks differ becomes one value per rank; a group name stays rank 0's."""
    base = graphs[0]
    nodes = [list(g.graph.nodes) for g in graphs]
    if len({len(ns) for ns in nodes}) != 1:
        raise RuntimeMismatchError(f"the ranks' {what} graphs have {sorted({len(ns) for ns in nodes})} nodes: "
                                   "the plan does not run the same program on every rank")
    position = [{n: i for i, n in enumerate(ns)} for ns in nodes]
    changed = False
    for same in zip(*nodes):
        node = same[0]
        flat = []
        for rank, n in enumerate(same):
            leaves, spec = _torch.tree_flatten((n.args, n.kwargs))
            if n.op != node.op or n.target != node.target or (flat and spec != flat[0][1]):
                raise _diverged(what, node, rank)
            flat.append(([position[rank][x] if isinstance(x, fx.Node) else x for x in leaves], spec))
        if node.op == "get_attr":   # a constant the trace made: the same on every rank, or no SPMD
            held = [getattr(g, n.target) for g, n in zip(graphs, same)]
            for rank, value in enumerate(held):
                if isinstance(value, torch.Tensor) and not _same_tensor(value, held[0]):
                    raise _diverged(what, node, rank)
        args = list(_torch.tree_flatten((node.args, node.kwargs))[0])
        varies = False
        for i, values in enumerate(zip(*(f[0] for f in flat))):
            if all(v == values[0] and type(v) is type(values[0]) for v in values):
                continue
            if all(type(v) is int for v in values):
                with base.graph.inserting_before(node):
                    args[i] = base.graph.call_function(_torch.local_int, (tuple(values),))
                varies = True
            elif all(isinstance(v, str) for v in values) and _is_collective(node):
                continue   # rank 0's group: the mode runs every group of that mesh dim
            else:
                raise _diverged(what, node, next(r for r, v in enumerate(values) if v != values[0]))
        if varies:
            node.args, node.kwargs = _torch.tree_unflatten(args, flat[0][1])
            if node.target is operator.getitem:   # Python's list index takes no per-rank value
                node.target = _getitem_on_each_rank
            changed = True
    if changed:
        base.recompile()


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def _getitem_on_each_rank(seq, index):
    return _torch.on_each_rank(operator.getitem)(seq, index)


def _is_collective(node: fx.Node) -> bool:
    return getattr(node.target, "namespace", "").startswith("_c10d_functional")


def _diverged(what: str, node: fx.Node, rank: int) -> RuntimeMismatchError:
    return RuntimeMismatchError(f"rank {rank}'s {what} graph differs from rank 0's at {node.format_node()}: "
                                "the plan does not run the same program on every rank, so it cannot be simulated")
