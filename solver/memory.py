"""memory: what each decision costs in per-device bytes, and which activations may be recomputed.

A training step holds different things at different moments, and the peak is the largest of them.
Each moment is a row of the ILP (moment <= peak <= limit: solver/memory_rows.py builds them from the
model here), and :func:`predicted_memory` evaluates the same rows for a plan:

    forward             S + A + T_fwd
    backward phase p    S + G_p + A_p + R_p + T_p          (every phase p of backward, below)
    end of backward     S + G + D                          (what backward hands over unreduced)
    optimizer step      S + G + O

    S = sum_{v,s} state[v,s] x[v,s]                  parameters and optimizer state by storage
        + sum_p sum_{q != s} w[p,s] y[p,q,s]         placement, buffers, inputs; with K > 1
                                                     micro-batches also each gradient's
                                                     accumulation buffer, unreduced, by its
                                                     producer's placement; and the working copies:
                                                     parameter p gathered from storage q to working
                                                     placement s, kept for the step (y: the
                                                     storage -> working edge's flow variables; w:
                                                     bytes at s)
    G = sum_{v,s} grad[v,s] x[v,s]                   every trained parameter's gradient, at its
                                                     storage placement
    G_p = sum_{v,s} made[v,p] grad[v,s] x[v,s]       the gradients backward has made by the end of
                                                     phase p (with K > 1: G in every moment, the
                                                     forward's too, an upper bound: the runtime
                                                     moves them to storage after the last
                                                     micro-batch, the earlier ones' sums are in S)
    A = sum_{v,s} act[v,s] k[v,s] + sum_v c_v        activations kept for backward
    A_p = sum_{v,s} live[v,p] act[v,s] k[v,s]        those still to be read in phase p or later
          + sum_v live[v,p] c_v
    R_p = sum_{v in B} sum_s start[v,p] act[v,s] g[v,s]
          + sum_{v in B} sum_s replay[v,p] act[v,s] (j[v,s] - g[v,s])
                                                     values recomputed in backward: from
                                                     backward's start (g = x a, a below) until
                                                     their last reader, or (j = x r) from their
                                                     first reader to their last
    T_fwd >= sum_s work[v,s] x[v,s]   (forward v)    the largest working set: an op's outputs and
    T_p >= sum_s work[v,s] x[v,s]     (v in p)       the inputs no other term holds (not
                                                     parameters, buffers or the batch; in backward
                                                     not the forward values it reads, which are
                                                     saved or recomputed), each at its local size
                                                     under s
    O = sum_{v,s} param[v,s] x[v,s]                  the optimizer's temporary (param[v,s]: a
                                                     trained parameter's local bytes at storage
                                                     placement s), below

Gradients. With ``zero_grad(set_to_none=True)`` (torch's default) no gradient exists when
backward starts; each appears when backward makes it and lives until the next step's
``zero_grad``, while the activations die at their last reader. Backward runs the model's blocks
one after another (``problem.block``: a repeated layer's copy; every other node in no block), so
its phases are: 0, what runs before the first layer's backward (the loss and the head); one per
layer copy, in backward's order (nodes in no block that run among them join the phase they run
in); and last what runs after the last layer (the embeddings). A gradient is made in its
producer's phase (made[v,p] = 1 from then on); a kept forward value is live up to the last phase
that reads it, itself, through a view, or as the input of a node that may be replayed there
(live[v,p] = 1 until then: an upper bound where the plan recomputes nothing that late). The
largest backward moment is then the first phase (every activation, the head's gradients), the
last (every gradient, the first layer's activations), or one between: a tight upper bound, not
every gradient on top of every activation. Without repeated layers backward is one phase: every
gradient and every saved activation at once. In a shared problem (formulation.share) a class node
sums its copies, so made, live, start and replay are the share of its copies made or live in
phase p (one copy per layer: the phases at and after its layer's).

The optimizer step runs when backward has finished: no activation is left, every gradient is
there, and the optimizer adds its temporaries (``DeviceSpec.optimizer``, torch's AdamW):
"foreach" (torch's default on CUDA) computes sqrt(v) for every parameter at once, a temporary the
size of the parameters (O above; measured on one H200 at 8B parameters, bf16: the step's peak at
five times the parameter bytes, parameters + gradients + two moments + that temporary); the
for-loop version (torch's default on CPU) holds two such temporaries of one parameter at a time,
O >= 2 sum_s param[v,s] x[v,s] for every parameter v; "fused" holds none (O = 0).

Buckets. With one micro-batch the backward graph reduces each block's gradients as soon as the
block's last one is made (passes/bucket.py: a flat all-reduce or reduce-scatter per block, as DDP
and FSDP do), so while block b's bucket is packed it holds b's unreduced gradients and their flat
copy; the reduced result is the parameter's gradient, which G counts. That is one more working
set, in the phase that makes them:

         T_p >= sum_{grad edges e of b} sum_{q,p'} f[e,q,p'] y[e,q,p'] / n_e      (b's phase p)

(f: :func:`in_flight`, one layer copy's: n_e the copies a shared edge sums; a gradient is in its
parameter's block, :func:`bucket_of`). The last bucket, what backward makes after the last layer
(the embeddings' gradients), is reduced when no activation is left: it goes in D. A block's
parameters gathered at their uses (FSDP's reshard-after-forward; bucketed per block and phase,
passes/bucket.py) are a working set too, measured at three copies (the flat buffer being
unpacked, its pieces, and the neighbouring block's pieces still in use), in forward (T_fwd) or in
the phase of the block's backward:

         T >= 3 sum_{uses e of b, phase} sum_{q,p'} gathered[e,q,p'] y[e,q,p'] / n_e

(outside the layers the gathers of one consumer go together: T >= their gathered copies).

What backward cannot reduce that way (moves other than a summed partial to Replicate or to one
Shard, moves whose pieces differ in shape from rank to rank, and every gradient with K > 1
micro-batches, whose unreduced sums the runtime keeps and moves after the last one) it hands
over at its end, when no activation is left:

         D = sum_{e in the last bucket} sum_{q,p'} f[e,q,p'] y[e,q,p']
             + sum_{such e} sum_{q,p'} g[e,q,p'] y[e,q,p']   the gradients backward hands over,
                                                           and their copies in the runtime's flat
                                                           buckets (:func:`delivered`)

Saved activations. k[v,s] = x[v,s] keep_v, written in its tight (convex-hull) form: k[v,s] <=
x[v,s], sum_s k[v,s] = keep_v. ``keep_v`` (save v for backward) and ``r_v`` (recompute v in
backward) obey Checkmate-style validity:

    keep_u + r_u >= 1        for every forward value u that backward reads
    keep_u + r_u >= r_v      for every forward input u of a recomputed v
    keep_u >= keep_v         when v is a view of u (a saved view holds its base's memory)

unless the plan moves the view's input by a collective (on its input edge e, a pair q -> p that
communicates): the view is then of a new tensor, the moved copy, which it holds instead of its
base (what the runtime saves: :func:`resharded_view`), so the peak adds

    c_v >= sum_{q -> p moves} b[e,p] y[e,q,p] - B_v (1 - keep_v),   c_v >= 0

(b[e,p]: e's tensor's local bytes at p; B_v their largest). The rows still count the base then,
an upper bound: releasing it (keep_u >= keep_v - sum_{q -> p moves} y[e,q,p]) loosened the LP so
much that an 80-layer Llama's solve took 266 s instead of 39 s.

Recomputing v costs its compute again: sum_s c[v,s] j[v,s], j[v,s] = x[v,s] r_v in the same form,
and the resharding of its inputs again (a parameter's gather for FSDP, a tensor-parallel
all-reduce): for each input edge e of v, with R_e = sum of e's resharding terms (the resharding
rows' terms, before overlap) and M_e its largest value,

    w_e >= R_e - M_e (1 - r_v),   w_e >= 0,   objective += w_e

charged in full, exposed: the runtime issues a recomputed node's collectives in backward, in
line (exact where nothing overlaps, as on gloo; an upper bound where prefetch could hide them).

Recomputed values live in backward: torch's partitioner (``reordering_to_mimic_autograd_engine``)
replays a recomputed node just before backward first needs it, so block b's values come back
while b's backward runs and die at their last use (replay[v,p] = 1 from the phase of v's first
backward reader to its last's). B is the recomputed nodes backward reads (the ones that stay
until a backward op; the intermediates that only feed other replays die at once).

A replay runs back to the nearest saved values, so what the first backward ops read (the loss
and the head, before backward reaches a repeated layer: :func:`backward_start_reads`) brings
back, at once, every recomputed node upstream of it through recomputed nodes: recompute the
residual stream and the whole forward comes back at the start of backward (no memory saved).
a_v = 1 marks such a node, the least solution of

    a_u >= r_u                      u read by the first backward ops
    a_u >= a_v + r_u - 1            u an input of v,    a_v <= r_v

and it stays live from the start of backward to its last reader (start[v,p] = 1 until then); the
others (r_v - a_v = 1: behind a saved value, e.g. what only the saved attention output needs)
come back lazily, in their own phases.

Per-layer activation checkpointing (``recompute="full"``, :attr:`MemoryModel.recompute_all`)
recomputes every recomputable node inside the layers (from the first layer's first forward node
to the last layer's last) but the values that cross a layer's boundary, as
``torch.utils.checkpoint`` around each layer and Megatron's full recomputation do; the head and
the loss stay saved. A model without repeated layers recomputes every node it can.

Views and getitems alias their input and cost no bytes of their own; parameters and inputs are
always available; seeded random ops (dropout) are never recomputed.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Shard

from autoshard.cluster import costmodel
from autoshard.passes import rules
from autoshard.passes.annotate import META_KEY as COST_KEY, is_free, tensor_bytes
from autoshard.passes.coarsen import LAYER_KEY
from autoshard.passes.graph import META_KEY, per_strategy_list, tensor_inputs, value_of
from autoshard.passes.regions import held_fraction, moved_tensors

FORWARD = -1   # the forward pass's moment, beside backward's phases 0, 1, ...


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
    recompute_all: bool = False     # every recomputable node inside the layers recomputed but the checkpoints
    # The values that cross a repeated layer's boundary (its inputs, its output to the head). With
    # recompute_all they are saved, as per-layer activation checkpointing (Megatron's full
    # recomputation) saves them: recomputing them too would replay the whole forward at the start
    # of backward (:func:`replayed_at_start`), saving almost nothing.
    checkpoints: set = field(default_factory=set)
    inside: set = field(default_factory=set)   # forward nodes from the first layer's first to the last's last
    mesh_shape: tuple = ()
    held: list = field(default_factory=list)   # (storage, parameter, bytes): a gathered working copy
    block: dict = field(default_factory=dict)  # node -> its block (problem.block): whose backward replays it
    # a shared problem (formulation.share): a class node's terms sum its layer copies (1 when absent)
    copies: dict = field(default_factory=dict)
    alias: dict = field(default_factory=dict)  # class member -> its class node
    view_edge: dict = field(default_factory=dict)  # view -> the edge from its base, where it may reshard
    grads: list = field(default_factory=list)  # the "grad" edges: what backward hands over, and its move
    reduce_in_backward: bool = True  # one micro-batch: backward reduces each block's gradients itself
    last_bucket: set = field(default_factory=set)  # grad edges reduced after the last layer's backward
    uses: list = field(default_factory=list)   # a parameter's (or its view's) edges into its consumers
    decided: dict = field(default_factory=dict)  # node -> whether to recompute it, held fixed (api: last layer apart)
    # The moments (module docstring): backward's phases, and per phase p the share of a value live
    # (live[v][p]), replayed from its first reader (replay) or from backward's start (start), or of
    # a gradient made (made[storage][p]); ``at``: the moments an op's or an edge's working set is in
    phases: int = 1
    phase_names: list = field(default_factory=lambda: ["backward"])
    live: dict = field(default_factory=dict)
    replay: dict = field(default_factory=dict)
    start: dict = field(default_factory=dict)
    made: dict = field(default_factory=dict)
    at: dict = field(default_factory=dict)
    grad: dict = field(default_factory=dict)   # storage -> its gradient's bytes per strategy (grad[v,s])
    param: dict = field(default_factory=dict)  # storage -> a trained parameter's bytes per strategy (param[v,s])
    optimizer: str = "for-loop"                # DeviceSpec.optimizer: the optimizer step's temporaries
    # A pipeline stage holds the saved activations of several micro-batches at once (the ones
    # whose backward has not run yet: autoshard/planning/pipeline.py); H - 1 more of them than
    # the one running live in forward and in every phase of backward, beside it. The head's
    # values (``head``: forward after the last layer) only the last stage has: ``held_head`` of them
    held_batches: float = 1.0
    held_head: float = 1.0
    head: set = field(default_factory=set)

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

    def held_of(self, v) -> float:
        """Micro-batches whose saved copy of ``v`` a pipeline stage holds at once (1: no stages)."""
        return self.held_head if v in self.head else self.held_batches

    def others(self, saved: dict) -> float:
        """The saved bytes of a pipeline stage's other micro-batches in flight."""
        return sum((self.held_of(v) - 1) * b for v, b in saved.items())

    def grads_live_everywhere(self) -> bool:
        """With K > 1 micro-batches G counts in every moment (module docstring)."""
        return not self.reduce_in_backward


