"""Public entry points: trace, plan, compile."""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter
import warnings

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from autoshard import _torch, costmodel
from autoshard.cluster import Cluster
from autoshard.errors import (ClusterError, ConstraintError, CutoffError, InfeasibleError, PlanMismatchError,
                              SolverError, TraceError)
from autoshard.passes.annotate import META_KEY as COST_KEY, annotate, tensor_bytes
from autoshard.passes.coverage import coverage_gaps, report_gaps
from autoshard.passes.coarsen import LAYER_KEY, mark_followers, repeated_layers
from autoshard.passes.regions import untied
from autoshard.passes.bucket import bucket_gathers, gradient_buckets, reduce_gradients
from autoshard.passes.rewrite import local_joint, split
from autoshard.passes.strategies import META_KEY, find_strategies, value_of
from autoshard.passes.trace import TracedModel, trace as _trace
from autoshard.notation import parse_placements, placements_str
from autoshard.plan import NodeDecision, Plan
from autoshard.precision import MixedPrecision, cast_module, policy_fingerprint
from autoshard.progress import Progress
from autoshard.runtime import DistributedModule
from autoshard.solver.formulation import Storage, fixed, formulate, pool_blocks, share
from autoshard.solver.memory import memory_model, predicted_memory, recompute_resharding, timeline

OPTIMIZER_STATE_PER_PARAM_BYTE = 2.0  # Adam/AdamW: two moments in the parameter's dtype


def trace(model: nn.Module, example_inputs, *, mixed_precision: MixedPrecision | None = None,
          device=None) -> TracedModel:
    """Trace once (joint fwd+bwd graph on fake tensors), then plan for many clusters.
    ``mixed_precision`` puts the policy's casts into the traced program (autoshard/precision.py).
    ``device``: where the program will run (default: where the model is, the CPU for ``meta``);
    some ops are a device's own (attention), so a plan runs on the device it was traced for."""
    start = time.perf_counter()
    traced = _trace(cast_module(model, mixed_precision),
                    tuple(example_inputs) if isinstance(example_inputs, (list, tuple)) else (example_inputs,),
                    device=device)
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


def _accumulation(k) -> dict:
    """``_solve``'s keyword for K micro-batches per step (none for the default, K = 1)."""
    if not (isinstance(k, int) and k >= 1):
        raise ConstraintError(f"grad_accumulation must be a positive int, not {k!r}")
    return {} if k == 1 else {"grad_accumulation": k}


def _prepare(model_or_traced, cluster: Cluster, example_inputs, strict: bool, mixed_precision=None,
             progress: Progress | None = None, device=None):
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
        fallbacks = find_strategies(traced.gm, mesh, strict=strict, memo=traced.strategy_memo)
        gaps = report_gaps(coverage_gaps(traced.gm), strict=strict)
    return traced, fallbacks, gaps


def plan(model, cluster: Cluster, example_inputs=None, *, constraints: dict | None = None,
         memory_limit: float | None = None, recompute: bool | str = True, share_layers: bool = True,
         strict: bool = False, time_limit: float = 120.0, progress: bool | None = None,
         allow=None, mixed_precision: MixedPrecision | None = None, grad_accumulation: int = 1,
         meshes=None, followers: bool = True, cutoff: float | None = None) -> Plan:
    """Plan ``model`` (an nn.Module, on any device including ``meta``, or a traced model from
    :func:`trace`) for ``cluster``; ``example_inputs`` describe the global batch.

    ``meshes="auto"`` also plans on the logical meshes of :func:`autoshard.meshes.candidates`
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
    :class:`~autoshard.errors.InfeasibleError` with ``min_memory`` when no plan fits."""
    if meshes is not None:
        from autoshard import meshes as logical

        traced = model if isinstance(model, TracedModel) else trace(model, example_inputs,
                                                                    mixed_precision=mixed_precision)
        return logical.plan_over(plan, traced, cluster, meshes, constraints=constraints, memory_limit=memory_limit,
                                 recompute=recompute, share_layers=share_layers, strict=strict,
                                 time_limit=time_limit, progress=progress, allow=allow,
                                 mixed_precision=mixed_precision, grad_accumulation=grad_accumulation,
                                 followers=followers, cutoff=cutoff)
    t0 = time.perf_counter()
    progress = Progress(progress)
    traced, fallbacks, gaps = _prepare(model, cluster, example_inputs, strict, mixed_precision, progress)
    t1 = time.perf_counter()
    problem, solution, limit = _solve(traced, cluster, constraints, memory_limit, recompute, time_limit,
                                      share_layers, allow, **_accumulation(grad_accumulation),
                                      followers=followers, progress=progress, cutoff=cutoff)
    t2 = time.perf_counter()
    result = _make_plan(traced, cluster, problem, solution, fallbacks, gaps, limit)
    result.stats = {"trace_s": traced.trace_time if model is not traced else 0.0,
                    "strategies_s": t1 - t0 - (traced.trace_time if model is not traced else 0.0),
                    "formulate_s": t2 - t1 - solution.solve_time, "solve_s": solution.solve_time,
                    "plan_s": time.perf_counter() - t2, "total_s": time.perf_counter() - t0,
                    "shared_nodes": solution.shared_nodes}
    return result


