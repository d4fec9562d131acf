"""CPU flash attention: FLOP formulas and DTensor sharding rules.

``aten._scaled_dot_product_flash_attention_for_cpu`` (and its backward) is what every
``F.scaled_dot_product_attention`` becomes on CPU. torch 2.13 has neither a FLOP formula for it
(flop counting silently gives 0) nor a DTensor rule. Attention is independent per batch element
and per head, so on each mesh dim it may be sharded on dim 0 (batch) or dim 1 (heads) of q, k, v,
the output, the log-sum-exp and all gradients alike; the all-Replicate rule is implied.
"""

from __future__ import annotations

import torch

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


def _has_tensor_kwarg(kwargs, name) -> bool:
    return isinstance(kwargs.get(name), _torch.TensorMeta)


@_torch.register_single_dim_strategy(FWD)
def _fwd_rule(op, args_schema, kwargs_schema):
    # [out, logsumexp, query, key, value, (attn_mask)]
    has_mask = len(args_schema) > 5 and isinstance(args_schema[5], _torch.TensorMeta) or _has_tensor_kwarg(kwargs_schema, "attn_mask")
    if has_mask:  # a broadcast mask would need its own rule; run such attention replicated
        return []
    return [[S(d)] * 5 for d in (0, 1)]


@_torch.register_single_dim_strategy(BWD)
def _bwd_rule(op, args_schema, kwargs_schema):
    # [grad_q, grad_k, grad_v, grad_out, query, key, value, out, logsumexp]
    return [[S(d)] * 9 for d in (0, 1)]
