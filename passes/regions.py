"""regions: token-local regions, the part of a Mixture-of-Experts layer that each rank may run on
its own tokens.

A grouped-GEMM MoE layer (transformers' ``grouped_mm`` experts) sorts the flattened token-expert
pairs of the *whole* batch by expert (``aten.sort``), gathers the tokens in that order, counts
each expert's rows (``histc``, ``cumsum``), runs one GEMM per expert over its run of rows
(``_grouped_mm`` with offsets) and scatters the results back to token order. No op in the middle
has a sharded DTensor rule (a shard of a globally sorted tensor is not what a rank can compute),
so the routed tensors (tokens x top-k rows) would be whole on every rank. But routing is per
token: when each rank sorts, gathers, multiplies and scatters back only its own tokens, the
layer's output rows, its input gradient rows and its expert-weight gradients (partial sums over
tokens) are exactly the shards of the single-device ones. Expert-parallel MoE runs do the same
before their all-to-all.

:func:`find_regions` finds such regions by following what each tensor means from the sort on:

* *order*: ``sorted`` (rows in the rank's local expert order) or ``token`` (rows in token order);
* *values*: ``plain`` data, ``tok`` (local token positions: the sort's permutation, ``// top_k``)
  or ``pos`` (local sorted positions: the inverse permutation);
* a ``table`` (per-expert counts and offsets of the rank's own rows).

Gathers (``index``), scatters (``index_put``), the sort, the counts and the grouped GEMM have
rules for each combination that keeps the meaning exact; any other op touching a region tensor
must be row-wise (DTensor's own rule maps the token axis through it). A tensor leaves the region
only in token order with plain values (a shard) or as a sum over tokens (a partial); anything
else makes the region invalid, and it is left to the ordinary rules (replicated routing), with a
warning naming the op.

Facts go to ``node.meta["autoshard.region"]``: a :class:`TokenLocal` per region node, giving the
placement each of its tensors takes on a mesh dim the region splits tokens over.

Expert parallelism: a region may instead split its experts over one of those dims
(passes/rules/experts.py): each rank holds some experts whole and receives their rows from every
rank. The routed rows a gather or scatter puts into expert order are *moved* (sent to their
experts' ranks), and so is every row tensor computed from them, up to the gathers and scatters
back to token order, which receive them back; the sort's own ids and positions stay the rank's.
Each fact also gives its tensors' placements on such a dim (``ep_outputs``, ``ep_inputs``): a
moved tensor is ``Replicate`` there (a rank may receive every rank's rows), the experts' weights
and their gradients split by expert. :func:`ep_strategies` turns them into strategies of variant
``ep<d>``; a region whose ops mix moved rows with the rank's own sorted rows gets none. With a
capacity ``c`` (variant ``ep<d>@<c>``) a rank's moved tensors hold ``c`` times its own rows
instead of every rank's: :func:`received_rows` sizes them, :func:`held_fraction` tells the memory
model and the prices what part of the replicated size that is.
"""

from __future__ import annotations

import math
import operator
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard

from autoshard import _torch
from autoshard.passes.dtensor_rules import placements_through
from autoshard.passes.graph import picked_output, tensor_inputs

META_KEY = "autoshard.region"

aten = torch.ops.aten
_SORTS = (aten.sort.default, aten.sort.stable)
_CASTS = (aten._to_copy.default, torch.ops.prims.convert_element_type.default)
_DISPATCH = (aten.histc.default, aten._grouped_mm.default)
_BUFFERS = (aten.new_zeros.default, aten.empty_like.default, aten.zeros_like.default, aten.new_empty.default)
_LIKE = (aten.empty_like.default, aten.zeros_like.default)


