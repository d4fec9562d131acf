"""Expert parallelism: a token-local MoE region (passes/regions.py) whose experts are split over a
mesh dim, each rank holding ``experts / ep`` whole experts and computing their rows for every rank.

Under a strategy of variant ``ep<d>`` (``regions.ep_strategies``), the region's ops run locally as
in the token-local region, except:

* a gather or scatter that puts routed rows into the rank's sorted order **dispatches** them: an
  all-to-all sends each row to the rank holding its expert (:func:`moe_dispatch`);
* one that takes routed rows back to token order **combines** them first: the reverse all-to-all
  (:func:`moe_combine`);
* the counts (``histc``) become the rows each local expert receives from every rank
  (:func:`moe_counts`), so the grouped GEMMs' offsets walk the received rows;
* the grouped GEMMs multiply the received rows by the rank's own experts; the weight gradients
  come out whole per expert (``Shard(0)`` over the dim) instead of as partial sums.

Each of these ops first exchanges the per-expert counts (an all-gather of ``experts`` integers
from each rank) and reads the split sizes on the host: that read waits for the device, the sync
that dropless expert-parallel runs pay once per exchange (``.tolist()`` in :func:`_splits`). The
received rows are laid out expert-major (expert, source rank, row) at the front of a buffer; the
rows past the received ones are zero. The buffer holds every rank's rows together by default, so
no routing can overflow it, and a rank then holds the dim's routed rows whole, as if replicated.
With a capacity ``c`` (``plan(..., moe_capacity=c)``, variant ``ep<d>@<c>``) it holds ``c`` times
the rank's own rows; a step whose routing sends any rank more raises
:class:`~autoshard.errors.CapacityError` on every rank of the dim's group (each knows every
rank's counts there; the ranks of other groups, on a mesh of several dims, fail at their next
collective with them). The planner counts the buffer at its size either way
(``regions.held_fraction``).

Prices (:func:`exchange_time`): each exchange is the counts' all-gather, the host sync
(:data:`HOST_SYNC_S`) and the rows' all-to-all over the dim's links, the busiest receiver taking
``imbalance`` times an even share (``Strategy.imbalance``); the grouped GEMMs take that share of
the experts' work.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx
from torch.distributed.tensor import Shard

from autoshard import _torch
from autoshard.passes.graph import tensor_inputs
from autoshard.errors import CapacityError
from autoshard.passes.regions import META_KEY as REGION_KEY, ep_capacity, ep_dim, moved, received_rows

aten = torch.ops.aten

# Seconds a read of split sizes on the host costs beyond its transfer: the launch queue drains and
# refills (tens of microseconds on a GPU; nothing overlaps it)
HOST_SYNC_S = 30e-6

MOVES = (aten.index.Tensor, aten.index_put.default)   # the ops that move rows between the orders
COUNTS = aten.histc.default
GROUPED_MM = aten._grouped_mm.default


def _local_counts(ids: torch.Tensor, experts: int) -> torch.Tensor:
    return torch.zeros(experts, dtype=torch.int64, device=ids.device).scatter_add_(
        0, ids.reshape(-1).long(), torch.ones(ids.numel(), dtype=torch.int64, device=ids.device))


def _splits(ids: torch.Tensor, ep: tuple, capacity: float | None) -> tuple[torch.Tensor, list[int], list[int]]:
    """(received counts [source rank, local expert], rows sent to each rank, rows received from
    each rank): every rank's counts all-gathered, then read on the host. Each rank so knows what
    every rank receives, and with a ``capacity`` all of them raise together when one would
    overflow its buffer, leaving no collective half-entered."""
    experts, ranks, rank, group = ep
    sent = _local_counts(ids, experts)
    counts = _torch.wait(_torch.all_gather_async(sent, ranks, group)).view(ranks, ranks, experts // ranks)
    totals = counts.sum((0, 2)).tolist()      # rows each rank's experts receive
    own, limit = ids.shape[0], received_rows(ids.shape[0], ranks, capacity)
    if max(totals) > limit:
        busiest = max(range(ranks), key=totals.__getitem__)
        raise CapacityError(
            f"expert-parallel rank {busiest} of {ranks} received {totals[busiest]} routed rows, over its buffer of "
            f"{limit} (moe_capacity={capacity:g} x its own {own}); this step needed moe_capacity >= "
            f"{math.ceil(totals[busiest] / own * 1000) / 1000:g}. Plan with a larger moe_capacity, or None for a "
            f"buffer that holds every rank's rows.")
    received = counts[:, rank]
    return received, counts[rank].sum(1).tolist(), received.sum(1).tolist()


def _expert_major(received: torch.Tensor, n: int) -> torch.Tensor:
    """Index that reorders ``n`` rows arriving (source, expert, row) into (expert, source, row)
    (``n`` from the host, so that nothing here waits for the device again)."""
    lens = received.reshape(-1)
    starts = torch.cumsum(lens, 0) - lens                       # each (source, expert) block's start
    blocks = received.t().reshape(-1)                           # block lengths in (expert, source) order
    first = torch.cumsum(blocks, 0) - blocks                    # ... and their starts in that order
    starts = starts.view(received.shape).t().reshape(-1)
    return (torch.repeat_interleave(starts - first, blocks, output_size=n)
            + torch.arange(n, device=received.device))


@torch.library.custom_op("autoshard::moe_dispatch", mutates_args=())
def moe_dispatch(rows: torch.Tensor, ids: torch.Tensor, experts: int, ranks: int, rank: int, group: str,
                 capacity: float | None) -> torch.Tensor:
    """This rank's routed ``rows`` (sorted by expert, ``ids`` their experts) -> the rows its own
    experts receive from every rank, expert-major, zero-padded to its buffer (``received_rows``)."""
    received, sent, got = _splits(ids, (experts, ranks, rank, group), capacity)
    arrived = _torch.wait(_torch.all_to_all_async(rows.contiguous(), got, sent, group))
    out = rows.new_zeros((received_rows(rows.shape[0], ranks, capacity), *rows.shape[1:]))
    out[:arrived.shape[0]] = arrived[_expert_major(received, arrived.shape[0])]
    return out


@moe_dispatch.register_fake
def _(rows, ids, experts, ranks, rank, group, capacity):
    return rows.new_empty((received_rows(rows.shape[0], ranks, capacity), *rows.shape[1:]))


@torch.library.custom_op("autoshard::moe_combine", mutates_args=())
def moe_combine(rows: torch.Tensor, ids: torch.Tensor, experts: int, ranks: int, rank: int, group: str,
                capacity: float | None) -> torch.Tensor:
    """The inverse of :func:`moe_dispatch`: rows computed for the received ones go back to the
    ranks they came from, in each rank's own sorted order."""
    received, sent, got = _splits(ids, (experts, ranks, rank, group), capacity)
    n = sum(got)
    arrived = torch.empty_like(rows[:n])
    arrived[_expert_major(received, n)] = rows[:n]
    return _torch.wait(_torch.all_to_all_async(arrived.contiguous(), sent, got, group))


