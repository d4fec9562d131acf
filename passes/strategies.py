"""strategies: the candidate sharding strategies of every node on an N-D device mesh.

A :class:`Strategy` fixes, for each mesh dim, the placement (Replicate, Shard(d), Partial) of every
tensor output and of every tensor input the op needs; resharding a producer's output to that
input placement is the solver's edge cost. Rules are DTensor's own registry (so what is planned
is what DTensor runs), plus autoshard's rules for ops torch lacks (``passes/rules``):

* ops with a single-dim rule: the rule's placements per mesh dim, expanded over the mesh as their
  Cartesian product (the all-Replicate rule is implied);
* ops with an op-strategy function (written to *propagate*: several follow one input, ``stack``
  and ``cat`` merge theirs): asked once per combination of input placements, every placement each
  input can have (not only what its producer outputs), the answers united, so no rule narrows
  the set (:func:`_from_op_strategy_all`; docs/design.md; tests/test_coverage.py holds it against
  brute force);
* ops with no tensor input (factories): Replicate;
* anything else: Replicate, reported in the result's ``fallback`` (``strict`` raises).

Dim arguments are made non-negative before any rule sees them (:func:`normalized_args`). Only
even sharding is kept (every sharded dim divides by its shard count), and no strided shards
or masked partials (vocab-parallel embedding), so local shapes, costs and numerics are exact. Facts go to ``node.meta["autoshard.strategies"]``.

Example::

    >>> find_strategies(traced, planning_mesh((2,), ("d0",)))
    >>> [str(s) for s in mm.meta["autoshard.strategies"].strategies][:3]
    ['(R),(R)->(R)', '(S(0)),(R)->(S(0))', '(R),(S(1))->(S(1))']
"""

from __future__ import annotations

import itertools
import operator
import warnings
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autoshard import _torch
from autoshard.errors import NoShardingRuleError
from autoshard.notation import placements_str

META_KEY = "autoshard.strategies"
Placements = tuple[Placement, ...]


@dataclass(frozen=True)
class Strategy:
    outputs: tuple[Placements | None, ...]   # per tensor output of the op
    inputs: tuple[Placements | None, ...]    # per tensor input (tensor_inputs(node) order)
    shards: int = 1                          # ranks the op's work is split over

    @cached_property
    def text(self) -> str:
        return ",".join(map(placements_str, self.inputs)) + "->" + ",".join(map(placements_str, self.outputs))

    def __str__(self) -> str:
        return self.text


@dataclass
class NodeStrategies:
    strategies: list[Strategy] = field(default_factory=list)
    fallback: str | None = None              # why the op was planned replicated, if it was
    alias_of: tuple[fx.Node, int] | None = None  # getitem: (producer, output index)


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """A node's tensor arguments in DTensor's order (args, then kwargs), duplicates kept. Constants
    the graph holds (``get_attr``: a tensor built in forward, the same on every rank) are not
    among them: like a Python number, each rank has its own whole copy."""
    out: list[fx.Node] = []

    def walk(a) -> None:
        if isinstance(a, fx.Node):
            if a.op != "get_attr":
                out.append(a)
        elif isinstance(a, (tuple, list)):
            for x in a:
                walk(x)
        elif isinstance(a, dict):
            for x in a.values():
                walk(x)

    walk(node.args)
    walk(node.kwargs)
    return out


def args_key(a, leaf):
    """A node's arguments as one comparable value: each fx.Node through ``leaf``, tuples, lists
    and dicts as tagged tuples (a plain walk: pytree's took a tenth of planning a deep model)."""
    if isinstance(a, fx.Node):
        return leaf(a)
    if isinstance(a, (tuple, list)):
        return (type(a) is tuple, *(args_key(x, leaf) for x in a))
    if isinstance(a, dict):
        return ("D", *((k, args_key(x, leaf)) for k, x in a.items()))
    return a


