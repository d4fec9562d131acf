"""strategies: the candidate sharding strategies of every node on an N-D device mesh.

A :class:`Strategy` fixes, for each mesh dim, the placement (Replicate, Shard(d), Partial) of every
tensor output and of every tensor input the op needs; resharding a producer's output to that
input placement is the solver's edge cost. Rules are DTensor's own registry (so what is planned
is what DTensor runs), plus autoshard's rules for ops torch lacks (``passes/rules``), asked so
that none narrows the set (passes/dtensor_rules.py); an op no rule takes is planned Replicate and
reported in the result's ``fallback`` (``strict`` raises). A token-local MoE region's ops also
get the strategies that run them on each rank's own tokens (passes/regions.py), and causal
attention its sequence splits (``rules.EXTRA``: context parallelism, passes/rules/attention.py).

Only even sharding is kept (every sharded dim divides by its shard count), and no strided shards
or masked partials (vocab-parallel embedding), so local shapes, costs and numerics are exact.
Facts go to ``node.meta["autoshard.strategies"]`` (:class:`Strategy`, :class:`NodeStrategies`,
defined in passes/graph.py with the helpers that read them).

Example::

    >>> find_strategies(traced, planning_mesh((2,), ("d0",)))
    >>> [str(s) for s in mm.meta["autoshard.strategies"].strategies][:3]
    ['(R),(R)->(R)', '(S(0)),(R)->(S(0))', '(R),(S(1))->(S(1))']
"""

from __future__ import annotations

import itertools
import warnings

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard

from autoshard import _torch
from autoshard.errors import ConstraintError, NoShardingRuleError
from autoshard.passes import rules  # registers autoshard's own rules with DTensor's registry
from autoshard.passes.dtensor_rules import even, rule_placements
from autoshard.passes.graph import (  # the fact types stay importable from the pass that makes them
    META_KEY, NodeStrategies, Placements, Strategy, args_key, picked_output, tensor_inputs, tensor_vals)
from autoshard.passes.regions import (META_KEY as REGION_KEY, ep_strategies, find_regions, holds_table,
                                      token_local_strategies)


def _shards(s_out, s_in, mesh_shape) -> int:
    n = 1
    for d, m in enumerate(mesh_shape):
        if any(p is not None and not isinstance(p[d], Replicate) for p in (*s_out, *s_in)):
            n *= m
    return n


def _keep(node: fx.Node, outs, ins, mesh_shape) -> bool:
    out_vals = tensor_vals(node.meta["val"])
    for p, v in zip(outs, out_vals):
        if p is not None and (not isinstance(v, torch.Tensor) or not even(p, v.shape, mesh_shape)):
            return False
    for p, a in zip(ins, tensor_inputs(node)):
        if p is None or not even(p, a.meta["val"].shape, mesh_shape):
            return False
        if any(isinstance(x, Partial) and x.reduce_op != "sum" for x in p):
            return False  # ops fed avg/max partials duplicate their sum twins; keep one
    return True


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
    raw, reason = rule_placements(node, mesh)
    seen: dict[Strategy, None] = {}
    for outs, ins in raw:
        if _keep(node, outs, ins, mesh_shape) and not _scatters_into_split_dim(node, outs, ins):
            seen.setdefault(Strategy(outs, ins, _shards(outs, ins, mesh_shape)))
    extra = rules.EXTRA.get(node.target)
    for outs, ins, imbalance, variant in (extra(node, mesh_shape) if extra else ()):
        if _keep(node, outs, ins, mesh_shape):
            seen.setdefault(Strategy(outs, ins, _shards(outs, ins, mesh_shape), imbalance, variant))
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
    n_out = len(tensor_vals(node.meta["val"]))
    return Strategy(tuple(rep for _ in range(n_out)), tuple(rep for _ in tensor_inputs(node)), 1)


