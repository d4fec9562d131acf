"""Scatters (``aten.scatter``: the values of ``src``, or one number, written into ``input`` at
``index`` along ``dim``), where the installed torch's rule replicates every operand.

torch 2.11 and 2.12 register a scatter rule that offers only the all-Replicate strategy, so the
routing weights a mixture-of-experts layer scatters into its [tokens, experts] table (Qwen3-MoE,
Mixtral) are gathered on every rank. torch 2.13's rule, below, also splits a dim other than
``dim`` on which every operand has the same size: each rank then scatters its own rows, writing
only where its own rows are. Both releases register their rule as one asked per input placement,
so the registry cannot tell them apart: the release is checked (`_torch.RELEASE`).
"""

from __future__ import annotations

import torch

from autoshard import _torch

aten = torch.ops.aten
S = _torch.ShardingPlaceholder

# torch 2.13 gave scatter a rule that shards; before it, the rule replicates everything
REPLICATES_ONLY = _torch.RELEASE < (2, 13)


def _scatter(op, args_schema, kwargs_schema):
    # [out, input, index, src?] (the .value overload scatters a number: no src)
    x, dim, index = args_schema[:3]
    src = args_schema[3] if isinstance(args_schema[3], _torch.TensorMeta) else None
    if len(x.shape) != len(index.shape):
        return []
    dim %= len(x.shape)
    operands = [x, index] + ([src] if src is not None else [])
    return [[S(d)] * (1 + len(operands)) for d in range(len(x.shape))
            if d != dim and len({t.shape[d] for t in operands}) == 1]


RULES = {aten.scatter.src: _scatter, aten.scatter.value: _scatter}
# what this module registered (empty from torch 2.13): tests check these rules
ADDED = [op for op in RULES if REPLICATES_ONLY and _torch.single_dim_rule(op) is None]
for _op in ADDED:
    _torch.register_single_dim_strategy(_op, schema_info=_torch.RuntimeSchemaInfo(1))(RULES[_op])