@dataclass(frozen=True)
class TokenLocal:
    region: int                      # index of the region (one per MoE layer's sort)
    seed: str                        # the name of that sort
    outputs: tuple                   # per tensor output: its placement on a token-split mesh dim
    inputs: tuple                    # per tensor input (graph.tensor_inputs order)
    local: bool                      # run on local tensors (True) or through DTensor's rule (False)
    # on an expert-parallel mesh dim (module doc): per tensor output and input, its placement
    # there; None where the region cannot run expert-parallel
    ep_outputs: tuple | None = None
    ep_inputs: tuple | None = None
    experts: int = 0                 # the region's expert count (its counts' bins)
    # why the region's receive buffer must hold every rank's rows whatever the capacity (None: a
    # capacity may size it)
    dropless: str | None = None

    @property
    def neutral(self) -> bool:
        """No tensor of the node is split (a table op): it reads alike in either mode."""
        return all(p is None or isinstance(p, Replicate) for p in (*self.outputs, *self.inputs))


@dataclass(frozen=True)
class _Local:
    region: int
    order: str    # "sorted" | "token"
    axis: int     # the token axis
    values: str   # "plain" | "tok" | "pos"
    rows: int = 0  # for positions: the length of the axis they index
    moved: bool = False  # routed rows an expert-parallel run sends to their experts' ranks


@dataclass(frozen=True)
class _Table:
    region: int


@dataclass(frozen=True)
class _Buffer:     # a fresh tensor only a scatter writes
    region: int


class _Invalid(Exception):
    pass


def _val(a: fx.Node):
    return a.meta.get("val")


def find_regions(gm: fx.GraphModule) -> dict[fx.Node, TokenLocal]:
    """Mark every valid token-local region of ``gm`` (see the module doc); returns node -> fact."""
    for node in gm.graph.nodes:
        node.meta.pop(META_KEY, None)
    mesh1 = _torch.planning_mesh((2,), ("t",))
    state: dict[tuple, object] = {}        # (producer, output index) -> _Local | _Table
    facts: dict[fx.Node, TokenLocal] = {}
    invalid: dict[int, str] = {}
    seeds: list[fx.Node] = []
    dispatch: set[int] = set()              # regions that count or multiply per expert
    no_ep: dict[int, str] = {}              # region -> why it cannot run expert-parallel
    no_capacity: dict[int, str] = {}        # region -> why a capacity cannot size its buffer
    experts: dict[int, set[int]] = {}       # region -> the expert counts its counts and GEMMs imply

    def st(a):
        return state.get(picked_output(a) or (a, 0)) if isinstance(a, fx.Node) else None  # before value_of's facts

    for node in gm.graph.nodes:
        if node.op == "output":
            for a in tensor_inputs(node):
                s = st(a)
                if s is not None:
                    invalid.setdefault(s.region, f"{a.name}, in a rank's own order, is a graph output")
            continue
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        ins = tensor_inputs(node)
        regions = {s.region for s in map(st, ins) if s is not None}
        if node.target in _SORTS and not regions:
            x = ins[0]
            if _val(x).ndim == 1:
                rid = len(seeds)
                seeds.append(node)
                state[(node, 0)] = _Local(rid, "sorted", 0, "plain")
                state[(node, 1)] = _Local(rid, "sorted", 0, "tok", _val(x).shape[0])
                facts[node] = TokenLocal(rid, node.name, (Shard(0), Shard(0)), (Shard(0),), True,
                                         (Shard(0), Shard(0)), (Shard(0),))
            continue
        if not regions:
            continue
        # On a failure the node's outputs stay unmarked: the region will run as the ordinary
        # (global) ops it is, so what it makes are ordinary tensors, and later layers' sorts
        # still start regions of their own.
        if len(regions) > 1:
            for r in regions:
                invalid.setdefault(r, f"{node.name} joins two regions")
            continue
        (rid,) = regions
        if node.target in _DISPATCH:
            dispatch.add(rid)
        try:
            outs, fact = _rule(node, ins, mesh1, _Judge(rid, seeds[rid].name, st, facts, no_ep, no_capacity))
        except _Invalid as exc:
            invalid.setdefault(rid, f"{node.name} ({node.target}): {exc}")
            continue
        for i, s in enumerate(outs):
            if s is not None:
                state[(node, i)] = s
        facts[node] = _with_ep(node, fact, [st(a) for a in ins], outs)
        if node.target is aten.histc.default:
            experts.setdefault(rid, set()).add(node.args[1] if len(node.args) > 1 else node.kwargs.get("bins", 100))
        elif node.target is aten._grouped_mm.default and _val(node).ndim == 3:
            experts.setdefault(rid, set()).add(_val(node).shape[0])
        elif node.target is aten._grouped_mm.default:
            experts.setdefault(rid, set()).add(_val(node.args[1]).shape[0])
    for rid, why in invalid.items():
        if rid not in dispatch:   # a sort that is no MoE dispatch: planned as DTensor plans any sort
            continue
        warnings.warn(f"autoshard: the MoE dispatch sorted at {seeds[rid].name} stays replicated: {why}",
                      stacklevel=2)
    for rid, why in no_ep.items():
        if rid in dispatch and rid not in invalid:
            warnings.warn(f"autoshard: the MoE dispatch sorted at {seeds[rid].name} runs token-local only, not "
                          f"expert-parallel: {why}", stacklevel=2)
    ids: dict[int, int] = {}
    out: dict[fx.Node, TokenLocal] = {}
    for node in gm.graph.nodes:   # renumber the valid regions 0, 1, ... in graph order
        fact = facts.get(node)
        if fact is None or fact.region in invalid:
            continue
        n_experts = experts.get(fact.region, set())
        ep = fact.region not in no_ep and len(n_experts) == 1
        fact = TokenLocal(ids.setdefault(fact.region, len(ids)), fact.seed, fact.outputs, fact.inputs, fact.local,
                          fact.ep_outputs if ep else None, fact.ep_inputs if ep else None,
                          next(iter(n_experts)) if ep else 0, no_capacity.get(fact.region) if ep else None)
        node.meta[META_KEY] = out[node] = fact
    return out


