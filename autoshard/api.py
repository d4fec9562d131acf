"""Public entry points: trace, plan, compile."""

from __future__ import annotations

import math
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn

from autoshard.build import build
from autoshard.cluster import Cluster
from autoshard.errors import ClusterError, ConstraintError, TraceError
from autoshard.passes.trace import TracedModel
from autoshard.planning.driver import accumulation, check_backend, prepare, solve, trace
from autoshard.planning.plan import Plan
from autoshard.planning.pricing import price
from autoshard.precision import MixedPrecision
from autoshard.progress import Progress
from autoshard.runtime.module import DistributedModule

__all__ = ["compile", "plan", "trace"]


def plan(model, cluster: Cluster, example_inputs=None, *, constraints: dict | None = None,
         memory_limit: float | None = None, recompute: bool | str = True, share_layers: bool = True,
         strict: bool = False, time_limit: float = 120.0, progress: bool | None = None,
         allow=None, mixed_precision: MixedPrecision | None = None, grad_accumulation: int = 1,
         meshes=None, followers: bool = True, cutoff: float | None = None, backend: str = "eager",
         moe_imbalance: float = 1.0, moe_capacity: float | None = None, stages=None):
    """Plan ``model`` (an nn.Module, on any device including ``meta``, or a traced model from
    :func:`trace`) for ``cluster``; ``example_inputs`` describe the global batch.

    ``stages``: also try pipeline stages over the outer mesh dim ("auto": every stage count of
    :func:`autoshard.planning.pipeline.plan_pipeline`; an int or a list: those; with ``meshes``,
    over the outer dim of each logical mesh too) and return the
    faster of the plan without stages and the best :class:`~autoshard.planning.pipeline.PipelinePlan`
    (``compile(plan=...)`` runs either); the loser's step time is in ``stats["other_step_time"]``,
    and why a side has no plan in ``stats["other_error"]``. Default: no stages.

    ``meshes="auto"`` also plans on the logical meshes of :func:`autoshard.planning.meshes.candidates`
    (other grids over the same devices, priced by the links each dim spans) and keeps the fastest;
    (3-D ones pruned to data parallelism on their outer dim); ``"auto-2d"`` skips the 3-D ones; a
    list of shapes tries those; ``plan.mesh_shape`` records the one chosen. Default: the cluster's
    own mesh only. Each mesh after the first feasible one is solved with the best step so far as
    its ``cutoff``, so one that cannot beat it stops early (``plan.stats["mesh_errors"]``: "slower").

    ``cutoff`` (seconds): only a plan predicted faster will do; raises
    :class:`~autoshard.errors.CutoffError` as soon as the solver proves there is none.

    ``memory_limit`` (bytes per device; default: the cluster's usable device memory) caps the
    predicted peak; ``recompute=False`` forbids recomputing activations, ``recompute="full"``
    recomputes every activation it can but what crosses a repeated layer's boundary (per-layer
    activation checkpointing, as Megatron's full recomputation); ``share_layers=False``
    gives every repeated layer its own decisions and ``followers=False`` every elementwise op
    (passes/coarsen.py; both off: the exact, larger problem); ``progress`` shows
    each stage on stderr (default: when stderr is a terminal). ``allow(node, strategy) -> bool``
    limits the strategies the solver may pick (how :mod:`autoshard.baselines` pins hand-written
    strategies on the same problem). ``mixed_precision`` (a :class:`MixedPrecision`) plans the
    program with its casts; ``grad_accumulation=K`` plans for K micro-batches per optimizer step
    (``example_inputs`` are one micro-batch), the gradient reduction charged once per K. Raises
    :class:`~autoshard.errors.InfeasibleError` with ``min_memory`` when no plan fits.

    ``moe_imbalance`` (>= 1): for a Mixture-of-Experts run expert-parallel, the rows the busiest
    rank receives over an even share (as measured from the router's counts); its exchanges and
    grouped GEMMs are priced at that load. Default 1.0: uniform routing. ``moe_capacity``
    (>= ``moe_imbalance``): the rows each rank's receive buffer holds, over its own routed rows;
    a step whose routing sends a rank more raises :class:`~autoshard.errors.CapacityError` on
    every rank of its expert-parallel group at once (with other mesh dims, the other groups' ranks
    then fail at their next collective with those). Default None: the buffer holds every rank's
    rows, so nothing can overflow it, and is counted at that size.

    ``backend``: what will run the program, "eager" (op by op) or "inductor" (compiled, elementwise
    chains fused), which prices each op (the plan records it and runs only under it)."""
    check_backend(backend)
    if stages is not None:
        return _with_stages(model, cluster, example_inputs, stages, dict(
            constraints=constraints, memory_limit=memory_limit, recompute=recompute, share_layers=share_layers,
            strict=strict, time_limit=time_limit, progress=progress, allow=allow, mixed_precision=mixed_precision,
            grad_accumulation=grad_accumulation, meshes=meshes, followers=followers, cutoff=cutoff, backend=backend,
            moe_imbalance=moe_imbalance, moe_capacity=moe_capacity))
    if meshes is not None:
        from autoshard.planning import meshes as logical

        traced = model if isinstance(model, TracedModel) else trace(model, example_inputs,
                                                                    mixed_precision=mixed_precision)
        return logical.plan_over(plan, traced, cluster, meshes, constraints=constraints, memory_limit=memory_limit,
                                 recompute=recompute, share_layers=share_layers, strict=strict,
                                 time_limit=time_limit, progress=progress, allow=allow,
                                 mixed_precision=mixed_precision, grad_accumulation=grad_accumulation,
                                 followers=followers, cutoff=cutoff, backend=backend, moe_imbalance=moe_imbalance,
                                 moe_capacity=moe_capacity)
    t0 = time.perf_counter()
    progress = Progress(progress)
    traced, fallbacks, gaps = prepare(model, cluster, example_inputs, strict, mixed_precision, progress,
                                      moe_imbalance=moe_imbalance, moe_capacity=moe_capacity)
    t1 = time.perf_counter()
    problem, solution, limit = solve(traced, cluster, constraints, memory_limit, recompute, time_limit,
                                      share_layers, allow, **accumulation(grad_accumulation),
                                      followers=followers, progress=progress, cutoff=cutoff, backend=backend)
    t2 = time.perf_counter()
    result = price(traced, cluster, problem, solution, fallbacks, gaps, limit)
    result.stats = {"trace_s": traced.trace_time if model is not traced else 0.0,
                    "strategies_s": t1 - t0 - (traced.trace_time if model is not traced else 0.0),
                    "formulate_s": t2 - t1 - solution.solve_time, "solve_s": solution.solve_time,
                    "plan_s": time.perf_counter() - t2, "total_s": time.perf_counter() - t0,
                    "shared_nodes": solution.shared_nodes}
    return result


