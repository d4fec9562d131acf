"""Logical meshes: other grids over the same physical devices, and planning over several of them.

The physical cluster is (nodes, GPUs per node), but the best plan may view its devices as another
grid: 16 GPUs as (16,), (4, 4) or (8, 2). A logical mesh is laid out row-major over the ranks, as
``DeviceMesh`` does, so its innermost dim holds consecutive ranks (the GPUs of one node first).
:meth:`Cluster.with_mesh` prices each logical dim by the physical links it spans: a dim inside a
node rides NVLink; a dim that spans GPUs of several nodes is costed hierarchically (the NVLink
part first, then the network on a 1/p share of the bytes).

Candidate rule (:func:`candidates`), bounded so a plan costs a handful of solves. With W devices
and G devices per node (``cluster.ranks_per_node``):

* the cluster's own mesh;
* the flat mesh (W,);
* every 2-D grid (W/k, k) with 1 < k < W whose inner dim k either lies inside a node (k divides
  G) or is made of whole nodes (G divides k).

Grids equal up to dims of size 1 are one candidate (the first listed): one node of 8 H100s gives
(1, 8), (4, 2), (2, 4); 4 nodes of 8 give 5 grids; 16 Perlmutter nodes of 4 give 6. Grids of 3 or more dims are not
candidates: their strategy sets grow as (placements per dim) ** dims and a free 3-D solve of even
a tiny GPT takes ~20x a 2-D one; pass them explicitly (``meshes=[(4, 2, 8)]``) or reach them
through the hand strategies of :mod:`autoshard.baselines`, which constrain the problem enough.

>>> c = Cluster.preset("dgx-h100", nodes=1)
>>> [shape for shape, _ in candidates(c)]
[(1, 8), (4, 2), (2, 4)]
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from autoshard.cluster import Cluster
from autoshard.errors import ClusterError, InfeasibleError, SolverError


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _names(shape: tuple[int, ...]) -> tuple[str, ...]:
    return {1: ("world",), 2: ("outer", "inner")}.get(len(shape), tuple(f"l{i}" for i in range(len(shape))))


def candidates(cluster: Cluster) -> list[tuple[tuple[int, ...], tuple[str, ...]]]:
    """(shape, dim names) of the logical meshes the planner tries for ``cluster`` (rule above)."""
    world, per_node = cluster.world_size, cluster.ranks_per_node
    out = [(tuple(cluster.mesh_shape), tuple(cluster.mesh_dim_names))]
    if world > 1:
        out.append(((world,), _names((world,))))
    for k in _divisors(world)[1:-1]:
        if per_node % k == 0 or k % per_node == 0:
            out.append(((world // k, k), _names((world // k, k))))
    seen, unique = set(), []
    for shape, names in out:
        squeezed = tuple(p for p in shape if p > 1)  # a dim of one device splits nothing
        if squeezed not in seen:
            seen.add(squeezed)
            unique.append((shape, names))
    return unique


def _normalize(cluster: Cluster, meshes) -> list[tuple[tuple[int, ...], tuple[str, ...]]]:
    if meshes == "auto":
        return candidates(cluster)
    if isinstance(meshes, str) or not isinstance(meshes, Sequence) or not meshes:
        raise ClusterError(f"meshes must be 'auto' or a non-empty list of mesh shapes, got {meshes!r}")
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
    """Plan ``traced`` on each logical mesh of ``meshes`` ("auto": :func:`candidates`) with
    ``plan_one(traced, logical_cluster, **kwargs)`` and keep the fastest predicted step (ties: the
    earlier candidate, so the physical mesh wins a tie). ``plan.stats["meshes"]`` lists every
    candidate's step time (None: infeasible, or no solution within ``time_limit``). If none fits,
    raises the InfeasibleError whose ``min_memory`` is smallest."""
    best, tried, errors = None, {}, []
    for shape, names in _normalize(cluster, meshes):
        logical = cluster.with_mesh(shape, names)
        try:
            p = plan_one(traced, logical, **kwargs)
        except (InfeasibleError, SolverError) as exc:  # this grid has no plan: the others may
            tried[str(shape)] = None
            errors.append(exc)
            continue
        tried[str(shape)] = p.step_time
        if best is None or p.step_time < best.step_time:
            best = p
    if best is None:
        infeasible = [e for e in errors if isinstance(e, InfeasibleError)]
        if not infeasible:
            raise errors[0]
        raise min(infeasible, key=lambda e: math.inf if e.min_memory is None else e.min_memory)
    best.stats["meshes"] = tried
    return best
