"""Pricing a solution into a :class:`~autoshard.planning.plan.Plan`: each node's strategy, compute
and collectives (with the part of each block's collectives its compute does not hide), the step
time's terms, the peak moment's bytes by part, and the model FLOPs utilization."""

from __future__ import annotations

import dataclasses

import torch

from autoshard.cluster import costmodel
from autoshard.notation import placements_str
from autoshard.passes.annotate import META_KEY as COST_KEY, tensor_bytes
from autoshard.passes.coarsen import LAYER_KEY
from autoshard.passes.graph import META_KEY, value_of
from autoshard.planning.driver import OPTIMIZER_STATE_PER_PARAM_BYTE
from autoshard.planning.modules import module_names
from autoshard.planning.plan import NodeDecision, Plan
from autoshard.solver import overlap
from autoshard.solver.formulation import Storage
from autoshard.solver.memory import recompute_resharding


def price(traced, cluster, problem, solution, fallbacks, gaps=(), limit=None) -> Plan:
    choice = {n: n.meta[META_KEY].strategies[s] for n, s in solution.choice.items()}
    comm, edges, hidden = _collectives(cluster, problem, solution.choice)
    _expose(problem, solution.choice, hidden)
    nodes, compute, recompute_time = [], 0.0, 0.0
    modules = module_names(traced, {n: n.meta[LAYER_KEY][1] for n in traced.gm.graph.nodes if LAYER_KEY in n.meta})
    held = {**solution.memory.saved_by_node, **_held_by_params(traced, choice, cluster, problem.storage)}
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
                                  layer=None if layer is None else layer[1], module=modules.get(n.name),
                                  memory=held.get(n, 0.0)))
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
        saved_for_backward=solution.memory.saved, param_names={node.name: name for name, node in traced.params},
        backend=problem.backend)


def _collectives(cluster, problem, choice: dict) -> tuple[dict[str, list[dict]], list, dict[object, list[dict]]]:
    """Every edge's collectives under ``choice`` (node -> strategy index), per step and at first all
    exposed, by the node they show at; the graph's edges; and each block's collectives that its
    compute may hide (solver/overlap.py)."""
    comm: dict[str, list[dict]] = {}
    edges, hidden = [], {}
    mesh = cluster.mesh_shape
    for e in problem.edges:
        src = problem.src_placement(e, choice[e.src])
        dst = e.fixed if e.dst is None else e.dst_in[choice[e.dst]]
        where = "output" if e.dst is None else e.dst.name
        if e.kind != "gather":  # graph edges; a storage -> working gather shows at its parameter
            edges.append((e.src.name, where))
        calls = 1 if e.kind in ("grad", "gather") else problem.micro_batches  # per optimizer step
        bucketed, hides = e.in_bucket(src, dst, mesh), overlap.hidden(problem, e, src, dst, mesh)
        for c in costmodel.resharding(cluster, src, dst, e.moved_bytes(src, dst), bucketed):
            entry = {"kind": c.kind, "mesh_dim": c.mesh_dim, "bytes": c.nbytes, "time": c.time * calls,
                     "src": e.src.name, "exposed": c.time * calls, "calls": calls, "role": e.kind}
            comm.setdefault(where, []).append(entry)
            if hides:
                hidden.setdefault(e.block, []).append(entry)
    return comm, edges, hidden


def _expose(problem, choice: dict, hidden: dict[object, list[dict]]) -> None:
    """Each block's exposed communication, the solver's E_b at ``choice`` (solver/overlap.py),
    spread over the block's hidden collectives in proportion to their time."""
    members = overlap.hiding_nodes(problem)
    for b, entries in hidden.items():
        total = sum(c["time"] for c in entries)
        left = overlap.exposed(problem, total, members.get(b, []), choice)
        for c in entries:
            c["exposed"] = c["time"] * (left / total if total > 0 else 0.0)


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


def _held_by_params(traced, choice, cluster, storage: dict) -> dict:
    """Per-device bytes each parameter holds across the step: itself at rest, its gradient and
    optimizer state when trained, and its working copy when gathered once per step and kept (the
    parts :func:`_state_detail` sums over all parameters)."""
    mesh, out = cluster.mesh_shape, {}
    for name, node in traced.params:
        nbytes = tensor_bytes(_val(node, 0))
        rest = costmodel.local_bytes(nbytes, choice[storage[node]].outputs[0], mesh)
        trained = traced.grads.get(name) is not None
        out[node] = rest * (1 + (1 + OPTIMIZER_STATE_PER_PARAM_BYTE if trained else 0))
        if choice[node].outputs[0] != choice[storage[node]].outputs[0]:
            out[node] += costmodel.local_bytes(nbytes, choice[node].outputs[0], mesh)
    return out


def _val(node, k):
    v = node.meta["val"]
    return v[k] if isinstance(v, (tuple, list)) else v
