"""annotate: FLOPs, bytes moved and output bytes of every node, and its phase.

Records an :class:`OpCost` under ``node.meta["autoshard.cost"]``. FLOPs come from
``torch.utils.flop_counter``'s formulas (autoshard registers the ones torch lacks, e.g. the CPU
flash-attention kernels, in ``passes/rules``); bytes are the global sizes of the op's tensor
inputs and outputs (a roofline's memory traffic); views, getitem and other aliasing ops cost
nothing. Costs are global: a strategy divides them by its shard count.

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

META_KEY = "autoshard.cost"


@dataclass(frozen=True)
class OpCost:
    flops: float          # global FLOPs of the op
    bytes: float          # global bytes read + written (0 for views)
    out_bytes: float      # bytes of the op's outputs
    phase: str            # "fwd" | "bwd" | "input"
    dtype: torch.dtype    # compute dtype (of the largest output)


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


def annotate(gm: fx.GraphModule) -> None:
    """Fill ``node.meta["autoshard.cost"]`` for every placeholder and call_function node."""
    from autoshard.passes import rules  # noqa: F401 - registers autoshard's own formulas and rules

    phase = phases(gm)
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
            in_b = sum(tensor_bytes(a.meta.get("val")) for a in node.all_input_nodes)
            cost = OpCost(_flops(node), in_b + out_b, out_b, phase[node], dtype)
        node.meta[META_KEY] = cost
