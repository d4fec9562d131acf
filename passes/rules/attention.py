"""CPU flash attention: FLOP formulas and DTensor sharding rules.

``aten._scaled_dot_product_flash_attention_for_cpu`` (and its backward) is what every
``F.scaled_dot_product_attention`` becomes on CPU. torch 2.13 has neither a FLOP formula for it
(flop counting silently gives 0) nor a DTensor rule. Attention is independent per batch element
and per head, so on each mesh dim it may be sharded on dim 0 (batch) or dim 1 (heads) of q, k, v,
the output, the log-sum-exp and all gradients alike; the all-Replicate rule is implied. A mask
(transformers' SDPA path passes one of (batch, 1, q, k)) splits along with the batch or heads
where it has that dim, and is replicated where it broadcasts.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate

from autoshard import _torch

aten = torch.ops.aten
FWD = aten._scaled_dot_product_flash_attention_for_cpu.default
BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _fwd_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return _torch.sdpa_flop_count(query, key, value)


def _bwd_flops(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return _torch.sdpa_backward_flop_count(grad_out, query, key, value)


_torch.register_flop_formula([FWD.overloadpacket], _fwd_flops)
_torch.register_flop_formula([BWD.overloadpacket], _bwd_flops)

S = _torch.ShardingPlaceholder


def _mask(args_schema, kwargs_schema, position: int):
    """The attention mask's TensorMeta (positional at ``position`` or keyword), or None."""
    if len(args_schema) > position and isinstance(args_schema[position], _torch.TensorMeta):
        return args_schema[position]
    mask = kwargs_schema.get("attn_mask")
    return mask if isinstance(mask, _torch.TensorMeta) else None


def _with_mask(rules, mask, query):
    """A mask broadcasts over (batch, heads, q, k): it follows a batch or head split where it has
    that dim in full, and stays whole where it is broadcast (size 1)."""
    if mask is None:
        return rules
    out = []
    for d, rule in zip((0, 1), rules):
        lead = len(mask.shape) - 4 + d   # the mask's dim aligned with query's dim d, if any
        if lead < 0 or mask.shape[lead] == 1:
            out.append(rule + [Replicate()])
        elif mask.shape[lead] == query.shape[d]:
            out.append(rule + [S(lead)])
    return out


@_torch.register_single_dim_strategy(FWD)
def _fwd_rule(op, args_schema, kwargs_schema):
    # [out, logsumexp, query, key, value, (attn_mask)]
    rules = [[S(d)] * 5 for d in (0, 1)]
    return _with_mask(rules, _mask(args_schema, kwargs_schema, 5), args_schema[0])


@_torch.register_single_dim_strategy(BWD)
def _bwd_rule(op, args_schema, kwargs_schema):
    # [grad_q, grad_k, grad_v, grad_out, query, key, value, out, logsumexp, (attn_mask)]
    rules = [[S(d)] * 9 for d in (0, 1)]
    return _with_mask(rules, _mask(args_schema, kwargs_schema, 8), args_schema[1])
