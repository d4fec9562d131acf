"""Mixed precision as part of the traced program: fp32 master weights, bf16 (or fp16) compute.

A :class:`MixedPrecision` policy makes the trace start forward with a cast of every floating
parameter (and floating input) to ``param_dtype``. The casts are ordinary graph nodes, so
everything downstream follows the policy without knowing of it: the ILP may cast a sharded
parameter before gathering it (the gather moves ``param_dtype`` bytes), the low-precision copies
are activations in the memory model, compute is priced at the ``param_dtype`` FLOP rate, and the
cast's backward turns each gradient back to the parameter's dtype, so the optimizer steps fp32
master weights with fp32 gradients.

``reduce_dtype`` is a runtime choice, applied by passes/rewrite.py and the runtime: every
reduction of a partial sum on the way to a parameter's gradient (inside backward, where the plan
reduces a bf16 weight gradient before its cast, and the move to storage after it) runs in that
dtype. The plan prices each reduction at the dtype of the tensor it reduces.

The same wrapper run eagerly is the single-device reference of the policy::

    >>> policy = MixedPrecision(param_dtype=torch.bfloat16)
    >>> loss = cast_module(model, policy)(*batch)          # fp32 params, bf16 compute
    >>> loss.dtype, next(model.parameters()).dtype
    (torch.bfloat16, torch.float32)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call


@dataclass(frozen=True)
class MixedPrecision:
    """``param_dtype``: the dtype floating parameters and inputs are cast to for compute (once
    per forward, in the traced program; buffers keep theirs). ``reduce_dtype``: the dtype in
    which partial sums of parameter gradients are reduced (``None``: the dtype they have there,
    bf16 inside backward, the parameter's own in the move to storage). Parameters, gradients
    and optimizer state stay in the parameters' dtype (fp32 master weights)."""

    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype | None = torch.float32

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, torch.dtype) and v.is_floating_point):
                raise TypeError(f"MixedPrecision.{name} must be a floating torch.dtype, not {v!r}")

    def key(self) -> str:
        """A stable text for fingerprints and plan files."""
        return f"param={self.param_dtype},reduce={self.reduce_dtype}"


class CastParams(nn.Module):
    """``model`` with its floating parameters and inputs cast per ``policy`` at the start of
    forward. It holds the model's own parameter, buffer and submodule dicts, so its
    ``named_parameters()`` are the model's, under the model's names (tied weights still tied),
    and a trace of it pairs gradients with the user's parameters."""

    def __init__(self, model: nn.Module, policy: MixedPrecision):
        super().__init__()
        d = self.__dict__
        d["_parameters"], d["_buffers"], d["_modules"] = model._parameters, model._buffers, model._modules
        d["_non_persistent_buffers_set"] = model._non_persistent_buffers_set
        d["_inner"], d["policy"] = model, policy
        self.training = model.training

    def train(self, mode: bool = True):
        self.__dict__["_inner"].training = mode
        return super().train(mode)

    def forward(self, *args, **kwargs):
        model, p = self.__dict__["_inner"], self.policy
        cast = lambda t: t.to(p.param_dtype) if t.is_floating_point() else t  # noqa: E731
        params = {name: cast(w) for name, w in model.named_parameters()}
        args = tuple(cast(a) if isinstance(a, torch.Tensor) else a for a in args)
        kwargs = {k: cast(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        return functional_call(model, params, args, kwargs, tie_weights=True, strict=False)


def cast_module(model: nn.Module, policy: MixedPrecision | None) -> nn.Module:
    """``model`` under ``policy`` (itself when there is none)."""
    return model if policy is None else CastParams(model, policy)


def policy_fingerprint(fingerprint: str, policy: MixedPrecision) -> str:
    """A graph fingerprint extended by the policy's dtypes (a plan made for one runs no other)."""
    return hashlib.sha256(f"{fingerprint}|{policy.key()}".encode()).hexdigest()[:16]
