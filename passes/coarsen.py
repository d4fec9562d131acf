"""coarsen: shrink the sharding ILP. Followers take their producer's layout; repeated layers share
one set of decisions.

Followers (:func:`mark_followers`). An op *follows* one of its tensor inputs when the edge from
that input is *aligned* (solver/formulation.py): the op takes the placement the input arrives in,
or a free slice of it (a replicated dim sharded), and the edge needs no flow variables. Followers
are the elementwise ops with a single user:

* elementwise ops of one input, casts (``aten._to_copy``) included;
* in backward, elementwise ops of several inputs, following the largest (the first on ties).

An input qualifies only when the op accepts every placement its producer can output, so no
producer choice is cut off. What the merge gives up, and why these and no others:

* one input, one user: nothing in bytes. A resharding before the op can move to the edge after
  it and carries the same data (the same collective on the same dims; a cast's is narrower);
  the op computes on a slice when its input is replicated.
* several users: moving the resharding past the op would repeat it on every user (a ReLU whose
  output feeds the next convolution and its own backward). Not merged.
* several inputs: which input moves to meet the others is fixed (the smaller ones). In forward
  that joins two streams whose producers want different layouts (a residual add after a
  channel-sharded BatchNorm): not merged. In backward the followed input is the gradient being
  carried, the others saved values; there the optimum did not change on the zoo.
* views (``t``, ``view``, ``transpose``, ...): not merged, though the same argument holds for
  bytes. The edge after a view is often of another kind than the one before it: a weight's
  gradient is ``t(mm(...))``, and a move after the ``t`` is the gradient's move to storage,
  bucketed and overlapped, which a two-dim move cannot fully be (costmodel.bucket_move), while a
  move before it is on the critical path. With views as followers the plan could not split such
  a move in two (one dim in the graph, one in the bucket). Measured on Llama-3-8B shapes on 8x8
  H100s (8 layers at 18 GB, 32 at 40 and 54 GB, 80 at 40 GB), views as followers gave plans
  0.3-2.4% slower and solves 1.3-2.5x longer, although the ILP had 16% fewer columns.

Measured (objective with vs without followers): equal within the solver's 0.1% gap on those
Llama shapes (8 layers at 18 GB, 32 and 80 at 40 GB) and on the models of tests/test_coarsen.py,
which bounds the difference at 1%; the small Llama's ILP there has about 20% fewer columns.
``plan(followers=False)`` gives every op its own choice.

Facts go to ``node.meta["autoshard.follows"]``: the index (in ``tensor_inputs`` order) of the
input the node follows.

Repeated layers (:func:`repeated_layers`).
A transformer's joint graph is a prefix, L copies of one block's forward, a middle, L copies of
its backward and a suffix. Each decision node gets a *token* (op, shapes, dtypes, non-tensor
arguments and its list of strategies); in each phase, the token that occurs most regularly
(equal spacing p, c times) marks the period, and positions ``b + j*p + i`` (j < c) whose tokens
all agree form one class ``i``. Parameters join the class of their consumer slot. Structure is
read from the graph alone, never from module names.

Merging is a restriction (members must choose alike), exact in cost: every edge, memory term
and recompute keeps its own numbers (solver/formulation.py's ``share`` sums them). Facts go to
``node.meta["autoshard.layer"]``: (class representative, index of the block copy the node is in).
Copies are numbered by layer in both passes (backward runs them last to first), so a block is
one layer's forward, backward, parameters and gradients; the representative is copy 0.

What sharing gives up is granularity: under a memory cap the exact plan may treat some layers
unlike the others (backward starts with the last layer at the peak), and a shared one moves all
copies at once. That step is coarsest in a short stack: a 2-layer GPT at 0.7 of its free peak
came out 1.09% slower than the exact plan (the exact one shards the last layer's MLP otherwise).
So a stack of at most ``api.LAST_LAYER_APART`` layers has its last layer decided again after
the shared solve, everything else held (leaving that GPT 0.14% off). Deeper stacks gained at
most 0.17% from it (Llama-3-8B shapes, 8-80 layers, on 8x8 H100s) for 2-9 s more solving, and
skip it.

Example::

    >>> rep = repeated_layers(traced)            # 12-layer GPT: 12 members per class
    >>> sum(1 for n, r in rep.items() if n is not r) / len(rep)
    0.87
"""

