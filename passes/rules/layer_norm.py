"""Layer norm and RMS norm, forward and backward, where the installed torch's rule cannot be planned.

torch 2.13 gave these ops single-dim rules. torch 2.11 and 2.12 have rules of the older kind,
written for DTensor's dispatch, where the statistics (mean, rstd) and the weight and bias reaching
the backward always come from a forward that DTensor itself placed: the backward's rule takes their
placements as it finds them and never asks for a redistribution. Asked about every placement of
every input, as planning asks (passes/dtensor_rules.py), that rule accepts statistics split unlike
the input and a split weight, and the plan then fails at run time (a [32] weight slice against a
[.., 64] row). The rules below, torch 2.13's, are registered where torch has no single-dim rule
for the op; DTensor's dispatch prefers a single-dim rule, so execution runs what was planned.

A norm works on each row (the trailing normalized dims) alone: the input, output, gradients and
statistics split alike on a leading dim, the weight and bias whole; their gradients sum over the
rows, so each rank's is a partial sum.
"""

from __future__ import annotations

import torch

from autoshard import _torch

aten = torch.ops.aten
S = _torch.ShardingPlaceholder
R = torch.distributed.tensor.Replicate()
P = torch.distributed.tensor.Partial()


def _leading_dims(x, normalized_shape) -> range:
    """The dims of ``x`` a norm over ``normalized_shape`` keeps apart: those before the rows."""
    n = 1 if isinstance(normalized_shape, int) else len(normalized_shape)
    return range(len(x.shape) - n)


def _layer_norm(op, args_schema, kwargs_schema):
    # [out, mean, rstd, input, weight?, bias?]
    x, shape, weight, bias = args_schema[:4]
    params = [R] * ((weight is not None) + (bias is not None))
    return [[S(d)] * 4 + params for d in _leading_dims(x, shape)]


def _layer_norm_backward(op, args_schema, kwargs_schema):
    # [grad_input, grad_weight, grad_bias, grad_out, input, mean, rstd, weight?, bias?]
    _, x, shape, _, _, weight, bias, mask = args_schema
    params = [R] * ((weight is not None) + (bias is not None))
    return [[S(d) if mask[0] else None, P if mask[1] and weight is not None else None,
             P if mask[2] and bias is not None else None] + [S(d)] * 4 + params
            for d in _leading_dims(x, shape)]


def _rms_norm(op, args_schema, kwargs_schema):
    # [out, rstd, input, weight?]
    x, shape, weight = args_schema[:3]
    return [[S(d)] * 3 + [R] * (weight is not None) for d in _leading_dims(x, shape)]


def _rms_norm_backward(op, args_schema, kwargs_schema):
    # [grad_input, grad_weight, grad_out, input, rstd, weight?]
    _, x, shape, _, weight, mask = args_schema
    return [[S(d) if mask[0] else None, P if mask[1] and weight is not None else None] + [S(d)] * 3
            + [R] * (weight is not None) for d in _leading_dims(x, shape)]


# op -> (rule, index of the first argument that is no tensor and changes the answer)
RULES = {
    aten.native_layer_norm.default: (_layer_norm, 1),
    aten.native_layer_norm_backward.default: (_layer_norm_backward, 2),
    aten._fused_rms_norm.default: (_rms_norm, 1),
    aten._fused_rms_norm_backward.default: (_rms_norm_backward, 2),
}
# what this module registered (empty from torch 2.13): tests check these rules
ADDED = [op for op in RULES if _torch.single_dim_rule(op) is None]
for _op in ADDED:
    _rule, _static = RULES[_op]
    _torch.register_single_dim_strategy(_op, schema_info=_torch.RuntimeSchemaInfo(_static))(_rule)
