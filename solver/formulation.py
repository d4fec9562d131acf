"""formulation: the sharding ILP as data, read straight off the annotated graph.

    minimize   sum_v sum_s c[v,s] x[v,s]  +  sum_e sum_{q,p} R_e[q,p] y[e,q,p]
    subject to sum_s x[v,s] = 1                                  (one strategy per node)
               sum_p y[e,q,p] = sum_{s: out_e(s) = q} x[u,s]      (flow form of each edge
               sum_q y[e,q,p] = sum_{s: in_e(s)  = p} x[v,s]       u -> v: y is the product
               x binary, y >= 0                                    x_u x_v, exact for binary x)

c[v,s] is the compute time of node v under strategy s; R_e[q,p] the resharding time of edge e's
tensor from the producer's placement q to the placement p the consumer needs. y is indexed by
distinct placements, not strategies, so an edge costs |Q| x |P| continuous variables; an edge
whose producer (or consumer) has a single placement needs none (its cost is linear in x).
Besides op inputs, two kinds of edges close the step: each forward output must end Replicate,
and each gradient must land in its parameter's storage placement (the placeholder's choice).
An edge from a parameter into a view of it is *aligned* (no resharding: the view takes the
storage placement, sum_{s: in_e(s) = p} x[v,s] = sum_{s: out_e(s) = p} x[u,s]), so parameters
are gathered at their consumers, forward and backward alike. Memory rows: solver/memory.py;
repeated layers: :func:`share`.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import torch.fx as fx
from torch.distributed.tensor import Replicate

from autoshard import costmodel
from autoshard.errors import ConstraintError
from autoshard.passes.annotate import is_free
from autoshard.passes.strategies import META_KEY, tensor_inputs, value_of


@dataclass
class Edge:
    src: fx.Node                 # producer (decision node)
    src_out: int                 # which output of the producer
    dst: fx.Node | None          # consumer decision node; None: the placement is fixed (`fixed`)
    dst_in: list | None          # consumer's required placement per consumer strategy
    nbytes: float                # global size of the tensor
    fixed: tuple | None = None   # required placement when dst is None
    kind: str = "input"          # input | output | grad
    weight: float = 1.0          # how many identical edges this one stands for (repeated layers)
    aligned: bool = False        # the consumer must take the producer's placement (no resharding)


@dataclass
class Problem:
    nodes: list[fx.Node]
    cost: dict[fx.Node, list[float]]
    allowed: dict[fx.Node, list[int]]          # strategies a node may take (after constraints)
    edges: list[Edge] = field(default_factory=list)

    def src_placement(self, e: Edge, s: int):
        return e.src.meta[META_KEY].strategies[s].outputs[e.src_out]


def _parse_placements(value, ndim: int, what: str):
    from autoshard.plan import parse_placements

    try:
        return parse_placements(value, ndim)
    except (ValueError, TypeError) as exc:
        raise ConstraintError(f"constraint for {what}: {exc}") from exc


def _restrict(node: fx.Node, placements, what: str) -> list[int]:
    strategies = node.meta[META_KEY].strategies
    ok = [i for i, s in enumerate(strategies) if s.outputs[0] == placements]
    if not ok:
        options = ", ".join(str(s).split("->")[1] for s in strategies)
        raise ConstraintError(f"{what} cannot be placed {placements}: its shape allows {options}")
    return ok


def formulate(traced, cluster, constraints: dict | None = None, allow=None) -> Problem:
    """``allow(node, strategy) -> bool`` (optional) limits the strategies the solver may pick;
    hand-written strategies (autoshard.baselines) are such limits on this same problem."""
    gm = traced.gm
    nodes = [n for n in gm.graph.nodes if META_KEY in n.meta and n.meta[META_KEY].alias_of is None]
    cost = {n: [costmodel.compute_time(cluster, n, s) for s in n.meta[META_KEY].strategies] for n in nodes}
    allowed = {n: list(range(len(n.meta[META_KEY].strategies))) for n in nodes}
    rep = tuple([Replicate()] * cluster.ndim)

    # Buffers and tangents stay replicated; user constraints pin parameters and inputs.
    for _, node in traced.buffers:
        allowed[node] = _restrict(node, rep, f"buffer {node.name}")
    for node in traced.tangents:
        allowed[node] = _restrict(node, rep, "the loss tangent")
    for key, value in (constraints or {}).items():
        if key == "inputs":
            if len(value) != len(traced.inputs):
                raise ConstraintError(f"'inputs' has {len(value)} entries but the model takes {len(traced.inputs)} "
                                      f"tensor inputs; give one placement list (or None) per input")
            for i, (node, v) in enumerate(zip(traced.inputs, value)):
                if v is not None:
                    allowed[node] = _restrict(node, _parse_placements(v, cluster.ndim, f"input {i}"), f"input {i}")
            continue
        matched = [(name, node) for name, node in traced.params if fnmatch.fnmatchcase(name, key)]
        if not matched:
            names = ", ".join(n for n, _ in traced.params[:6])
            raise ConstraintError(f"constraint {key!r} matches no parameter (parameters are named like {names}, ...)")
        pl = _parse_placements(value, cluster.ndim, key)
        for name, node in matched:
            allowed[node] = _restrict(node, pl, f"parameter {name}")

    if allow is not None:
        for n in nodes:
            strategies = n.meta[META_KEY].strategies
            allowed[n] = [s for s in allowed[n] if allow(n, strategies[s])]
            if not allowed[n]:
                raise ConstraintError(f"no strategy of {n.name} ({n.target}) satisfies the given limits")
    problem = Problem(nodes, cost, allowed)
    params = {node for _, node in traced.params}
    for v in nodes:
        if v.op != "call_function":
            continue
        for i, arg in enumerate(tensor_inputs(v)):
            u, k = value_of(arg)
            # A view of a parameter takes the parameter's storage placement: the gather happens at
            # each consumer, forward and backward, so no gathered copy lives from one to the other
            # (FSDP's reshard-after-forward) and the view costs no memory, as the memory model says.
            problem.edges.append(Edge(u, k, v, [s.inputs[i] for s in v.meta[META_KEY].strategies],
                                      costmodel.tensor_nbytes(arg.meta["val"]),
                                      aligned=u in params and is_free(v)))
    for out in traced.outputs:
        if out is not None:
            u, k = value_of(out)
            problem.edges.append(Edge(u, k, None, None, costmodel.tensor_nbytes(out.meta["val"]), rep, "output"))
    params = dict(traced.params)
    for name, grad in traced.grads.items():
        if grad is not None:
            u, k = value_of(grad)
            p = params[name]
            problem.edges.append(Edge(u, k, p, [s.outputs[0] for s in p.meta[META_KEY].strategies],
                                      costmodel.tensor_nbytes(grad.meta["val"]), kind="grad"))
    return problem


def share(problem: Problem, mm, rep: dict[fx.Node, fx.Node]):
    """The problem with each class of ``rep`` (member -> representative) as one node: costs and
    memory terms of the members summed, identical edges merged with their multiplicity.

    Returns (problem, memory model, expand) where ``expand(choice, recompute)`` maps a solution
    of the shared problem back onto every node."""
    r = lambda v: rep.get(v, v)  # noqa: E731
    nodes = list(dict.fromkeys(r(v) for v in problem.nodes))
    cost: dict[fx.Node, list[float]] = {v: [0.0] * len(problem.cost[v]) for v in nodes}
    for v in problem.nodes:
        cost[r(v)] = [a + b for a, b in zip(cost[r(v)], problem.cost[v])]
    shared = Problem(nodes, cost, {v: problem.allowed[v] for v in nodes})
    merged: dict[tuple, Edge] = {}
    for e in problem.edges:
        key = (r(e.src), e.src_out, None if e.dst is None else r(e.dst),
               None if e.dst is None else tuple(map(str, e.dst_in)), e.nbytes, e.fixed, e.kind, e.aligned)
        if key in merged:
            merged[key].weight += e.weight
        else:
            merged[key] = Edge(r(e.src), e.src_out, None if e.dst is None else r(e.dst), e.dst_in, e.nbytes,
                               e.fixed, e.kind, e.weight, e.aligned)
    shared.edges = list(merged.values())

    from autoshard.solver.memory import MemoryModel

    m = MemoryModel(mm.limit, recompute_all=mm.recompute_all)
    for table, out in ((mm.state, m.state), (mm.act, m.act)):
        for v, vals in table.items():
            out[r(v)] = [a + b for a, b in zip(out.get(r(v), [0.0] * len(vals)), vals)]
    for v, vals in mm.work.items():
        m.work[r(v)] = [max(a, b) for a, b in zip(m.work.get(r(v), vals), vals)]
    m.needed = list(dict.fromkeys(r(v) for v in mm.needed))
    m.recomputable = list(dict.fromkeys(r(v) for v in mm.recomputable))
    for v, us in mm.inputs_of.items():
        m.inputs_of.setdefault(r(v), [])
        m.inputs_of[r(v)] = list(dict.fromkeys(m.inputs_of[r(v)] + [r(u) for u in us if r(u) is not r(v)]))
    for v, u in mm.base_of.items():
        if r(u) is not r(v):
            m.base_of[r(v)] = r(u)

    def expand(choice: dict, recompute: set) -> tuple[dict, set]:
        return ({v: choice[r(v)] for v in problem.nodes},
                {v for v in mm.recomputable if r(v) in recompute})

    return shared, m, expand