def _outputs_bytes(node: fx.Node) -> list[float]:
    val = node.meta["val"]
    vals = val if isinstance(val, (tuple, list)) else (val,)
    return [tensor_bytes(v) for v in vals]


def _local_outputs(node: fx.Node, mesh_shape) -> list[float]:
    sizes = _outputs_bytes(node)
    moves = moved_tensors(node)
    return [sum(costmodel.local_bytes(b, s.outputs[k] if k < len(s.outputs) else None, mesh_shape)
                * _held(moves, 0, k, s, mesh_shape) for k, b in enumerate(sizes))
            for s in node.meta[META_KEY].strategies]


def _held(moves, side: int, k: int, s, mesh_shape) -> float:
    """Of the size ``s``'s placements give the ``k``-th output (side 0) or input (side 1): the
    part a rank holds. Routed rows an expert-parallel strategy receives fill a buffer of its
    capacity, which may be less than the replicated size its placement says."""
    if moves is None or k >= len(moves[side]) or not moves[side][k]:
        return 1.0
    return held_fraction(s, mesh_shape)


def _producer(node: fx.Node) -> fx.Node:
    return value_of(node)[0]


def backward_phases(graph: fx.Graph, block: dict) -> tuple[dict[fx.Node, int], list[str]]:
    """Each backward node's phase (module docstring, "Gradients") and each phase's name: what
    runs before the first node in a block, one phase per run of a block, what runs after the
    last; a node in no block among the layers, or a view (it does no work), joins the phase it
    runs in."""
    nodes = [n for n in graph.nodes if _phase(n) == "bwd"]
    of = {n: None if is_free(n) else block.get(n) for n in nodes}
    layered = [i for i, n in enumerate(nodes) if of[n] is not None]
    if not layered:
        return dict.fromkeys(nodes, 0), ["backward"]
    first, last = layered[0], layered[-1]
    out, names, key = {}, [], None
    for i, n in enumerate(nodes):
        b = of[n]
        now = "head" if i < first else "tail" if i > last else key if b is None else ("block", b)
        if now != key:
            key = now
            name = {"head": "backward, before the layers", "tail": "backward, after the layers"}.get(
                now, f"backward of layer {now[1]}" if isinstance(now, tuple) else "")
            names.append(name if name not in names else f"{name} ({len(names)})")   # a block's second run
        out[n] = len(names) - 1
    return out, names


