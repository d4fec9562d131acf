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
are gathered at their consumers, forward and backward alike. The rows are solver/solve.py's;
memory: solver/memory.py (the model) and solver/memory_rows.py (its rows); repeated layers:
:func:`share`.

Token-local regions (passes/regions.py: an MoE dispatch each rank may run on its own tokens).
With T_d(v) the strategies of member v that split the tokens on mesh dim d and h the region's
first member, every member splits where the others do:

    sum_{s in T_d(v)} x[v,s] = sum_{s in T_d(h)} x[h,s]        (every member v, every mesh dim d)

Storage. Each parameter p has two placements: its storage O (a :class:`Storage` decision: where
the module holds it between steps, where its gradient lands and where its optimizer state lives)
and its working placement S (the placeholder's strategy, what its consumers and views read). An
edge O -> S charges one gather per step; when S differs from O the gathered copy stays for the
whole step (the memory rows count it), otherwise each consumer gathers from storage on its own,
forward and backward (FSDP's reshard-after-forward). So DDP (O = S = R), ZeRO-3/FSDP (O = S
sharded), ZeRO-1/2 (O sharded, S = R: sharded gradients and optimizer state, parameters gathered
once), FSDP without resharding after forward, and their per-parameter mixes are all choices here.

Overlap. Moving a parameter (its gathers at consumers) and reducing a gradient to storage depend
on no activation, so the runtime can issue them ahead (FSDP's prefetch, DDP's bucketed
reduction) and hide them behind compute; every other collective (tensor-parallel all-reduces,
activation resharding) sits on the critical path. Per block b (a repeated layer's copy; all
nodes outside repeated layers form one more block), with a = the cluster's ``comm_overlap``:

    E_b >= sum_{overlappable e in b} R_e  -  a * sum_{v in b} sum_s c[v,s] x[v,s],   E_b >= 0

and the objective charges E_b instead of those edges (solver/overlap.py: the rows, and E_b at a
plan for pricing it). A gather belongs to its consumer's block, a gradient reduction to its
producer's. Only a bucketed gradient reduction made by backward itself hides (:meth:`Edge.hides`);
any other runs after backward, exposed, on its own (with its latency). With a = 0 everything is
exposed (the CPU runtime issues collectives in graph order and waits on each).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field, replace

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard

from autoshard.cluster import costmodel
from autoshard.errors import ConstraintError
from autoshard.notation import parse_placements
from autoshard.passes.annotate import META_KEY as COST_KEY, feeds_only_grads, is_free, tensor_bytes
from autoshard.passes.coarsen import FOLLOW_KEY, LAYER_KEY
from autoshard.passes.regions import META_KEY as REGION_KEY, ep_dim, ep_member, split_dims
from autoshard.passes.graph import META_KEY, per_strategy_list, tensor_inputs, value_of


@dataclass(eq=False)  # edges are keyed by identity (the solver maps each to its cost terms)
class Edge:
    src: fx.Node                 # producer (decision node)
    src_out: int                 # which output of the producer
    dst: fx.Node | None          # consumer decision node; None: the placement is fixed (`fixed`)
    dst_in: list | None          # consumer's required placement per consumer strategy
    nbytes: float                # global size of the tensor
    fixed: tuple | None = None   # required placement when dst is None
    kind: str = "input"          # input | output | grad (to storage) | gather (storage -> working)
    weight: float = 1.0          # runs per step: micro-batches x identical edges merged (repeated layers)
    aligned: bool = False        # the consumer must take the producer's placement (no resharding)
    slices: bool = False         # aligned, or a free slice of it (a follower: passes/coarsen.py)
    overlap: bool = False        # a parameter's or gradient's move: may hide behind its block's compute
    block: object = None         # the block whose compute can hide it (overlap edges)
    kept: float = 0.0            # global bytes kept: a gather's working copy (for the step), a
                                 # gradient's unreduced buffer (between micro-batches)
    reduce_nbytes: float | None = None  # size when a pending sum is reduced (the policy's reduce dtype)

    def moved_bytes(self, src, dst) -> float:
        """Global bytes resharding ``src`` -> ``dst`` moves: a gradient's partial sums travel in the
        mixed-precision policy's reduce dtype (passes/rewrite.py), anything else in its own."""
        if self.reduce_nbytes is not None and any(isinstance(q, Partial) and q != p for q, p in zip(src, dst)):
            return self.reduce_nbytes
        return self.nbytes

    def in_bucket(self, src, dst, mesh_shape) -> bool:
        """Whether the runtime makes the move ``src`` -> ``dst`` in one flat collective with others
        (priced without its latency: costmodel.resharding's ``bucketed``): a parameter's gather,
        a gradient's reduction when its pieces allow (costmodel.grad_bucket_move)."""
        if self.kind == "grad":
            return costmodel.grad_bucket_move(self.dst.param.meta["val"].shape, src, dst, mesh_shape) is not None
        return self.overlap

    def hides(self, src, dst, mesh_shape, micro_batches: int) -> bool:
        """Whether the move may hide behind its block's compute (Overlap, above). A gradient's only
        when backward itself reduces it: one micro-batch (with accumulation the last backward
        leaves them unreduced) and a bucketed move; any other gradient moves after backward."""
        if self.kind == "grad":
            return micro_batches == 1 and self.in_bucket(src, dst, mesh_shape)
        return self.overlap


def slices_to(src, dst) -> bool:
    """``src`` becomes ``dst`` with no communication: equal on every mesh dim, or ``dst`` shards
    a dim ``src`` replicates (each rank keeps its slice)."""
    return all(q == p or (isinstance(q, Replicate) and isinstance(p, Shard)) for q, p in zip(src, dst))


class Storage:
    """A parameter's storage decision: no graph node of its own, the parameter's strategies as its
    options (their output placement is the storage placement)."""

    op = "storage"
    target = "storage"
    args: tuple = ()          # fx.Node's reading surface, so predicates over nodes need no case
    kwargs: dict = {}
    users: dict = {}
    all_input_nodes: list = []

    def __init__(self, param: fx.Node):
        self.param = param
        self.name = param.name  # its collectives show at the parameter
        self.meta = {META_KEY: param.meta[META_KEY]}
        if LAYER_KEY in param.meta:
            self.meta[LAYER_KEY] = param.meta[LAYER_KEY]

    def __repr__(self) -> str:
        return f"Storage({self.param.name})"


@dataclass
class Problem:
    nodes: list[fx.Node]
    cost: dict[fx.Node, list[float]]
    allowed: dict[fx.Node, list[int]]          # strategies a node may take (after constraints)
    edges: list[Edge] = field(default_factory=list)
    block: dict[fx.Node, object] = field(default_factory=dict)   # node -> block (see Overlap)
    overlap: float = 0.0                                        # the cluster's comm_overlap
    micro_batches: int = 1                                      # K: graph runs per optimizer step
    storage: dict = field(default_factory=dict)                 # parameter placeholder -> its Storage
    # token-local regions (passes/regions.py), per region and mesh dim: [(node, strategies that
    # split tokens on that dim)]; every member takes one of its listed strategies, or none does
    ties: list[list[tuple[fx.Node, tuple[int, ...]]]] = field(default_factory=list)
    backend: str = "eager"                                      # what runs the ops (costmodel.BACKENDS)

    def src_placement(self, e: Edge, s: int):
        return e.src.meta[META_KEY].strategies[s].outputs[e.src_out]

    @staticmethod
    def src_placement_of(node: fx.Node, k: int, s: int):
        return node.meta[META_KEY].strategies[s].outputs[k]


def _parse_placements(value, ndim: int, what: str):
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


def formulate(traced, cluster, constraints: dict | None = None, allow=None, micro_batches: int = 1,
              followers: bool = True, backend: str = "eager") -> Problem:
    """``allow(node, strategy) -> bool`` (optional) limits the strategies the solver may pick;
    hand-written strategies (autoshard.baselines) are such limits on this same problem.
    ``followers``: align each follower marked by passes/coarsen.py with the input it follows.

    ``micro_batches`` K: one step runs the graph K times (gradient accumulation); every compute
    cost and resharding counts K times except the gradients' reduction to storage, which runs
    once, on the last micro-batch (the earlier ones accumulate unreduced: solver/memory.py).
    ``backend``: how the program's ops run ("eager" or "inductor"), which prices them
    (costmodel.compute_time)."""
    policy = getattr(traced, "mixed_precision", None)
    param_dtype = getattr(policy, "param_dtype", None)  # the runtime gathers it when narrower
    reduce_dtype = getattr(policy, "reduce_dtype", None)
    storage = {node: Storage(node) for _, node in traced.params}
    nodes = [n for n in traced.gm.graph.nodes if META_KEY in n.meta and n.meta[META_KEY].alias_of is None]
    nodes += storage.values()
    cost = _costs(traced, cluster, nodes, micro_batches, backend)
    rep = tuple([Replicate()] * cluster.ndim)
    allowed = _allowed(traced, cluster, nodes, storage, constraints, allow, rep)
    block = {n: (n.meta.get(LAYER_KEY) or (None, None))[1] for n in nodes}
    problem = Problem(nodes, cost, allowed, block=block, overlap=cluster.device.comm_overlap,
                      micro_batches=micro_batches, storage=storage, backend=backend)
    _gather_edges(problem, param_dtype)
    _input_edges(problem, traced, followers, reduce_dtype)
    _output_edges(problem, traced, rep)
    _grad_edges(problem, traced, reduce_dtype)
    problem.ties = _token_local_ties(problem, cluster.ndim)
    return problem


def _costs(traced, cluster, nodes: list, micro_batches: int, backend: str) -> dict:
    """c[v,s]: an op's compute time under each strategy, K times per step; a Storage decision's,
    the optimizer's update of its shard (once per step, not per micro-batch)."""
    trained = {node for name, node in traced.params if traced.grads.get(name) is not None}
    priced: dict = {}   # a repeated layer's op prices like its twins: once per (strategy list, cost)

    def compute(n) -> list[float]:
        strategies = n.meta[META_KEY].strategies
        return list(per_strategy_list(priced, strategies, n.meta.get(COST_KEY), lambda: [
            micro_batches * costmodel.compute_time(cluster, n, s, backend) for s in strategies]))

    return {n: [costmodel.optimizer_time(cluster, n.param, s, n.param in trained) for s in n.meta[META_KEY].strategies]
            if isinstance(n, Storage) else compute(n) for n in nodes}


def _allowed(traced, cluster, nodes: list, storage: dict, constraints: dict | None, allow, rep: tuple) -> dict:
    """The strategies each node may take: buffers and tangents replicated, the user's pins on
    parameters and inputs, then ``allow``'s limits."""
    allowed = {n: list(range(len(n.meta[META_KEY].strategies))) for n in nodes}
    for _, node in traced.buffers:
        allowed[node] = _restrict(node, rep, f"buffer {node.name}")
    for node in traced.tangents:
        allowed[node] = _restrict(node, rep, "the loss tangent")
    for key, value in (constraints or {}).items():
        if key == "inputs":
            _pin_inputs(allowed, traced, cluster, value)
        else:
            _pin_params(allowed, traced, cluster, storage, key, value)
    if allow is not None:
        for n in nodes:
            strategies = n.meta[META_KEY].strategies
            allowed[n] = [s for s in allowed[n] if allow(n, strategies[s])]
            if not allowed[n]:
                raise ConstraintError(f"no strategy of {n.name} ({n.target}{_shape_of(n)}) satisfies the given "
                                      f"limits; it has {_listed([str(strategies[s]) for s in range(len(strategies))])}")
    return allowed


def _shape_of(n) -> str:
    val = getattr(n, "meta", {}).get("val")
    return f", shape {tuple(val.shape)}" if isinstance(val, torch.Tensor) else ""


def _listed(texts: list[str], most: int = 6) -> str:
    """"the strategies a, b, c", or the first ``most`` and how many more."""
    shown = ", ".join(texts[:most])
    return f"the strategies {shown}" + (f" and {len(texts) - most} more" if len(texts) > most else "")


def _pin_inputs(allowed: dict, traced, cluster, value) -> None:
    if len(value) != len(traced.inputs):
        raise ConstraintError(f"'inputs' has {len(value)} entries but the model takes {len(traced.inputs)} "
                              f"tensor inputs; give one placement list (or None) per input")
    for i, (node, v) in enumerate(zip(traced.inputs, value)):
        if v is not None:
            allowed[node] = _restrict(node, _parse_placements(v, cluster.ndim, f"input {i}"), f"input {i}")


def _pin_params(allowed: dict, traced, cluster, storage: dict, key: str, value) -> None:
    """The storage placement of the parameters whose names match the pattern ``key``."""
    matched = [(name, node) for name, node in traced.params if fnmatch.fnmatchcase(name, key)]
    if not matched:
        names = ", ".join(n for n, _ in traced.params[:6])
        raise ConstraintError(f"constraint {key!r} matches no parameter (parameters are named like {names}, ...)")
    pl = _parse_placements(value, cluster.ndim, key)
    for name, node in matched:
        allowed[storage[node]] = _restrict(node, pl, f"parameter {name}")


def _gather_edges(problem: Problem, param_dtype) -> None:
    # storage -> working placement: one gather per step (not per micro-batch: the copy is kept)
    # (under a mixed-precision policy the gather moves the compute dtype: autoshard/runtime/module.py)
    for p, st in problem.storage.items():
        full = tensor_bytes(p.meta["val"])
        moves = min(full, tensor_bytes(p.meta["val"], param_dtype)) if param_dtype else full
        problem.edges.append(Edge(st, 0, p, [s.outputs[0] for s in p.meta[META_KEY].strategies], moves,
                                  kind="gather", overlap=True, block=problem.block[p], kept=full))


def _input_edges(problem: Problem, traced, followers: bool, reduce_dtype) -> None:
    """An edge per tensor input of every op, K runs per step: aligned for a view of a parameter
    and for a follower, overlappable for a parameter's move (it waits on no compute)."""
    params = {node for _, node in traced.params}
    # parameters, their views and casts: what a consumer gathers without waiting on compute
    moved = set(params)
    to_grads = feeds_only_grads(traced.gm, traced) if reduce_dtype is not None else set()
    wanted: dict = {}   # twins share their edges' dst_in lists, which share() keys by

    def inputs_of(v, i: int) -> list:
        strategies = v.meta[META_KEY].strategies
        return per_strategy_list(wanted, strategies, i, lambda: [s.inputs[i] for s in strategies])

    for v in problem.nodes:
        if v.op != "call_function":
            continue
        args = tensor_inputs(v)
        for i, arg in enumerate(args):
            u, k = value_of(arg)
            dst_in = inputs_of(v, i)
            # A view of a parameter takes the parameter's storage placement: the gather happens at
            # each consumer, forward and backward, so no gathered copy lives from one to the other
            # (FSDP's reshard-after-forward) and the view costs no memory, as the memory model says.
            # A follower (passes/coarsen.py) takes its input's placement whichever it is.
            param_view = u in params and is_free(v)
            follows = not param_view and followers and v.meta.get(FOLLOW_KEY) == i and \
                {problem.src_placement_of(u, k, s) for s in problem.allowed[u]} <= \
                {dst_in[s] for s in problem.allowed[v]}
            aligned = param_view or follows
            if aligned and u in moved and len(args) == 1:
                moved.add(v)
            problem.edges.append(Edge(u, k, v, dst_in, tensor_bytes(arg.meta["val"]), aligned=aligned,
                                      slices=follows, overlap=u in moved and not aligned, block=problem.block[v],
                                      weight=problem.micro_batches,
                                      reduce_nbytes=tensor_bytes(arg.meta["val"], reduce_dtype)
                                      if v in to_grads else None))


def _output_edges(problem: Problem, traced, rep: tuple) -> None:
    # each forward output ends Replicate, K times per step
    for out in traced.outputs:
        if out is not None:
            u, k = value_of(out)
            problem.edges.append(Edge(u, k, None, None, tensor_bytes(out.meta["val"]), rep, "output",
                                      weight=problem.micro_batches))


def _grad_edges(problem: Problem, traced, reduce_dtype) -> None:
    # each gradient lands in its parameter's storage placement, once per step (to_storage moves
    # it in reduce_dtype)
    params = dict(traced.params)
    for name, grad in traced.grads.items():
        if grad is not None:
            u, k = value_of(grad)
            p = params[name]
            problem.edges.append(Edge(u, k, problem.storage[p], [s.outputs[0] for s in p.meta[META_KEY].strategies],
                                      tensor_bytes(grad.meta["val"], reduce_dtype), kind="grad",
                                      overlap=True, block=problem.block[u],
                                      kept=tensor_bytes(grad.meta["val"])))


def _token_local_ties(problem: Problem, ndim: int) -> list:
    regions: dict[int, list[fx.Node]] = {}
    for v in problem.nodes:
        fact = v.meta.get(REGION_KEY)
        if fact is not None and not fact.neutral:
            regions.setdefault(fact.region, []).append(v)
    ties = []
    for members in regions.values():
        for d in range(ndim):
            ties.append([(v, tuple(s for s in problem.allowed[v]
                                   if d in split_dims(v.meta[REGION_KEY], v.meta[META_KEY].strategies[s])))
                         for v in members])
            # expert-parallel over d: the members that run otherwise then, all or none
            ep = [(v, tuple(s for s in problem.allowed[v] if ep_dim(v.meta[META_KEY].strategies[s]) == d))
                  for v in members if ep_member(v)]
            if any(allowed for _, allowed in ep):
                ties.append(ep)
    return ties


def pool_blocks(problem: Problem, rep: dict[fx.Node, fx.Node], blocks: dict) -> None:
    """Give each class member its representative's block (``blocks``: each node's own, as
    formulated), so the overlap rows of shared layers pool every copy's comm and compute (as
    :func:`share` sums them); copies that choose alike hide the same, so this changes nothing
    but boundary effects between unlike neighbours."""
    problem.block = dict(blocks)
    for v in problem.nodes:
        if v in rep:
            problem.block[v] = blocks.get(rep[v])  # copy 0's (coarsen.repeated_layers)
    for e in problem.edges:
        if e.overlap:
            anchor = e.src if e.kind == "grad" else e.dst
            e.block = problem.block.get(anchor)


def fixed(problem: Problem, choice: dict, nodes) -> Problem:
    """``problem`` with each of ``nodes`` (and a parameter's storage with it) held to its
    strategy in ``choice``."""
    held = set(nodes)
    held |= {problem.storage[p] for p in list(held) if p in problem.storage}
    allowed = {v: [choice[v]] if v in held else ss for v, ss in problem.allowed.items()}
    ties = [[(v, tuple(s for s in ss if s in allowed[v])) for v, ss in tie] for tie in problem.ties]
    return replace(problem, allowed=allowed, ties=ties)


def share(problem: Problem, mm, rep: dict[fx.Node, fx.Node]):
    """The problem with each class of ``rep`` (member -> representative) as one node: costs and
    memory terms of the members summed, identical edges merged with their multiplicity.

    Returns (problem, memory model, expand) where ``expand(choice, recompute)`` maps a solution
    of the shared problem back onto every node."""
    # a parameter's storage joins its class when it is as free as the representative's
    rep = {**rep, **{st: problem.storage[rep[p]] for p, st in problem.storage.items()
                     if p in rep and problem.allowed[st] == problem.allowed[problem.storage[rep[p]]]}}
    r = lambda v: rep.get(v, v)  # noqa: E731
    shared = _shared_nodes(problem, r)
    shared.edges, new_of = _merged_edges(problem, r)
    # a region's copies tie the same class nodes alike: one tie per distinct mapped row
    shared.ties = list({tuple((r(v), ss) for v, ss in tie): [(r(v), ss) for v, ss in tie]
                        for tie in problem.ties}.values())
    m = _shared_memory(problem, mm, rep, r)
    _shared_memory_graph(mm, m, r, new_of)

    def expand(choice: dict, recompute: set) -> tuple[dict, set]:
        return ({v: choice[r(v)] for v in problem.nodes},
                {v for v in mm.recomputable if r(v) in recompute})

    return shared, m, expand


def _shared_nodes(problem: Problem, r) -> Problem:
    """The class nodes, each costing its members' sum, without edges yet."""
    nodes = list(dict.fromkeys(r(v) for v in problem.nodes))
    cost: dict[fx.Node, list[float]] = {v: [0.0] * len(problem.cost[v]) for v in nodes}
    for v in problem.nodes:
        cost[r(v)] = [a + b for a, b in zip(cost[r(v)], problem.cost[v])]
    # a class's block is its representative's: the block rows then sum every copy's comm and
    # compute, which equals the sum of the per-copy rows since the copies choose alike
    return Problem(nodes, cost, {v: problem.allowed[v] for v in nodes},
                   block={v: problem.block.get(v) for v in nodes}, overlap=problem.overlap,
                   micro_batches=problem.micro_batches,
                   storage={p: st for p, st in problem.storage.items() if p in cost}, backend=problem.backend)


def _merged_edges(problem: Problem, r) -> tuple[list[Edge], dict[Edge, Edge]]:
    """The class graph's edges, identical ones merged (their weights summed), and each edge's
    merged edge."""
    merged: dict[tuple, Edge] = {}
    new_of: dict[Edge, Edge] = {}
    wanted: dict[int, tuple] = {}   # id(dst_in) -> its text: twins' edges share the list (formulate)
    for e in problem.edges:
        anchor = e.src if e.kind == "grad" else e.dst
        blk = None if anchor is None else problem.block.get(r(anchor))
        if e.dst is not None and id(e.dst_in) not in wanted:
            wanted[id(e.dst_in)] = tuple(map(str, e.dst_in))
        key = (r(e.src), e.src_out, None if e.dst is None else r(e.dst),
               None if e.dst is None else wanted[id(e.dst_in)], e.nbytes, e.fixed, e.kind, e.aligned, e.slices,
               e.overlap, blk, e.kept, e.reduce_nbytes)
        if key in merged:
            merged[key].weight += e.weight
        else:
            merged[key] = Edge(r(e.src), e.src_out, None if e.dst is None else r(e.dst), e.dst_in, e.nbytes,
                               e.fixed, e.kind, e.weight, e.aligned, e.slices, e.overlap, blk, e.kept,
                               e.reduce_nbytes)
        new_of[e] = merged[key]
    return list(merged.values()), new_of


def _shared_memory(problem: Problem, mm, rep: dict, r):
    """The memory model of the class graph: a class's bytes summed over its copies, and the share
    of its copies live (made, replayed) in each backward phase."""
    from autoshard.solver.memory import MemoryModel

    # one keep / recompute decision per class too: per group of copies (1, 2, 4, ... copies, any
    # count a choice) measured 0.4% faster plans at 80 layers for 1.4x the solve time
    copies: dict = {}
    for v in rep:
        copies[r(v)] = copies.get(r(v), 0) + 1
    m = MemoryModel(mm.limit, recompute_all=mm.recompute_all, mesh_shape=mm.mesh_shape, block=dict(problem.block),
                    copies=copies, alias={v: r(v) for v in rep}, reduce_in_backward=mm.reduce_in_backward,
                    held_batches=mm.held_batches, held_head=mm.held_head, phases=mm.phases, phase_names=list(mm.phase_names), optimizer=mm.optimizer)
    for table, out in ((mm.state, m.state), (mm.act, m.act), (mm.grad, m.grad), (mm.param, m.param)):
        for v, vals in table.items():
            out[r(v)] = [a + b for a, b in zip(out.get(r(v), [0.0] * len(vals)), vals)]
    # a class's share of its copies live (made, replayed) in each backward phase: their mean
    for table, out in ((mm.live, m.live), (mm.replay, m.replay), (mm.start, m.start), (mm.made, m.made)):
        for v, vec in table.items():
            n = copies.get(r(v), 1)
            out[r(v)] = tuple(a + b / n for a, b in zip(out.get(r(v), (0.0,) * len(vec)), vec))
    for v, vals in mm.work.items():
        m.work[r(v)] = [max(a, b) for a, b in zip(m.work.get(r(v), vals), vals)]
    return m


def _shared_memory_graph(mm, m, r, new_of: dict) -> None:
    """``m``'s forward graph, recompute candidates and moments: ``mm``'s, mapped onto the class
    nodes (and the merged edges)."""
    m.inside = {r(v) for v in mm.inside}
    m.head = {r(v) for v in mm.head}
    m.needed = list(dict.fromkeys(r(v) for v in mm.needed))
    m.recomputable = list(dict.fromkeys(r(v) for v in mm.recomputable))
    m.checkpoints = {r(v) for v in mm.checkpoints}
    for v, us in mm.inputs_of.items():
        m.inputs_of.setdefault(r(v), [])
        m.inputs_of[r(v)] = list(dict.fromkeys(m.inputs_of[r(v)] + [r(u) for u in us if r(u) is not r(v)]))
    for v, u in mm.base_of.items():
        if r(u) is not r(v):
            m.base_of[r(v)] = r(u)
    m.held = [(r(st), r(p), nbytes) for st, p, nbytes in mm.held]
    m.view_edge = {r(v): new_of[e] for v, e in mm.view_edge.items() if r(v) in m.base_of}
    for key, moments in mm.at.items():   # an op or an edge: its copies' moments
        shared_key = new_of.get(key) if isinstance(key, Edge) else r(key)
        m.at[shared_key] = m.at.get(shared_key, frozenset()) | moments
    m.grads = list(dict.fromkeys(new_of[e] for e in mm.grads))
    m.last_bucket = {new_of[e] for e in mm.last_bucket}
    m.uses = list(dict.fromkeys(new_of[e] for e in mm.uses))
