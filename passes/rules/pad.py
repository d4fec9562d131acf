"""Constant padding (``aten.constant_pad_nd``), where the installed torch's rule cannot be planned.

torch 2.11 and 2.12 register a placeholder rule for it: one all-Replicate strategy whose
placements are written for a 1-D mesh (one per tensor, and two input specs for the one input), so
on a 2-D mesh it answers with placements of the wrong length. Swin pads its windows this way
(with zero pads where the size already divides). The rule below, torch 2.13's, is registered
where torch has no single-dim rule for it:

* any dim the pads leave alone (both pads zero) splits, the input and the output alike;
* a partial sum stays one where what is written is zero (every pad zero, or the value zero):
  the ranks' zeros sum to zero.
"""

from __future__ import annotations

import torch

from autoshard import _torch

aten = torch.ops.aten
S = _torch.ShardingPlaceholder
P = torch.distributed.tensor.Partial()


def _constant_pad(op, args_schema, kwargs_schema):
    # [out, input]; pad lists [last dim's left, its right, the dim before's left, ...]
    x, pad = args_schema[:2]
    value = args_schema[2] if len(args_schema) > 2 else kwargs_schema.get("value", 0)
    ndim = len(x.shape)
    padded = {ndim - 1 - i // 2 for i, amount in enumerate(pad) if amount != 0}
    rules = [[S(d), S(d)] for d in range(ndim) if d not in padded]
    if not padded or value == 0:
        rules.append([P, P])
    return rules


RULES = {aten.constant_pad_nd.default: _constant_pad}
# what this module registered (empty from torch 2.13): tests check these rules
ADDED = [op for op in RULES if _torch.single_dim_rule(op) is None]
for _op in ADDED:
    _torch.register_single_dim_strategy(_op, schema_info=_torch.RuntimeSchemaInfo(1))(RULES[_op])