def per_strategy_list(cache: dict, strategies: list, extra, make):
    """``make()``, once per (strategy list, ``extra``) over a cache's life. Identical nodes (the
    repeated layers) share one immutable strategy list (:func:`find_strategies`), so what derives
    from it is computed once per list, not per node. The cache keys by the list's id and keeps
    the list alive so that id is not reused."""
    key = (id(strategies), extra)
    hit = cache.get(key)
    if hit is None:
        hit = cache[key] = (make(), strategies)
    return hit[0]


def picked_output(node: fx.Node) -> tuple[fx.Node, int] | None:
    """(producer, output index) when ``node`` is a getitem picking one output of a multi-output
    op (no decision of its own: :func:`value_of` reads it from the strategies), else None."""
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node) \
            and isinstance(node.args[0].meta.get("val"), (tuple, list)):
        return node.args[0], node.args[1]
    return None


def value_of(node: fx.Node) -> tuple[fx.Node, int]:
    """(producer, output index) of the tensor a node stands for."""
    ns = node.meta.get(META_KEY)
    if ns is not None and ns.alias_of is not None:
        return ns.alias_of
    return node, 0


def output_options(node: fx.Node) -> list[Placements]:
    """Distinct placements the tensor ``node`` can have, over its producer's strategies."""
    producer, k = value_of(node)
    seen: dict[Placements, None] = {}
    for s in producer.meta[META_KEY].strategies:
        if s.outputs[k] is not None:
            seen.setdefault(s.outputs[k])
    return list(seen)


def _meta(val) -> "_torch.TensorMeta":
    return _torch.TensorMeta(val.shape, val.stride(), val.dtype)


def _even(placements: Placements | None, shape, mesh_shape) -> bool:
    if placements is None:
        return True
    split = [1] * len(shape)
    for p, m in zip(placements, mesh_shape):
        if m == 1 and not isinstance(p, Replicate):  # a mesh dim of one device splits nothing
            return False
        if isinstance(p, _torch.StridedShard) or (isinstance(p, Shard) and type(p) is not Shard):
            return False
        if isinstance(p, Partial) and type(p) is not Partial:
            # DTensor's masked partial (vocab-parallel embedding) carries per-call state that a
            # planned, pre-redistributed input cannot hand to the op; not planned yet
            return False

        if isinstance(p, Shard):
            if not 0 <= p.dim < len(shape):
                return False
            split[p.dim] *= m
    return all(s % k == 0 for s, k in zip(shape, split))


def _shards(s_out, s_in, mesh_shape) -> int:
    n = 1
    for d, m in enumerate(mesh_shape):
        if any(p is not None and not isinstance(p[d], Replicate) for p in (*s_out, *s_in)):
            n *= m
    return n


def _tensor_vals(val) -> list:
    return [v for v in (val if isinstance(val, (tuple, list)) else (val,))]


def _keep(node: fx.Node, outs, ins, mesh_shape) -> bool:
    out_vals = _tensor_vals(node.meta["val"])
    for p, v in zip(outs, out_vals):
        if p is not None and (not isinstance(v, torch.Tensor) or not _even(p, v.shape, mesh_shape)):
            return False
    for p, a in zip(ins, tensor_inputs(node)):
        if p is None or not _even(p, a.meta["val"].shape, mesh_shape):
            return False
        if any(isinstance(x, Partial) and x.reduce_op != "sum" for x in p):
            return False  # ops fed avg/max partials duplicate their sum twins; keep one
    return True


# dim-valued arguments, by name in the op's schema, that DTensor's rules read; a negative one is
# made non-negative before any rule sees it (some rules index shapes with it unchecked)
_DIM_ARGS = frozenset({"dim", "dims", "dim0", "dim1", "dim2", "start_dim", "end_dim", "source", "destination"})
# ops whose dim counts in the output's rank (the op inserts a dim), not the first input's
_DIM_OF_OUTPUT = frozenset({"aten::stack", "aten::unsqueeze", "aten::select_backward", "aten::diag_embed"})


