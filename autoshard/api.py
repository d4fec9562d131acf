"""Public entry points: trace, plan, compile."""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from autoshard import _torch, costmodel
from autoshard.cluster import Cluster
from autoshard.errors import ClusterError, ConstraintError, InfeasibleError, PlanMismatchError, TraceError
from autoshard.passes.annotate import META_KEY as COST_KEY, annotate
from autoshard.passes.coarsen import LAYER_KEY, repeated_layers
from autoshard.passes.rewrite import local_joint, split
from autoshard.passes.strategies import META_KEY, find_strategies, placement_str
from autoshard.passes.trace import TracedModel, trace as _trace
from autoshard.plan import NodeDecision, Plan
from autoshard.progress import Progress
from autoshard.runtime import DistributedModule
from autoshard.solver.formulation import formulate, share
from autoshard.solver.memory import memory_model, predicted_memory, timeline
from autoshard.solver.solve import solve

OPTIMIZER_STATE_PER_PARAM_BYTE = 2.0  # Adam/AdamW: two moments in the parameter's dtype


def trace(model: nn.Module, example_inputs) -> TracedModel:
    """Trace once (joint fwd+bwd graph on fake tensors), then plan for many clusters."""
    start = time.perf_counter()
    traced = _trace(model, tuple(example_inputs) if isinstance(example_inputs, (list, tuple)) else (example_inputs,))
    annotate(traced.gm)
    traced.trace_time = time.perf_counter() - start
    return traced


def _pl(p) -> str:
    return "(" + ",".join(placement_str(x) for x in p) + ")"


def _prepare(model_or_traced, cluster: Cluster, example_inputs, strict: bool):
    traced = model_or_traced if isinstance(model_or_traced, TracedModel) else trace(model_or_traced, example_inputs)
    mesh = _torch.planning_mesh(cluster.mesh_shape, cluster.mesh_dim_names)
    fallbacks = find_strategies(traced.gm, mesh, strict=strict)
    return traced, fallbacks


def plan(model, cluster: Cluster, example_inputs=None, *, constraints: dict | None = None,
         memory_limit: float | None = None, recompute: bool | str = True, share_layers: bool = True,
         strict: bool = False, time_limit: float = 120.0, progress: bool | None = None,
         allow=None) -> Plan:
    """Plan ``model`` (an nn.Module, on any device including ``meta``, or a traced model from
    :func:`trace`) for ``cluster``; ``example_inputs`` describe the global batch.

    ``memory_limit`` (bytes per device; default: the cluster's usable device memory) caps the
    predicted peak; ``recompute=False`` forbids recomputing activations, ``recompute="full"``
    recomputes every activation it can (full activation checkpointing); ``share_layers=False``
    gives every repeated layer its own decisions (the exact, larger problem); ``progress`` shows
    each stage on stderr (default: when stderr is a terminal). ``allow(node, strategy) -> bool``
    limits the strategies the solver may pick (how :mod:`autoshard.baselines` pins hand-written
    strategies on the same problem). Raises
    :class:`~autoshard.errors.InfeasibleError` with ``min_memory`` when no plan fits."""
    t0 = time.perf_counter()
    progress = Progress(progress)
    with progress.stage("tracing and strategies"):
        traced, fallbacks = _prepare(model, cluster, example_inputs, strict)
    t1 = time.perf_counter()
    with progress.stage("formulating and solving"):
        problem, solution, limit = _solve(traced, cluster, constraints, memory_limit, recompute, time_limit,
                                          share_layers, allow)
    t2 = time.perf_counter()
    result = _make_plan(traced, cluster, problem, solution, fallbacks, limit)
    result.stats = {"trace_s": traced.trace_time if model is not traced else 0.0,
                    "strategies_s": t1 - t0 - (traced.trace_time if model is not traced else 0.0),
                    "formulate_s": t2 - t1 - solution.solve_time, "solve_s": solution.solve_time,
                    "plan_s": time.perf_counter() - t2, "total_s": time.perf_counter() - t0,
                    "shared_nodes": solution.shared_nodes}
    return result


