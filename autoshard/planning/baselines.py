"""Hand-written parallel strategies as constraints on the same ILP, for comparing with the free plan.

Each baseline is a logical mesh (:mod:`autoshard.planning.meshes`) whose dims play *roles*, and an
``allow(node, strategy)`` predicate (:func:`autoshard.plan`'s ``allow``) built from those roles.
The solver, cost model and memory model are the free plan's, so the only difference from the free
plan is the freedom; within a baseline the solver still picks what the hand strategy leaves open
(colwise or rowwise per matmul, where activations are resharded), i.e. the baseline at its best.

The roles a mesh dim can play (dp, fsdp, tp, data, free) and what each allows: :mod:`autoshard.planning.roles`.

The baselines (W devices, G per node, N nodes; grids listed outer dim first, dims of size 1
dropped):

* ``ddp``: roles (dp,) on the flat mesh (W,).
* ``fsdp`` (ZeRO-3): (fsdp,) on (W,).
* ``hsdp``: (dp, fsdp) on (W/s, s), shard group s in {G/2, G, 2G} (1 < s < W).
* ``megatron``: (dp, tp) on (W/t, t), tensor-parallel degree t a divisor of G, t > 1: TP inside
  the node, data parallel across.
* ``tp_fsdp``: (fsdp, tp) on (W/t, t), t as megatron: 2-D, FSDP across the TP groups.
* ``fsdp_cp``: (fsdp, cp) on (W/c, c), context-parallel degree c a divisor of G, c > 1, or
  c = W across nodes: the sequence split, attention by its queries' sequence with keys and values
  gathered, parameters sharded over all W and gathered per use (torchtitan's FSDP x CP).
* ``fsdp_ep``: (fsdp, ep) on the grids of fsdp_cp, the expert-parallel degree e in place of c:
  every MoE region expert-parallel over the ep dim (each rank holds E/e experts and receives
  their rows by all-to-all), the experts FSDP-sharded over the fsdp dim as well, every other
  parameter FSDP over both dims (torchtitan's layout for MoE models: its "efsdp x ep" mesh for
  the experts, FSDP over every rank for the rest). A grid whose ep dim does not divide the
  experts has no plan.
* ``axonn_4d``: (dp, fsdp, tp, tp) on (data, z, y, x) with x * y = G split near-square (x >= y,
  x inner, G >= 4), and z in {N, 1} (data = N/z): AxoNN's 3-D tensor grid (weights as 2-D blocks over
  x, y and sharded further over z, gathered before use), data parallel outside; on one node of
  G >= 8 also z = 2 with y * x = G/2.

* ``fsdp_tp_pp``: pipeline stages over the outer mesh dim (8 of them, or the outer dim's size
  when smaller), and inside each stage (fsdp, tp) on its (N/8, G) mesh: torchtitan's 3-D layout
  for its largest runs (FSDP 8 x TP 8 x PP 8 on 512 H100). Priced by
  :mod:`autoshard.planning.pipeline` (a :class:`~autoshard.planning.pipeline.PipelinePlan`, which
  ``compile`` runs), over 1F1B and interleaved 1F1B (torchtitan's; zero bubble is left to the
  free search); with fewer than 8 nodes, the most stages
  up to 8 that divide them. :func:`plan_baseline` plans it from the ``nn.Module`` (the stages
  cut its layers); :func:`compare` does not.

Each in two forms: no recompute (``"name"``) and full activation recompute, per layer (each
repeated layer's inputs saved, everything else recomputed: Megatron's full recomputation)
(``"name+recompute"``); over its grids the fastest feasible plan is kept. :func:`compare` plans
them all next to the free plan (``"auto"``: every logical mesh of :func:`autoshard.planning.meshes.candidates`,
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
from typing import TYPE_CHECKING, Callable

from autoshard.cluster import Cluster
from autoshard.errors import ConstraintError, CutoffError, InfeasibleError, SolverError
from autoshard.planning.meshes import divisors, failure, near_square, tightened
from autoshard.passes.trace import TracedModel
from autoshard.planning.plan import Plan
from autoshard.planning.roles import allow_for

if TYPE_CHECKING:
    from autoshard.planning.pipeline import PipelinePlan

RECOMPUTE = {"": False, "+recompute": "full"}


# --- grids -------------------------------------------------------------------------------------
def _flat(c: Cluster):
    return [(c.world_size,)]


def _hsdp(c: Cluster):
    w, g = c.world_size, c.ranks_per_node
    return [(w // s, s) for s in (g // 2, g, 2 * g) if 1 < s < w and w % s == 0]


def _tp(c: Cluster):
    w, g = c.world_size, c.ranks_per_node
    return [(w // t, t) for t in divisors(math.gcd(g, w)) if t > 1]


def _cp(c: Cluster):
    """(W/c, c) for c a divisor of G, c > 1, and (1, W) across nodes: a batch of one sequence
    splits over no fsdp dim."""
    w = c.world_size
    return _tp(c) + ([(1, w)] if w > c.ranks_per_node else [])


def _axonn(c: Cluster):
    w, g = c.world_size, c.ranks_per_node
    if w % g or g < 4:
        return []
    n = w // g
    x, y = near_square(g)
    grids = [(n // z, z, y, x) for z in dict.fromkeys((n, 1))]
    if n == 1 and g % 8 == 0:
        x2, y2 = near_square(g // 2)
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
    Baseline("fsdp_cp", ("fsdp", "cp"), _cp),
    Baseline("fsdp_ep", ("fsdp", "ep"), _cp),
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


# --- planning ----------------------------------------------------------------------------------
def plan_baseline(model, cluster: Cluster, name: str, example_inputs=None, *, recompute: bool | str = False,
                  _solved: dict | None = None, **kwargs) -> Plan | PipelinePlan:
    """The fastest plan of baseline ``name`` ("fsdp", or "fsdp+recompute" for full recompute)
    over its grids; ``kwargs`` go to :func:`autoshard.plan`. Raises InfeasibleError when no grid
    fits (or the baseline cannot be expressed on this cluster or batch). ``plan.stats["meshes"]``
    gives each grid's step time (None: no plan) and ``plan.stats["mesh_errors"]`` why
    (:func:`autoshard.planning.meshes.failure`; "time_limit": that grid was not priced; "slower": solved
    with the best grid's objective as cutoff, and proven no faster).

    ``"fsdp_tp_pp"`` returns a :class:`~autoshard.planning.pipeline.PipelinePlan` instead (priced,
    not run), from the ``nn.Module`` only.

    ``_solved`` (:func:`compare`'s, for calls with the same model, cluster and ``kwargs``) holds
    the outcome of each (grid, dim names, roles, recompute) solved so far: two baselines that
    coincide on a grid (megatron and tp_fsdp at t = G on one node: both (tp,) on (G,)) are one
    problem, solved once."""
    from autoshard.api import plan, trace

    base, _, suffix = name.partition("+")
    if base == "fsdp_tp_pp" and suffix in ("", "recompute"):   # a PipelinePlan
        return _fsdp_tp_pp(model, cluster, example_inputs, recompute="full" if suffix else recompute, **kwargs)
    if base not in BASELINES or suffix not in ("", "recompute"):
        raise ConstraintError(f"unknown baseline {name!r}; known: {', '.join(BASELINES)}, fsdp_tp_pp (add '+recompute' "
                              "for full activation recompute)")
    if suffix:
        recompute = "full"
    traced = model if isinstance(model, TracedModel) else trace(model, example_inputs)
    if "ep" in BASELINES[base].roles and not _has_experts(traced):
        raise InfeasibleError(f"{name} splits experts over a mesh dim, and this model has no mixture-of-experts "
                              f"layer that can run so (passes/regions.py)")
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


def _fsdp_tp_pp(model, cluster: Cluster, example_inputs, recompute, **kwargs):
    from autoshard.planning.pipeline import plan_pipeline

    if isinstance(model, TracedModel):
        raise ConstraintError("fsdp_tp_pp cuts the model's layers into stages: pass the nn.Module, not a traced model")
    unknown = set(kwargs) - {"memory_limit", "time_limit", "strict"}
    if unknown:
        raise ConstraintError(f"fsdp_tp_pp takes memory_limit, time_limit and strict, not {', '.join(sorted(unknown))}")
    stages = max(d for d in divisors(cluster.mesh_shape[0]) if d <= 8)
    if stages < 2:
        raise InfeasibleError(f"fsdp_tp_pp needs an outer mesh dim of 2 or more to put stages on, not "
                              f"{tuple(cluster.mesh_shape)}")
    try:
        # torchtitan's schedules for this layout: the zero-bubble one is the free search's
        return plan_pipeline(model, cluster, example_inputs, stages=stages, roles=("fsdp", "tp"),
                             schedules=("1f1b", "interleaved"), recompute=recompute, **kwargs)
    except ConstraintError as exc:   # a baseline this model or batch cannot express: as for the others
        raise InfeasibleError(f"fsdp_tp_pp: {exc}") from exc


def _has_experts(traced: TracedModel) -> bool:
    from autoshard.passes.regions import META_KEY, find_regions

    if not any(META_KEY in n.meta for n in traced.gm.graph.nodes):
        find_regions(traced.gm)
    return any(n.meta[META_KEY].experts for n in traced.gm.graph.nodes if META_KEY in n.meta)


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
    if any(n.partition("+")[0] == "fsdp_tp_pp" for n in names):
        raise ConstraintError("compare plans Plans; fsdp_tp_pp is a PipelinePlan: plan it with "
                              "plan_baseline(model, cluster, 'fsdp_tp_pp', inputs)")
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