def _until(phases: int, last: int) -> tuple[float, ...]:
    """1 in phases 0..last, 0 after."""
    return tuple(1.0 if p <= last else 0.0 for p in range(phases))


def _between(phases: int, first: int, last: int) -> tuple[float, ...]:
    return tuple(1.0 if first <= p <= last else 0.0 for p in range(phases))


def memory_model(traced, problem, cluster, limit: float, optimizer_factor: float) -> MemoryModel:
    """optimizer_factor: optimizer-state bytes per parameter byte (Adam: 2)."""
    mesh = cluster.mesh_shape
    mm = MemoryModel(limit, mesh_shape=tuple(mesh), block=dict(problem.block),
                     reduce_in_backward=problem.micro_batches == 1, optimizer=cluster.device.optimizer)
    sized: dict = {}   # one sum per (strategy list, output sizes)

    def local_outputs(node: fx.Node) -> list[float]:
        return list(per_strategy_list(sized, node.meta[META_KEY].strategies, tuple(_outputs_bytes(node)),
                                      lambda: _local_outputs(node, mesh)))

    _storage(mm, traced, problem, local_outputs, optimizer_factor)
    if problem.micro_batches > 1:
        _accumulated_gradients(mm, problem)
    fwd = [v for v in problem.nodes if v.op == "call_function" and v.meta[COST_KEY].phase == "fwd"]
    _working_sets(mm, traced, problem, tuple(mesh))
    _activations(mm, fwd, local_outputs)
    graph = traced.gm.graph
    phase, mm.phase_names = backward_phases(graph, mm.block)
    mm.phases = len(mm.phase_names)
    reads = _backward_reads(graph, phase, set(fwd))
    mm.needed = list(reads)
    _liveness(mm, fwd, reads)
    _moments_of_moves(mm, problem, phase)
    mm.last_bucket = _last_bucket(mm, problem, graph)
    mm.view_edge = {e.dst: e for e in problem.edges
                    if e.kind == "input" and not e.aligned and e.dst is not None and mm.base_of.get(e.dst) is e.src}
    return mm


