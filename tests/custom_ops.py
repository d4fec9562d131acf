"""A loss written as a custom op of the tests' own: DTensor has no sharding rule for it or for its
backward, which is what a user's own kernel looks like to the planner (torch's elementwise losses
trace as their decompositions, which have rules)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from autoshard.zoo import MLP


@torch.library.custom_op("autoshard_tests::squared_error", mutates_args=())
def squared_error(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((pred - target) ** 2).mean()


@squared_error.register_fake
def _(pred, target):
    return pred.new_empty(())


@torch.library.custom_op("autoshard_tests::squared_error_backward", mutates_args=())
def squared_error_backward(grad: torch.Tensor, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return grad * 2 * (pred - target) / pred.numel()


@squared_error_backward.register_fake
def _(grad, pred, target):
    return torch.empty_like(pred)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    pred, target = ctx.saved_tensors
    return squared_error_backward(grad, pred, target), None


squared_error.register_autograd(_backward, setup_context=_setup)


class MLPOwnLoss(MLP):
    """The zoo's MLP with its squared error as :func:`squared_error`."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        return squared_error(x, y)
