"""Solving one plan: strategies enumerated for the mesh, the ILP formulated with its memory model,
repeated layers solved once and shared, the last layer of a short stack decided apart, and the
least memory any plan needs when none fits (the error's figure)."""

from __future__ import annotations

import math
import time
import warnings
from collections import Counter

from torch import nn

from autoshard import _torch
from autoshard.cluster import Cluster
from autoshard.cluster.costmodel import BACKENDS
from autoshard.errors import ConstraintError, CutoffError, InfeasibleError, SolverError
from autoshard.passes.coarsen import LAYER_KEY, mark_followers, repeated_layers
from autoshard.passes.coverage import coverage_gaps, report_gaps
from autoshard.passes.strategies import find_strategies
from autoshard.passes.annotate import annotate
from autoshard.passes.trace import TracedModel, trace as _trace
from autoshard.precision import MixedPrecision, cast_module, policy_fingerprint
from autoshard.progress import Progress
from autoshard.solver.formulation import fixed, formulate, pool_blocks, share
from autoshard.solver.memory import memory_model, predicted_memory, timeline

OPTIMIZER_STATE_PER_PARAM_BYTE = 2.0  # Adam/AdamW: two moments in the parameter's dtype


def trace(model: nn.Module, example_inputs, *, mixed_precision: MixedPrecision | None = None,
          device=None, input_grads: bool = False) -> TracedModel:
    """Trace once (joint fwd+bwd graph on fake tensors), then plan for many clusters.
    ``mixed_precision`` puts the policy's casts into the traced program (autoshard/precision.py).
    ``device``: where the program will run (default: where the model is, the CPU for ``meta``);
    some ops are a device's own (attention), so a plan runs on the device it was traced for.
    ``input_grads``: inputs that require grad get gradients (passes/trace.py)."""
    start = time.perf_counter()
    traced = _trace(cast_module(model, mixed_precision),
                    tuple(example_inputs) if isinstance(example_inputs, (list, tuple)) else (example_inputs,),
                    device=device, input_grads=input_grads)
    annotate(traced.gm)
    traced.mixed_precision = mixed_precision
    if mixed_precision is not None:  # the reduce dtype is not in the graph: a plan for one policy runs no other
        traced.fingerprint = policy_fingerprint(traced.fingerprint, mixed_precision)
    traced.trace_time = time.perf_counter() - start
    return traced


def _ilp():
    """The ILP solver module, imported when a plan is solved: it needs OR-Tools, which running a
    saved plan (``compile(plan=...)``) does not."""
    from autoshard.solver import solve

    return solve


def accumulation(k) -> dict:
    """``solve``'s keyword for K micro-batches per step (none for the default, K = 1)."""
    if not (isinstance(k, int) and k >= 1):
        raise ConstraintError(f"grad_accumulation must be a positive int, not {k!r}")
    return {} if k == 1 else {"grad_accumulation": k}


def prepare(model_or_traced, cluster: Cluster, example_inputs, strict: bool, mixed_precision=None,
            progress: Progress | None = None, device=None, moe_imbalance: float = 1.0,
            moe_capacity: float | None = None):
    progress = progress or Progress(False)
    if isinstance(model_or_traced, TracedModel):
        traced = model_or_traced
        if mixed_precision is not None and getattr(traced, "mixed_precision", None) != mixed_precision:
            raise ConstraintError("this model was traced without the given mixed_precision policy (or with "
                                  "another); pass mixed_precision to autoshard.trace instead")
    else:
        with progress.stage("tracing"):
            traced = trace(model_or_traced, example_inputs, mixed_precision=mixed_precision, device=device)
    mesh = _torch.planning_mesh(cluster.mesh_shape, cluster.mesh_dim_names)
    with progress.stage("strategies"):
        fallbacks = find_strategies(traced.gm, mesh, strict=strict, memo=traced.strategy_memo,
                                    moe_imbalance=moe_imbalance, moe_capacity=moe_capacity)
        gaps = report_gaps(coverage_gaps(traced.gm, tuple(cluster.mesh_shape)), strict=strict)
    return traced, fallbacks, gaps


def check_backend(backend) -> None:
    """A backend is named before anything is traced or solved, so a typo costs no planning."""
    if backend not in BACKENDS:
        raise ConstraintError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, not {backend!r}")