def _storage(mm: MemoryModel, traced, problem, local_outputs, optimizer_factor: float) -> None:
    """S's bytes per strategy: each parameter at its storage placement with, trained, its optimizer
    state (and G's gradient, O's temporary); the inputs and buffers; each parameter's working copy."""
    trained = {name for name, g in traced.grads.items() if g is not None}
    for name, node in traced.params:
        # at its storage placement: a frozen parameter has no gradient and no optimizer state
        st, local = problem.storage[node], local_outputs(node)
        mm.state[st] = [b * (1.0 + optimizer_factor) for b in local] if name in trained else list(local)
        if name in trained:
            mm.grad[st], mm.param[st] = list(local), list(local)
        mm.held.append((st, node, tensor_bytes(node.meta["val"])))
    for node in [*traced.inputs, *(node for _, node in traced.buffers)]:
        mm.state[node] = local_outputs(node)


def _accumulated_gradients(mm: MemoryModel, problem) -> None:
    # all but the last micro-batch keep their gradients unreduced, where backward made them
    # (a Partial gradient is a full local copy), and add the next one's into them
    for e in problem.edges:
        if e.kind == "grad":
            held = [costmodel.local_bytes(e.kept, s.outputs[e.src_out], mm.mesh_shape)  # in its own dtype
                    for s in e.src.meta[META_KEY].strategies]
            mm.state[e.src] = [a + b for a, b in zip(mm.state.get(e.src, [0.0] * len(held)), held)]


def _working_sets(mm: MemoryModel, traced, problem, mesh_shape) -> None:
    """work[v,s]: each op's working set under each strategy: its outputs and inputs, each at its
    local size under s (an input s wants whole, such as the keys and values of attention split
    by sequence, is whole here), and what the op holds beyond them (``rules.HELD``)."""
    stateful = {node for _, node in [*traced.params, *traced.buffers]} | set(traced.inputs)
    cache: dict = {}
    for v in problem.nodes:
        if v.op == "call_function":
            # inputs counted elsewhere stay out of the op's working set: parameters, buffers and
            # the batch (state), and in backward the forward values it reads (saved or recomputed)
            strategies = v.meta[META_KEY].strategies
            if v.meta[COST_KEY].bytes == 0:   # a view: it allocates nothing
                mm.work[v] = [0.0] * len(strategies)
                continue
            backward = v.meta[COST_KEY].phase == "bwd"
            first: dict[fx.Node, int] = {}
            for k, a in enumerate(tensor_inputs(v)):
                first.setdefault(a, k)
            counted = tuple((k, tensor_bytes(a.meta.get("val"))) for a, k in first.items()
                            if not (_base(a) in stateful or backward and _phase(_base(a)) == "fwd"))
            outs = tuple(_outputs_bytes(v))
            held = rules.HELD.get(v.target)
            moves = moved_tensors(v)
            mm.work[v] = list(per_strategy_list(cache, strategies, (outs, counted), lambda: [
                sum(costmodel.local_bytes(b, s.outputs[k] if k < len(s.outputs) else None, mesh_shape)
                    * _held(moves, 0, k, s, mesh_shape) for k, b in enumerate(outs))
                + sum(costmodel.local_bytes(b, s.inputs[k], mesh_shape) * _held(moves, 1, k, s, mesh_shape)
                      for k, b in counted)
                + (held(v, s, mesh_shape) if held is not None else 0.0)
                for s in strategies]))


def _activations(mm: MemoryModel, fwd: list[fx.Node], local_outputs) -> None:
    """act[v,s] of every forward value (a view's: none), the forward graph the recompute rows
    read, what may be recomputed, and per-layer checkpointing's boundaries."""
    fwd_set = set(fwd)
    for v in fwd:
        free = is_free(v)
        mm.act[v] = [0.0] * len(v.meta[META_KEY].strategies) if free else local_outputs(v)
        producers = [_producer(a) for a in tensor_inputs(v)]
        mm.inputs_of[v] = [u for u in dict.fromkeys(producers) if u in fwd_set]
        if free and mm.inputs_of[v]:
            mm.base_of[v] = mm.inputs_of[v][0]
        if not _is_random(v):
            mm.recomputable.append(v)
    layer = lambda n: (n.meta.get(LAYER_KEY) or (None, None))[1]  # noqa: E731 - its copy, unpooled
    mm.checkpoints = {v for v in fwd if any(u in fwd_set and layer(u) != layer(v) for u in _consumers(v))}
    layered = [i for i, v in enumerate(fwd) if mm.block.get(v) is not None]
    mm.inside = set(fwd[layered[0]:layered[-1] + 1]) if layered else set(fwd)   # no layers: all of it
    mm.head = set(fwd[layered[-1] + 1:]) if layered else set()


