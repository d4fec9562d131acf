"""Elementwise ops DTensor registers no rule for.

``aten.floor_divide`` appears in transformers' grouped-GEMM Mixture-of-Experts dispatch (sorted
token-expert slot // top_k = the token a slot came from); ``aten.polar`` (magnitude and angle to
a complex number) in rotary embeddings written with complex numbers, as Meta's Llama code does. Elementwise means every output element
depends on the same element of the inputs alone, so sharding every operand on the same dim is
exact; integer division is not linear, so no Partial. An operand that broadcasts (another shape,
or a Python number) stays replicated; the all-Replicate rule is implied.
"""

from __future__ import annotations

import torch

from autoshard import _torch

aten = torch.ops.aten
S = _torch.ShardingPlaceholder


def _same_dim_rule(op, args_schema, kwargs_schema):
    tensors = [a for a in args_schema if isinstance(a, _torch.TensorMeta)]
    out = tensors[0].shape
    if any(t.shape != out for t in tensors):  # broadcasting: the smaller operand has no dim d
        return []
    return [[S(d)] * (1 + len(tensors)) for d in range(len(out))]


for _op in (aten.floor_divide.default, aten.floor_divide.Scalar, aten.polar.default):
    _torch.register_single_dim_strategy(_op)(_same_dim_rule)
