"""Hand-written parallel strategies as constraints on the same ILP, for comparing with the free plan.

Each baseline is a logical mesh (:mod:`autoshard.meshes`) whose dims play *roles*, and an
``allow(node, strategy)`` predicate (:func:`autoshard.plan`'s ``allow``) built from those roles.
The solver, cost model and memory model are the free plan's, so the only difference from the free
plan is the freedom; within a baseline the solver still picks what the hand strategy leaves open
(colwise or rowwise per matmul, where activations are resharded), i.e. the baseline at its best.

Roles of a mesh dim (placements are per mesh dim; "stored" is a parameter's placement at rest,
"consumed" the placement an op computes with, through any views of the parameter):

=========  ===========================  ==================================  =====================
role       parameter stored             parameter consumed                  model inputs
=========  ===========================  ==================================  =====================
dp         Replicate                    Replicate                           Shard(0) (batch)
fsdp       Shard(any dim)               Replicate (all-gathered per use)    Shard(0) (batch)
tp         Shard(any) if >= 2-D, else   Shard(any) if >= 2-D (colwise or    Replicate
           Replicate                    rowwise: the solver picks), else
                                        any
data       Replicate or Shard(any)      Replicate                           Shard(0) (batch)
free       any                          any                                 any
=========  ===========================  ==================================  =====================

"data" is dp or fsdp, per parameter, as the solver likes; "free" leaves a dim to the solver (the
pruned 3-D candidates of :mod:`autoshard.meshes` use ("data", "free", "free")). On dp, fsdp and
data dims an op's outputs are split along the batch (dim 0) or not at all (Replicate, Partial):
data parallelism, no sequence or feature splits; on AxoNN's x and y dims they are not split
along the batch; views are exempt (a transposed activation's batch dim moves).

A parameter that no strategy can place so (a dim that does not divide by the mesh size) falls
back to Replicate on that dim, as FSDP's padding or Megatron's replicated small layers would; on
"tp" dims of a mesh with two of them (AxoNN's x and y), a >= 2-D parameter must be sharded on both
along different tensor dims (a 2-D block). Otherwise activations are free: the solver places them.
A parameter's working placement (what its consumers gather from) obeys its storage rule too, so
FSDP gathers at every use (reshard after forward) rather than keeping a gathered copy.

The baselines (W devices, G per node, N nodes; grids listed outer dim first, dims of size 1
dropped):

* ``ddp``: roles (dp,) on the flat mesh (W,).
* ``fsdp`` (ZeRO-3): (fsdp,) on (W,).
* ``hsdp``: (dp, fsdp) on (W/s, s), shard group s in {G/2, G, 2G} (1 < s < W).
* ``megatron``: (dp, tp) on (W/t, t), tensor-parallel degree t a divisor of G, t > 1: TP inside
  the node, data parallel across.
* ``tp_fsdp``: (fsdp, tp) on (W/t, t), t as megatron: 2-D, FSDP across the TP groups.
* ``axonn_4d``: (dp, fsdp, tp, tp) on (data, z, y, x) with x * y = G split near-square (x >= y,
  x inner, G >= 4), and z in {N, 1} (data = N/z): AxoNN's 3-D tensor grid (weights as 2-D blocks over
  x, y and sharded further over z, gathered before use), data parallel outside; on one node of
  G >= 8 also z = 2 with y * x = G/2.

Each in two forms: no recompute (``"name"``) and full activation recompute, per layer (each
repeated layer's inputs saved, everything else recomputed: Megatron's full recomputation)
(``"name+recompute"``); over its grids the fastest feasible plan is kept. :func:`compare` plans
them all next to the free plan (``"auto"``: every logical mesh of :func:`autoshard.meshes.candidates`,
selective recompute); an infeasible baseline maps to its :class:`InfeasibleError`. Any of the
plans runs with ``autoshard.compile(model, cluster, inputs, plan=plans[name])``.

>>> plans = compare(model, Cluster.preset("dgx-h100"), inputs)            # doctest: +SKIP
>>> {k: round(p.step_time * 1e3, 2) for k, p in plans.items() if isinstance(p, Plan)}  # doctest: +SKIP
"""

from __future__ import annotations

import collections
import copy
import math
from dataclasses import dataclass
from typing import Callable