def _backward_reads(graph: fx.Graph, phase: dict, fwd_set: set) -> dict[fx.Node, list[int]]:
    """Forward value -> the phases of the backward ops reading it."""
    reads: dict[fx.Node, list[int]] = {}
    for n in graph.nodes:
        if n in phase:
            for a in tensor_inputs(n):
                u = _producer(a)
                if u in fwd_set:
                    reads.setdefault(u, []).append(phase[n])
    return reads


def _moments_of_moves(mm: MemoryModel, problem, phase: dict) -> None:
    """The moments of the gradients' and parameter uses' moves: a gradient is made (made[v,p]) and
    in flight in its producer's phase, a parameter is gathered in its consumer's."""
    mm.grads = [e for e in problem.edges if e.kind == "grad"]
    for e in mm.grads:
        made = phase.get(e.src, 0)
        mm.made[e.dst] = tuple(1.0 if p >= made else 0.0 for p in range(mm.phases))
        mm.at[e] = frozenset({made})
    mm.uses = [e for e in problem.edges if e.kind == "input" and e.overlap]
    for e in mm.uses:
        mm.at[e] = frozenset({phase.get(e.dst, FORWARD)})
    for v in mm.work:
        mm.at[v] = frozenset({phase.get(v, FORWARD)})


def _last_bucket(mm: MemoryModel, problem, graph: fx.Graph) -> set:
    """Gradients of parameters outside the layers that backward makes after the last layer (the
    embeddings'): their bucket is reduced when no activation is left."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    last = max((order[n] for n in order if n.op == "call_function" and _phase(n) == "bwd"
                and problem.block.get(n) is not None), default=None)
    return {e for e in mm.grads if last is not None and problem.block.get(e.dst.param) is None
            and order.get(e.src, -1) > last}


def _liveness(mm: MemoryModel, fwd: list[fx.Node], reads: dict[fx.Node, list[int]]) -> None:
    """live, replay and start of every forward value (module docstring): the phases that read it,
    itself or through its views, and, kept, the last phase in which a node it feeds may be
    replayed (forward nodes in reverse: every consumer and view comes before what it reads)."""
    seen: dict[fx.Node, list[int]] = {v: list(reads.get(v, [])) for v in fwd}   # own and views' reads
    until: dict[fx.Node, int] = {}
    later: dict[fx.Node, int] = {}    # the last phase a consumer's replay or a view needs it
    recomputable = set(mm.recomputable)
    for v in reversed(fwd):
        until[v] = max([*seen[v], later.get(v, FORWARD)])
        if v in mm.base_of:
            base = mm.base_of[v]
            seen[base] += seen[v]
            later[base] = max(later.get(base, FORWARD), until[v])
        if v in recomputable:
            for u in mm.inputs_of.get(v, []):
                later[u] = max(later.get(u, FORWARD), until[v])
    for v in fwd:
        mm.live[v] = _until(mm.phases, until[v])
        if seen[v]:
            mm.replay[v] = _between(mm.phases, min(seen[v]), max(seen[v]))
            mm.start[v] = _until(mm.phases, max(seen[v]))


def _consumers(node: fx.Node) -> list[fx.Node]:
    """The ops reading ``node``'s outputs, through the getitems of a multi-output op."""
    return [w for u in node.users for w in (_consumers(u) if u.target is operator.getitem else [u])]


def _base(node: fx.Node) -> fx.Node:
    """The tensor whose storage ``node`` reads: through getitems and views (backward's transpose
    of a saved input is that input)."""
    u = _producer(node)
    while u.op == "call_function" and is_free(u) and tensor_inputs(u):
        u = _producer(tensor_inputs(u)[0])
    return u


def _phase(node: fx.Node) -> str | None:
    cost = node.meta.get(COST_KEY)
    return cost.phase if cost is not None and node.op == "call_function" else None


def _is_random(node: fx.Node) -> bool:
    """Seeded random ops (dropout, bernoulli, ...) are never replayed: the rewrite saves them."""
    return torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def moved_copy(mm: MemoryModel, v: fx.Node, q, p) -> float | None:
    """Bytes view v holds of its own when its input moves from placement q to p: a collective's
    result is a new tensor, which the view holds instead of its base; None when it aliases its base."""
    e = mm.view_edge[v]
    return mm.copies.get(v, 1) * costmodel.local_bytes(e.nbytes, p, mm.mesh_shape) if costmodel.communicates(q, p) else None


def resharded_view(mm: MemoryModel, v: fx.Node, choice: dict | None) -> float | None:
    """:func:`moved_copy` under the plan ``choice``."""
    e = mm.view_edge.get(v)
    if e is None or choice is None:
        return None
    return moved_copy(mm, v, e.src.meta[META_KEY].strategies[choice[e.src]].outputs[e.src_out], e.dst_in[choice[v]])


def saved_for_backward(mm: MemoryModel, recompute: set, choice: dict | None = None) -> list[fx.Node]:
    """The forward nodes whose outputs stay in memory until backward (views resolved to their
    base, unless ``choice`` reshards the view's input: :func:`resharded_view`)."""
    saved: dict[fx.Node, None] = {}

    def hold(u: fx.Node) -> None:
        while u in mm.base_of and resharded_view(mm, u, choice) is None:  # a view keeps its base alive
            u = mm.base_of[u]
        saved.setdefault(u)

    for u in mm.needed:
        if u not in recompute:
            hold(u)
    for v in sorted(recompute):   # graph order, not the set's (its hash is the node's address)
        for u in mm.inputs_of.get(v, []):
            if u not in recompute:
                hold(u)
    return list(saved)