def solve(traced, cluster, constraints, memory_limit, recompute, time_limit, share_layers=True, allow=None,
           grad_accumulation: int = 1, followers: bool = True, progress: Progress | None = None,
           cutoff: float | None = None, backend: str = "eager", held_batches: float = 1.0,
           held_head: float | None = None):
    if recompute not in (True, False, "full"):
        raise ConstraintError(f"recompute must be True, False or 'full', not {recompute!r}")
    check_backend(backend)
    progress = progress or Progress(False)
    with progress.stage("formulating"):
        layers = repeated_layers(traced)  # also marks each node's block copy (the overlap rows' blocks)
        if followers:
            mark_followers(traced)
        problem = formulate(traced, cluster, constraints, allow, micro_batches=grad_accumulation, followers=followers,
                            backend=backend)
        limit = float(cluster.memory_limit if memory_limit is None else memory_limit)
        mm = memory_model(traced, problem, cluster, limit, OPTIMIZER_STATE_PER_PARAM_BYTE)
        if not recompute:
            mm.recomputable = []
        mm.recompute_all = recompute == "full"
        mm.held_batches = held_batches   # a pipeline stage's micro-batches in flight (planning/pipeline.py)
        mm.held_head = held_batches if held_head is None else held_head
        rep = {n: r for n, r in layers.items()
               if problem.allowed.get(n) == problem.allowed.get(r)} if share_layers else {}
        pool_blocks(problem, rep, mm.block)   # the memory model keeps each node's own block
        small, small_mm, expand = share(problem, mm, rep)
    shared_nodes = (len(problem.nodes), len(small.nodes))

    def run(limit_, minimize="time"):
        small_mm.limit = limit_
        sol = _ilp().solve(small, cluster, small_mm, time_limit=time_limit, minimize=minimize, cutoff=cutoff)
        sol.choice, sol.recompute = expand(sol.choice, sol.recompute)
        sol.memory = predicted_memory(mm, sol.choice, sol.recompute)
        sol.shared_nodes = shared_nodes
        return sol

    try:
        with progress.stage("solving"):
            solution = run(limit)
        # the layers: the copies most classes have (a class of two nodes per layer has twice as many)
        copies = Counter(Counter(rep.values()).values()).most_common(1)[0][0] if rep else 1
        if 1 < copies <= LAST_LAYER_APART and solution.status == "optimal":
            with progress.stage("deciding the last layer apart"):
                solution = _last_layer_apart(problem, mm, rep, solution, cluster, time_limit, cutoff)
        if solution.status != "optimal":
            warnings.warn(f"autoshard: the solver stopped at time_limit={time_limit:g}s with a plan within "
                          f"{solution.gap:.1%} of the best possible; raise time_limit for one proven within 0.1%",
                          stacklevel=3)
        solution.timeline = timeline(mm, traced.gm.graph, solution.choice, solution.recompute)
        return problem, solution, limit
    except InfeasibleError:
        try:
            with progress.stage("finding the least memory any plan needs"):
                least = run(float("inf"), "memory")
        except InfeasibleError:
            raise InfeasibleError("the constraints admit no plan at any memory limit: the pinned placements "
                                  "conflict (check the parameter patterns and 'inputs' given)") from None
        need = float(math.ceil(least.objective * (1 + 1e-9)))  # the ILP's own minimum: feasible as a limit
        parts = ", ".join(f"{k} {_gib(v)}" for k, v in sorted(least.memory.items(), key=lambda kv: -kv[1]))
        top = max(least.memory, key=least.memory.get)
        what = {"state": "parameters and optimizer state", "grads": "gradients",
                "optimizer_step": "the optimizer step's temporaries", "activations": "activations saved for backward",
                "transient": "the largest working set: an op's, a block's gradients being reduced or its gathered "
                             "parameters",
                "recomputed": "values recomputed in backward",
                "grad_delivery": "the end of backward: the last gradient bucket, gradients handed over unreduced"}[top]
        raise InfeasibleError(
            f"no plan fits {_gib(limit)} per device; the smallest peak any plan reaches is "
            f"{_gib(need)} ({parts}), dominated by {what}. Raise memory_limit to at least "
            f"{_gib(need)}, use more devices{'' if recompute else ', allow recompute'}, or shrink the "
            f"batch", min_memory=need) from None


# A stack of at most this many layers gets its last layer decided apart after the shared solve
# (passes/coarsen.py: "Repeated layers").
LAST_LAYER_APART = 4


def _last_layer_apart(problem, mm, rep, solution, cluster, time_limit, cutoff):
    """``solution`` (of the problem shared by ``rep``) improved by letting the last layer copy and
    the nodes outside the layers choose again, every other copy's strategies and recompute fixed
    to it; ``solution`` itself when no plan is faster. ``problem``'s blocks are left pooled as
    the returned plan's decisions are. A ``cutoff`` prunes the shared solve before this step, so
    a mesh or baseline whose shared plan is slower than it is not refined (autoshard.planning.meshes)."""
    last: dict = {}
    for n, r in rep.items():
        last[r] = max(last.get(r, 0), n.meta[LAYER_KEY][1])
    pooled = {n: r for n, r in rep.items() if n.meta[LAYER_KEY][1] != last[r]}
    pool_blocks(problem, pooled, mm.block)
    small, small_mm, expand = share(fixed(problem, solution.choice, pooled), mm, pooled)
    small_mm.decided = {v: v in solution.recompute for v in pooled.values()}
    # The shared plan is one of this problem's; only a plan faster by more than the solve's gap
    # (0.1%: within it, plans differ in ties, e.g. which dim a weight is stored on) will do.
    bar = solution.objective * (1 - 1e-3)
    start = time.perf_counter()
    try:
        # its own time_limit, not what the shared solve left of it: a budget that shrank on a
        # slower machine could stop this solve there and not here, and change an optimal plan
        better = _ilp().solve(small, cluster, small_mm, time_limit=time_limit, cutoff=min(bar, cutoff or math.inf))
    except (CutoffError, InfeasibleError):   # proven: no plan faster
        better = None
    except SolverError:   # not proven either way within time_limit: the shared plan is not proven best
        better, solution.status = None, "feasible"
    solution.solve_time += time.perf_counter() - start
    if better is None or better.objective >= bar:
        pool_blocks(problem, rep, mm.block)
        return solution
    better.choice, better.recompute = expand(better.choice, better.recompute)
    better.memory = predicted_memory(mm, better.choice, better.recompute)
    better.shared_nodes, better.solve_time = solution.shared_nodes, solution.solve_time
    # Plan.solver reports this solve's problem size; as bound the lower of the two solves' (each
    # bounds its own restriction of the exact problem, neither the exact problem itself)
    better.bound = min(better.bound, solution.bound)
    return better


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"
