"""memory: what each decision costs in per-device bytes, and which activations may be recomputed.

    peak = sum_{v,s} state[v,s] x[v,s]              parameters (+ gradients and optimizer state
                                                     when trained) by storage placement, buffers,
                                                     inputs; with K > 1 micro-batches also each
                                                     gradient's accumulation buffer, unreduced,
                                                     by its producer's placement
         + sum_p sum_{q != s} w[p,s] y[p,q,s]        working copies: parameter p gathered from
                                                     storage q to working placement s, kept for
                                                     the step (y: the storage -> working edge's
                                                     flow variables; w: bytes at s)
         + sum_{v,s} act[v,s] k[v,s]                 activations kept for backward
         + T,  T >= sum_s work[v,s] x[v,s]  (all v)  the largest op's working set
         <= limit

where k[v,s] = x[v,s] keep_v, written in its tight (convex-hull) form: k[v,s] <= x[v,s],
sum_s k[v,s] = keep_v. All saved activations are live together when backward starts, so their sum
is the activation peak. ``keep_v`` (save v for backward) and ``r_v`` (recompute v in backward)
obey Checkmate-style validity:

    keep_u + r_u >= 1        for every forward value u that backward reads
    keep_u + r_u >= r_v      for every forward input u of a recomputed v
    keep_u >= keep_v         when v is a view of u (a saved view holds its base's memory)

Recomputing v costs its compute again: sum_s c[v,s] j[v,s], j[v,s] = x[v,s] r_v in the same form.
Views and getitems alias their input and cost no bytes of their own; parameters and inputs are
always available; seeded random ops (dropout) are never recomputed. Resharding a recomputed
node's inputs again is not charged (approximation).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autoshard import costmodel
from autoshard.passes.annotate import META_KEY as COST_KEY, is_free
from autoshard.passes.strategies import META_KEY, tensor_inputs, value_of


@dataclass
class MemoryModel:
    limit: float
    state: dict[fx.Node, list[float]] = field(default_factory=dict)
    act: dict[fx.Node, list[float]] = field(default_factory=dict)
    work: dict[fx.Node, list[float]] = field(default_factory=dict)
    needed: list[fx.Node] = field(default_factory=list)       # forward values backward reads
    recomputable: list[fx.Node] = field(default_factory=list)
    inputs_of: dict[fx.Node, list[fx.Node]] = field(default_factory=dict)
    base_of: dict[fx.Node, fx.Node] = field(default_factory=dict)
    recompute_all: bool = False     # every recomputable node recomputed (full activation checkpointing)
    mesh_shape: tuple = ()
    held: list = field(default_factory=list)   # (storage, parameter, bytes): a gathered working copy

    @property
    def candidates(self) -> list[fx.Node]:
        """Forward nodes that get a keep variable."""
        seen = dict.fromkeys(self.needed)
        for v in self.recomputable:
            seen.update(dict.fromkeys(self.inputs_of[v]))
            seen[v] = None
        seen.update(dict.fromkeys(self.base_of))
        seen.update(dict.fromkeys(self.base_of.values()))
        return list(seen)


def _outputs_bytes(node: fx.Node) -> list[float]:
    val = node.meta["val"]
    vals = val if isinstance(val, (tuple, list)) else (val,)
    return [costmodel.tensor_nbytes(v) for v in vals]


def _local_outputs(node: fx.Node, mesh_shape) -> list[float]:
    sizes = _outputs_bytes(node)
    return [sum(costmodel.local_bytes(b, s.outputs[k] if k < len(s.outputs) else None, mesh_shape)
                for k, b in enumerate(sizes)) for s in node.meta[META_KEY].strategies]


def _producer(node: fx.Node) -> fx.Node:
    return value_of(node)[0]


def memory_model(traced, problem, cluster, limit: float, optimizer_factor: float) -> MemoryModel:
    """optimizer_factor: optimizer-state bytes per parameter byte (Adam: 2)."""
    mesh = cluster.mesh_shape
    mm = MemoryModel(limit, mesh_shape=tuple(mesh))
    trained = {name for name, g in traced.grads.items() if g is not None}
    for name, node in traced.params:
        # at its storage placement: a frozen parameter has no gradient and no optimizer state
        factor = 2.0 + optimizer_factor if name in trained else 1.0
        mm.state[problem.storage[node]] = [b * factor for b in _local_outputs(node, mesh)]
        mm.held.append((problem.storage[node], node, costmodel.tensor_nbytes(node.meta["val"])))
    for node in [*traced.inputs, *(node for _, node in traced.buffers)]:
        mm.state[node] = _local_outputs(node, mesh)
    if problem.micro_batches > 1:
        # all but the last micro-batch keep their gradients unreduced, where backward made them
        # (a Partial gradient is a full local copy), and add the next one's into them
        for e in problem.edges:
            if e.kind == "grad":
                held = [costmodel.local_bytes(e.nbytes, s.outputs[e.src_out], mesh)
                        for s in e.src.meta[META_KEY].strategies]
                mm.state[e.src] = [a + b for a, b in zip(mm.state.get(e.src, [0.0] * len(held)), held)]

    fwd = [v for v in problem.nodes if v.op == "call_function" and v.meta[COST_KEY].phase == "fwd"]
    fwd_set = set(fwd)
    for v in problem.nodes:
        if v.op == "call_function":
            cost = v.meta[COST_KEY]
            mm.work[v] = [cost.bytes / s.shards for s in v.meta[META_KEY].strategies]
    for v in fwd:
        free = is_free(v)
        mm.act[v] = [0.0] * len(v.meta[META_KEY].strategies) if free else _local_outputs(v, mesh)
        producers = [_producer(a) for a in tensor_inputs(v)]
        mm.inputs_of[v] = [u for u in dict.fromkeys(producers) if u in fwd_set]
        if free and mm.inputs_of[v]:
            mm.base_of[v] = mm.inputs_of[v][0]
        if not _is_random(v):
            mm.recomputable.append(v)

    needed: dict[fx.Node, None] = {}
    for n in traced.gm.graph.nodes:
        if n.op == "call_function" and n.meta[COST_KEY].phase == "bwd":
            for a in tensor_inputs(n):
                u = _producer(a)
                if u in fwd_set:
                    needed.setdefault(u)
    mm.needed = list(needed)
    return mm


def _is_random(node: fx.Node) -> bool:
    """Seeded random ops (dropout, bernoulli, ...) are never replayed: the rewrite saves them."""
    return torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def saved_for_backward(mm: MemoryModel, recompute: set) -> list[fx.Node]:
    """The forward nodes whose outputs stay in memory until backward (views resolved to their base)."""
    saved: dict[fx.Node, None] = {}

    def hold(u: fx.Node) -> None:
        while u in mm.base_of:          # a view keeps its base alive
            u = mm.base_of[u]
        saved.setdefault(u)

    for u in mm.needed:
        if u not in recompute:
            hold(u)
    for v in recompute:
        for u in mm.inputs_of.get(v, []):
            if u not in recompute:
                hold(u)
    return list(saved)


def working_copies(mm: MemoryModel, choice: dict, mesh_shape) -> float:
    """Bytes of the parameters gathered once per step and kept (working placement != storage)."""
    total = 0.0
    for st, p, nbytes in mm.held:
        have = st.meta[META_KEY].strategies[choice[st]].outputs[0]
        want = p.meta[META_KEY].strategies[choice[p]].outputs[0]
        if have != want:
            total += costmodel.local_bytes(nbytes, want, mesh_shape)
    return total


def predicted_memory(mm: MemoryModel, choice: dict[fx.Node, int], recompute: set) -> dict[str, float]:
    """The peak a chosen plan needs: the bytes the runtime will actually hold, which the ILP's
    rows bound from above (its slack variables may sit anywhere below the limit)."""
    return {
        "state": sum(mm.state[v][choice[v]] for v in mm.state) + working_copies(mm, choice, mm.mesh_shape),
        "activations": sum(mm.act[u][choice[u]] for u in saved_for_backward(mm, recompute) if u in mm.act),
        "transient": max((mm.work[v][choice[v]] for v in mm.work), default=0.0),
    }


def timeline(mm: MemoryModel, graph: fx.Graph, choice: dict[fx.Node, int], recompute: set) -> list[tuple[str, float]]:
    """Predicted per-device bytes held after each node: persistent state, plus each saved
    activation from its forward node until its last backward reader, plus that op's working set."""
    from autoshard.passes.strategies import value_of

    state = sum(mm.state[v][choice[v]] for v in mm.state) + working_copies(mm, choice, mm.mesh_shape)
    saved = set(saved_for_backward(mm, recompute))
    last_use: dict[fx.Node, fx.Node] = {}
    for n in graph.nodes:
        for a in n.all_input_nodes:
            u = value_of(a)[0]
            while u in mm.base_of:
                u = mm.base_of[u]
            if u in saved:
                last_use[u] = n
    frees: dict[fx.Node, list[fx.Node]] = {}
    for u, n in last_use.items():
        frees.setdefault(n, []).append(u)
    live, out = 0.0, []
    for n in graph.nodes:
        if n.op != "call_function" or n not in choice:
            continue
        if n in saved:
            live += mm.act[n][choice[n]]
        work = mm.work.get(n, [0.0] * (choice[n] + 1))[choice[n]]
        out.append((n.name, state + live + work))
        for u in frees.get(n, []):
            live -= mm.act[u][choice[u]]
    return out