from __future__ import annotations

from collections import Counter, defaultdict

import torch
import torch.fx as fx

from autoshard.passes.annotate import META_KEY as COST_KEY, is_free
from autoshard.passes.graph import META_KEY, args_key, tensor_inputs, value_of

LAYER_KEY = "autoshard.layer"
FOLLOW_KEY = "autoshard.follows"
_CASTS = (torch.ops.aten._to_copy.default,)  # elementwise, though not tagged so (the policy's casts)


def _placements_out(node: fx.Node) -> set:
    producer, k = value_of(node)
    return {s.outputs[k] for s in producer.meta[META_KEY].strategies}


def mark_followers(traced) -> dict[fx.Node, int]:
    """node -> index of the tensor input it follows (see the module doc), for every follower."""
    out: dict[fx.Node, int] = {}
    for node in traced.gm.graph.nodes:
        node.meta.pop(FOLLOW_KEY, None)
        ns = node.meta.get(META_KEY)
        if node.op != "call_function" or ns is None or ns.alias_of is not None:
            continue
        args = tensor_inputs(node)
        if len(node.users) != 1:  # moving a resharding past the op could multiply it by its fan-out
            continue
        if is_free(node) or not args or not (torch.Tag.pointwise in getattr(node.target, "tags", ())
                                             or node.target in _CASTS):  # views: see the module doc
            continue
        if len(args) > 1 and node.meta[COST_KEY].phase != "bwd":  # a forward join: see the module doc
            continue
        numel = [a.meta["val"].numel() if isinstance(a.meta.get("val"), torch.Tensor) else -1 for a in args]
        i = max(range(len(args)), key=lambda j: (numel[j], -j))
        if value_of(args[i])[0].meta.get(META_KEY) is None:
            continue
        accepted = {s.inputs[i] for s in ns.strategies}
        if _placements_out(args[i]) <= accepted:
            out[node] = node.meta[FOLLOW_KEY] = i
    return out


def _from_input(a: fx.Node) -> bool:
    """Whether ``a`` is a graph input, or views of one."""
    while a.op == "call_function" and is_free(a) and tensor_inputs(a):
        a = tensor_inputs(a)[0]
    return a.op == "placeholder"