def _buffer_fact(buf: fx.Node, rid: int, seed: str, st) -> TokenLocal:
    """A fresh buffer a scatter writes, made locally at its local size; its template input (read
    for dtype and device only) stays where it is in the region, or is read as row shards."""
    (x,) = tensor_inputs(buf)
    s = st(x)
    fact = TokenLocal(rid, seed, (Shard(0),), (Shard(s.axis) if isinstance(s, _Local) else Shard(0),), True)
    return _with_ep(buf, fact, [s], [None])


def _with_ep(node: fx.Node, fact: TokenLocal, in_states: list, out_states: list) -> TokenLocal:
    """``fact`` with its placements on an expert-parallel mesh dim: a routed row tensor there is
    every rank's received rows, up to all the dim's rows (held as large as replicated); the
    experts' weights are split by expert, and so are their gradients, whole per expert."""
    moved = lambda s: isinstance(s, _Local) and s.moved  # noqa: E731
    outs = [Replicate() if moved(s) else p for p, s in zip(fact.outputs, out_states)]
    ins = [Replicate() if moved(s) else p for p, s in zip(fact.inputs, in_states)]
    if node.target is aten._grouped_mm.default:
        if isinstance(outs[0], Partial):
            outs[0] = Shard(0)          # the weight gradient: each rank sums its experts' rows
        elif in_states[1] is None:
            ins[1] = Shard(0)           # the weight: each rank holds its own experts
    return replace(fact, ep_outputs=tuple(outs), ep_inputs=tuple(ins))


_Judged = tuple[list, TokenLocal]   # the states of a node's outputs, and its fact


@dataclass(frozen=True)
class _Judge:
    """What judging one node of a region reads and writes: the region, the name of its sort, the
    state of each tensor so far (``st``) and the facts, which a scatter extends with its
    buffer's."""
    rid: int
    seed: str
    st: Callable[[object], object]
    facts: dict
    no_ep: dict   # region -> why it cannot run expert-parallel
    no_capacity: dict   # region -> why a capacity cannot size its receive buffer

    def local(self, order: str, axis: int = 0, values: str = "plain", rows: int = 0, moved: bool = False) -> _Local:
        return _Local(self.rid, order, axis, values, rows, moved)

    def fact(self, outputs: tuple, inputs: tuple, runs_local: bool) -> TokenLocal:
        return TokenLocal(self.rid, self.seed, outputs, inputs, runs_local, outputs, inputs)


