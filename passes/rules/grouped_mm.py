"""Grouped GEMM (``aten._grouped_mm``): the FLOP formula torch lacks.

Mixture-of-Experts layers (transformers' ``grouped_mm`` experts) sort the token-expert pairs by
expert and multiply each expert's run of rows by that expert's weight. Without a formula the
FLOP counter gives 0 and the planner would price a Mixtral's experts by their bytes alone. DTensor
has this op's sharding rule (split the weight's output or contraction dim: tensor-parallel
experts); it has none that splits the experts themselves, which needs an all-to-all dispatch.
"""

from __future__ import annotations

import math

import torch

from autoshard import _torch

GROUPED_MM = torch.ops.aten._grouped_mm.default


def _flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    if len(a_shape) == 2 and len(b_shape) == 2:
        # (m, k) x (k, n) with k split into groups: one (m, k_g) x (k_g, n) product per group
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    # (rows, k) x (groups, k, n), or batched (groups, m, k) x (groups, k, n): each output element
    # is one length-k dot product
    return 2 * math.prod(out_shape) * a_shape[-1]


_torch.register_flop_formula([GROUPED_MM.overloadpacket], _flops)
