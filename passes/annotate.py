"""annotate: FLOPs, bytes moved and output bytes of every node, and its phase.

Records an :class:`OpCost` under ``node.meta["autoshard.cost"]``. FLOPs come from
``torch.utils.flop_counter``'s formulas (autoshard registers the ones torch lacks, e.g. the CPU
flash-attention kernels, in ``passes/rules``); bytes are the global sizes of the op's tensor
inputs and outputs (a roofline's memory traffic); views, getitem and other aliasing ops cost
nothing. Costs are global: a strategy divides them by its shard count.

Under a fusing compiler (``backend="inductor"``) an elementwise op read by another elementwise op
or a reduction of the same phase runs inside that reader's kernel: it launches no kernel of its
own, that reader reads nothing of it, and it writes its value only for readers that do not fuse
it (:func:`fused`; inductor calls such an op inlined, and a value it writes realized).
``OpCost.fused_bytes`` is what an op moves then, ``OpCost.inlined`` whether it launches nothing
(docs/design.md, "Backends").

Example::

    >>> annotate(traced)
    >>> mm = traced.gm.graph.find_nodes(op="call_function", target=torch.ops.aten.mm.default)[0]
    >>> mm.meta["autoshard.cost"].flops        # 2 * M * K * N
    2097152
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from autoshard import _torch

aten = torch.ops.aten

META_KEY = "autoshard.cost"


@dataclass(frozen=True)
class OpCost:
    flops: float          # global FLOPs of the op
    bytes: float          # global bytes read + written (0 for views)
    out_bytes: float      # bytes of the op's outputs
    phase: str            # "fwd" | "bwd" | "input"
    dtype: torch.dtype    # compute dtype (of the largest output)
    fused_bytes: float | None = None   # bytes moved under a fusing compiler (None: as ``bytes``)
    inlined: bool = False              # under a fusing compiler, computed inside a reader's kernel


def tensor_bytes(val, dtype: torch.dtype | None = None) -> float:
    """Bytes of a tensor (or of the tensors in a tuple); with ``dtype``, floating tensors counted
    at that dtype's size (what a mixed-precision runtime moves)."""
    def size(t: torch.Tensor) -> int:
        return t.numel() * (dtype.itemsize if dtype is not None and t.is_floating_point() else t.element_size())

    return float(sum(size(t) for t in _torch.tree_leaves(val) if isinstance(t, torch.Tensor)))


def feeds_only_grads(gm: fx.GraphModule, traced) -> set[fx.Node]:
    """Nodes whose values reach nothing but parameter gradients (the weight-gradient matmul, its
    transposes and casts): the reductions into them are gradient reductions."""
    grads = {g for g in traced.grads.values() if g is not None}
    only: set[fx.Node] = set()
    for node in reversed(gm.graph.nodes):
        if node.op != "call_function":
            continue
        users = list(node.users)
        if node in grads or (users and all(u in only for u in users)):
            only.add(node)
    return only


# Ops that move no data but whose schemas do not say they alias (_unsafe_view is view + no
# aliasing check; detach/alias return views).
_FREE = (torch.ops.aten.detach.default, torch.ops.aten.alias.default, torch.ops.aten._unsafe_view.default)


def is_free(node: fx.Node) -> bool:
    """Ops that alias their input or move no data."""
    if node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return False
    if node.target in _FREE:
        return True
    return any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def _flops(node: fx.Node) -> float:
    formula = _torch.flop_formula(node.target)
    if formula is None:
        return 0.0
    # torch's formulas take the (fake) tensors and read their shapes themselves
    args = _torch.tree_map_only(fx.Node, lambda a: a.meta.get("val"), node.args)
    kwargs = _torch.tree_map_only(fx.Node, lambda a: a.meta.get("val"), node.kwargs)
    return float(formula(*args, **kwargs, out_val=node.meta.get("val")))


def _source(node: fx.Node) -> fx.Node:
    """The op whose value ``node`` is a view of (itself if it is none)."""
    while is_free(node) and node.op == "call_function" and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