def _solve(traced, cluster, constraints, memory_limit, recompute, time_limit, share_layers=True, allow=None):
    if recompute not in (True, False, "full"):
        raise ConstraintError(f"recompute must be True, False or 'full', not {recompute!r}")
    problem = formulate(traced, cluster, constraints, allow)
    limit = float(cluster.memory_limit if memory_limit is None else memory_limit)
    mm = memory_model(traced, problem, cluster, limit, OPTIMIZER_STATE_PER_PARAM_BYTE)
    if not recompute:
        mm.recomputable = []
    mm.recompute_all = recompute == "full"
    rep = {n: r for n, r in repeated_layers(traced).items()
           if problem.allowed.get(n) == problem.allowed.get(r)} if share_layers else {}
    small, small_mm, expand = share(problem, mm, rep)
    shared_nodes = (len(problem.nodes), len(small.nodes))

    def run(limit_, minimize="time"):
        small_mm.limit = limit_
        sol = solve(small, cluster, small_mm, time_limit=time_limit, minimize=minimize)
        sol.choice, sol.recompute = expand(sol.choice, sol.recompute)
        sol.memory = predicted_memory(mm, sol.choice, sol.recompute)
        sol.shared_nodes = shared_nodes
        return sol

    try:
        solution = run(limit)
        solution.timeline = timeline(mm, traced.gm.graph, solution.choice, solution.recompute)
        return problem, solution, limit
    except InfeasibleError:
        try:
            least = run(float("inf"), "memory")
        except InfeasibleError:
            raise InfeasibleError("the constraints admit no plan at any memory limit: the pinned placements "
                                  "conflict (check the parameter patterns and 'inputs' given)") from None
        need = float(math.ceil(least.objective * (1 + 1e-9)))  # the ILP's own minimum: feasible as a limit
        parts = ", ".join(f"{k} {_gib(v)}" for k, v in sorted(least.memory.items(), key=lambda kv: -kv[1]))
        top = max(least.memory, key=least.memory.get)
        what = {"state": "parameters, gradients and optimizer state", "activations": "activations saved for backward",
                "transient": "the largest single op's working set"}[top]
        raise InfeasibleError(
            f"no plan fits {_gib(limit)} per device; the smallest peak any plan reaches is "
            f"{_gib(need)} ({parts}), dominated by {what}. Raise memory_limit to at least "
            f"{_gib(need)}, use more devices{'' if recompute else ', allow recompute'}, or shrink the "
            f"batch", min_memory=need) from None


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


def _make_plan(traced, cluster, problem, solution, fallbacks, limit=None) -> Plan:
    choice = {n: n.meta[META_KEY].strategies[s] for n, s in solution.choice.items()}
    comm: dict[str, list[dict]] = {}
    edges = []
    for e in problem.edges:
        src = choice[e.src].outputs[e.src_out]
        dst = e.fixed if e.dst is None else e.dst_in[solution.choice[e.dst]]
        where = "output" if e.dst is None else e.dst.name
        edges.append((e.src.name, where))
        for c in costmodel.resharding(cluster, src, dst, e.nbytes):
            comm.setdefault(where, []).append({"kind": c.kind, "mesh_dim": c.mesh_dim, "bytes": c.nbytes,
                                               "time": c.time, "src": e.src.name})
    nodes, compute, recompute_time = [], 0.0, 0.0
    for n, s in choice.items():
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
    # itemized so the parts add up to the peak: the ILP's "state" is params+grads+optimizer+inputs
    memory = {**_state_detail(traced, choice, cluster), "activations": solution.memory["activations"],
              "transient": solution.memory["transient"]}
    peak = sum(memory.values())
    step = compute + comm_time + recompute_time
    return Plan(
        fingerprint=traced.fingerprint, cluster=cluster.to_json(), mesh_shape=tuple(cluster.mesh_shape),
        mesh_dim_names=tuple(cluster.mesh_dim_names), nodes=nodes,
        storage={name: _pl(choice[node].outputs[0]) for name, node in traced.params},
        inputs=[_pl(choice[node].outputs[0]) for node in traced.inputs],
        step_time=step, compute_time=compute, comm_time=comm_time,
        peak_memory=peak, memory=memory, fallbacks=[tuple(f) for f in fallbacks],
        solver={"status": solution.status, "objective": solution.objective, "bound": solution.bound,
                "gap": solution.gap, "backend": solution.backend,
                "variables": solution.num_variables, "constraints": solution.num_constraints},
        edges=edges, memory_limit=limit, mfu=_mfu(traced, cluster, step),
        memory_timeline=list(solution.timeline),
        breakdown={"compute": compute, "comm": comm_time, "recompute": recompute_time})


def _mfu(traced, cluster, step_time: float) -> float | None:
    """Model FLOPs (forward + backward ops of the joint graph, each once) over what the devices
    could do in the predicted step at their peak for the model's dtype."""
    flops = sum(n.meta[COST_KEY].flops for n in traced.gm.graph.nodes if COST_KEY in n.meta)
    dtype = traced.gm.graph.find_nodes(op="placeholder")[0].meta["val"].dtype if traced.params else torch.float32
    if step_time <= 0:
        return None
    return flops / (step_time * cluster.peak_flops(dtype) * cluster.world_size)


