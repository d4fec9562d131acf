"""graph: what the passes read off an fx graph, and the strategy facts they share.

A node's tensor inputs in DTensor's order, its arguments as one comparable value, which output a
getitem picks, and the facts the strategy pass leaves in ``node.meta["autoshard.strategies"]``
(:class:`Strategy`, :class:`NodeStrategies`) with the helpers that read them. They live below the
strategy pass so that the passes it calls (regions) and the ones after it (coverage, coarsen,
rewrite, the solver) read them without importing the pass. No DTensor rule is asked here
(passes/dtensor_rules.py asks them).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from functools import cached_property

import torch.fx as fx
from torch.distributed.tensor.placement_types import Placement

from autoshard.notation import placements_str

META_KEY = "autoshard.strategies"
Placements = tuple[Placement, ...]


@dataclass(frozen=True)
class Strategy:
    outputs: tuple[Placements | None, ...]   # per tensor output of the op
    inputs: tuple[Placements | None, ...]    # per tensor input (tensor_inputs(node) order)
    shards: int = 1                          # ranks the op's work is split over
    # the slowest rank's work over an even share (1: even; causal attention split by sequence into
    # contiguous chunks: the last chunk sees every key, passes/rules/attention.py; below 1 for an
    # op over an expert-parallel receive buffer smaller than its replicated placement says,
    # passes/regions.py)
    imbalance: float = 1.0
    variant: str = ""                        # how the op runs these placements, where there are two ways

    @property
    def work_shards(self) -> float:
        """The op's time divides by this: its shards, less the slowest rank's excess."""
        return self.shards / self.imbalance

    @cached_property
    def text(self) -> str:
        text = ",".join(map(placements_str, self.inputs)) + "->" + ",".join(map(placements_str, self.outputs))
        return f"{text} {self.variant}" if self.variant else text

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


def tensor_vals(val) -> list:
    """A node's ``meta["val"]`` as a list, one entry per output (a single-output op's one)."""
    return [v for v in (val if isinstance(val, (tuple, list)) else (val,))]


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
    repeated layers) share one immutable strategy list (passes/strategies.py), so what derives
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