def _rows(a: fx.Node) -> int:
    return _val(a).shape[0]


def _is_local(s, order: str | None = None, values: str | None = None, axis: int | None = None) -> bool:
    """Whether state ``s`` is region rows with the given order, values and token axis (None: any)."""
    return isinstance(s, _Local) and order in (None, s.order) and values in (None, s.values) \
        and axis in (None, s.axis)


def _rule(node: fx.Node, ins: list, mesh1, j: _Judge) -> _Judged:
    """How ``node``, touching region ``j.rid``, keeps what its tensors mean; raises _Invalid where
    it cannot."""
    t, st = node.target, j.st
    if t in _BUFFERS:
        if len(node.users) != 1 or next(iter(node.users)).target is not aten.index_put.default:
            raise _Invalid("a new tensor from routed rows that is not a scatter's buffer")
        if t in _LIKE and _is_local(st(ins[0])) and st(ins[0]).moved:
            # sized by its template, which an expert-parallel rank holds as its received rows
            j.no_ep.setdefault(j.rid, f"{node.name} makes a scatter's buffer the size of routed rows")
        return [_Buffer(j.rid)], _buffer_fact(node, j.rid, j.seed, st)
    if any(isinstance(st(a), _Buffer) for a in ins) and t is not aten.index_put.default:
        raise _Invalid("reads a scatter's buffer")
    if t is aten.floor_divide.default and _is_local(st(ins[0]), values="tok") and len(ins) == 1:
        return _route_tokens(node, st(ins[0]), j)
    if t is aten._to_copy.default and isinstance(st(ins[0]), _Local):
        s = st(ins[0])
        return [s], j.fact((Shard(s.axis),), (Shard(s.axis),), False)
    if t is aten.histc.default:
        return _counts(node, st(ins[0]), j)
    if t is aten.cumsum.default:
        if not isinstance(st(ins[0]), _Table):
            raise _Invalid("cumsum of a routed tensor")
        return [_Table(j.rid)], j.fact((Replicate(),), (Replicate(),), True)
    if t is aten.index.Tensor:
        return _gather(node, j)
    if t is aten.index_put.default:
        return _scatter(node, j)
    if t is aten._grouped_mm.default:
        return _grouped_mm(node, j)
    return _row_wise(node, ins, mesh1, j)


