"""coverage: the nodes whose strategies cannot keep a sharded input sharded.

After :func:`autoshard.passes.strategies.find_strategies`, a node is a *coverage gap* when, for
some tensor input that its producer can hand over sharded, every one of its strategies wants that
input whole (Replicate on every mesh dim). Planning such a graph is still correct, but the input
is gathered on every rank: with no rule for the op, a rule that narrows, or uneven shapes, a
plan can silently turn several times slower. "Sharded" means split (Shard), not a Partial sum, which
most ops must reduce first anyway. Not gaps, because replicating is the answer: scalar and integer
inputs (indices and positions are read against the whole of what they index); a norm's weight and
bias (``INHERENT``: they span the normalized dims). A reduction to a scalar, a loss among them, is
no exception: it reduces each rank's rows to a Partial sum (torch 2.14 and 2.15 gather the whole
batch for a mean cross-entropy, which :mod:`autoshard.passes.normalize` rewrites as a sum).

Each gap names the op, the input, why, and the model line that made the node (the node's
``meta["stack_trace"]``, which :mod:`autoshard.passes.trace` records for forward and backward
nodes alike). Facts go to ``node.meta["autoshard.coverage"]`` (the node's gaps).

Example::

    >>> find_strategies(traced.gm, mesh)
    >>> [(g.node, g.op) for g in coverage_gaps(traced.gm)]
    [('stack', 'aten.stack.default')]
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard

from autoshard.errors import CoverageGapError
from autoshard.passes.graph import META_KEY as STRATEGIES, output_options, tensor_inputs, value_of
from autoshard.passes.rules import attention

META_KEY = "autoshard.coverage"


@dataclass(frozen=True)
class Gap:
    node: str          # graph node name
    op: str            # the ATen op, e.g. "aten.stack.default"
    input: str         # the input every strategy replicates
    reason: str
    source: str        # the model line that made the node ("" when unknown)

    def __str__(self) -> str:
        where = f" at {self.source}" if self.source else ""
        return f"{self.node} ({self.op}){where}: {self.reason}"


def source_line(node: fx.Node) -> str:
    """``file:line in function`` of the model code that made ``node``, or ""."""
    trace = node.meta.get("stack_trace") or ""
    for line in trace.splitlines():
        line = line.strip()
        if line.startswith('File "'):
            path, _, rest = line[len('File "'):].partition('", line ')
            number, _, func = rest.partition(", in ")
            return f"{path}:{number.strip()} in {func.strip()}"
    return ""


def _replicated(p) -> bool:
    return p is None or all(isinstance(x, Replicate) for x in p)


def _sharded(p) -> bool:
    return p is not None and any(isinstance(x, Shard) for x in p)


# Inputs no local strategy can take sharded, by op and schema argument: a norm's weight and bias
# span the dims it normalizes over, and sharding those needs every rank's statistics (the
# normalized input shards on its other dims instead, as sequence parallelism does); attention's
# keys and values, where neither batch nor heads split, are read whole by every query (the
# queries shard by sequence instead: context parallelism, passes/rules/attention.py).
INHERENT: dict[str, frozenset[str]] = {
    "aten::native_layer_norm": frozenset({"weight", "bias"}),
    "aten::native_layer_norm_backward": frozenset({"weight", "bias"}),
    "aten::_fused_rms_norm": frozenset({"weight"}),
    "aten::_fused_rms_norm_backward": frozenset({"weight"}),
    "aten::_scaled_dot_product_flash_attention_for_cpu": frozenset({"key", "value"}),
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": frozenset({"key", "value"}),
}


def _arg_names(node: fx.Node) -> list[str]:
    """The schema argument name of each of ``tensor_inputs(node)``."""
    schema = getattr(node.target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    out: list[str] = []

    def walk(v, name):
        if isinstance(v, fx.Node):
            if v.op != "get_attr":   # as tensor_inputs: a graph constant is no input
                out.append(name)
        elif isinstance(v, (tuple, list)):
            for x in v:
                walk(x, name)

    for i, v in enumerate(node.args):
        walk(v, names[i] if i < len(names) else f"arg{i}")
    for k, v in node.kwargs.items():
        walk(v, k)
    return out


def _exempt(a: fx.Node) -> bool:
    """Scalars move for nothing; integer tensors are indices and positions, which an op reads
    against the whole of the data they index (a gather's index, a slice of position ids)."""
    val = a.meta.get("val")
    return not isinstance(val, torch.Tensor) or math.prod(val.shape) <= 1 or \
        not (val.is_floating_point() or val.is_complex())


def coverage_gaps(gm: fx.GraphModule, mesh_shape: tuple[int, ...] = ()) -> list[Gap]:
    """Every gap of ``gm``'s strategies, in graph order (one per node and input); ``mesh_shape``
    (the mesh they were found for) lets a gap name the shapes that would split."""
    gaps: list[Gap] = []
    for node in gm.graph.nodes:
        ns = node.meta.get(STRATEGIES)
        node.meta.pop(META_KEY, None)
        if node.op != "call_function" or ns is None or ns.alias_of is not None or ns.fallback:
            continue
        found = []
        inputs = tensor_inputs(node)
        names = _arg_names(node)
        inherent = INHERENT.get(getattr(getattr(node.target, "_schema", None), "name", None), frozenset())
        for a in dict.fromkeys(inputs):
            k = inputs.index(a)
            if _exempt(a) or names[k] in inherent:
                continue
            if all(_replicated(s.inputs[k]) for s in ns.strategies) and \
                    any(_sharded(p) for p in output_options(a)):
                producer, _ = value_of(a)
                hint = attention.no_sequence_split(node, ns.strategies, k, mesh_shape) if attention.is_attention(node) else ""
                hint = f"; {hint}" if hint else ""
                found.append(Gap(node.name, str(node.target), a.name,
                                 f"every strategy replicates input {k} ({a.name}, {tuple(a.meta['val'].shape)}), "
                                 f"which {producer.name} can hand over sharded{hint}", source_line(node)))
        if found:
            node.meta[META_KEY] = found
            gaps += found
    return gaps


def report_gaps(gaps: list[Gap], *, strict: bool = False) -> list[Gap]:
    """Warn once per op (its count and first node), or raise :class:`CoverageGapError` under
    ``strict``; returns ``gaps``."""
    by_op: dict[str, list[Gap]] = defaultdict(list)
    for g in gaps:
        by_op[g.op].append(g)
    for op, found in by_op.items():
        first = found[0]
        message = (f"{len(found)} {op} node(s) replicate an input that could stay sharded, so the plan gathers "
                   f"it on every rank; first: {first}. Their sharding rule narrows or is missing: register one "
                   f"with torch.distributed.tensor's register_sharding, or write the model line another way")
        if strict:
            raise CoverageGapError(f"autoshard: {message} (strict=True; plan.gaps lists them when strict=False)")
        warnings.warn(f"autoshard: {message}; plan.gaps lists them all", stacklevel=4)
    return gaps