def normalized_args(node: fx.Node) -> tuple[tuple, dict]:
    """``node``'s args and kwargs with every dim argument non-negative (schema-driven)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return node.args, node.kwargs
    if schema.name in _DIM_OF_OUTPUT:
        rank = len(_tensor_vals(node.meta["val"])[0].shape)
    else:   # the largest input's: cat takes legacy empty 1-D tensors beside its real operands
        rank = max((a.meta["val"].ndim for a in tensor_inputs(node)), default=0)

    def norm(v):
        if isinstance(v, int) and not isinstance(v, bool):
            return v + rank if v < 0 and rank > 0 else v
        if isinstance(v, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            return type(v)(norm(x) for x in v)
        return v

    names = [a.name for a in schema.arguments]
    args = tuple(norm(v) if i < len(names) and names[i] in _DIM_ARGS else v for i, v in enumerate(node.args))
    kwargs = {k: norm(v) if k in _DIM_ARGS else v for k, v in node.kwargs.items()}
    return args, kwargs


def placement_options(val, mesh_shape) -> list[Placements]:
    """Every placement a tensor like ``val`` can have on the mesh, evenly: per mesh dim Replicate,
    Shard of each dim and (floating and complex tensors) a sum Partial."""
    per_dim: list[Placement] = [Replicate()] + [Shard(d) for d in range(val.ndim)]
    if val.is_floating_point() or val.is_complex():
        per_dim.append(Partial())
    return [p for p in itertools.product(per_dim, repeat=len(mesh_shape)) if _even(p, val.shape, mesh_shape)]


def _from_single_dim(node, info, mesh) -> list:
    """A single-dim rule's strategies on one mesh dim, expanded over the mesh as their Cartesian
    product: complete by construction (the rule reads shapes, never input placements)."""
    args, kwargs = normalized_args(node)
    args = _torch.tree_map_only(fx.Node, lambda a: _meta(a.meta["val"]), args)
    kwargs = _torch.tree_map_only(fx.Node, lambda a: _meta(a.meta["val"]), kwargs)
    rules = info.func(node.target, args, kwargs)
    n_in = len(tensor_inputs(node))
    n_out = len(rules[0]) - n_in if rules else len([v for v in _tensor_vals(node.meta["val"])])
    out_vals = _tensor_vals(node.meta["val"])
    replicate = [None if not isinstance(out_vals[i] if i < len(out_vals) else None, torch.Tensor) else Replicate()
                 for i in range(n_out)] + [Replicate()] * n_in
    rules = [replicate] + [list(r) for r in rules]
    conv = lambda p: Shard(p.dim) if isinstance(p, _torch.ShardingPlaceholder) else p  # noqa: E731
    rules = [[conv(p) for p in r] for r in rules]
    result = []
    for combo in itertools.product(rules, repeat=mesh.ndim):
        cols = list(zip(*combo))  # per tensor position, its placement on each mesh dim
        pl = [None if any(c is None for c in col) else tuple(col) for col in cols]
        result.append((tuple(pl[:n_out]), tuple(pl[n_out:])))
    return result


def _input_combos(inputs: list[fx.Node], options: dict, rep: Placements) -> list[dict]:
    """The input placements to ask a propagating rule about, one combination per call: each input
    in each of its placements, the others replicated, and (for rules that want every operand
    placed alike: cat, stack, follow rules) the others in that same placement where they can be.
    Checked against every combination, one call each, in tests/test_coverage.py."""
    combos: dict[tuple, None] = {}
    for a in inputs:
        for p in options[a]:
            combos.setdefault(tuple(p if b is a else rep for b in inputs))
            combos.setdefault(tuple(p if b is a or p in options[b] else rep for b in inputs))
    return [dict(zip(inputs, c)) for c in combos]


def _from_op_strategy_all(node, func, mesh, schema_info, mesh_shape) -> list:
    """A propagating rule (DTensor's op-strategy functions answer for the input strategies they are
    given, and several follow one input or merge them) asked so that it cannot narrow the set:
    per combination of input placements, the answers united. A rule whose answer is the same for
    every input offered and for replicated inputs, and shards something, expands to the whole
    mesh by itself (the SDPA kernels, the softmax backwards): its one answer is complete."""
    inputs = list(dict.fromkeys(tensor_inputs(node)))
    options = {a: placement_options(a.meta["val"], mesh_shape) for a in inputs}
    rep = tuple([Replicate()] * mesh.ndim)

    def ask(choose) -> list | None:
        try:
            return _from_op_strategy(node, func, mesh, schema_info, choose)
        except Exception:  # noqa: BLE001 - a rule that rejects this combination
            return None

    everything = ask(lambda a: options[a])
    if everything is not None:
        replicated = ask(lambda a: [rep])
        if replicated is not None and set(everything) == set(replicated) and \
                any(p != rep for _, ins in everything for p in ins if p is not None):
            return everything
    result = list(everything or [])
    for combo in _input_combos(inputs, options, rep):
        result += ask(lambda a: [combo[a]]) or []
    if not result:
        raise RuntimeError("no input placement combination is supported")
    return result


def _from_op_strategy(node, func, mesh, schema_info, options) -> list:
    def to_strategy(a: fx.Node):
        tm = _meta(a.meta["val"])
        return _torch.OpStrategy([_torch.OpSpec(_torch.DTensorSpec(mesh, p, tm)) for p in options(a)])

    args, kwargs = normalized_args(node)
    args = _torch.tree_map_only(fx.Node, to_strategy, args)
    args = tuple(_torch.TupleStrategy(list(a)) if isinstance(a, (list, tuple)) and a and
                 all(isinstance(x, _torch.OpStrategy) for x in a) else a for a in args)
    kwargs = _torch.tree_map_only(fx.Node, to_strategy, kwargs)
    out = func(_torch.OpSchema(node.target, args, kwargs, schema_info=schema_info))
    if isinstance(out, _torch.TupleStrategy):
        raise NotImplementedError(f"tuple strategies for {node.target}")
    n_in, n_out = len(tensor_inputs(node)), len(_tensor_vals(node.meta["val"]))
    result = []
    for spec in out.strategies:
        # one spec for an op of several outputs stands for all of them, as DTensor's dispatch reads
        # it (torch 2.11's layer-norm rule gives one for output, mean and rstd)
        outs = spec.output_specs if isinstance(spec.output_specs, (tuple, list)) else (spec.output_specs,) * n_out
        outs = tuple(None if o is None else tuple(o.placements) for o in outs)
        if spec.input_specs is None:
            ins = (outs[0],) * n_in
        else:
            ins = tuple(None if i is None else tuple(i.placements) for i in spec.input_specs)
        result.append((outs, ins))
    return result


def placements_through(node: fx.Node, mesh, inputs: list) -> tuple | None:
    """The output placements DTensor's rule gives ``node`` on a 1-D ``mesh`` when its tensor
    inputs arrive in ``inputs`` (one placement each), or None where no rule takes them."""
    single, propagating = _torch.single_dim_rule(node.target), _torch.op_strategy_rule(node.target)
    want = tuple((p,) for p in inputs)
    try:
        if single is not None:
            found = _from_single_dim(node, single, mesh)
        elif propagating is not None:
            fixed = dict(zip(tensor_inputs(node), want))
            func, schema_info = propagating
            found = _from_op_strategy(node, func, mesh, schema_info, lambda a: [fixed[a]])
        else:
            return None
    except Exception:  # noqa: BLE001 - a rule that rejects these placements
        return None
    for outs, ins in found:
        if tuple(ins) == want:
            return tuple(None if o is None else o[0] for o in outs)
    return None


def _enumerate(node: fx.Node, mesh) -> tuple[list, str | None]:
    op = node.target
    if not tensor_inputs(node):
        return [(tuple(tuple([Replicate()] * mesh.ndim) for _ in _tensor_vals(node.meta["val"])), ())], None
    single, propagating = _torch.single_dim_rule(op), _torch.op_strategy_rule(op)
    try:
        if single is not None:
            return _from_single_dim(node, single, mesh), None
        if propagating is not None:
            func, schema_info = propagating
            return _from_op_strategy_all(node, func, mesh, schema_info, tuple(mesh.shape)), None
        reason = f"{op} has no sharding rule"
    except Exception as exc:  # noqa: BLE001 - a rule that fails on these shapes is reported, not hidden
        reason = f"{op}'s sharding rule failed on these shapes: {type(exc).__name__}: {exc}"
    n_out = len(_tensor_vals(node.meta["val"]))
    rep = tuple([Replicate()] * mesh.ndim)
    return [(tuple(rep for _ in range(n_out)), tuple(rep for _ in tensor_inputs(node)))], reason


def _cache_key(node: fx.Node):
    """One enumeration per distinct (op, argument shapes and values): every rule is asked about
    every placement of each input (not the producer's), so nothing else enters. Which inputs are
    the same node does (``mul(x, x)`` is not ``mul(x, y)``); None when an argument is unhashable."""
    seen: dict[fx.Node, int] = {}

    def leaf(a: fx.Node):
        v = a.meta["val"]
        return ("T", tuple(v.shape), v.dtype, seen.setdefault(a, len(seen)))
    try:
        k = (node.target, args_key(node.args, leaf), args_key(node.kwargs, leaf))
        hash(k)
        return k
    except TypeError:
        return None


def _strategies(node: fx.Node, mesh, mesh_shape, rep) -> tuple[list[Strategy], str | None]:
    raw, reason = _enumerate(node, mesh)
    seen: dict[Strategy, None] = {}
    for outs, ins in raw:
        if _keep(node, outs, ins, mesh_shape) and not _scatters_into_split_dim(node, outs, ins):
            seen.setdefault(Strategy(outs, ins, _shards(outs, ins, mesh_shape)))
    # Canonical order: DTensor's rules iterate sets whose order varies between processes
    # (string hashing), and every rank must see the same problem to pick the same plan.
    strategies = sorted(seen, key=str)
    if not strategies:  # every rule shards unevenly here: replicate is always valid, and reported
        strategies = [_replicated(node, rep)]
        reason = reason or f"{node.target}: no rule shards these shapes evenly on mesh {mesh_shape}"
    return strategies, reason


def _scatters_into_split_dim(node: fx.Node, outs, ins) -> bool:
    """An ``index_put`` whose destination is split on a dim its indices select: each rank would
    write global positions into its own rows. torch 2.11's rule offers that where the values have
    the destination's rank (batched_mm Mixtral's expert-weight gradient, scattered by expert id);
    later releases do not. (A token-local region's scatters, on each rank's own positions, get
    their strategies apart: passes/regions.py.)"""
    if node.target is not torch.ops.aten.index_put.default:
        return False
    selected = {d for d, index in enumerate(node.args[1]) if index is not None}
    return any(isinstance(p, Shard) and p.dim in selected for pl in (outs[0], ins[0]) if pl is not None for p in pl)


def _replicated(node: fx.Node, rep: Placements) -> Strategy:
    n_out = len(_tensor_vals(node.meta["val"]))
    return Strategy(tuple(rep for _ in range(n_out)), tuple(rep for _ in tensor_inputs(node)), 1)


def find_strategies(gm: fx.GraphModule, mesh, *, strict: bool = False, memo: dict | None = None) -> list[tuple[str, str]]:
    """Fill ``node.meta["autoshard.strategies"]``; returns the (node, reason) fallbacks.

    ``memo`` (a dict kept with the graph: ``TracedModel.strategy_memo``) holds each mesh shape's
    result, so planning the same graph again on a mesh of that shape (a baseline, another logical
    mesh, another memory cap) does not enumerate again: strategies depend on the mesh's shape only."""
    from autoshard.passes import rules  # noqa: F401 - registers autoshard's own rules

    mesh_shape = tuple(mesh.shape)
    if memo is not None and mesh_shape in memo:
        found, fallbacks = memo[mesh_shape]
        for node, ns in found.items():
            node.meta[META_KEY] = ns
    else:
        with _torch.unpriced_strategies():
            fallbacks = _enumerate_graph(gm, mesh, mesh_shape)
        if memo is not None:
            while len(memo) >= MEMO_SHAPES:
                memo.pop(next(iter(memo)))
            memo[mesh_shape] = ({n: n.meta[META_KEY] for n in gm.graph.nodes if META_KEY in n.meta}, fallbacks)
    if strict and fallbacks:
        name, reason = fallbacks[0]
        raise NoShardingRuleError(f"node {name}: {reason}. Register a rule with "
                                  f"torch.distributed.tensor's register_sharding or pass strict=False "
                                  f"to plan it replicated.")
    for name, reason in fallbacks:
        warnings.warn(f"autoshard: {name} planned replicated: {reason}", stacklevel=3)
    return list(fallbacks)