def phases(gm: fx.GraphModule) -> dict[fx.Node, str]:
    """Forward = the nodes before the first one that reads a tangent; backward = the rest.

    By position, not by dataflow: autograd emits a few tangent-free nodes (detaches) among the
    backward ops, and torch's partitioner splits the graph by position too."""
    tangents = {n for n in gm.graph.find_nodes(op="placeholder") if n.name.startswith("tangents")}
    out, in_bwd = {}, False
    for n in gm.graph.nodes:
        in_bwd = in_bwd or (n.op == "call_function" and any(a in tangents for a in n.all_input_nodes))
        out[n] = "input" if n.op == "placeholder" else "bwd" if in_bwd else "fwd"
    return out


# Reductions and normalizations inductor lowers to loops over their input, into which it fuses
# the elementwise ops that feed them (it also fuses elementwise readers into some of them, which
# is not counted: a reduction's output is always written).
_FUSIBLE_REDUCTIONS = frozenset({
    aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default, aten.amax.default,
    aten.amin.default, aten.var_mean.correction, aten._softmax.default, aten._log_softmax.default,
    aten._softmax_backward_data.default, aten._log_softmax_backward_data.default,
    aten.native_layer_norm.default, aten.native_layer_norm_backward.default,
})


def is_pointwise(node: fx.Node) -> bool:
    """Elementwise: torch's pointwise tag, and a cast of dtype alone (``_to_copy`` carries no tag,
    and mixed precision puts one on every parameter and activation it narrows)."""
    if node.op != "call_function":
        return False
    if node.target is aten._to_copy.default:
        return set(node.kwargs) <= {"dtype", "layout", "memory_format"}
    return torch.Tag.pointwise in getattr(node.target, "tags", ())


def _readers(node: fx.Node) -> list[fx.Node]:
    """The ops that read ``node``'s value, through views (which a fused kernel indexes into)."""
    out = []
    for u in node.users:
        out += _readers(u) if is_free(u) else [u]
    return out


def _fuses(reader: fx.Node, node: fx.Node, phase: dict[fx.Node, str]) -> bool:
    """Whether a fusing compiler computes ``node`` inside ``reader``'s kernel: an elementwise op
    or a fusible reduction, of the same phase (the forward and backward graphs compile apart)."""
    return (is_pointwise(reader) or reader.target in _FUSIBLE_REDUCTIONS) and phase.get(reader) == phase[node]


def fused(gm: fx.GraphModule, phase: dict[fx.Node, str]) -> dict[fx.Node, bool]:
    """The elementwise ops a fusing compiler computes inside their readers' kernels (those with
    a reader that fuses them, :func:`_fuses`), each mapped to whether its value is still realized
    (written to memory) for a reader that does not fuse it: a matmul, attention, an op of the
    other phase (a value saved for backward) or the graph's output. Nothing is fused into matmuls
    or attention. Read off the traced graph, before any strategy: a resharding between two ops
    would break their fusion, which the rule does not see."""
    out = {}
    for node in gm.graph.nodes:
        if not is_pointwise(node) or is_free(node):
            continue
        readers = _readers(node)
        fusing = [u for u in readers if _fuses(u, node, phase)]
        if fusing:
            out[node] = len(fusing) < len(readers)
    return out


def annotate(gm: fx.GraphModule) -> None:
    """Fill ``node.meta["autoshard.cost"]`` for every placeholder and call_function node."""
    from autoshard.passes import rules  # noqa: F401 - registers autoshard's own formulas and rules

    phase = phases(gm)
    inside = fused(gm, phase)
    for node in gm.graph.nodes:
        if node.op not in ("placeholder", "call_function"):
            continue
        val = node.meta.get("val")
        tensors = [t for t in _torch.tree_leaves(val) if isinstance(t, torch.Tensor)]
        dtype = max(tensors, key=lambda t: t.numel()).dtype if tensors else torch.float32
        out_b = tensor_bytes(val)
        if node.op == "placeholder" or is_free(node):
            cost = OpCost(0.0, 0.0, out_b, phase[node], dtype)
        else:
            ins = [(a, tensor_bytes(a.meta.get("val"))) for a in node.all_input_nodes]
            in_b = sum(b for _, b in ins)
            # what a fused kernel reads from memory: not the values computed inside it
            outside = sum(b for a, b in ins if not (_source(a) in inside and _fuses(node, _source(a), phase)))
            realized = inside.get(node, True)
            cost = OpCost(_flops(node), in_b + out_b, out_b, phase[node], dtype,
                          fused_bytes=outside + (out_b if realized else 0.0), inlined=node in inside)
        node.meta[META_KEY] = cost