def _with_stages(model, cluster: Cluster, example_inputs, stages, options: dict):
    """The faster of the plan without stages and the best pipeline plan (:func:`plan`'s ``stages``)."""
    from autoshard.errors import CutoffError, InfeasibleError, SolverError
    from autoshard.planning.pipeline import plan_pipeline

    if isinstance(model, TracedModel):
        raise ConstraintError("pipeline stages cut the model's layers: pass the nn.Module, not a traced model")
    defaults = dict(constraints=None, allow=None, cutoff=None, moe_capacity=None,
                    grad_accumulation=1, backend="eager", moe_imbalance=1.0)
    pinned = {k for k, v in defaults.items() if options[k] != v}
    if pinned:
        raise ConstraintError(f"pipeline candidates take no {', '.join(sorted(pinned))}: plan with stages=None "
                              "for those, or drop them")
    results, errors = [], {}
    try:
        results.append(plan(model, cluster, example_inputs, **options))
    except (InfeasibleError, SolverError, CutoffError) as exc:
        errors["flat"] = exc
    try:
        results.append(plan_pipeline(model, cluster, example_inputs, stages=None if stages == "auto" else stages,
                                     memory_limit=options["memory_limit"], recompute=options["recompute"],
                                     time_limit=options["time_limit"], strict=options["strict"],
                                     meshes=options["meshes"], mixed_precision=options["mixed_precision"]))
    except (InfeasibleError, SolverError, ConstraintError) as exc:   # no layers to cut, too: the flat plan stands
        errors["pipeline"] = exc
    if not results:
        errors["flat"].add_note(f"with stages: {type(errors['pipeline']).__name__}: {errors['pipeline']}")
        raise errors["flat"]
    for side, exc in errors.items():   # the plan returned is the other side's: say so
        warnings.warn(f"autoshard: plan(stages=...) has no plan {'with' if side == 'pipeline' else 'without'} stages "
                      f"({type(exc).__name__}: {exc}); returning the other", stacklevel=3)
    best = min(results, key=lambda r: r.step_time)
    other = [r for r in results if r is not best]
    best.stats["other_step_time"] = other[0].step_time if other else None
    best.stats["other_error"] = {side: f"{type(e).__name__}: {e}" for side, e in errors.items()}
    return best