def rematerialized(mm: MemoryModel) -> list[fx.Node]:
    """Recomputable nodes whose recomputed value stays live in backward: backward reads it, or a
    view of it (the view holds its base's bytes)."""
    read = set()
    for u in mm.needed:
        read.add(u)
        while u in mm.base_of:
            u = mm.base_of[u]
            read.add(u)
    return [v for v in mm.recomputable if v in read]


def backward_start_reads(nodes, block: dict) -> list[fx.Node]:
    """Forward values read by the backward ops that run before backward reaches a repeated layer
    (a node with a ``block``): the loss's and the head's backward. Without repeated layers, the
    first backward op's alone (nothing marks where the head ends; later replays are taken to
    run lazily, as the partitioner runs them)."""
    graph = next((n.graph for n in nodes if isinstance(n, fx.Node)), None)
    backward = [n for n in ([] if graph is None else graph.nodes)
                if n.op == "call_function" and COST_KEY in n.meta and n.meta[COST_KEY].phase == "bwd"]
    # a shared problem's blocks name its representatives only: the other copies' by their layer mark
    of = lambda n: block[n] if n in block else (n.meta.get(LAYER_KEY) or (None, None))[1]  # noqa: E731
    layered = any(of(n) is not None for n in backward)
    out: dict[fx.Node, None] = {}   # in graph order: the ILP's rows follow it (plans must not follow id())
    for i, n in enumerate(backward):
        if of(n) is not None or (i > 0 and not layered):
            break
        out.update(dict.fromkeys(u for u in map(_producer, tensor_inputs(n))
                                 if u.op == "call_function" and COST_KEY in u.meta and u.meta[COST_KEY].phase == "fwd"))
    return list(out)


def replayed_at_start(mm: MemoryModel, recompute: set) -> set[fx.Node]:
    """The a_v = 1 nodes (module docstring): the least solution, from the seeds up the inputs
    (a shared problem's class graph may have cycles: a block's output feeds its own class)."""
    todo = [u for u in dict.fromkeys(mm.alias.get(u, u) for u in backward_start_reads(mm.recomputable, mm.block))
            if u in recompute]
    on: set[fx.Node] = set(todo)
    while todo:
        v = todo.pop()
        for u in mm.inputs_of.get(v, []):
            if u in recompute and u not in on:
                on.add(u)
                todo.append(u)
    return on


def recomputed_live(mm: MemoryModel, choice: dict, recompute: set) -> float:
    """Bytes of recomputed values live at once in backward: the largest R_p (module docstring)."""
    per = _replays(mm, choice, recompute)
    return max((sum(b * vec[p] for b, vec in per) for p in range(mm.phases)), default=0.0)


def _replays(mm: MemoryModel, choice: dict, recompute: set) -> list[tuple[float, tuple]]:
    """(bytes, the phases it is live in) of every recomputed value backward reads: from the start
    of backward (a_v = 1) or from its first reader (module docstring)."""
    start = replayed_at_start(mm, recompute)
    return [(mm.act[v][choice[v]], mm.start[v] if v in start else mm.replay[v])
            for v in rematerialized(mm) if v in recompute and v in mm.act]


def recompute_resharding(problem, cluster, choice: dict, recompute: set) -> float:
    """Seconds of resharding run again in backward for the recomputed nodes' inputs:
    sum over input edges e of recomputed nodes of weight_e * resharding time (the objective's
    w_e at their optimum; ``choice``: node -> strategy index, as a Solution holds it)."""
    total = 0.0
    for e in problem.edges:
        if e.kind != "input" or e.aligned or e.dst not in recompute:
            continue
        src = e.src.meta[META_KEY].strategies[choice[e.src]].outputs[e.src_out]
        dst = e.dst_in[choice[e.dst]]
        total += e.weight * costmodel.resharding_time(cluster, src, dst, e.moved_bytes(src, dst),
                                                      e.in_bucket(src, dst, cluster.mesh_shape))
    return total


def saved_bytes(mm: MemoryModel, choice: dict, recompute: set) -> dict[fx.Node, float]:
    """Bytes of each output saved for backward under the plan."""
    out = {}
    for u in saved_for_backward(mm, recompute, choice):
        own = resharded_view(mm, u, choice)
        out[u] = own if own is not None else mm.act[u][choice[u]] if u in mm.act else 0.0
    return out


def working_copies(mm: MemoryModel, choice: dict, mesh_shape) -> float:
    """Bytes of the parameters gathered once per step and kept (working placement != storage)."""
    total = 0.0
    for st, p, nbytes in mm.held:
        have = st.meta[META_KEY].strategies[choice[st]].outputs[0]
        want = p.meta[META_KEY].strategies[choice[p]].outputs[0]
        if have != want:
            total += costmodel.local_bytes(nbytes, want, mesh_shape)
    return total


def in_backward(mm: MemoryModel, e, q, p) -> bool:
    """Whether backward itself reduces gradient edge ``e`` moving from q to its storage placement
    p (the module docstring's "Buckets"): a bucketable move whose pieces are alike on every rank
    (autoshard/collectives.py: bucketable); an uneven one is handed over and moved after backward."""
    return mm.reduce_in_backward and e.in_bucket(q, p, mm.mesh_shape)