def _route_tokens(node: fx.Node, s: _Local, j: _Judge) -> _Judged:
    """Route positions // top_k: the token of each route (routes of a token are adjacent)."""
    c = node.args[1]
    if not isinstance(c, int) or c <= 0 or s.rows % c:
        raise _Invalid("divides token positions by something other than a whole group size")
    return [j.local(s.order, s.axis, "tok", s.rows // c)], j.fact((Shard(s.axis),), (Shard(s.axis),), False)


def _counts(node: fx.Node, s, j: _Judge) -> _Judged:
    """``histc`` of the sorted expert ids: the rank's own per-expert counts."""
    if not _is_local(s, "sorted", "plain", 0):
        raise _Invalid("counts something other than the sorted expert ids")
    lo = node.args[2] if len(node.args) > 2 else node.kwargs.get("min", 0)
    hi = node.args[3] if len(node.args) > 3 else node.kwargs.get("max", 0)
    if not lo < hi:   # a range taken from the data would differ from rank to rank
        raise _Invalid("counts over a range taken from the data (give histc its min and max)")
    bins = node.args[1] if len(node.args) > 1 else node.kwargs.get("bins", 100)
    x = node.args[0]
    while isinstance(x, fx.Node) and x.target in _CASTS:
        x = x.args[0]
    ids = isinstance(x, fx.Node) and x.target is operator.getitem and x.args[0].name == j.seed and x.args[1] == 0
    if not (ids and lo == 0 and hi in (bins - 1, bins)):
        # an expert-parallel rank counts the sort's ids itself, one bin per expert
        j.no_ep.setdefault(j.rid, f"{node.name} counts something other than the expert ids, one bin each")
    return [_Table(j.rid)], j.fact((Replicate(),), (Shard(0),), True)


def _gather(node: fx.Node, j: _Judge) -> _Judged:
    """``x[idx]``: into local order by the sort's token positions, or back to token order by the
    sorted positions."""
    x, idx = node.args[0], node.args[1]
    if len(idx) != 1 or not isinstance(idx[0], fx.Node):
        raise _Invalid("indexes more than one dim")
    sx, si = j.st(x), j.st(idx[0])
    S0 = Shard(0)
    if sx is None and _is_local(si, "sorted", "tok") and _rows(x) == si.rows:
        return [j.local("sorted", moved=True)], j.fact((S0,), (S0, S0), True)  # gather into local order
    if _is_local(sx, "sorted", "plain", 0) and _is_local(si, "token", "pos") and _rows(x) == si.rows:
        return [None], j.fact((S0,), (S0, S0), True)   # back to token order: a shard
    raise _Invalid("a gather that is neither into local order nor back to token order")


def _check_scatter(buf: fx.Node, idx, acc: bool) -> None:
    """A scatter into anything but a fresh buffer of its own would mix in what the buffer held,
    which differs between the rank's own rows and the global ones."""
    if len(idx) != 1 or not isinstance(idx[0], fx.Node):
        raise _Invalid("scatters on more than one dim")
    if buf.target not in _BUFFERS or len(buf.users) != 1:
        raise _Invalid(f"scatters into {buf.name}, not a fresh buffer")
    if not acc and buf.target is not aten.empty_like.default:
        raise _Invalid("overwrites part of an existing tensor")
    if acc and buf.target not in (aten.new_zeros.default, aten.zeros_like.default):
        raise _Invalid("accumulates into a tensor that is not fresh zeros")


def _scatter(node: fx.Node, j: _Judge) -> _Judged:
    """``index_put`` into a fresh buffer: the inverse permutation, rows back to token order, or
    token-order rows into local order."""
    buf, idx, vals = node.args[0], node.args[1], node.args[2]
    acc = (node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False))
    _check_scatter(buf, idx, acc)
    si, sv = j.st(idx[0]), j.st(vals)
    S0 = Shard(0)
    iota = (vals.target is aten.arange.default and len(vals.args) == 1 and len(vals.users) == 1
            and not acc and _is_local(si, values="tok") and vals.args[0] == _rows(idx[0]))
    if _is_local(si, "sorted", "tok") and _rows(node) == si.rows:
        if iota:     # out[perm[i]] = i: the inverse permutation (local sorted positions)
            j.facts[vals] = j.fact((S0,), (), True)
            out = j.local("token", 0, "pos", _rows(idx[0]))
        elif _is_local(sv, "sorted", "plain", 0):
            out = None        # back to token order: a shard
        else:
            raise _Invalid("scatters values that are not in local order")
    elif _is_local(si, "token", "pos") and sv is None and _rows(node) == si.rows:
        out = j.local("sorted", moved=True)  # token-order rows into local order (a gather's backward)
    else:
        raise _Invalid("a scatter by something other than the sort's permutation")
    j.facts[buf] = _buffer_fact(buf, j.rid, j.seed, j.st)
    return [out], j.fact((S0,), (S0, S0, S0), True)


def _grouped_mm(node: fx.Node, j: _Judge) -> _Judged:
    """One GEMM per expert over the region's sorted rows (forward), or their sum over tokens (the
    weight gradient)."""
    a, b = node.args[0], node.args[1]
    offs = node.args[2] if len(node.args) > 2 else node.kwargs.get("offs")
    if not isinstance(j.st(offs), _Table):
        raise _Invalid("a grouped GEMM whose offsets are not the region's counts")
    sa, sb = j.st(a), j.st(b)
    S0, R = Shard(0), Replicate()
    if not (_is_local(sa) and sa.moved and (sb is None or (_is_local(sb) and sb.moved))):
        j.no_ep.setdefault(j.rid, f"{node.name} multiplies rows that are not the routed tokens")
    if _is_local(sa, "sorted", axis=0) and sb is None and _val(b).ndim == 3:
        return [j.local("sorted", moved=True)], j.fact((S0,), (S0, R, R), True)
    if _is_local(sa, axis=1) and _is_local(sb, axis=0):
        return [None], j.fact((Partial(),), (Shard(1), S0, R), True)  # a sum over tokens
    raise _Invalid("a grouped GEMM over rows that are not the region's")


def _row_wise(node: fx.Node, ins: list, mesh1, j: _Judge) -> _Judged:
    """Any other op must be row-wise: DTensor's rule carries the token axis through it."""
    if torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()):
        raise _Invalid("draws random numbers by row position, which the rank's own order changes")
    states = [j.st(a) for a in ins]
    if any(isinstance(s, _Table) or (isinstance(s, _Local) and s.values != "plain") for s in states):
        raise _Invalid("computes on the region's counts or positions")
    orders = {s.order for s in states if s is not None}
    if len(orders) != 1:
        raise _Invalid("mixes rows in token and in local order")
    in_pl = [Replicate() if s is None else Shard(s.axis) for s in states]
    outs = placements_through(node, mesh1, in_pl)
    if outs is None:
        raise _Invalid("has no rule that keeps the token axis")
    # one output row per input row: a view that merged rows would pair a rank's own neighbours,
    # not the neighbours the global order pairs
    n = {_val(a).shape[s.axis] for a, s in zip(ins, states) if s is not None}
    vals = _val(node) if isinstance(_val(node), (tuple, list)) else (_val(node),)
    if len(n) != 1 or any(isinstance(o, Shard) and v.shape[o.dim] not in n for o, v in zip(outs, vals)):
        raise _Invalid("merges or splits the region's rows")
    moved = {s.moved for s in states if isinstance(s, _Local)}
    if len(moved) > 1:
        j.no_ep.setdefault(j.rid, f"{node.name} mixes routed rows with the sorted expert ids")
    if True in moved and n & set(_ints((node.args, node.kwargs))):
        # DTensor runs it with the sizes it was traced with, every rank's rows: a buffer of
        # another size would not match them
        j.no_capacity.setdefault(j.rid, f"{node.name} names the routed rows' count in its arguments")
    result = []
    for o in outs:
        if isinstance(o, Shard):
            result.append(j.local(next(iter(orders)), o.dim, moved=True in moved))
        elif isinstance(o, Partial) and o.reduce_op == "sum":
            result.append(None)                  # a sum over tokens: order does not matter
            if True in moved:   # over received rows: another rank's tokens, and the buffer's padding
                j.no_ep.setdefault(j.rid, f"{node.name} sums over routed rows")
        elif o is None:
            result.append(None)
        else:
            raise _Invalid(f"its rule gives {o} for the token axis")
    return result, j.fact(tuple(outs), tuple(in_pl), False)


