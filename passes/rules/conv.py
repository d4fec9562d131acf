"""Convolution: the channel splits DTensor's rule leaves out.

torch's rule for ``aten.convolution`` and its backward splits the batch only, so a convolution's
weight is always whole where it runs (a patch embedding, a ConvNeXt block's depthwise conv). On
one mesh dim a (non-transposed) convolution may also split:

* output channels (groups == 1): input whole, weight and bias split on their dim 0, output split
  on dim 1; in backward the input gradient sums over output channels (Partial);
* input channels (groups == 1): input and weight split on their dim 1, the output a Partial sum
  (the bias, then, a Partial too, so it is added once);
* channels of a depthwise convolution (groups == channels: each channel its own group): input,
  weight, bias, output and all gradients split alike.

A grouped convolution with 1 < groups < channels keeps the batch split only: a channel split
must hold whole groups, which depends on the mesh dim's size (not known to a single-dim rule).
The rules below are DTensor's batch rule plus these, registered in its place.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate

from autoshard import _torch

aten = torch.ops.aten
S = _torch.ShardingPlaceholder
R, P = Replicate(), Partial()


def _is_meta(x) -> bool:
    return isinstance(x, _torch.TensorMeta)


@_torch.register_single_dim_strategy(aten.convolution.default)
def _forward(op, args_schema, kwargs_schema):
    # [out, input, weight, (bias)]
    x, w, bias = args_schema[0], args_schema[1], args_schema[2]
    transposed, groups = args_schema[6], args_schema[8]
    b = [S(0)] if _is_meta(bias) else []
    rules = [[S(0), S(0), R] + ([R] if b else [])]
    if transposed:
        return rules
    if groups == 1:
        rules.append([S(1), R, S(0)] + b)                                # output channels
        rules.append([P, S(1), S(1)] + ([P] if b else []))               # input channels
    elif groups == x.shape[1] == w.shape[0]:
        rules.append([S(1), S(1), S(0)] + b)                             # depthwise channels
    return rules


@_torch.register_single_dim_strategy(aten.convolution_backward.default)
def _backward(op, args_schema, kwargs_schema):
    # [grad_input, grad_weight, grad_bias, grad_out, input, weight]
    grad_out, x, w = args_schema[0], args_schema[1], args_schema[2]
    transposed, groups, mask = args_schema[7], args_schema[9], args_schema[10]

    def rule(gi, gw, gb, go, xi, wi):
        return [gi if mask[0] else None, gw if mask[1] else None, gb if mask[2] else None, go, xi, wi]

    rules = [rule(S(0), P, P, S(0), S(0), R)]                             # batch
    if transposed:
        return rules
    if groups == 1:
        rules.append(rule(P, S(0), S(0), S(1), R, S(0)))                  # output channels
        rules.append(rule(S(1), S(1), R, R, S(1), S(1)))                  # input channels
    elif groups == x.shape[1] == w.shape[0]:
        rules.append(rule(S(1), S(0), S(0), S(1), S(1), S(0)))            # depthwise channels
    return rules


def _local_groups(groups: int, local_channels: int, channels: int) -> int:
    """A depthwise convolution split over channels has as many groups as local channels."""
    return groups if groups == 1 else groups * local_channels // channels


def _local_forward(node, args: tuple, kwargs: dict, strategy, mesh):
    x_local, x = args[0], node.args[0].meta["val"]
    return node.target(*args[:8], _local_groups(args[8], x_local.shape[1], x.shape[1]), *args[9:], **kwargs)


def _local_backward(node, args: tuple, kwargs: dict, strategy, mesh):
    x_local, w_local, x = args[1], args[2], node.args[1].meta["val"]
    bias_sizes = None if args[3] is None else [w_local.shape[0]]
    return node.target(*args[:3], bias_sizes, *args[4:9], _local_groups(args[9], x_local.shape[1], x.shape[1]),
                       *args[10:], **kwargs)


# op -> run on the local tensors with its arguments made local: the rewriter runs these ops on local
# shards itself (DTensor's convolution handler takes a sharded input for a spatial split)
LOCAL = {aten.convolution.default: _local_forward, aten.convolution_backward.default: _local_backward}