def _solve(traced, cluster, constraints, memory_limit, recompute, time_limit, share_layers=True, allow=None,
           grad_accumulation: int = 1, followers: bool = True, progress: Progress | None = None,
           cutoff: float | None = None):
    if recompute not in (True, False, "full"):
        raise ConstraintError(f"recompute must be True, False or 'full', not {recompute!r}")
    progress = progress or Progress(False)
    with progress.stage("formulating"):
        layers = repeated_layers(traced)  # also marks each node's block copy (the overlap rows' blocks)
        if followers:
            mark_followers(traced)
        problem = formulate(traced, cluster, constraints, allow, micro_batches=grad_accumulation, followers=followers)
        limit = float(cluster.memory_limit if memory_limit is None else memory_limit)
        mm = memory_model(traced, problem, cluster, limit, OPTIMIZER_STATE_PER_PARAM_BYTE)
        if not recompute:
            mm.recomputable = []
        mm.recompute_all = recompute == "full"
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
    a mesh or baseline whose shared plan is slower than it is not refined (autoshard.meshes)."""
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


def _make_plan(traced, cluster, problem, solution, fallbacks, gaps=(), limit=None) -> Plan:
    choice = {n: n.meta[META_KEY].strategies[s] for n, s in solution.choice.items()}
    comm: dict[str, list[dict]] = {}
    edges, hideable = [], {}
    for e in problem.edges:
        src = choice[e.src].outputs[e.src_out]
        dst = e.fixed if e.dst is None else e.dst_in[solution.choice[e.dst]]
        where = "output" if e.dst is None else e.dst.name
        if e.kind != "gather":  # graph edges; a storage -> working gather shows at its parameter
            edges.append((e.src.name, where))
        calls = 1 if e.kind in ("grad", "gather") else problem.micro_batches  # per optimizer step
        bucketed, hides = e.in_bucket(src, dst, cluster.mesh_shape), \
            e.hides(src, dst, cluster.mesh_shape, problem.micro_batches)
        for c in costmodel.resharding(cluster, src, dst, e.moved_bytes(src, dst), bucketed):
            entry = {"kind": c.kind, "mesh_dim": c.mesh_dim, "bytes": c.nbytes, "time": c.time * calls,
                     "src": e.src.name, "exposed": c.time * calls, "calls": calls, "role": e.kind}
            comm.setdefault(where, []).append(entry)
            if hides and problem.overlap > 0:
                hideable.setdefault(e.block, []).append(entry)
    # the exposed part of each block's parameter and gradient moves (formulation.py: Overlap),
    # spread over its collectives in proportion to their time
    block_compute: dict[object, float] = {}
    for n in problem.nodes:
        if isinstance(n, Storage):  # the optimizer step runs after backward: it hides nothing
            continue
        block_compute[problem.block.get(n)] = block_compute.get(problem.block.get(n), 0.0) + \
            problem.cost[n][solution.choice[n]]
    for b, entries in hideable.items():
        total = sum(c["time"] for c in entries)
        left = max(0.0, total - problem.overlap * block_compute.get(b, 0.0))
        for c in entries:
            c["exposed"] = c["time"] * (left / total if total > 0 else 0.0)
    nodes, compute, recompute_time = [], 0.0, 0.0
    for n, s in choice.items():
        if isinstance(n, Storage):  # recorded in Plan.storage; its collectives show at the parameter
            continue
        t = problem.cost[n][solution.choice[n]]
        compute += t
        again = n in solution.recompute
        recompute_time += t if again else 0.0
        layer = n.meta.get(LAYER_KEY)
        nodes.append(NodeDecision(n.name, str(n.target) if n.op == "call_function" else n.op, str(s), t,
                                  n.meta[COST_KEY].phase, comm.get(n.name, []), recompute=again,
                                  layer=None if layer is None else layer[1]))
    if "output" in comm:
        nodes.append(NodeDecision("output", "output", "->(R)", 0.0, "fwd", comm["output"]))
    comm_time = sum(c["time"] for cs in comm.values() for c in cs)
    exposed = sum(c["exposed"] for cs in comm.values() for c in cs)
    # the peak moment's bytes, itemized so the parts add up to the peak: the ILP's "state" is
    # params+optimizer+inputs, and its "grads" the gradients made by then (solver/memory.py)
    memory = {**_state_detail(traced, choice, cluster, problem.storage, problem.micro_batches),
              **{k: v for k, v in solution.memory.items() if k != "state"}}
    peak = sum(memory.values())
    # the optimizer step on each parameter's storage shard; recomputed nodes' inputs moved again
    optimizer = sum(problem.cost[st][solution.choice[st]] for st in problem.storage.values())
    recompute_comm = recompute_resharding(problem, cluster, solution.choice, solution.recompute)
    step = compute + exposed + recompute_time + recompute_comm + optimizer
    return Plan(
        fingerprint=traced.fingerprint, cluster=cluster.to_json(), mesh_shape=tuple(cluster.mesh_shape),
        mesh_dim_names=tuple(cluster.mesh_dim_names), nodes=nodes,
        storage={name: placements_str(choice[problem.storage[node]].outputs[0]) for name, node in traced.params},
        inputs=[placements_str(choice[node].outputs[0]) for node in traced.inputs],
        step_time=step, compute_time=compute, comm_time=comm_time,
        peak_memory=peak, memory=memory, fallbacks=[tuple(f) for f in fallbacks],
        gaps=[dataclasses.asdict(g) for g in gaps],
        solver={"status": solution.status, "objective": solution.objective, "bound": solution.bound,
                "gap": solution.gap, "backend": solution.backend,
                "variables": solution.num_variables, "constraints": solution.num_constraints},
        edges=edges, memory_limit=limit, mfu=_mfu(traced, cluster, step / problem.micro_batches),
        memory_timeline=list(solution.timeline),
        breakdown={"compute": compute, "comm": comm_time, "exposed_comm": exposed, "recompute": recompute_time,
                   "recompute_comm": recompute_comm, "optimizer": optimizer},
        grad_accumulation=problem.micro_batches, peak_moment=solution.memory.moment,
        saved_for_backward=solution.memory.saved)


def _mfu(traced, cluster, step_time: float) -> float | None:
    """Model FLOPs (forward + backward ops of the joint graph, each once) over what the devices
    could do in the predicted step at their peak for the dtype the FLOPs run in (under a
    mixed-precision policy the matmuls' bf16, not the fp32 parameters')."""
    costs = [n.meta[COST_KEY] for n in traced.gm.graph.nodes if COST_KEY in n.meta]
    flops = sum(c.flops for c in costs)
    by_dtype: dict = {}
    for c in costs:
        by_dtype[c.dtype] = by_dtype.get(c.dtype, 0.0) + c.flops
    dtype = max(by_dtype, key=by_dtype.get) if flops > 0 else torch.float32
    if step_time <= 0:
        return None
    return flops / (step_time * cluster.peak_flops(dtype) * cluster.world_size)


def _state_detail(traced, choice, cluster, storage: dict, micro_batches: int = 1) -> dict[str, float]:
    """Per-device bytes of the persistent state, itemized (the ILP's "state" is their sum)."""
    mesh = cluster.mesh_shape
    local = lambda node, at=None: costmodel.local_bytes(  # noqa: E731
        tensor_bytes(_val(node, 0)), choice[at or node].outputs[0], mesh)
    params = sum(local(node, storage[node]) for _, node in traced.params)
    trained = sum(local(node, storage[node]) for name, node in traced.params if traced.grads.get(name) is not None)
    detail = {"params": params,
              # gathered once per step and kept (working placement != storage: formulation.py)
              "working_params": sum(local(node) for _, node in traced.params
                                    if choice[node].outputs[0] != choice[storage[node]].outputs[0]),
              "grads": trained, "optimizer": trained * OPTIMIZER_STATE_PER_PARAM_BYTE,
              "buffers": sum(local(node) for _, node in traced.buffers),
              "inputs": sum(local(node) for node in traced.inputs)}
    if micro_batches > 1:  # gradients accumulated unreduced, where backward makes them (solver/memory.py)
        detail["grad_accumulation"] = sum(
            costmodel.local_bytes(tensor_bytes(_val(u, k)), choice[u].outputs[k], mesh)
            for u, k in (value_of(g) for g in traced.grads.values() if g is not None))
    return detail


def _val(node, k):
    v = node.meta["val"]
    return v[k] if isinstance(v, (tuple, list)) else v


def _choice_from_plan(traced, the_plan: Plan) -> dict:
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


def compile(model: nn.Module, cluster: Cluster, example_inputs, *, constraints: dict | None = None,
            plan: Plan | None = None, memory_limit: float | None = None, recompute: bool = True,
            share_layers: bool = True, strict: bool = False, time_limit: float = 120.0,
            mixed_precision: MixedPrecision | None = None, grad_accumulation: int | None = None,
            allow=None, followers: bool = True) -> DistributedModule:
    """Plan (unless ``plan`` is given) and build this rank's module. Call on every rank of an
    initialized process group whose world size is ``cluster.world_size``.

    ``mixed_precision``: parameters stay in their dtype (fp32 master weights, what the optimizer
    steps), cast to ``param_dtype`` once per use in the program; gradient reductions run in
    ``reduce_dtype``. ``grad_accumulation=K`` (default: the given plan's, else 1): plan for K
    micro-batches per step, and move the gradients to storage only on every K-th backward (the
    others accumulate them unreduced; ``module.no_sync()`` does the same explicitly)."""
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
                             or allow is not None):
        raise ConstraintError("compile(plan=...) runs the given plan as it is; constraints, memory_limit, "
                              "recompute and allow only apply when planning: re-plan with them, or drop them")
    if plan is not None and tuple(plan.mesh_shape) != tuple(cluster.mesh_shape) \
            and math.prod(plan.mesh_shape) == cluster.world_size:
        # a plan made on a logical mesh (autoshard.meshes) runs on that grid of the same devices
        cluster = cluster.with_mesh(tuple(plan.mesh_shape), tuple(plan.mesh_dim_names))
    if grad_accumulation is None:
        grad_accumulation = getattr(plan, "grad_accumulation", 1) if plan is not None else 1
    # the program is traced for the device it runs on: NCCL's ranks compute on GPUs, gloo's on
    # CPUs, a fake group's (simulated ranks, autoshard/simulate.py) on the model's device
    backend = dist.get_backend()
    if backend == "fake":
        device_type = next((p.device.type for p in model.parameters()), "cpu")
    else:
        device_type = "cuda" if backend == "nccl" else "cpu"
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    traced, fallbacks, gaps = _prepare(model, cluster, example_inputs, strict, mixed_precision, device=device)
    if plan is None:
        # Rank 0 plans and everyone runs its plan: ranks must never disagree on a tie.
        box = [None]
        if dist.get_rank() == 0:
            try:
                problem, solution, limit = _solve(traced, cluster, constraints, memory_limit, recompute, time_limit,
                                                  share_layers, allow, **_accumulation(grad_accumulation),
                                                  followers=followers)
                box = [_make_plan(traced, cluster, problem, solution, fallbacks, gaps, limit).to_json()]
            except Exception as exc:  # noqa: BLE001 - every rank must learn of it, not hang
                box = [exc]
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], Exception):
            raise box[0]
        plan = Plan.from_json(box[0])
    plan.check_matches(traced.fingerprint, cluster.to_json())
    choice = _choice_from_plan(traced, plan)

    # sub-groups of an N-D mesh inherit the user's process-group options (its timeout above all:
    # a dead peer must fail the job in the user's time, not torch's 30-minute default; a fake
    # group, under simulated ranks, has none)
    options = _torch.default_group_options(device_type) if len(cluster.mesh_shape) > 1 else None
    override = None if options is None else dict.fromkeys(range(len(cluster.mesh_shape)), options)
    mesh = torch.distributed.device_mesh.init_device_mesh(device_type, tuple(cluster.mesh_shape),
                                                          mesh_dim_names=tuple(cluster.mesh_dim_names),
                                                          backend_override=override)
    rep = [Replicate()] * mesh.ndim

    def distribute(full: torch.Tensor, placements) -> DTensor:
        full = full.detach().to(device).clone()
        dist.broadcast(full, src=0)  # every rank starts from rank 0's values, as DDP does
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
        local_primals.append(torch.zeros(costmodel.local_shape(val.shape, pl, mesh.shape), dtype=val.dtype, device=device))
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
                             working=working, bw_sync=bw_sync, reduced=reduced)


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
