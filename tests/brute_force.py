"""The oracle for strategy enumeration: every combination of input placements fed to DTensor's
propagation one at a time, the answers united.

Independent of passes/dtensor_rules.py: its own placement lists and evenness check, and DTensor's
own expansion of single-dim rules over the mesh (``_expand_single_dim_strategy_to_mesh``, what
DTensor runs at dispatch) rather than autoshard's Cartesian product. Combinations beyond ``limit`` are
sampled (seeded), so wide ops (16-input stacks, attention backward) are checked too.
"""

from __future__ import annotations

import itertools
import math
import random

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard

from autoshard import _torch
from autoshard._torch import DTensorSpec, OpSchema, OpSpec, OpStrategy, TensorMeta, TupleStrategy


def _inputs(node: fx.Node) -> list[fx.Node]:
    out = []
    for a in [*node.args, *node.kwargs.values()]:
        for x in (a if isinstance(a, (list, tuple)) else [a]):
            if isinstance(x, fx.Node):
                out.append(x)
    return out


def _tm(val) -> TensorMeta:
    return TensorMeta(val.shape, val.stride(), val.dtype)


def placements(val, mesh_shape) -> list[tuple]:
    """Every placement of a tensor on the mesh that splits it evenly."""
    per_dim = [Replicate(), *[Shard(d) for d in range(val.ndim)]]
    if val.is_floating_point() or val.is_complex():
        per_dim.append(Partial())
    return [p for p in itertools.product(per_dim, repeat=len(mesh_shape)) if even(p, val, mesh_shape)]


def even(p, val, mesh_shape) -> bool:
    split = [1] * val.ndim
    for x, m in zip(p, mesh_shape):
        if type(x) not in (Replicate, Shard, Partial):
            return False           # strided shards, masked partials: not planned
        if m == 1 and not isinstance(x, Replicate):
            return False
        if isinstance(x, Shard):
            if not 0 <= x.dim < val.ndim:
                return False
            split[x.dim] *= m
    return all(s % k == 0 for s, k in zip(val.shape, split))


def _schema(node, mesh, combo: dict):
    from autoshard.passes.dtensor_rules import normalized_args

    def spec(a):
        return OpStrategy([OpSpec(DTensorSpec(mesh, combo[a], _tm(a.meta["val"])))])

    args, kwargs = normalized_args(node)
    def arg(a):
        if isinstance(a, fx.Node):
            return spec(a)
        if isinstance(a, (list, tuple)) and a and all(isinstance(x, fx.Node) for x in a):
            return TupleStrategy([spec(x) for x in a])
        if isinstance(a, (list, tuple)):   # an index list with None holes
            return type(a)(spec(x) if isinstance(x, fx.Node) else x for x in a)
        return a

    args = tuple(arg(a) for a in args)
    kwargs = {k: spec(v) if isinstance(v, fx.Node) else v for k, v in kwargs.items()}
    prop = _torch.sharding_propagator()
    info = prop.op_to_schema_info_for_single_dim_strategy.get(node.target) or prop.op_to_schema_info.get(node.target)
    return OpSchema(node.target, args, kwargs, schema_info=info)


def _answers(node, mesh, combo) -> list:
    prop = _torch.sharding_propagator()
    schema = _schema(node, mesh, combo)
    if node.target in prop.op_single_dim_strategy_funcs:
        vals = node.meta["val"] if isinstance(node.meta["val"], (tuple, list)) else [node.meta["val"]]
        metas = [_tm(v) if isinstance(v, torch.Tensor) else None for v in vals]
        fn = _torch.expand_single_dim_strategy(mesh, schema, prop.op_single_dim_strategy_funcs[node.target],
                                                 metas[0] if len(metas) == 1 else tuple(metas))
        out = fn(node.target, schema.args_meta, schema.kwargs_meta)
    else:
        out = prop.op_strategy_funcs[node.target](schema)
    result = []
    n_in = len(_inputs(node))
    for s in out.strategies:
        outs = s.output_specs if isinstance(s.output_specs, (tuple, list)) else (s.output_specs,)
        outs = tuple(None if o is None else tuple(o.placements) for o in outs)
        ins = (outs[0],) * n_in if s.input_specs is None else tuple(None if i is None else tuple(i.placements)
                                                                    for i in s.input_specs)
        result.append((outs, ins))
    return result


def strategies(node: fx.Node, mesh, limit: int = 1500, seed: int = 0) -> tuple[set, int, int]:
    """(the united, evenly split strategies; combinations asked; combinations in all). A single-dim
    rule's expansion reads only which kinds of shard its inputs hold, and costs milliseconds on a
    2-D mesh: it is asked ``limit // 40`` combinations."""
    mesh_shape = tuple(mesh.shape)
    if node.target in _torch.sharding_propagator().op_single_dim_strategy_funcs:
        limit //= 40
    inputs = list(dict.fromkeys(_inputs(node)))
    options = [placements(a.meta["val"], mesh_shape) for a in inputs]
    total = math.prod(len(o) for o in options)
    if total <= limit:
        combos = itertools.product(*options)
    else:
        rng = random.Random(seed)
        combos = [tuple(rng.choice(o) for o in options) for _ in range(limit)]
    vals = node.meta["val"] if isinstance(node.meta["val"], (tuple, list)) else [node.meta["val"]]
    found: set = set()
    asked = 0
    with _torch.unpriced_strategies():
        for combo in combos:
            asked += 1
            _ask(node, mesh, dict(zip(inputs, combo)), vals, mesh_shape, found)
    return found, asked, total


def _ask(node, mesh, combo, vals, mesh_shape, found) -> None:
    try:
        answers = _answers(node, mesh, combo)
    except Exception:  # noqa: BLE001 - the rule rejects this combination
        return
    for outs, ins in answers:
        ok = all(p is None or (isinstance(v, torch.Tensor) and even(p, v, mesh_shape)) for p, v in zip(outs, vals))
        ok = ok and all(p is not None and even(p, a.meta["val"], mesh_shape) and
                        not any(isinstance(x, Partial) and x.reduce_op != "sum" for x in p)
                        for p, a in zip(ins, _inputs(node)))
        if ok:
            found.add((outs, ins))
