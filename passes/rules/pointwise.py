"""Elementwise ops DTensor registers no rule for (on some releases or on all).

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

# Activations and their backward ops: elementwise in every tensor operand (the input, the
# gradient, the output where the backward reads it), with Python-number parameters. No release
# has rules for most backward ops (ReLU6's hardtanh, LeakyReLU's, softplus's as in Mamba's
# step size, ELU's, Mish's, hard swish's and hard sigmoid's as in MobileNet), and torch 2.11 none
# for the forward ops either; without one the planner gathered the activation on every rank.
# Registered only where the installed torch has none, so a release's own rule stays.
ACTIVATIONS = [aten.softplus.default, aten.softplus_backward.default, aten.elu.default, aten.elu_backward.default,
               aten.celu.default, aten.selu.default, aten.leaky_relu.default, aten.leaky_relu_backward.default,
               aten.hardtanh.default, aten.hardtanh_backward.default, aten.hardswish.default,
               aten.hardswish_backward.default, aten.hardsigmoid.default, aten.hardsigmoid_backward.default,
               aten.mish.default, aten.mish_backward.default, aten.softshrink.default,
               aten.softshrink_backward.default, aten.hardshrink.default, aten.hardshrink_backward.default,
               aten.logit_backward.default]
# ``copy(dst, src)``: src's values in dst's shape and dtype, elementwise where the shapes match.
# Functionalization writes an in-place slice copy so (DeepSeek-V3's attention assembles its keys
# with ``new_empty(...)[..., :d].copy_(k)``); without a rule the keys were gathered on every rank.
COPIES = [aten.copy.default]
ADDED = [op for op in ACTIVATIONS + COPIES if not _torch.has_sharding_rule(op)]
for _op in ADDED:
    _torch.register_single_dim_strategy(_op)(_same_dim_rule)
