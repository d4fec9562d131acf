"""dtensor_rules: what DTensor's rule registry (and autoshard's rules for ops torch lacks,
``passes/rules``) allows an op, as (outputs, inputs) placement pairs on an N-D mesh.

* ops with a single-dim rule: the rule's placements per mesh dim, expanded over the mesh as their
  Cartesian product (the all-Replicate rule is implied);
* ops with an op-strategy function (written to *propagate*: several follow one input, ``stack``
  and ``cat`` merge theirs): asked once per combination of input placements, every placement each
  input can have (not only what its producer outputs), the answers united, so no rule narrows
  the set (:func:`_from_op_strategy_all`; docs/design.md; tests/test_coverage.py holds it against
  brute force);
* ops with no tensor input (factories): Replicate;
* anything else: Replicate, with the reason (:func:`rule_placements`).

Dim arguments are made non-negative before any rule sees them (:func:`normalized_args`).
:func:`even` is the evenness the strategy pass keeps (passes/strategies.py). The region pass asks
one op's rule about given input placements (:func:`placements_through`), so this module sits
below both and imports neither.
"""

from __future__ import annotations

import itertools

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autoshard import _torch
from autoshard.passes.graph import Placements, tensor_inputs, tensor_vals


def _meta(val) -> "_torch.TensorMeta":
    return _torch.TensorMeta(val.shape, val.stride(), val.dtype)


def even(placements: Placements | None, shape, mesh_shape) -> bool:
    """Whether ``placements`` split a tensor of ``shape`` evenly on a mesh of ``mesh_shape`` (every
    sharded dim divides by its shard count), with no strided shard, no masked partial and nothing
    but Replicate on a mesh dim of one device: local shapes, costs and numerics are then exact."""
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
        rank = len(tensor_vals(node.meta["val"])[0].shape)
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
    return [p for p in itertools.product(per_dim, repeat=len(mesh_shape)) if even(p, val.shape, mesh_shape)]


def _from_single_dim(node, info, mesh) -> list:
    """A single-dim rule's strategies on one mesh dim, expanded over the mesh as their Cartesian
    product: complete by construction (the rule reads shapes, never input placements)."""
    args, kwargs = normalized_args(node)
    args = _torch.tree_map_only(fx.Node, lambda a: _meta(a.meta["val"]), args)
    kwargs = _torch.tree_map_only(fx.Node, lambda a: _meta(a.meta["val"]), kwargs)
    rules = info.func(node.target, args, kwargs)
    n_in = len(tensor_inputs(node))
    n_out = len(rules[0]) - n_in if rules else len([v for v in tensor_vals(node.meta["val"])])
    out_vals = tensor_vals(node.meta["val"])
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
    n_in, n_out = len(tensor_inputs(node)), len(tensor_vals(node.meta["val"]))
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


def rule_placements(node: fx.Node, mesh) -> tuple[list, str | None]:
    """The (outputs, inputs) placements the rules allow ``node`` on ``mesh``, uneven ones among
    them, and why it is planned replicated (None where a rule answered)."""
    op = node.target
    if not tensor_inputs(node):
        return [(tuple(tuple([Replicate()] * mesh.ndim) for _ in tensor_vals(node.meta["val"])), ())], None
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
    n_out = len(tensor_vals(node.meta["val"]))
    rep = tuple([Replicate()] * mesh.ndim)
    return [(tuple(rep for _ in range(n_out)), tuple(rep for _ in tensor_inputs(node)))], reason