def in_flight(mm: MemoryModel, e, q, p) -> float:
    """Bytes one layer copy of gradient edge ``e`` holds while backward packs its block's bucket,
    when backward reduces it (:func:`in_backward`): the unreduced gradient (local, at q) and its
    copy in the flat bucket (in the wire dtype). The reduced result is the parameter's gradient."""
    if not in_backward(mm, e, q, p):
        return 0.0
    return costmodel.local_bytes(e.kept, q, mm.mesh_shape) + costmodel.local_bytes(e.moved_bytes(q, p), q, mm.mesh_shape)


def delivered(mm: MemoryModel, e, q, p) -> float:
    """Bytes gradient edge ``e`` holds at the end of backward when backward hands it over
    unreduced (not :func:`in_backward`) to move from placement q to its storage placement p: the
    gradient (local, at q) and, when that moves, its copy in the runtime's flat bucket (in the
    wire dtype) and a reduce-scatter's result (at p); an all-reduce sums in place (autoshard/collectives.py:
    to_storage_many). Where q is p the gradient handed over is the parameter's, counted in G."""
    if q == p or in_backward(mm, e, q, p):
        return 0.0
    held = costmodel.local_bytes(e.kept, q, mm.mesh_shape)
    if costmodel.communicates(q, p):
        held += costmodel.local_bytes(e.moved_bytes(q, p), q, mm.mesh_shape)
        if any(isinstance(a, Partial) and isinstance(b, Shard) for a, b in zip(q, p)):
            held += costmodel.local_bytes(e.kept, p, mm.mesh_shape)
    return e.weight * held


def _edge_placements(e, choice: dict):
    """(source, destination) placements of edge ``e`` under the plan ``choice``."""
    return e.src.meta[META_KEY].strategies[choice[e.src]].outputs[e.src_out], e.dst_in[choice[e.dst]]


def end_of_backward(mm: MemoryModel, choice: dict) -> float:
    """D (module docstring): bytes beyond S and G at the end of backward, when no activation is
    left: the last bucket backward reduces (:func:`in_flight`), every gradient it hands over
    unreduced, and the buckets that move them (:func:`delivered`)."""
    return sum(delivered(mm, e, *_edge_placements(e, choice))
               + (in_flight(mm, e, *_edge_placements(e, choice)) if e in mm.last_bucket else 0.0)
               for e in mm.grads)


END = "end of backward"   # bucket_of's name for the bucket reduced when no activation is left


def bucket_of(mm: MemoryModel, e) -> object:
    """The block whose bucket reduces gradient edge ``e``: its parameter's (the runtime buckets a
    parameter's gradient with its layer's, wherever backward sums it), or END for what backward
    makes after the last layer (the runtime buckets consecutive gradients of one block)."""
    return END if e in mm.last_bucket else mm.block.get(e.dst.param, e.block)


def _largest(pairs) -> float:
    """The largest sum of bytes over [(key, bytes)] by key."""
    per: dict[object, float] = {}
    for key, nbytes in pairs:
        per[key] = per.get(key, 0.0) + nbytes
    return max(per.values(), default=0.0)


GATHERED_COPIES = 3   # a block's gathered parameters: their flat buffer, its pieces, the neighbour's


def gathered(mm: MemoryModel, e, q, p) -> float:
    """Bytes of the copy a parameter use ``e`` (one of :attr:`MemoryModel.uses`) gathers when
    the consumer needs placement p of the parameter's q (FSDP's reshard-after-forward); one
    layer copy's."""
    return costmodel.local_bytes(e.nbytes, p, mm.mesh_shape) if costmodel.communicates(q, p) else 0.0


def gather_of(mm: MemoryModel, e) -> tuple[tuple, int]:
    """The bucket a parameter use's gather goes in, and the copies it holds: in a layer, its
    consumer's block (one layer copy's) and phase (passes/bucket.py gathers a block's parameters
    at once in forward, and again in backward), GATHERED_COPIES; outside the layers the uses
    of one consumer together (a norm's weight and bias), one copy (the gathers' results)."""
    block, phase = mm.block.get(e.dst), e.dst.meta[COST_KEY].phase
    return ((block, phase), GATHERED_COPIES) if block is not None else ((e.dst, phase), 1)


def transient(mm: MemoryModel, choice: dict) -> dict[int, float]:
    """T of every moment (FORWARD, then each backward phase): the largest working set there, an
    op's, a block's gradients in flight or a block's gathered parameters (module docstring)."""
    ops: dict[int, float] = {}
    buckets: dict[int, list] = {}
    gathers: dict[int, list] = {}
    for v, work in mm.work.items():
        for t in mm.at.get(v, ()):
            ops[t] = max(ops.get(t, 0.0), work[choice[v]])
    for e in mm.grads:
        if e not in mm.last_bucket:
            for t in mm.at.get(e, ()):
                buckets.setdefault(t, []).append((bucket_of(mm, e), in_flight(mm, e, *_edge_placements(e, choice))))
    for e in mm.uses:
        key, copies = gather_of(mm, e)
        for t in mm.at.get(e, ()):
            gathers.setdefault(t, []).append((key, copies * gathered(mm, e, *_edge_placements(e, choice))))
    return {t: max(ops.get(t, 0.0), _largest(buckets.get(t, [])), _largest(gathers.get(t, [])))
            for t in [FORWARD, *range(mm.phases)]}


def optimizer_temporary(mm: MemoryModel, choice: dict) -> float:
    """O (module docstring): foreach AdamW's sqrt(v) of every parameter, the for-loop version's
    two temporaries of its largest parameter (one copy of a shared class), fused AdamW's none."""
    local = {st: mm.param[st][choice[st]] for st in mm.param}
    if mm.optimizer == "foreach":
        return sum(local.values())
    if mm.optimizer == "for-loop":
        return 2 * max((b / mm.copies.get(st, 1) for st, b in local.items()), default=0.0)
    return 0.0