def _token(node: fx.Node, signatures: dict) -> tuple:
    def shape(v):
        return (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None

    val = node.meta.get("val")
    outs = tuple(shape(v) for v in (val if isinstance(val, (tuple, list)) else (val,)))
    # nodes (also inside lists, e.g. cat's) by shape, and whether they are graph inputs (a weight,
    # maybe through views) or computed: their names differ from layer to layer, their kind does not
    args = repr(args_key((node.args, node.kwargs), lambda a: (shape(a.meta.get("val")), _from_input(a))))
    strategies = node.meta[META_KEY].strategies
    if id(strategies) not in signatures:  # lists are shared between identical nodes
        signatures[id(strategies)] = (strategies, hash(tuple(s.text for s in strategies)))
    return (str(node.target), outs, args, signatures[id(strategies)][1])


def _period(tokens: list) -> tuple[int, int, int] | None:
    """(first position, period, count) of the most regular token, by coverage count * period."""
    positions = defaultdict(list)
    for i, t in enumerate(tokens):
        positions[t].append(i)
    best = None
    for pos in positions.values():
        if len(pos) < 2:
            continue
        gaps = {b - a for a, b in zip(pos, pos[1:])}
        if len(gaps) == 1:
            (p,) = gaps
            cand = (len(pos) * p, -p, pos[0], len(pos))
            best = max(best, cand) if best else cand
    if best is None:
        return None
    _, neg_p, first, count = best
    return first, -neg_p, count


def _classes(nodes: list[fx.Node], token) -> dict[fx.Node, fx.Node]:
    tokens = [token(n) for n in nodes]
    found = _period(tokens)
    rep: dict[fx.Node, fx.Node] = {}
    if found is None:
        return rep
    first, p, count = found
    # the block start: the alignment whose offsets agree across all copies most often
    lo = max(0, first - p + 1)
    same = [all(t + j * p < len(nodes) and tokens[t + j * p] == tokens[t] for j in range(count))
            for t in range(lo, first + p)]  # position t's token recurs in every copy

    def agree(b: int) -> list[int]:
        return [i for i in range(p) if same[b + i - lo]]

    b = max(range(lo, first + 1), key=lambda b: (len(agree(b)), -b))
    if len(agree(b)) == 1 and len({(nodes[b + j * p + agree(b)[0]].args, str(nodes[b + j * p + agree(b)[0]].kwargs))
                                    for j in range(count)}) == 1:
        # one op computed again on the same inputs (a decomposed loss's difference, for its
        # forward and again for its backward) is a repeated computation, not a repeated layer:
        # each its own class (dropped below), out of the next rounds' search
        return {nodes[b + j * p + agree(b)[0]]: nodes[b + j * p + agree(b)[0]] for j in range(count)}
    for i in agree(b):
        head = nodes[b + i]
        for j in range(count):
            rep[nodes[b + j * p + i]] = head
    return rep


def repeated_layers(traced) -> dict[fx.Node, fx.Node]:
    """member -> representative, for every decision node in a repeated block (and its parameters)."""
    gm = traced.gm
    rep: dict[fx.Node, fx.Node] = {}
    signatures: dict[int, tuple] = {}  # id(strategy list) -> (the list, kept alive; its hash)
    tokens: dict[fx.Node, tuple] = {}   # a node's token, once for all rounds

    def token(n: fx.Node) -> tuple:
        if n not in tokens:
            tokens[n] = _token(n, signatures)
        return tokens[n]
    for phase in ("fwd", "bwd"):
        nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.meta[META_KEY].alias_of is None
                 and n.meta[COST_KEY].phase == phase]
        # Autograd interleaves some per-layer nodes (bias gradients, concatenations) irregularly;
        # a few more rounds over what is left catch their own periods.
        for _ in range(4):
            found = _classes([n for n in nodes if n not in rep], token)
            if not found:
                break
            rep.update(found)
    heads = {r for n, r in rep.items() if n is not r}
    rep = {n: r for n, r in rep.items() if n is not r or n in heads}   # a class of one is none
    # Parameters: those read only by class members, at the same (class, argument) slots, form a
    # class of their own.
    params = {node for _, node in traced.params}
    slot: dict[fx.Node, set] = defaultdict(set)
    for n, r in rep.items():
        for k, a in enumerate(tensor_inputs(n)):
            if a in params:
                slot[a].add((r, k))
    by_slot: dict[frozenset, list[fx.Node]] = defaultdict(list)
    for param, slots in slot.items():
        if all(u in rep for u in param.users):
            by_slot[frozenset(slots)].append(param)
    for members in by_slot.values():
        sig = Counter(str(s) for s in members[0].meta[META_KEY].strategies)
        same = [m for m in members if Counter(str(s) for s in m.meta[META_KEY].strategies) == sig
                and tuple(m.meta["val"].shape) == tuple(members[0].meta["val"].shape)]
        if len(same) > 1:
            for m in same:
                rep[m] = same[0]
    # node.meta[LAYER_KEY] = (representative, which copy of the block this node is in)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    members: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    for n, r in rep.items():
        members[r].append(n)
    for r, ms in members.items():
        ms = sorted(ms, key=order.__getitem__)
        if r.op == "call_function" and r.meta[COST_KEY].phase == "bwd":
            ms.reverse()  # backward runs the copies last to first: copy j is layer j in every phase
        for j, n in enumerate(ms):
            rep[n] = ms[0]
            n.meta[LAYER_KEY] = (ms[0], j)
    return rep
