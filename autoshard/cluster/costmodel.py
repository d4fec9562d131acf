"""Costs of a strategy and of a resharding, from the node's annotations and the Cluster.

compute(node, strategy) = cluster.compute_time(flops / shards, bytes / shards, dtype): the op
runs on its local shard, split over the ranks of every mesh dim where any of its tensors is not
replicated (a replicated mesh dim repeats the whole op on each rank). Where the split is uneven
in work (causal attention split by sequence), ``shards`` is divided by the strategy's
``imbalance``: the slowest rank sets the time. An op that communicates inside itself under a
strategy (``rules.INLINE_COMM``) adds those collectives' time as the op prices it: the balanced
causal split's all-to-alls in full, a ring's key passes less what its blocks' compute hides. For
the inductor backend the bytes are the op's fused ones and an op inlined into its reader's kernel
has no launch (passes/annotate.py).

resharding(src -> dst) walks the mesh dims; on dim d the local tensor (the global one divided by
the shards of the *other* dims) moves by one collective (ring formulas in cluster.py):

    Partial -> Replicate   all-reduce       Shard -> Replicate   all-gather
    Partial -> Shard       reduce-scatter   Shard(i) -> Shard(j) all-to-all
    Replicate -> Shard / Partial, and unchanged placements: local, free

Multi-dim resharding is the sum over the dims it touches (docs/cost_model.md).

optimizer(parameter, storage strategy) = the AdamW update of the parameter's local shard, once per
step, where its storage placement keeps it (:func:`optimizer_time`): memory-bound, by how torch
runs it (``DeviceSpec.optimizer``)::

    foreach    ADAMW_FOREACH_PASSES * local_bytes / (memory_bandwidth * memory_efficiency)
               + ADAMW_KERNELS * dtensor_op_overhead
    fused      ADAMW_PASSES * local_bytes / (memory_bandwidth * memory_efficiency)
               + dtensor_op_overhead
    for-loop   ADAMW_KERNELS * (launch_overhead + dtensor_op_overhead)
               + ADAMW_PASSES * local_bytes / (memory_bandwidth * memory_efficiency)

with ``dtensor_op_overhead`` the calibrated dispatch cost of one op on a DTensor (the emitted
module's parameters are DTensors but on one device; 0 without a calibration). A foreach or fused
kernel serves many parameters at once, so its launch is no parameter's own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch.distributed.tensor import Partial, Replicate, Shard

from autoshard import collectives
from autoshard.passes import rules
from autoshard.passes.annotate import META_KEY as COST_KEY, tensor_bytes

# Which gradient reductions and gathers go in flat buckets is the runtime's rule
# (autoshard/collectives.py); the solver prices a move as bucketed by that same rule, named here,
# so a plan never counts on a bucket the program would not make.
bucket_move, grad_bucket_move = collectives.bucket_move, collectives.grad_bucket_move
splits_evenly = collectives.splits_evenly


@dataclass(frozen=True)
class Collective:
    kind: str          # all_reduce | all_gather | reduce_scatter | all_to_all
    mesh_dim: int
    nbytes: float      # the collective's n (docs/cost_model.md conventions)
    time: float


def _shard_factor(placements, mesh_shape, skip: int) -> int:
    f = 1
    for d, (p, m) in enumerate(zip(placements, mesh_shape)):
        if d != skip and isinstance(p, Shard):
            f *= m
    return f


def resharding(cluster, src, dst, nbytes: float, bucketed: bool = False) -> list[Collective]:
    """Collectives that turn placements ``src`` into ``dst`` for a tensor of ``nbytes`` (global).

    ``bucketed``: the move is one of many merged into one collective (a parameter's gather and a
    gradient's reduction: the emitted module gathers a block's parameters at once and reduces
    the gradients in flat buckets, as FSDP and DDP do), so it pays the bandwidth term alone; the
    bucket's latency, once per block, is left out of the per-tensor price."""
    out = []
    if src is None or dst is None:
        return out
    for d, (a, b) in enumerate(zip(src, dst)):
        if a == b or isinstance(a, Replicate):
            continue
        n = nbytes / max(_shard_factor(src, cluster.mesh_shape, d), _shard_factor(dst, cluster.mesh_shape, d))
        if isinstance(a, Partial):
            kind = "all_reduce" if isinstance(b, Replicate) else "reduce_scatter" if isinstance(b, Shard) else None
        elif isinstance(a, Shard):
            kind = "all_gather" if not isinstance(b, Shard) else "all_to_all"
        else:
            kind = "all_gather"
        if kind is None:
            continue
        if kind == "all_to_all":  # each rank exchanges its own shard: n is the per-rank tensor
            n /= cluster.mesh_shape[d]
        t = cluster.collective_time(kind, n, d)
        if bucketed:  # less the latency a: the times are a + b n, so a = 2 t(1) - t(2)
            t = max(0.0, t - 2 * cluster.collective_time(kind, 1.0, d) + cluster.collective_time(kind, 2.0, d))
        out.append(Collective(kind, d, n, t))
    return out