def _state_detail(traced, choice, cluster) -> dict[str, float]:
    """Per-device bytes of the persistent state, itemized (the ILP's "state" is their sum)."""
    mesh = cluster.mesh_shape
    local = lambda node: costmodel.local_bytes(costmodel.tensor_nbytes(_val(node, 0)), choice[node].outputs[0], mesh)  # noqa: E731
    params = sum(local(node) for _, node in traced.params)
    trained = sum(local(node) for name, node in traced.params if traced.grads.get(name) is not None)
    return {"params": params, "grads": trained, "optimizer": trained * OPTIMIZER_STATE_PER_PARAM_BYTE,
            "buffers": sum(local(node) for _, node in traced.buffers),
            "inputs": sum(local(node) for node in traced.inputs)}


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
    return choice


def compile(model: nn.Module, cluster: Cluster, example_inputs, *, constraints: dict | None = None,
            plan: Plan | None = None, memory_limit: float | None = None, recompute: bool = True,
            share_layers: bool = True, strict: bool = False, time_limit: float = 120.0) -> DistributedModule:
    """Plan (unless ``plan`` is given) and build this rank's module. Call on every rank of an
    initialized process group whose world size is ``cluster.world_size``."""
    if not dist.is_available() or not dist.is_initialized():
        raise ClusterError("autoshard.compile needs an initialized process group (torch.distributed."
                           "init_process_group, or launch with torchrun); use autoshard.plan to plan without one")
    if dist.get_world_size() != cluster.world_size:
        raise ClusterError(f"the cluster has {cluster.world_size} devices (mesh {tuple(cluster.mesh_shape)}) but the "
                           f"process group has world size {dist.get_world_size()}; make them match")
    if any(p.device.type == "meta" for p in model.parameters()):
        raise TraceError("autoshard.compile needs the model's parameter values; a model on 'meta' can be planned "
                         "(autoshard.plan) but must be materialized (e.g. to_empty + init) before compile")
    if plan is not None and (constraints is not None or memory_limit is not None or not recompute):
        raise ConstraintError("compile(plan=...) runs the given plan as it is; constraints, memory_limit and "
                              "recompute only apply when planning: re-plan with them, or drop them")
    traced, fallbacks = _prepare(model, cluster, example_inputs, strict)
    if plan is None:
        # Rank 0 plans and everyone runs its plan: ranks must never disagree on a tie.
        box = [None]
        if dist.get_rank() == 0:
            try:
                problem, solution, limit = _solve(traced, cluster, constraints, memory_limit, recompute, time_limit,
                                                  share_layers)
                box = [_make_plan(traced, cluster, problem, solution, fallbacks, limit).to_json()]
            except Exception as exc:  # noqa: BLE001 - every rank must learn of it, not hang
                box = [exc]
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], Exception):
            raise box[0]
        plan = Plan.from_json(box[0])
    plan.check_matches(traced.fingerprint, cluster.to_json())
    choice = _choice_from_plan(traced, plan)

    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    # sub-groups of an N-D mesh inherit the user's process-group options (its timeout above all:
    # a dead peer must fail the job in the user's time, not torch's 30-minute default)
    override = ({d: _torch.default_group_options(device_type) for d in range(len(cluster.mesh_shape))}
                if len(cluster.mesh_shape) > 1 else None)
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
    params = {name: distribute(named[name], choice[node].outputs[0]) for name, node in traced.params}
    buffers = {name: distribute(named_buffers[name], rep).to_local() for name, _ in traced.buffers}
    input_pl = [choice[node].outputs[0] for node in traced.inputs]
    local_primals = [p.to_local() for p in params.values()] + list(buffers.values())
    for node, pl in zip(traced.inputs, input_pl):
        val = node.meta["val"]
        local_primals.append(torch.zeros(costmodel.local_shape(val.shape, pl, mesh.shape), dtype=val.dtype, device=device))
    order = [node for node in traced.gm.graph.find_nodes(op="placeholder") if node not in traced.tangents]
    if order != [n for _, n in traced.params] + [n for _, n in traced.buffers] + list(traced.inputs):
        raise TraceError("the traced graph lists its inputs in an order autoshard does not expect "
                         "(parameters, buffers, then inputs); this torch version is not supported")
    joint, n_out = local_joint(traced, choice, mesh, local_primals)
    fw, bw = split(joint, n_out, frozenset(n.name for n in plan.nodes if n.recompute))
    first, aliases = {}, {}  # tied weights: every name the model uses for a shared parameter
    for name, p in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(p), name) != name:
            aliases[name] = first[id(p)]
    return DistributedModule(plan, mesh, fw, bw, n_out, params, buffers, input_pl, traced.input_meta,
                             aliases=aliases)