MEMO_SHAPES = 8   # mesh shapes a memo keeps (a plan over logical meshes tries a handful)


def _enumerate_graph(gm: fx.GraphModule, mesh, mesh_shape) -> list[tuple[str, str]]:
    from autoshard.passes.regions import META_KEY as REGION_KEY, find_regions, holds_table, token_local_strategies

    find_regions(gm)
    rep = tuple([Replicate()] * mesh.ndim)
    cache: dict = {}
    unsplit: dict[str, str] = {}   # a region's sort -> a member no token split suits here
    fallbacks: list[tuple[str, str]] = []
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder":
            opts = [rep]
            if isinstance(val, torch.Tensor) and val.ndim > 0 and not node.name.startswith("tangents"):
                per_dim = [Replicate()] + [Shard(d) for d in range(val.ndim)]
                opts = [p for p in itertools.product(per_dim, repeat=mesh.ndim) if _even(p, val.shape, mesh_shape)]
            node.meta[META_KEY] = NodeStrategies(sorted((Strategy((p,), (), _shards((p,), (), mesh_shape)) for p in opts), key=str))
            continue
        if node.op != "call_function":
            continue
        picked = picked_output(node)
        if picked is not None:
            node.meta[META_KEY] = NodeStrategies(alias_of=picked)
            continue
        # One enumeration per distinct (op, shapes, arguments): repeated layers
        # share the (immutable) result.
        key = _cache_key(node)
        if key is not None and key in cache:
            strategies, reason = cache[key]
        else:
            strategies, reason = _strategies(node, mesh, mesh_shape, rep)
            if key is not None:
                cache[key] = (strategies, reason)
        fact = node.meta.get(REGION_KEY)
        if fact is not None and fact.neutral:
            # a region's counts and offsets stay replicated (passes/regions.py, holds_table): from
            # torch 2.15 DTensor's cumsum rule also passes Partial through, and a plan took it
            strategies = [s for s in strategies if holds_table(s)] or [_replicated(node, rep)]
        elif fact is not None:
            # a token-local region's ops also run on each rank's own tokens (passes/regions.py)
            extra = [Strategy(outs, ins, _shards(outs, ins, mesh_shape))
                     for outs, ins in token_local_strategies(fact, mesh.ndim) if _keep(node, outs, ins, mesh_shape)]
            strategies = sorted(dict.fromkeys([*strategies, *extra]), key=str)
            if extra:
                reason = None
            else:
                unsplit.setdefault(fact.seed, node.name)
        if reason is not None:
            fallbacks.append((node.name, reason))
        node.meta[META_KEY] = NodeStrategies(strategies, reason)
    for seed, name in unsplit.items():   # the tie then keeps the whole region global
        warnings.warn(f"autoshard: the MoE dispatch sorted at {seed} stays replicated on mesh {mesh_shape}: "
                      f"{name}'s tokens do not split evenly over any of its dims", stacklevel=3)
    return fallbacks