def find_strategies(gm: fx.GraphModule, mesh, *, strict: bool = False, memo: dict | None = None,
                    moe_imbalance: float = 1.0, moe_capacity: float | None = None) -> list[tuple[str, str]]:
    """Fill ``node.meta["autoshard.strategies"]``; returns the (node, reason) fallbacks.

    ``memo`` (a dict kept with the graph: ``TracedModel.strategy_memo``) holds each mesh shape's
    result, so planning the same graph again on a mesh of that shape (a baseline, another logical
    mesh, another memory cap) does not enumerate again: strategies depend on the mesh's shape only,
    and on ``moe_imbalance`` and ``moe_capacity`` (the load expert-parallel strategies are priced
    at, and the receive buffer they hold; part of the key)."""
    _check_moe(moe_imbalance, moe_capacity)
    mesh_shape = tuple(mesh.shape)
    key = (mesh_shape if (moe_imbalance, moe_capacity) == (1.0, None)
           else (mesh_shape, float(moe_imbalance), moe_capacity and float(moe_capacity)))
    if memo is not None and key in memo:
        found, fallbacks = memo[key]
        for node, ns in found.items():
            node.meta[META_KEY] = ns
    else:
        with _torch.unpriced_strategies():
            fallbacks = _enumerate_graph(gm, mesh, mesh_shape, moe_imbalance, moe_capacity)
        if memo is not None:
            while len(memo) >= MEMO_SHAPES:
                memo.pop(next(iter(memo)))
            memo[key] = ({n: n.meta[META_KEY] for n in gm.graph.nodes if META_KEY in n.meta}, fallbacks)
    if strict and fallbacks:
        name, reason = fallbacks[0]
        raise NoShardingRuleError(f"node {name}: {reason}. Register a rule with "
                                  f"torch.distributed.tensor's register_sharding or pass strict=False "
                                  f"to plan it replicated.")
    for name, reason in fallbacks:
        warnings.warn(f"autoshard: {name} planned replicated: {reason}", stacklevel=3)
    return list(fallbacks)


MEMO_SHAPES = 8   # mesh shapes a memo keeps (a plan over logical meshes tries a handful)


def _check_moe(imbalance, capacity) -> None:
    number = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool)  # noqa: E731
    if not (number(imbalance) and imbalance >= 1.0):
        raise ConstraintError(f"moe_imbalance is the busiest expert-parallel rank's received rows over an even "
                              f"share: a number >= 1.0, not {imbalance!r}")
    if capacity is not None and not (number(capacity) and capacity >= imbalance):
        raise ConstraintError(f"moe_capacity is the rows an expert-parallel rank's receive buffer holds over its own "
                              f"rows: None (every rank's rows) or a number >= moe_imbalance ({imbalance:g}), since "
                              f"the busiest rank receives that many; not {capacity!r}")


def _enumerate_graph(gm: fx.GraphModule, mesh, mesh_shape, moe_imbalance: float = 1.0,
                     moe_capacity: float | None = None) -> list[tuple[str, str]]:
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
                opts = [p for p in itertools.product(per_dim, repeat=mesh.ndim) if even(p, val.shape, mesh_shape)]
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
            # ... or expert-parallel: each rank holds some experts and receives their rows
            extra += [Strategy(outs, ins, _shards(outs, ins, mesh_shape), imbalance, variant)
                      for outs, ins, imbalance, variant
                      in ep_strategies(node, fact, mesh_shape, moe_imbalance, moe_capacity)
                      if _keep(node, outs, ins, mesh_shape)]
            strategies = sorted(dict.fromkeys([*strategies, *extra]), key=str)
            if extra:
                reason = None
            else:
                unsplit.setdefault(fact.seed, node.name)
        if reason is not None:
            fallbacks.append((node.name, reason))
        node.meta[META_KEY] = NodeStrategies(strategies, reason)
    if moe_capacity is not None:
        dropless = {f.seed: f.dropless for n in gm.graph.nodes
                    if (f := n.meta.get(REGION_KEY)) is not None and f.dropless is not None}
        for seed, why in dropless.items():
            warnings.warn(f"autoshard: the MoE dispatch sorted at {seed} keeps a receive buffer for every rank's "
                          f"rows if it runs expert-parallel, whatever moe_capacity says: {why}", stacklevel=3)
    for seed, name in unsplit.items():   # the tie then keeps the whole region global
        warnings.warn(f"autoshard: the MoE dispatch sorted at {seed} stays replicated on mesh {mesh_shape}: "
                      f"{name}'s tokens do not split evenly over any of its dims", stacklevel=3)
    return fallbacks