def _ints(args) -> list[int]:
    return [a for a in _torch.tree_leaves(args) if isinstance(a, int) and not isinstance(a, bool)]


def _on(placements, d):
    return None if placements is None else placements[d]


def split_dims(fact: TokenLocal, strategy) -> frozenset[int]:
    """The mesh dims on which ``strategy`` splits the region's tokens (its tensors take
    ``fact``'s placements there, or its expert-parallel ones on its expert-parallel dim)."""
    ndim = next(len(p) for p in (*strategy.outputs, *strategy.inputs) if p is not None)
    ep = ep_dim(strategy)
    return frozenset(d for d in range(ndim)
                     if all(want is None or _on(got, d) == want
                            for want, got in zip((*fact.outputs, *fact.inputs), (*strategy.outputs, *strategy.inputs)))
                     or d == ep)


# ops that wait on the rank receiving the most rows: its grouped GEMMs, and the exchanges
_WAIT_ON_BUSIEST = (aten._grouped_mm.default, aten.index.Tensor, aten.index_put.default, aten.histc.default)
# the variant of an expert-parallel strategy: "ep", its mesh dim and, with a capacity, "@" and the
# capacity: "ep1" (dropless), "ep1@1.25"
EP = "ep"


def parse_ep(v: str) -> tuple[int, float | None] | None:
    """(mesh dim, capacity or None) of an expert-parallel variant; None for any other."""
    if not v.startswith(EP):
        return None
    dim, _, capacity = v[len(EP):].partition("@")
    return (int(dim), float(capacity) if capacity else None) if dim.isdigit() else None