PARTS = ("state", "grads", "optimizer_step", "activations", "recomputed", "transient", "grad_delivery")


class Breakdown(dict):
    """Bytes per device of the peak moment by part (:data:`PARTS`; they sum to the peak);
    ``moment``, its name: "forward", a backward phase's, "end of backward" or "optimizer step";
    ``saved``, the bytes forward saves for backward (A, all live when forward ends), and
    ``saved_by_node`` those bytes by the node that made them (:func:`saved_bytes`)."""

    def __init__(self, parts: dict[str, float], moment: str, saved: float = 0.0,
                 saved_by_node: dict | None = None):
        super().__init__(parts)
        self.moment, self.saved, self.saved_by_node = moment, saved, saved_by_node or {}


def moments(mm: MemoryModel, choice: dict[fx.Node, int], recompute: set) -> dict[str, dict[str, float]]:
    """Every moment of the step (module docstring) by part: the bytes the runtime will hold,
    which the ILP's rows bound from above (its slack variables may sit anywhere below the limit)."""
    state = sum(mm.state[v][choice[v]] for v in mm.state) + working_copies(mm, choice, mm.mesh_shape)
    grads = {st: mm.grad[st][choice[st]] for st in mm.grad}
    full = sum(grads.values())
    everywhere = mm.grads_live_everywhere()
    saved = saved_bytes(mm, choice, recompute)
    replays = _replays(mm, choice, recompute)
    temp = transient(mm, choice)

    def parts(**some: float) -> dict[str, float]:
        return {k: state if k == "state" else some.get(k, 0.0) for k in PARTS}

    others = mm.others(saved)
    out = {"forward": parts(grads=full if everywhere else 0.0, activations=sum(saved.values()) + others,
                            transient=temp[FORWARD])}
    for p, name in enumerate(mm.phase_names):
        out[name] = parts(grads=full if everywhere else sum(b * mm.made[st][p] for st, b in grads.items()),
                          activations=sum(b * mm.live[u][p] for u, b in saved.items()) + others,
                          recomputed=sum(b * vec[p] for b, vec in replays), transient=temp[p])
    out[END] = parts(grads=full, grad_delivery=end_of_backward(mm, choice))
    out["optimizer step"] = parts(grads=full, optimizer_step=optimizer_temporary(mm, choice))
    return out


def predicted_memory(mm: MemoryModel, choice: dict[fx.Node, int], recompute: set) -> Breakdown:
    """The peak a chosen plan needs: its largest moment (:func:`moments`; the first of equal ones),
    by part."""
    every = moments(mm, choice, recompute)
    name = max(every, key=lambda k: sum(every[k].values()))
    saved = saved_bytes(mm, choice, recompute)
    return Breakdown(every[name], name, sum(saved.values()), saved)


def timeline(mm: MemoryModel, graph: fx.Graph, choice: dict[fx.Node, int], recompute: set) -> list[tuple[str, float]]:
    """Predicted per-device bytes held after each node: S, the gradients backward has made so far
    (all of them with K > 1), each saved activation from its forward node until its last backward
    reader, each recomputed value from its block's first backward reader of one (where the replay
    runs) until its own last backward reader, and that op's working set (with a pipeline stage's
    held micro-batches, their saved activations throughout); last the optimizer step."""
    from autoshard.passes.graph import value_of

    state = sum(mm.state[v][choice[v]] for v in mm.state) + working_copies(mm, choice, mm.mesh_shape)
    full = sum(mm.grad[st][choice[st]] for st in mm.grad)
    made = {e.src: mm.grad[e.dst][choice[e.dst]] for e in mm.grads if e.dst in mm.grad}
    grads = full if mm.grads_live_everywhere() else 0.0
    saved = saved_bytes(mm, choice, recompute)
    state += mm.others(saved)   # a pipeline stage's other micro-batches, throughout
    replayed = {v for v in rematerialized(mm) if v in recompute and v in mm.act}
    size = {v: mm.act[v][choice[v]] / mm.copies.get(v, 1) for v in replayed}
    last_use: dict[fx.Node, fx.Node] = {}
    first_replay: dict[object, fx.Node] = {}   # block -> where its backward replays its values
    for n in graph.nodes:
        backward = n.op == "call_function" and COST_KEY in n.meta and n.meta[COST_KEY].phase == "bwd"
        for a in n.all_input_nodes:
            u = value_of(a)[0]
            if backward and u in replayed:
                first_replay.setdefault(mm.block.get(u), n)
                last_use[u] = n
            while u in mm.base_of and u not in saved:
                u = mm.base_of[u]
            if u in saved:
                last_use[u] = n
    frees: dict[fx.Node, list[fx.Node]] = {}
    for u, n in last_use.items():
        frees.setdefault(n, []).append(u)
    starts: dict[fx.Node, list[fx.Node]] = {}
    for v in replayed:
        if mm.block.get(v) in first_replay:
            starts.setdefault(first_replay[mm.block.get(v)], []).append(v)
    live, out = 0.0, []
    for n in graph.nodes:
        if n.op != "call_function" or n not in choice:
            continue
        live += saved.get(n, 0.0)
        live += sum(size[v] for v in starts.get(n, []))
        if not mm.grads_live_everywhere():
            grads += made.get(n, 0.0)
        work = mm.work.get(n, [0.0] * (choice[n] + 1))[choice[n]]
        out.append((n.name, state + grads + live + work))
        for u in frees.get(n, []):
            live -= size[u] if u in replayed else saved[u]
    out.append(("optimizer step", state - mm.others(saved) + full + optimizer_temporary(mm, choice)))
    return out
