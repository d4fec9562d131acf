"""Logical meshes: other grids over the same physical devices, and planning over several of them.

The physical cluster is (nodes, GPUs per node), but the best plan may view its devices as another
grid: 16 GPUs as (16,), (4, 4) or (8, 2). A logical mesh is laid out row-major over the ranks, as
``DeviceMesh`` does, so its innermost dim holds consecutive ranks (the GPUs of one node first).
:meth:`Cluster.with_mesh` prices each logical dim by the physical links it spans: a dim inside a
node rides NVLink; a dim that spans GPUs of several nodes is costed hierarchically (the NVLink
part first, then the network on a 1/p share of the bytes).

Candidate rule (:func:`candidates`), bounded so a plan costs a handful of solves. With W devices,
G devices per node (``cluster.ranks_per_node``) and N = W/G nodes:

* the cluster's own mesh;
* the flat mesh (W,);
* every 2-D grid (W/k, k) with 1 < k < W whose inner dim k either lies inside a node (k divides
  G) or is made of whole nodes (G divides k);
* on several nodes (N > 1) of G >= 4: the 3-D grids (N, G/t, t) for t in {2, G/2} (the node
  split in two dims, e.g. TP x FSDP inside, data across), and with N >= 4 even also (N/2, 2, G)
  (pairs of nodes, e.g. FSDP over a pair, TP inside a node; 64 GPUs as (4, 2, 8)). These are
  *pruned*: their outer dim, named "data", is data parallel only (the batch split, parameters
  replicated or sharded at rest and gathered before use: roles "data", "free", "free" of
  :mod:`autoshard.baselines`); the two inner dims are free;
* on one node of G >= 8 (G a multiple of 8), the pruned 3-D grid (2, y, x) with x * y = G/2 near
  square (x >= y): AxoNN's single-node tensor grid (baselines' ``axonn_4d`` with z = 2), so the
  free plan's space holds every hand-written grid.

Grids equal up to dims of size 1 are one candidate (the first listed): one node of 8 H100s gives
(1, 8), (4, 2), (2, 4) and (2, 2, 2); 4 nodes of 8 give 5 grids and 3 3-D ones; 16 Perlmutter
nodes of 4 give 6 and 2. An unpruned 3-D solve costs (placements per dim) ** 3 strategies per op: on a 4-layer
GPT (hidden 512, 2 nodes of 8 H100s) one took 80-117 s against 7-22 s for each 2-D grid; the
pruned ones took 26-34 s (1.5-2.5x a 2-D grid; ~5 s of it enumerating strategies) and found a
plan 16% faster than the best 2-D grid (the unpruned solves returned one 2% slower still,
although their space holds the pruned one: not yet explained). On GPT-2 124M over 4 nodes of 8
the three 3-D candidates took 27-65 s against 1-28 s for each of the five others (one, (4, 2, 4),
won by 0.01%); over 16 Perlmutter nodes the two took 143 s (no plan within the 120 s limit) and
160 s against 1-23 s, and neither won. So ``meshes="auto"`` on several nodes costs 2.3-6x the
2-D candidates alone (timings on 2 shared cores). Unpruned 3-D or 4-D grids (AxoNN's (data, z, y, x)) are reached by passing them
(``meshes=[(4, 2, 8)]``: every dim free) or through the hand strategies of
:mod:`autoshard.baselines`, which constrain the problem enough.

>>> c = Cluster.preset("dgx-h100", nodes=1)
>>> [shape for shape, _ in candidates(c)]
[(1, 8), (4, 2), (2, 4), (2, 2, 2)]
>>> [shape for shape, _ in candidates(Cluster.preset("dgx-h100", nodes=4))][-3:]
[(4, 4, 2), (4, 2, 4), (2, 2, 8)]
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from autoshard.cluster import Cluster
from autoshard.errors import ClusterError, ConstraintError, CutoffError, InfeasibleError, SolverError
from autoshard.planning.roles import allow_for

# the dim names of a pruned 3-D candidate (its outer dim is data parallel; see the rule above)
DATA_NAMES = ("data", "outer", "inner")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def near_square(g: int) -> tuple[int, int]:
    """(x, y) with x * y = g, x >= y, as square as possible."""
    y = max(d for d in divisors(g) if d * d <= g)
    return g // y, y


def _names(shape: tuple[int, ...]) -> tuple[str, ...]:
    return {1: ("world",), 2: ("outer", "inner")}.get(len(shape), tuple(f"l{i}" for i in range(len(shape))))


def candidates(cluster: Cluster) -> list[tuple[tuple[int, ...], tuple[str, ...]]]:
    """(shape, dim names) of the logical meshes the planner tries for ``cluster`` (rule above)."""
    world, per_node = cluster.world_size, cluster.ranks_per_node
    out = [(tuple(cluster.mesh_shape), tuple(cluster.mesh_dim_names))]
    if world > 1:
        out.append(((world,), _names((world,))))
    for k in divisors(world)[1:-1]:
        if per_node % k == 0 or k % per_node == 0:
            out.append(((world // k, k), _names((world // k, k))))
    nodes = world // per_node if world % per_node == 0 else 1
    if nodes > 1 and per_node >= 4:
        for t in dict.fromkeys((2, per_node // 2)):
            out.append(((nodes, per_node // t, t), DATA_NAMES))
        if nodes >= 4 and nodes % 2 == 0:
            out.append(((nodes // 2, 2, per_node), DATA_NAMES))
    if nodes == 1 and per_node % 8 == 0 and world == per_node:
        x, y = near_square(per_node // 2)
        out.append(((2, y, x), DATA_NAMES))
    seen, unique = set(), []
    for shape, names in out:
        squeezed = tuple(p for p in shape if p > 1)  # a dim of one device splits nothing
        if squeezed not in seen:
            seen.add(squeezed)
            unique.append((shape, names))
    return unique


def allow_data_outer(traced, allow):
    """``allow`` and, on the outer dim, data parallelism only (:mod:`autoshard.planning.roles`)."""
    data = allow_for(traced, ("data", "free", "free"))
    return data if allow is None else (lambda node, s: allow(node, s) and data(node, s))


def grids(cluster: Cluster, meshes) -> list[tuple[tuple[int, ...], tuple[str, ...]]]:
    """(shape, dim names) of each logical mesh ``meshes`` names: "auto", "auto-2d" or a list of
    shapes (a ClusterError for anything else)."""
    if meshes == "auto":
        return candidates(cluster)
    if meshes == "auto-2d":  # the cheap part: no 3-D solves
        return [(shape, names) for shape, names in candidates(cluster) if names != DATA_NAMES]
    if isinstance(meshes, str) or not isinstance(meshes, Sequence) or not meshes:
        raise ClusterError(f"meshes must be 'auto', 'auto-2d' or a non-empty list of mesh shapes, got {meshes!r}")
    out = []
    for m in meshes:
        shape = (m,) if isinstance(m, int) else tuple(m)
        if not shape or not all(isinstance(p, int) and p > 0 for p in shape):
            raise ClusterError(f"logical mesh {m!r} must be a tuple of positive ints")
        if math.prod(shape) != cluster.world_size:
            raise ClusterError(f"logical mesh {shape} holds {math.prod(shape)} devices but the cluster has "
                               f"{cluster.world_size}; give shapes whose entries multiply to {cluster.world_size}")
        names = tuple(cluster.mesh_dim_names) if shape == tuple(cluster.mesh_shape) else _names(shape)
        out.append((shape, tuple(names)))
    return out


def plan_over(plan_one, traced, cluster: Cluster, meshes, **kwargs):
    """Plan ``traced`` on each logical mesh of ``meshes`` ("auto": :func:`candidates`; "auto-2d":
    those of at most 2 dims, a fraction of the cost on several nodes) with
    ``plan_one(traced, logical_cluster, **kwargs)`` and keep the fastest predicted step (ties: the
    earlier candidate, so the physical mesh wins a tie). ``plan.stats["meshes"]`` lists every
    candidate's step time (None: infeasible, or no solution within ``time_limit``; a pruned 3-D
    candidate also when its data dim cannot split the batch), ``plan.stats["mesh_errors"]`` why
    each None is None (:func:`failure`: a "time_limit" mesh was not priced, not proven worse) and
    ``plan.stats["mesh_seconds"]`` what each took to plan. If none fits, raises the
    InfeasibleError whose ``min_memory`` is smallest.

    Once a mesh has a plan, the next ones are solved with its objective as their ``cutoff``: a
    mesh that cannot beat it (by more than the solve's gap) stops as soon as its bound shows so
    ("slower": not priced; on a tight Llama-3-8B on one node the 3-D candidate took 413 s
    without a plan in full, 149 s to be cut off)."""
    best, tried, errors, seconds, why = None, {}, [], {}, {}
    cutoff = kwargs.pop("cutoff", None)
    for shape, names in grids(cluster, meshes):
        logical = cluster.with_mesh(shape, names)
        start = time.perf_counter()
        args = dict(kwargs, cutoff=tightened(cutoff, best))
        if names == DATA_NAMES:
            args["allow"] = allow_data_outer(traced, kwargs.get("allow"))
        try:
            p = plan_one(traced, logical, **args)
        except (InfeasibleError, SolverError, CutoffError) as exc:  # this grid has no plan: the others may
            seconds[str(shape)] = time.perf_counter() - start
            tried[str(shape)] = None
            why[str(shape)] = failure(exc)
            errors.append(exc)
            continue
        except ConstraintError as exc:  # the pruned grid cannot split this batch over its data dim
            if names != DATA_NAMES:
                raise
            tried[str(shape)] = None
            why[str(shape)] = failure(exc)
            continue
        seconds[str(shape)] = time.perf_counter() - start
        tried[str(shape)] = p.step_time
        if best is None or p.step_time < best.step_time:
            best = p
    if best is None:
        infeasible = [e for e in errors if isinstance(e, InfeasibleError)]
        if not infeasible or any(isinstance(e, CutoffError) for e in errors):  # the caller's cutoff
            raise next((e for e in errors if isinstance(e, CutoffError)), errors[0])
        raise min(infeasible, key=lambda e: math.inf if e.min_memory is None else e.min_memory)
    best.stats.update(meshes=tried, mesh_seconds=seconds, mesh_errors=why)
    return best


def tightened(cutoff: float | None, best) -> float | None:
    """The cutoff for the next grid: the caller's, lowered to the objective of the best plan so
    far (None: no cutoff)."""
    if best is None:
        return cutoff
    return min(best.solver["objective"], math.inf if cutoff is None else cutoff)


def failure(exc: Exception) -> str:
    """Why a logical mesh has no plan, in one word: "time_limit" (a SolverError: no plan within
    ``time_limit``, so that mesh was not priced), "slower" (a CutoffError: proven no faster than
    the best mesh before it, to within the solve's gap, or without a plan at all), "infeasible" (nothing fits the memory
    limit), "constraint" (the grid cannot express the strategy or split the batch) or
    "solver_error" (HiGHS stopped with an internal error)."""
    if isinstance(exc, CutoffError):
        return "slower"
    if isinstance(exc, SolverError):
        return "solver_error" if "internal error" in str(exc) else "time_limit"
    return "infeasible" if isinstance(exc, InfeasibleError) else "constraint"