@moe_combine.register_fake
def _(rows, ids, experts, ranks, rank, group, capacity):
    return rows.new_empty((ids.shape[0], *rows.shape[1:]))


@torch.library.custom_op("autoshard::moe_counts", mutates_args=())
def moe_counts(ids: torch.Tensor, experts: int, ranks: int, rank: int, group: str,
               capacity: float | None) -> torch.Tensor:
    """Rows each of this rank's experts receives, from all ranks together."""
    received, _, _ = _splits(ids, (experts, ranks, rank, group), capacity)
    return received.sum(0)


@moe_counts.register_fake
def _(ids, experts, ranks, rank, group, capacity):
    return ids.new_empty((experts // ranks,), dtype=torch.int64)


def run(node: fx.Node, args: tuple, kwargs: dict, strategy, mesh, ids: torch.Tensor):
    """``node``'s local outputs when its region runs expert-parallel under ``strategy``; ``args``
    are its local inputs, ``ids`` this rank's sorted expert ids (the region's sort)."""
    fact, d = node.meta[REGION_KEY], ep_dim(strategy)
    exchange = dict(ids=ids, experts=fact.experts, ranks=mesh.shape[d], rank=mesh.get_local_rank(d),
                    group=mesh.get_group(d).group_name, capacity=ep_capacity(strategy))
    if node.target is COUNTS:
        return torch.ops.autoshard.moe_counts(**exchange).to(node.meta["val"].dtype)
    if node.target is GROUPED_MM:
        out = node.target(*args, **kwargs)
        if out.ndim == 2:   # rows past the received ones: zeros, as the dispatch pads them
            offs = args[2] if len(args) > 2 else kwargs["offs"]
            keep = torch.arange(out.shape[0], device=out.device) < offs[-1]
            out = torch.where(keep.unsqueeze(-1), out, torch.zeros((), dtype=out.dtype, device=out.device))
        return out
    if node.target not in MOVES:
        return node.target(*args, **kwargs)
    # the values of the node's tensor inputs (graph constants are not among them) are combined
    # where the rows are received ones
    received = iter([moved(t, e) for t, e in zip(fact.inputs, fact.ep_inputs)])
    nodes, _ = _torch.tree_flatten((node.args, node.kwargs))
    values, spec = _torch.tree_flatten((args, kwargs))
    values = [torch.ops.autoshard.moe_combine(v, **exchange)
              if isinstance(a, fx.Node) and a.op != "get_attr" and next(received) else v
              for a, v in zip(nodes, values)]
    args, kwargs = _torch.tree_unflatten(values, spec)
    out = node.target(*args, **kwargs)
    if moved(fact.outputs[0], fact.ep_outputs[0]):
        out = torch.ops.autoshard.moe_dispatch(out, **exchange)
    return out


def exchange_time(cluster, node, strategy, compute: float) -> float:
    """Seconds the exchanges of ``node`` add under an expert-parallel ``strategy`` (module doc)."""
    d = ep_dim(strategy)
    fact = node.meta.get(REGION_KEY)
    if d is None or fact is None:
        return 0.0
    # every rank's counts (experts int64s each), gathered
    counts = cluster.collective_time("all_gather", fact.experts * 8 * cluster.mesh_shape[d], d) + HOST_SYNC_S
    if node.target is COUNTS:
        return counts
    if node.target not in MOVES:
        return 0.0
    vals = [a.meta["val"] for a in tensor_inputs(node)]
    routed = [v for v, t, e in zip(vals, fact.inputs, fact.ep_inputs) if moved(t, e)]
    if moved(fact.outputs[0], fact.ep_outputs[0]):
        routed.append(node.meta["val"])
    time = 0.0
    for v in routed:
        # the rank's own rows (split like the tokens on every dim): moved, the busiest receiver
        # taking ``imbalance`` times its share
        own = v.numel() * v.element_size() / _token_shards(strategy, cluster.mesh_shape)
        time += counts + cluster.collective_time("all_to_all", own * strategy.imbalance, d)
    return time


def _token_shards(strategy, mesh_shape) -> int:
    """Ranks the routed rows are split over: every mesh dim the strategy splits the tokens on."""
    n = 1
    for dim, m in enumerate(mesh_shape):
        if any(p is not None and isinstance(p[dim], Shard) for p in strategy.inputs):
            n *= m
    return n


INLINE_COMM = {t: exchange_time for t in (*MOVES, COUNTS)}