def ep_dim(strategy) -> int | None:
    """The mesh dim over which ``strategy`` runs its region expert-parallel, if it does."""
    ep = parse_ep(strategy.variant)
    return None if ep is None else ep[0]


def ep_capacity(strategy) -> float | None:
    """The receive buffer of an expert-parallel ``strategy`` in the rank's own rows (None: every
    rank's rows, dropless; also for a strategy that is not expert-parallel)."""
    ep = parse_ep(strategy.variant)
    return None if ep is None else ep[1]


def received_rows(own: int, ranks: int, capacity: float | None) -> int:
    """Rows a rank's receive buffer holds: ``capacity`` times its own ``own`` rows, at most every
    rank's (all of them when ``capacity`` is None)."""
    if capacity is None:
        return ranks * own
    return min(ranks * own, math.ceil(round(capacity * own, 6)))


def held_fraction(strategy, mesh_shape) -> float:
    """A moved tensor's size under ``strategy`` over the size its placements give (replicated on
    the expert-parallel dim): its capacity over the dim's ranks; 1 when dropless."""
    ep = parse_ep(strategy.variant)
    return 1.0 if ep is None else _held(*ep, mesh_shape)


def _held(d: int, capacity: float | None, mesh_shape) -> float:
    return 1.0 if capacity is None else min(capacity, mesh_shape[d]) / mesh_shape[d]


def moved(token, ep) -> bool:
    """Whether a tensor placed ``token`` on a token-split dim and ``ep`` on an expert-parallel one
    is routed rows: the rank's own there, the rows its experts receive here."""
    return isinstance(token, Shard) and isinstance(ep, Replicate)


def moved_tensors(node: fx.Node) -> tuple[tuple[bool, ...], tuple[bool, ...]] | None:
    """Per tensor output and input of ``node``, whether it is moved rows under an expert-parallel
    strategy (None: the node holds none)."""
    fact = node.meta.get(META_KEY)
    if fact is None or fact.ep_outputs is None:
        return None
    outs = tuple(map(moved, fact.outputs, fact.ep_outputs))
    ins = tuple(map(moved, fact.inputs, fact.ep_inputs))
    return (outs, ins) if any(outs) or any(ins) else None


def ep_member(node: fx.Node) -> bool:
    """Whether ``node`` runs otherwise when its region is expert-parallel: it holds routed rows
    or expert weights there, moves them (a gather or scatter between the two orders), or counts
    the rows each rank receives (the counts)."""
    fact = node.meta.get(META_KEY)
    return (fact is not None and fact.experts > 0
            and (node.target is aten.histc.default or (fact.ep_outputs, fact.ep_inputs) != (fact.outputs, fact.inputs)))