def compile(model: nn.Module, cluster: Cluster, example_inputs, *, constraints: dict | None = None,
            plan: Plan | None = None, memory_limit: float | None = None, recompute: bool = True,
            share_layers: bool = True, strict: bool = False, time_limit: float = 120.0,
            mixed_precision: MixedPrecision | None = None, grad_accumulation: int | None = None,
            allow=None, followers: bool = True, backend: str | None = None,
            moe_imbalance: float = 1.0, moe_capacity: float | None = None) -> DistributedModule:
    """Plan (unless ``plan`` is given) and build this rank's module. Call on every rank of an
    initialized process group whose world size is ``cluster.world_size``.

    ``mixed_precision``: parameters stay in their dtype (fp32 master weights, what the optimizer
    steps), cast to ``param_dtype`` once per use in the program; gradient reductions run in
    ``reduce_dtype``. ``grad_accumulation=K`` (default: the given plan's, else 1): plan for K
    micro-batches per step, and move the gradients to storage only on every K-th backward (the
    others accumulate them unreduced; ``module.no_sync()`` does the same explicitly).
    ``moe_imbalance`` and ``moe_capacity``: as for :func:`plan`; with ``plan`` given, the
    capacity is the plan's and the imbalance, a planning option, stays at its default.

    ``backend``: "eager" runs the forward and backward graphs op by op; "inductor" compiles
    each (``torch.compile``: C++ on CPU, Triton on GPU) on their first call, and the plan is
    priced for fused kernels. Default: the given plan's, else "eager"."""
    from autoshard.planning.pipeline import PipelinePlan

    if not dist.is_available() or not dist.is_initialized():
        raise ClusterError("autoshard.compile needs an initialized process group (torch.distributed."
                           "init_process_group, or launch with torchrun); use autoshard.plan to plan without one")
    if dist.get_world_size() != cluster.world_size:
        raise ClusterError(f"the cluster has {cluster.world_size} devices (mesh {tuple(cluster.mesh_shape)}) but the "
                           f"process group has world size {dist.get_world_size()}; make them match")
    if any(p.device.type == "meta" for p in model.parameters()):
        raise TraceError("autoshard.compile needs the model's parameter values; a model on 'meta' can be planned "
                         "(autoshard.plan) but must be materialized (e.g. to_empty + init) before compile")
    if plan is not None and (constraints is not None or memory_limit is not None or recompute is not True
                             or allow is not None or moe_imbalance != 1.0):
        raise ConstraintError("compile(plan=...) runs the given plan as it is; constraints, memory_limit, "
                              "recompute, allow and moe_imbalance only apply when planning: re-plan with them, "
                              "or drop them")
    if isinstance(plan, PipelinePlan):
        return _compile_pipeline(model, cluster, example_inputs, plan, mixed_precision, grad_accumulation, backend,
                                 time_limit, strict)
    if plan is not None and tuple(plan.mesh_shape) != tuple(cluster.mesh_shape) \
            and math.prod(plan.mesh_shape) == cluster.world_size:
        # a plan made on a logical mesh (autoshard.planning.meshes) runs on that grid of the same devices
        cluster = cluster.with_mesh(tuple(plan.mesh_shape), tuple(plan.mesh_dim_names))
    if plan is not None and moe_capacity not in (None, plan.moe_capacity):
        raise ConstraintError(f"compile(plan=...) runs the given plan as it is: its expert-parallel buffer holds "
                              f"moe_capacity={plan.moe_capacity}, not {moe_capacity}; re-plan with it, or drop it")
    if plan is not None:
        moe_capacity = plan.moe_capacity
    if grad_accumulation is None:
        grad_accumulation = getattr(plan, "grad_accumulation", 1) if plan is not None else 1
    if backend is None:
        backend = plan.backend if plan is not None else "eager"
    check_backend(backend)
    if plan is not None:
        plan.check_backend(backend)   # before the trace: the mismatch is known already
    device = _device(model)   # the program is traced for the device it runs on
    traced, fallbacks, gaps = prepare(model, cluster, example_inputs, strict, mixed_precision, device=device,
                                      moe_imbalance=moe_imbalance, moe_capacity=moe_capacity)
    if plan is None:
        # Rank 0 plans and everyone runs its plan: ranks must never disagree on a tie.
        box = [None]
        if dist.get_rank() == 0:
            try:
                problem, solution, limit = solve(traced, cluster, constraints, memory_limit, recompute, time_limit,
                                                  share_layers, allow, **accumulation(grad_accumulation),
                                                  followers=followers, backend=backend)
                box = [price(traced, cluster, problem, solution, fallbacks, gaps, limit).to_json()]
            except Exception as exc:  # noqa: BLE001 - every rank must learn of it, not hang
                box = [exc]
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], Exception):
            raise box[0]
        plan = Plan.from_json(box[0])
    plan.check_matches(traced.fingerprint, cluster.to_json(), backend)
    return build(model, traced, plan, cluster, device, mixed_precision, grad_accumulation)


def _device(model: nn.Module) -> torch.device:
    """Where this rank computes, what its program is traced for: NCCL's ranks on GPUs, gloo's on
    CPUs, a fake group's (simulated ranks, autoshard/runtime/simulate.py) on the model's device."""
    group_backend = dist.get_backend()
    if group_backend == "fake":
        device_type = next((p.device.type for p in model.parameters()), "cpu")
    else:
        device_type = "cuda" if group_backend == "nccl" else "cpu"
    return torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")


def _compile_pipeline(model, cluster, example_inputs, plan, mixed_precision, grad_accumulation, backend,
                      time_limit, strict):
    from autoshard.runtime.pipeline import build_pipeline

    if grad_accumulation not in (None, 1) or backend not in (None, "eager"):
        raise ConstraintError("a pipeline plan runs eagerly, its micro-batches accumulated by its schedule: drop "
                              "grad_accumulation and backend, or plan without stages")
    return build_pipeline(model, cluster, example_inputs, plan, _device(model), time_limit=time_limit, strict=strict,
                          mixed_precision=mixed_precision)
