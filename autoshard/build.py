"""The per-rank build of ``autoshard.compile``: the traced joint graph rewritten for this rank under a
plan (local shapes, collectives, recompute, gathers and gradient reductions bucketed per block),
split into forward and backward, and wrapped with the DTensor parameters in a
:class:`~autoshard.runtime.module.DistributedModule`."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from autoshard import _torch
from autoshard.cluster import Cluster
from autoshard.collectives import gradient_buckets, local_shape
from autoshard.errors import PlanMismatchError, TraceError
from autoshard.notation import parse_placements
from autoshard.passes.bucket import bucket_gathers, reduce_gradients
from autoshard.passes.regions import untied
from autoshard.passes.rewrite import local_joint, split
from autoshard.passes.strategies import META_KEY
from autoshard.passes.trace import TracedModel
from autoshard.planning.plan import Plan
from autoshard.precision import MixedPrecision
from autoshard.runtime.module import DistributedModule


def choice_from_plan(traced, the_plan: Plan) -> dict:
    by_name = {n.name: n.strategy for n in the_plan.nodes}
    choice = {}
    for node in traced.gm.graph.nodes:
        ns = node.meta.get(META_KEY)
        if ns is None or ns.alias_of is not None:
            continue
        want = by_name.get(node.name)
        match = [s for s in ns.strategies if str(s) == want]
        if not match:
            raise PlanMismatchError(f"the plan's strategy for {node.name} ({want}) is not valid for this model")
        choice[node] = match[0]
    why = untied(choice)
    if why is not None:
        raise PlanMismatchError(f"the plan cannot run: {why}")
    return choice


def device_mesh(cluster: Cluster, device_type: str):
    """The cluster's mesh over the whole process group (every rank calls it)."""
    # sub-groups of an N-D mesh inherit the user's process-group options (its timeout above all:
    # a dead peer must fail the job in the user's time, not torch's 30-minute default; a fake
    # group, under simulated ranks, has none)
    options = _torch.default_group_options(device_type) if len(cluster.mesh_shape) > 1 else None
    override = None if options is None else dict.fromkeys(range(len(cluster.mesh_shape)), options)
    return torch.distributed.device_mesh.init_device_mesh(device_type, tuple(cluster.mesh_shape),
                                                          mesh_dim_names=tuple(cluster.mesh_dim_names),
                                                          backend_override=override)


def build(model: nn.Module, traced: TracedModel, plan: Plan, cluster: Cluster, device: torch.device,
          mixed_precision: MixedPrecision | None, grad_accumulation: int, mesh=None) -> DistributedModule:
    """This rank's module running ``plan`` (made for ``traced``, the model traced for ``device``)
    on ``cluster``'s mesh; every rank of the process group calls it. ``mesh``: the device mesh to
    run on instead (a pipeline stage's, a sub-mesh of the whole group's; only its ranks call)."""
    device_type = device.type
    choice = choice_from_plan(traced, plan)
    mesh = device_mesh(cluster, device_type) if mesh is None else mesh
    rep = [Replicate()] * mesh.ndim

    def distribute(full: torch.Tensor, placements) -> DTensor:
        full = full.detach().to(device).clone()
        # every rank starts from the values of the mesh's first rank, as DDP does from rank 0's
        for d in range(mesh.ndim):
            dist.broadcast(full, group=mesh.get_group(d), group_src=0)
        return DTensor.from_local(full, mesh, rep, run_check=False).redistribute(mesh, placements)

    named = dict(model.named_parameters())
    named_buffers = dict(model.named_buffers())
    # parameters live in their storage placement; the plan's working placement (what the graph
    # computes with) differs where it gathers once per step and keeps the copy
    stored = {name: tuple(parse_placements(plan.storage[name], mesh.ndim)) for name, _ in traced.params}
    working = {name: choice[node].outputs[0] for name, node in traced.params
               if tuple(choice[node].outputs[0]) != stored[name]}
    params = {name: distribute(named[name], stored[name]) for name, _ in traced.params}
    buffers = {name: distribute(named_buffers[name], rep).to_local() for name, _ in traced.buffers}
    input_pl = [choice[node].outputs[0] for node in traced.inputs]
    local_primals = [(p.redistribute(mesh, working[name]) if name in working else p).to_local()
                     for name, p in params.items()] + list(buffers.values())
    for node, pl in zip(traced.inputs, input_pl):
        val = node.meta["val"]
        local_primals.append(torch.zeros(local_shape(val.shape, pl, mesh.shape), dtype=val.dtype, device=device))
    order = [node for node in traced.gm.graph.find_nodes(op="placeholder") if node not in traced.tangents]
    if order != [n for _, n in traced.params] + [n for _, n in traced.buffers] + list(traced.inputs):
        raise TraceError("the traced graph lists its inputs in an order autoshard does not expect "
                         "(parameters, buffers, then inputs); this torch version is not supported")
    reduce_dtype = None if mixed_precision is None else mixed_precision.reduce_dtype
    joint, n_out, grad_pl = local_joint(traced, choice, mesh, local_primals, reduce_dtype)
    fw, bw = split(joint, n_out, frozenset(n.name for n in plan.nodes if n.recompute))
    block_of = {n.name: n.layer for n in plan.nodes}
    fw, bw = bucket_gathers(fw, block_of), bucket_gathers(bw, block_of)
    bw_sync, reduced = _reducing_backward(bw, traced, params, grad_pl, block_of, reduce_dtype)
    first, aliases = {}, {}  # tied weights: every name the model uses for a shared parameter
    for name, p in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(p), name) != name:
            aliases[name] = first[id(p)]
    return DistributedModule(plan, mesh, fw, bw, n_out, params, buffers, input_pl, traced.input_meta,
                             aliases=aliases, grad_placements=grad_pl, reduce_dtype=reduce_dtype,
                             grad_accumulation=grad_accumulation, mixed_precision=mixed_precision,
                             working=working, bw_sync=bw_sync, reduced=reduced, backend=plan.backend,
                             input_grads=[i for i, g in enumerate(traced.input_grads) if g is not None],
                             tangent_outputs=traced.tangent_outputs,
                             non_persistent={n for n, _ in traced.buffers} - set(model.state_dict()))

def _reducing_backward(bw, traced, params: dict, grad_pl: list, block_of: dict, reduce_dtype):
    """``bw`` with each block's gradient reductions in it (passes/bucket.py), and the indices of
    the gradients it hands over reduced; (None, ()) when no gradient moves in a bucket."""
    (out,) = bw.graph.find_nodes(op="output")
    made = out.args[0]
    pos = {n: i for i, n in enumerate(bw.graph.nodes)}
    moves = []
    for i, ((name, node), pl) in enumerate(zip(traced.params, grad_pl)):
        g = made[i]
        if pl is None or not isinstance(g, fx.Node) or tuple(pl) == tuple(params[name].placements):
            continue
        # bucketed by the parameter's block (a layer's bias gradient is summed where the next begins)
        moves.append((pos[g], i, tuple(pl), params[name], block_of.get(node.name), g.meta["val"].dtype))
    moves.sort(key=lambda m: m[0])   # in the order backward makes them
    buckets = gradient_buckets([m[1:] for m in moves], reduce_dtype)
    if not buckets:
        return None, ()
    return reduce_gradients(bw, buckets), tuple(i for b in buckets for i in b.indices)
