"""Batch norm and max pooling, where the installed torch has no DTensor rule for them.

torch 2.13 added rules for these ops; on torch 2.11 and 2.12 ``aten._native_batch_norm_legit``,
``aten.native_batch_norm_backward`` and ``aten.max_pool2d_with_indices`` (and its backward) have
none, so every convolutional network planned there would run them replicated. The rules below are
registered only for the ops the installed torch leaves without one.

Batch norm normalizes each channel over the batch and the spatial dims, so channels are
independent: the input, output and gradients ([N, C, ...]) shard on dim 1, per-channel tensors
([C]: weight, bias, running and saved statistics) on dim 0. The batch is not independent (its
statistics span it), so no batch rule. Max pooling works per sample and per channel: batch or
channel sharding, with the indices sharded alike; its backward is linear in the output gradient,
which may also arrive as a partial sum (the input and indices then replicated).
"""

from __future__ import annotations

import torch

from autoshard import _torch

aten = torch.ops.aten
S = _torch.ShardingPlaceholder
R = torch.distributed.tensor.Replicate()
P = torch.distributed.tensor.Partial()


def _tensors(args_schema) -> list:
    return [a for a in args_schema if isinstance(a, _torch.TensorMeta)]


def _batch_norm(op, args_schema, kwargs_schema):
    # [out, save_mean, save_invstd, input, weight?, bias?, running stats?...]
    return [[S(1), S(0), S(0), S(1)] + [S(0)] * (len(_tensors(args_schema)) - 1)]


def _batch_norm_backward(op, args_schema, kwargs_schema):
    # [grad_input, grad_weight, grad_bias, grad_out, input, weight?, stats?...]; output_mask last
    mask = args_schema[-1]
    outputs = [pl if made else None for pl, made in zip((S(1), S(0), S(0)), mask)]
    return [outputs + [S(1), S(1)] + [S(0)] * (len(_tensors(args_schema)) - 2)]


def _max_pool(op, args_schema, kwargs_schema):
    # [out, indices, input]
    batched = len(args_schema[0].shape) == 4
    return [[S(d)] * 3 for d in ((0, 1) if batched else (0,))]


def _max_pool_backward(op, args_schema, kwargs_schema):
    # [grad_input, grad_out, input, indices]
    batched = len(args_schema[0].shape) == 4
    return [[S(d)] * 4 for d in ((0, 1) if batched else (0,))] + [[P, P, R, R]]


RULES = {
    aten._native_batch_norm_legit.default: _batch_norm,
    aten._native_batch_norm_legit.no_stats: _batch_norm,
    aten.native_batch_norm.default: _batch_norm,
    aten.native_batch_norm_backward.default: _batch_norm_backward,
    aten.max_pool2d_with_indices.default: _max_pool,
    aten.max_pool2d_with_indices_backward.default: _max_pool_backward,
}
# what this module registered (empty where torch has all of them): tests check these rules
ADDED = [op for op in RULES if not _torch.has_sharding_rule(op)]
for _op in ADDED:
    _torch.register_single_dim_strategy(_op)(RULES[_op])