def communicates(src, dst) -> bool:
    """Whether turning ``src`` into ``dst`` runs a collective (its result is then a new tensor;
    a local slice of a replicated tensor may stay a view of it)."""
    return src is not None and dst is not None and any(
        a != b and not isinstance(a, Replicate) and not (isinstance(a, Partial) and isinstance(b, Partial))
        for a, b in zip(src, dst))


def resharding_time(cluster, src, dst, nbytes: float, bucketed: bool = False) -> float:
    return sum(c.time for c in resharding(cluster, src, dst, nbytes, bucketed))


BACKENDS = ("eager", "inductor")


def compute_time(cluster, node, strategy, backend: str = "eager") -> float:
    """The op's time under ``strategy`` as ``backend`` runs it: eager, one kernel per op reading
    its inputs and writing its outputs; inductor, elementwise chains fused into their readers
    (passes/annotate.py: an inlined op launches nothing, a fused kernel moves only what enters
    and leaves it)."""
    cost = node.meta.get(COST_KEY)
    if cost is None or (cost.flops == 0 and cost.bytes == 0):
        return 0.0
    if backend == "inductor" and cost.fused_bytes is not None:
        time = cluster.compute_time(cost.flops / strategy.work_shards, cost.fused_bytes / strategy.work_shards,
                                    cost.dtype, launch=not cost.inlined)
    else:
        time = cluster.compute_time(cost.flops / strategy.work_shards, cost.bytes / strategy.work_shards, cost.dtype)
    inline = rules.INLINE_COMM.get(node.target)
    return time + (inline(cluster, node, strategy, time) if inline is not None else 0.0)


# AdamW reads p, g, m, v and writes p, m, v: 7 shard-sized passes through memory, what a fused
# kernel moves. torch's for-loop version runs 9 kernels per parameter (p *= 1 - lr wd; m.lerp_(g);
# v *= b2; v += (1 - b2) g g; d = sqrt(v); d /= c2; d += eps; p -= s m / d; the step count) over
# 20 passes, but one parameter's p, g, m, v and d stay in cache between them: measured on CPU, the
# loop's time is the 7 passes at the calibrated (64 MiB copy) bandwidth plus its 9 launches.
# The foreach version (torch's default on CUDA) runs those ops each over every parameter at once,
# so nothing stays in cache between them: 20 passes (lerp 3, mul 2, addcmul 3, weight decay 2,
# sqrt 2, div 2, add 2, addcdiv 4). Measured on one H200 at 8B bf16 parameters (16 GB): 91 ms for
# foreach (these 20 passes at 80% of 4.8 TB/s: 84 ms), 36 ms fused (the 7 passes: 29 ms).
ADAMW_PASSES = 7
ADAMW_FOREACH_PASSES = 20
ADAMW_KERNELS = 9


def optimizer_time(cluster, param, strategy, trained: bool = True) -> float:
    """Seconds of one AdamW update of ``param`` (a parameter placeholder) stored in ``strategy``'s
    output placement, as ``cluster.device.optimizer`` runs it; 0.0 for a frozen parameter
    (``trained=False``: no gradient, no update)."""
    if not trained:
        return 0.0
    d = cluster.device
    shard = local_bytes(tensor_bytes(param.meta["val"]), strategy.outputs[0], cluster.mesh_shape)
    # the emitted module's parameters are DTensors except on one device (runtime.py)
    dtensor = (cluster.calibration or {}).get("dtensor_op_overhead", 0.0) if math.prod(cluster.mesh_shape) > 1 else 0.0
    stream = d.memory_bandwidth * d.memory_efficiency
    if d.optimizer == "foreach":
        return ADAMW_KERNELS * dtensor + ADAMW_FOREACH_PASSES * shard / stream
    if d.optimizer == "fused":
        return dtensor + ADAMW_PASSES * shard / stream
    return ADAMW_KERNELS * (d.launch_overhead + dtensor) + ADAMW_PASSES * shard / stream


def local_bytes(nbytes: float, placements, mesh_shape) -> float:
    """Bytes one rank holds of a tensor with these placements (Partial holds a full copy)."""
    return nbytes / _shard_factor(placements, mesh_shape, -1) if placements is not None else nbytes
