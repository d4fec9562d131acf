"""Gathers by index tensors (``aten.index.Tensor``), where the installed torch has no rule
autoshard can read.

torch 2.13 gave ``index.Tensor`` a single-dim rule; 2.11 and 2.12 have only an older kind of rule
(asked for one output placement given the inputs', it lists no strategies), so every gather would
be planned replicated there, among them the expert weights batched_mm Mixtral gathers per token.
The rule below, torch 2.13's, is registered only where torch has none of the strategy kinds:

* the values split on a dim no index selects, the indices replicated: the output splits where
  that dim lands (in place of a consecutive block of indexed dims, else after the index dims);
* the indices split on one broadcast dim, each along its own dim there (replicated where it
  broadcasts), the values replicated: the output splits on the index dims' position of it;
* the values a partial sum: the gather of each addend sums to the gather of the sum.
"""

from __future__ import annotations

import torch

from autoshard import _torch

aten = torch.ops.aten
S = _torch.ShardingPlaceholder
R = torch.distributed.tensor.Replicate()
P = torch.distributed.tensor.Partial()


def _index(op, args_schema, kwargs_schema):
    # [out, values, *indices (the non-None ones)]
    values, indices = args_schema[:2]
    indexed = [d for d, index in enumerate(indices) if index is not None]
    metas = [index for index in indices if index is not None]
    broadcast = max(len(m.shape) for m in metas)
    at = indexed[0] if indexed == list(range(indexed[0], indexed[-1] + 1)) else 0
    rules = []
    for d in range(len(values.shape)):
        if d not in indexed:
            out = d if d < at else d + broadcast - sum(1 for i in indexed if i < d)
            rules.append([S(out), S(d)] + [R] * len(metas))
    for b in range(broadcast):
        own = [b - (broadcast - len(m.shape)) for m in metas]   # each index's dim there, < 0: broadcast
        split = [S(k) if k >= 0 and m.shape[k] > 1 else R for k, m in zip(own, metas)]
        if any(p is not R for p in split):
            rules.append([S(at + b), R] + split)
    rules.append([P, P] + [R] * len(metas))
    return rules


RULES = {aten.index.Tensor: _index}
# what this module registered (empty where torch has the rule): tests check these rules
ADDED = [op for op in RULES if not _torch.has_sharding_rule(op)]
for _op in ADDED:
    _torch.register_single_dim_strategy(_op, schema_info=_torch.RuntimeSchemaInfo(needs_pytree=True))(RULES[_op])