from torch.distributed.tensor import Replicate, Shard

from autoshard.cluster import Cluster
from autoshard.errors import ConstraintError, CutoffError, InfeasibleError, SolverError
from autoshard.meshes import _divisors, _near_square, tightened
from autoshard.passes.annotate import is_free
from autoshard.passes.strategies import META_KEY, tensor_inputs, value_of
from autoshard.passes.trace import TracedModel
from autoshard.plan import Plan

RECOMPUTE = {"": False, "+recompute": "full"}


# --- grids -------------------------------------------------------------------------------------
def _flat(c: Cluster):
    return [(c.world_size,)]


def _hsdp(c: Cluster):
    w, g = c.world_size, c.ranks_per_node
    return [(w // s, s) for s in (g // 2, g, 2 * g) if 1 < s < w and w % s == 0]


def _tp(c: Cluster):
    w, g = c.world_size, c.ranks_per_node
    return [(w // t, t) for t in _divisors(math.gcd(g, w)) if t > 1]


def _axonn(c: Cluster):
    w, g = c.world_size, c.ranks_per_node
    if w % g or g < 4:
        return []
    n = w // g
    x, y = _near_square(g)
    grids = [(n // z, z, y, x) for z in dict.fromkeys((n, 1))]
    if n == 1 and g % 8 == 0:
        x2, y2 = _near_square(g // 2)
        grids.append((1, 2, y2, x2))
    return grids


@dataclass(frozen=True)
class Baseline:
    name: str
    roles: tuple[str, ...]                       # per logical dim, outer first
    grids: Callable[[Cluster], list[tuple[int, ...]]]


BASELINES: dict[str, Baseline] = {b.name: b for b in (
    Baseline("ddp", ("dp",), _flat),
    Baseline("fsdp", ("fsdp",), _flat),
    Baseline("hsdp", ("dp", "fsdp"), _hsdp),
    Baseline("megatron", ("dp", "tp"), _tp),
    Baseline("tp_fsdp", ("fsdp", "tp"), _tp),
    Baseline("axonn_4d", ("dp", "fsdp", "tp", "tp"), _axonn),
)}
_AXONN_NAMES = ("data", "z", "y", "x")


def logical_meshes(baseline: str, cluster: Cluster) -> list[tuple[tuple[int, ...], tuple[str, ...], tuple[str, ...]]]:
    """(shape, dim names, roles) of each grid ``baseline`` is tried on, dims of one device dropped."""
    b = BASELINES[baseline]
    out = []
    for grid in b.grids(cluster):
        names = _AXONN_NAMES if b.name == "axonn_4d" else b.roles
        kept = [(p, n, r) for p, n, r in zip(grid, names, b.roles) if p > 1]
        if not kept:
            kept = [(1, names[-1], b.roles[-1])]
        shape, names_, roles = (tuple(t) for t in zip(*kept))
        if math.prod(shape) == cluster.world_size and (shape, names_, roles) not in out:
            out.append((shape, names_, roles))
    return out


# --- the allow predicate -----------------------------------------------------------------------
def _stored_ok(role: str, p, nd: int) -> bool:
    if role in ("free", "data"):
        return role == "free" or isinstance(p, (Replicate, Shard))
    if role == "dp" or (role == "tp" and nd < 2):
        return isinstance(p, Replicate)
    return isinstance(p, Shard)


def _consumed_ok(role: str, p, nd: int) -> bool:
    if role == "free":
        return True
    if role in ("dp", "fsdp", "data"):
        return isinstance(p, Replicate)
    return nd < 2 or isinstance(p, Shard)


def _input_ok(role: str, p) -> bool:
    if role == "free":
        return True
    return isinstance(p, Shard) and p.dim == 0 if role in ("dp", "fsdp", "data") else isinstance(p, Replicate)


def _batch_ok(role: str, p, grid: bool) -> bool:
    """Data-parallel dims split the batch (dim 0) and nothing else; a tensor grid's dims (AxoNN's
    x, y) leave the batch to the data dims."""
    if not isinstance(p, Shard) or role == "free":
        return True
    if role == "tp":
        return not grid or p.dim in (1, -1) or p.dim >= 2
    return p.dim == 0


def _block_ok(roles, placements, nd: int) -> bool:
    """Two tp dims (AxoNN's x, y) shard a >= 2-D parameter along different tensor dims."""
    tp = [p for r, p in zip(roles, placements) if r == "tp"]
    if len(tp) < 2 or nd < 2:
        return True
    return len({p.dim for p in tp if isinstance(p, Shard)}) == len(tp)


def allow_for(traced: TracedModel, roles: tuple[str, ...]):
    """``allow(node, strategy)`` enforcing ``roles`` (one per mesh dim) on ``traced``."""
    params = {node: node.meta["val"].ndim for _, node in traced.params}
    root = dict.fromkeys(params)
    root.update({p: p for p in params})
    frontier = list(params)
    while frontier:  # views of a parameter take its storage placement; their consumers compute with it
        u = frontier.pop()
        for v in u.users:
            if v.op == "call_function" and is_free(v) and v not in root:
                root[v] = root[u]
                frontier.append(v)
    inputs = set(traced.inputs)
    grid = roles.count("tp") > 1
    strict_possible: dict = {}

    def check(node, s, strict: bool) -> bool:
        relax = lambda ok, p: ok or (not strict and isinstance(p, Replicate))  # noqa: E731
        param = getattr(node, "param", node)  # the solver's storage decision of a parameter names it
        if param in params:
            # storage and working placement alike: the hand strategies keep the parameter as stored
            pl, nd = s.outputs[0], params[param]
            return all(relax(_stored_ok(r, p, nd), p) for r, p in zip(roles, pl)) and \
                (not strict or _block_ok(roles, pl, nd))
        if node in inputs:
            return all(_input_ok(r, p) for r, p in zip(roles, s.outputs[0]))
        if node in root or node.op != "call_function":
            return True
        if not is_free(node) and not all(_batch_ok(r, p[d], grid) for d, r in enumerate(roles)
                                         for p in s.outputs if p is not None):
            return False
        for i, arg in enumerate(tensor_inputs(node)):
            src = value_of(arg)[0]
            if src in root and s.inputs[i] is not None:
                nd = params[root[src]]
                if not all(relax(_consumed_ok(r, p, nd), p) for r, p in zip(roles, s.inputs[i])):
                    return False
                if strict and not _block_ok(roles, s.inputs[i], nd):
                    return False
        return True

    def allow(node, s) -> bool:
        if node not in strict_possible:
            strict_possible[node] = any(check(node, t, True) for t in node.meta[META_KEY].strategies)
        return check(node, s, strict_possible[node])

    return allow


# --- planning ----------------------------------------------------------------------------------
def plan_baseline(model, cluster: Cluster, name: str, example_inputs=None, *, recompute: bool | str = False,
                  _solved: dict | None = None, **kwargs) -> Plan:
    """The fastest plan of baseline ``name`` ("fsdp", or "fsdp+recompute" for full recompute)
    over its grids; ``kwargs`` go to :func:`autoshard.plan`. Raises InfeasibleError when no grid
    fits (or the baseline cannot be expressed on this cluster or batch). ``plan.stats["meshes"]``
    gives each grid's step time (None: no plan) and ``plan.stats["mesh_errors"]`` why
    (:func:`autoshard.meshes.failure`; "time_limit": that grid was not priced; "slower": solved
    with the best grid's objective as cutoff, and proven no faster).

    ``_solved`` (:func:`compare`'s, for calls with the same model, cluster and ``kwargs``) holds
    the outcome of each (grid, dim names, roles, recompute) solved so far: two baselines that
    coincide on a grid (megatron and tp_fsdp at t = G on one node: both (tp,) on (G,)) are one
    problem, solved once."""
    from autoshard.api import plan, trace
    from autoshard.meshes import failure

    base, _, suffix = name.partition("+")
    if base not in BASELINES or suffix not in ("", "recompute"):
        raise ConstraintError(f"unknown baseline {name!r}; known: {', '.join(BASELINES)} (add '+recompute' "
                              "for full activation recompute)")
    if suffix:
        recompute = "full"
    traced = model if isinstance(model, TracedModel) else trace(model, example_inputs)
    best, errors, tried, why = None, [], {}, {}
    limit = kwargs.pop("cutoff", None)
    grids = logical_meshes(base, cluster)
    common = collections.Counter(g for b in BASELINES for g in logical_meshes(b, cluster))
    solved = {} if _solved is None else _solved
    for shape, names, roles in grids:
        key = ",".join(f"{n}={p}" for n, p in zip(names, shape))  # one shape can carry two role sets
        problem = (shape, names, roles, recompute)
        p = solved.get(problem)
        if p is None:
            # a grid that cannot beat this baseline's best so far stops early, unless another
            # baseline has the grid too (it is solved once, in full, for both); the early stop
            # is this baseline's outcome alone, so it is not kept
            cutoff = limit if common[shape, names, roles] > 1 else tightened(limit, best)
            try:
                p = solved[problem] = plan(traced, cluster.with_mesh(shape, names), allow=allow_for(traced, roles),
                                           recompute=recompute, cutoff=cutoff, **kwargs)
            except (ConstraintError, InfeasibleError, SolverError) as exc:
                p = solved[problem] = exc
            except CutoffError as exc:
                p = exc
        if isinstance(p, Exception):
            tried[key], why[key] = None, failure(p)
            if isinstance(p, CutoffError):  # proven no faster than the best grid so far
                continue
            if isinstance(p, ConstraintError):  # the hand strategy cannot be written on this grid or batch
                errors.append(InfeasibleError(f"{name} on mesh {shape}: {p}"))
            elif isinstance(p, InfeasibleError):
                errors.append(InfeasibleError(f"{name} on mesh {shape}: {p}", min_memory=p.min_memory))
            else:  # no solution within time_limit: this grid is not priced
                errors.append(SolverError(f"{name} on mesh {shape}: {p}"))
            continue
        tried[key] = p.step_time
        if best is None or p.step_time < best.step_time:
            best = p
    if best is None:
        if not errors:
            raise InfeasibleError(f"{name} has no grid on a cluster of {cluster.world_size} devices "
                                  f"({cluster.ranks_per_node} per node)")
        infeasible = [e for e in errors if isinstance(e, InfeasibleError)]
        if not infeasible:
            raise errors[0]
        raise min(infeasible, key=lambda e: math.inf if e.min_memory is None else e.min_memory)
    best = copy.copy(best)  # a solved grid may be shared with another baseline (_solved): own stats
    best.stats = dict(best.stats, baseline=name, meshes=tried, mesh_errors=why)
    return best


def compare(model, cluster: Cluster, example_inputs=None, *, memory_limit: float | None = None,
            baselines: list[str] | None = None, meshes="auto", **kwargs) -> dict[str, Plan | InfeasibleError]:
    """The free plan under "auto" and each baseline (both recompute forms) under its name; one
    that fits on none of its grids maps to its InfeasibleError (a SolverError when every grid ran
    out of ``time_limit`` instead).

    ``baselines``: a subset of names (default: all of :data:`BASELINES`, each with and without
    "+recompute"); ``meshes``: the free plan's logical meshes (see :func:`autoshard.plan`);
    ``kwargs`` (time_limit, share_layers, ...) go to every solve."""
    from autoshard.api import plan, trace

    traced = model if isinstance(model, TracedModel) else trace(model, example_inputs)
    names = baselines if baselines is not None else [b + s for b in BASELINES for s in RECOMPUTE]
    out: dict[str, Plan | InfeasibleError] = {}
    solved: dict = {}  # grids two baselines share are solved once (plan_baseline's _solved)
    try:
        out["auto"] = plan(traced, cluster, memory_limit=memory_limit, meshes=meshes, **kwargs)
    except (InfeasibleError, SolverError) as exc:
        out["auto"] = exc
    for name in names:
        try:
            out[name] = plan_baseline(traced, cluster, name, memory_limit=memory_limit, _solved=solved, **kwargs)
        except (InfeasibleError, SolverError) as exc:
            out[name] = exc
    return out


def best_baseline(plans: dict[str, Plan | InfeasibleError]) -> tuple[str, Plan] | None:
    """(name, plan) of the fastest feasible baseline in a :func:`compare` result, or None."""
    ok = [(k, p) for k, p in plans.items() if k != "auto" and isinstance(p, Plan)]
    return min(ok, key=lambda kv: kv[1].step_time) if ok else None
