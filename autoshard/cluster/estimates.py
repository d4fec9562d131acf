"""Textbook estimates of training memory, from parameter counts and transformer shapes alone (no
trace): what the benches hold the cost model against."""

from __future__ import annotations

from autoshard.cluster.specs import is_count


# --- memory formulas (docs/cost_model.md) ------------------------------------------------------------
# Bytes per parameter of training state, by precision: the parameter as the model computes with
# it, its gradient, and the fp32 master copy that mixed precision keeps (fp32 training has none).
_STATE_BYTES = {"fp32": {"params": 4, "grads": 4, "master": 0},
                "bf16-mixed": {"params": 2, "grads": 2, "master": 4}}
# Optimizer state per parameter, kept in fp32: Adam/AdamW two moments, SGD with momentum one.
_OPTIMIZER_BYTES = {"adam": 8, "adamw": 8, "sgd": 0, "sgd-momentum": 4}


def training_state_bytes(num_params: float, precision: str = "fp32", optimizer: str = "adam", *,
                         fp32_grads: bool = False, breakdown: bool = False) -> float | dict[str, float]:
    """Bytes of parameters + gradients + master weights + optimizer state for ``num_params``
    parameters, unsharded (divide by the shards of a ZeRO/FSDP placement). Per parameter::

        fp32 training, Adam           4 param + 4 grad + 8 moments               = 16
        bf16 mixed precision, Adam    2 param + 2 grad + 4 fp32 master + 8 moments = 16

    ``fp32_grads``: gradients kept/reduced in fp32 under mixed precision (+2 bytes).
    ``breakdown``: a dict {params, grads, master, optimizer, total} instead of the total.

    >>> training_state_bytes(6.74e9, "bf16-mixed") / 1e9   # Llama-2 7B with AdamW: ~108 GB
    107.84
    """
    if precision not in _STATE_BYTES:
        raise ValueError(f"unknown precision {precision!r}; known: {', '.join(_STATE_BYTES)}")
    if optimizer not in _OPTIMIZER_BYTES:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {', '.join(_OPTIMIZER_BYTES)}")
    if num_params < 0:
        raise ValueError(f"num_params must be >= 0, got {num_params}")
    per = dict(_STATE_BYTES[precision], optimizer=_OPTIMIZER_BYTES[optimizer])
    if fp32_grads:
        per["grads"] = 4
    parts = {k: float(v * num_params) for k, v in per.items()}
    parts["total"] = sum(parts.values())
    return parts if breakdown else parts["total"]


def transformer_activation_bytes(hidden: int, heads: int, seq: int, batch: int, layers: int, *,
                                 recompute: bool = False, fused_attention: bool = False) -> float:
    """Activations a transformer saves for backward, 16-bit, no tensor/sequence parallelism
    (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
    eq. 1; docs/cost_model.md). Per layer, per token::

        34 h + 5 a s     bytes   (h hidden, a heads, s sequence length)
        34 h             with fused attention (flash attention recomputes the a*s*s scores)
         2 h             with full recompute (only each layer's input is kept)

    times ``seq * batch * layers``. Counts the layers only, not embeddings or the loss.
    """
    for name, v in (("hidden", hidden), ("heads", heads), ("seq", seq), ("batch", batch), ("layers", layers)):
        if not is_count(v):
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if recompute:
        per_token = 2 * hidden
    else:
        per_token = 34 * hidden + (0 if fused_attention else 5 * heads * seq)
    return float(per_token * seq * batch * layers)