def ep_strategies(node: fx.Node, fact: TokenLocal, mesh_shape: tuple[int, ...], imbalance: float = 1.0,
                  capacity: float | None = None) -> list[tuple[tuple, tuple, float, str]]:
    """(outputs, inputs, imbalance, variant) of ``node`` running its region expert-parallel over
    one mesh dim, its tokens split there and over any other dims (replicated on the rest); empty
    where the node runs alike either way. ``imbalance``: the busiest rank's received rows over an
    even share (its grouped GEMMs wait on it); ``capacity``: the receive buffer, in the rank's own
    rows (None: every rank's). An op over moved rows that waits on no exchange runs over the whole
    buffer: its work is the buffer's part of the replicated size (:func:`held_fraction`)."""
    if not ep_member(node):
        return []
    if fact.dropless is not None:
        capacity = None     # the region's buffer holds every rank's rows (TokenLocal.dropless)
    moves = moved_tensors(node)
    over_buffer = moves is not None and any(moves[0]) and node.target not in _WAIT_ON_BUSIEST
    rep, ndim = Replicate(), len(mesh_shape)
    out = []
    for d in range(ndim):
        if fact.experts % mesh_shape[d] or mesh_shape[d] == 1:
            continue
        for mask in range(1, 2 ** ndim):
            if not mask >> d & 1:
                continue

            def pl(token, ep):
                if token is None:
                    return None
                return tuple(ep if e == d else token if mask >> e & 1 else rep for e in range(ndim))
            outs = tuple(map(pl, fact.outputs, fact.ep_outputs))
            ins = tuple(map(pl, fact.inputs, fact.ep_inputs))
            # at most every rank's rows: min(imbalance, ranks)
            busiest = (min(imbalance, mesh_shape[d]) if node.target in _WAIT_ON_BUSIEST
                       else _held(d, capacity, mesh_shape) if over_buffer else 1.0)
            out.append((outs, ins, busiest, f"{EP}{d}" if capacity is None else f"{EP}{d}@{float(capacity)!r}"))
    return out


def untied(choice: dict) -> str | None:
    """Why ``choice`` (node -> Strategy) cannot run: a region whose members split tokens on
    different mesh dims (the solver's plans never do; an edited plan file may)."""
    first: dict[int, tuple[str, frozenset]] = {}
    first_ep: dict[int, tuple[str, int | None]] = {}
    for node, s in choice.items():
        fact = node.meta.get(META_KEY)
        if fact is None or fact.neutral:
            continue
        dims = split_dims(fact, s)
        name, want = first.setdefault(fact.region, (node.name, dims))
        if dims != want:
            return (f"{name} splits the tokens of the MoE dispatch sorted at {fact.seed} on mesh dims {sorted(want)}, "
                    f"{node.name} on {sorted(dims)}; a region's ops must split alike")
        if ep_member(node):
            name, want = first_ep.setdefault(fact.region, (node.name, ep_dim(s)))
            if ep_dim(s) != want:
                return (f"{name} runs the experts of the MoE dispatch sorted at {fact.seed} expert-parallel on "
                        f"mesh dim {want}, {node.name} on {ep_dim(s)}; a region's ops must run alike")
    return None


def runs_locally(node: fx.Node, strategy) -> bool:
    """Whether the rewriter runs ``node`` on each rank's own tokens under ``strategy``."""
    fact = node.meta.get(META_KEY)
    return fact is not None and fact.local and not fact.neutral and bool(split_dims(fact, strategy))


def holds_table(strategy) -> bool:
    """Whether a table op (a neutral fact: the region's per-expert counts, their offsets) keeps its
    tensors replicated on every mesh dim under ``strategy``. Once the region splits tokens, each
    rank's table counts its own rows: replicated in name only, so any resharding would mix the
    ranks' tables (Replicate -> Partial keeps mesh coordinate 0's, and the sum that follows hands
    that one to every rank). A table is one number per expert: held replicated it costs nothing,
    also where the region runs globally."""
    return all(p is None or all(isinstance(x, Replicate) for x in p) for p in (*strategy.outputs, *strategy.inputs))


def token_local_strategies(fact: TokenLocal, ndim: int) -> list[tuple[tuple, tuple]]:
    """(outputs, inputs) placements splitting tokens over each non-empty set of mesh dims,
    replicated on the others."""
    rep = Replicate()
    out = []
    for mask in range(1, 2 ** ndim):
        dims = [d for d in range(ndim) if mask >> d & 1]
        pl = lambda p: None if p is None else tuple(p if d in dims else rep for d in range(ndim))  # noqa: E731
        out.append((tuple(map(pl, fact.outputs)), tuple(map(pl, fact.inputs))))
    return out
