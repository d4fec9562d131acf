"""autoshard's single-device plans against eager PyTorch measured on one H200: each measured
model and batch planned on ``meta`` for one H200 (the ``hgx-h200`` preset's device, a mesh of
one), with bf16 parameters, no recompute or per-layer activation checkpointing
(``recompute="full"``) as the measured run did, then the predicted step time and peak memory
next to the measured ones. Prints a table and writes bench/out/h200_model.json.

Targets: the predicted peak within 5% of the measured one and never more than 2% below it (a
prediction under the measured peak is an out-of-memory at a tight cap); the predicted step
within 10% for models of 1B parameters and more. tests/test_h200_model.py holds the rows to them.

    .venv/bin/python bench/h200_model.py [--only 8b 8b-ckpt]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time
import warnings
from pathlib import Path

import torch

import autoshard
from autoshard.cluster import PRESETS, Cluster
from autoshard.zoo import Llama, LlamaConfig

OUT = Path(__file__).parent / "out" / "h200_model.json"
PEAK_OVER, PEAK_UNDER, STEP = 0.05, 0.02, 0.10   # the targets (module docstring)


@dataclasses.dataclass(frozen=True)
class Measured:
    """One row measured with eager PyTorch on one H200, torch 2.11, median of 8 steps after 3
    warm-up steps: bf16 parameters (no fp32 master copy), AdamW, ``zero_grad(set_to_none=True)``,
    causal ``F.scaled_dot_product_attention``; step = forward + backward + optimizer step (CUDA
    events); peak = ``torch.cuda.max_memory_allocated()`` over the steps after the warm-up."""

    name: str
    config: LlamaConfig
    batch: int
    checkpointed: bool     # torch.utils.checkpoint around every layer
    optimizer: str         # torch's AdamW: "foreach" (its default on CUDA) or "fused"
    step_ms: float
    peak_gb: float         # 1e9 bytes


# Llama-style decoders (RMSNorm, rotary, grouped-query attention, SwiGLU, untied LM head)
GPT2_SMALL_LIKE = LlamaConfig(vocab=50304, seq=1024, hidden=768, heads=12, intermediate=3072, layers=12)
LLAMA_09B = LlamaConfig(vocab=32000, seq=2048, hidden=2048, heads=16, kv_heads=8, intermediate=5632, layers=16)
LLAMA3_8B = LlamaConfig.llama3_8b(seq=2048)

MEASURED = [   # eager PyTorch on one H200, torch 2.11, median of 8 steps
    Measured("gpt2-small-like", GPT2_SMALL_LIKE, 8, False, "foreach", 52.8, 7.85),
    Measured("0.9b", LLAMA_09B, 8, False, "foreach", 218.2, 32.37),
    Measured("0.9b-ckpt", LLAMA_09B, 8, True, "foreach", 275.6, 9.81),
    Measured("0.9b-ckpt-fused", LLAMA_09B, 8, True, "fused", 274.4, 9.81),
    Measured("8b", LLAMA3_8B, 2, False, "foreach", 461.7, 80.37),
    Measured("8b-fused", LLAMA3_8B, 2, False, "fused", 405.1, 78.36),
    Measured("8b-ckpt", LLAMA3_8B, 4, True, "foreach", 993.3, 80.37),
    Measured("8b-ckpt-fused", LLAMA3_8B, 4, True, "fused", 942.5, 65.16),
]


def one_h200(optimizer: str = "foreach") -> Cluster:
    """One H200 (the hgx-h200 preset's device and NVLink, a mesh of one), AdamW run ``optimizer``'s way."""
    preset = PRESETS["hgx-h200"]
    return Cluster((1,), ("gpu",), dataclasses.replace(preset.device, optimizer=optimizer), [preset.intra])


@functools.lru_cache(maxsize=None)
def traced(config: LlamaConfig, batch: int):
    """The model traced on ``meta`` with bf16 parameters, once per shape (an 8B trace takes
    seconds; the plans of one shape share it)."""
    with torch.device("meta"):
        model = Llama(config).to(torch.bfloat16)
    return autoshard.trace(model, tuple(torch.empty(batch, config.seq, dtype=torch.long, device="meta")
                                        for _ in range(2)))


def predict(row: Measured) -> dict:
    """Plan ``row``'s model and batch for one H200 and set the prediction next to the
    measurement: times in ms, bytes in GB (1e9), ratios predicted / measured."""
    start = time.perf_counter()
    model = traced(row.config, row.batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # CPU flash attention planned for a GPU: no warning matters here
        plan = autoshard.plan(model, one_h200(row.optimizer), recompute="full" if row.checkpointed else False)
    step, peak = plan.step_time * 1e3, plan.peak_memory / 1e9
    return {"name": row.name, "params_b": sum(n.meta["val"].numel() for _, n in model.params) / 1e9,
            "batch": [row.batch, row.config.seq], "checkpointed": row.checkpointed, "optimizer": row.optimizer,
            "measured_step_ms": row.step_ms, "predicted_step_ms": step, "step_ratio": step / row.step_ms,
            "measured_peak_gb": row.peak_gb, "predicted_peak_gb": peak, "peak_ratio": peak / row.peak_gb,
            "peak_moment": plan.peak_moment, "optimizer_ms": plan.breakdown["optimizer"] * 1e3,
            "memory_gb": {k: v / 1e9 for k, v in plan.memory.items() if v},
            "plan_s": time.perf_counter() - start}


def meets(r: dict) -> dict[str, bool]:
    """The targets a row meets: peak within PEAK_OVER above and PEAK_UNDER below the measured
    peak; step within STEP (the step target holds from 1B parameters up)."""
    return {"peak": 1 - PEAK_UNDER <= r["peak_ratio"] <= 1 + PEAK_OVER,
            "step": abs(r["step_ratio"] - 1) <= STEP}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", help="row names (default: all)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    rows = [predict(m) for m in MEASURED if not args.only or m.name in args.only]
    print(f"{'row':<17} {'params':>6} {'batch':>9} {'step ms meas/pred':>18} {'ratio':>6} "
          f"{'peak GB meas/pred':>18} {'ratio':>6}  peak moment")
    for r in rows:
        ok = meets(r)
        print(f"{r['name']:<17} {r['params_b']:5.2f}B {r['batch'][0]:>3}x{r['batch'][1]:<5} "
              f"{r['measured_step_ms']:8.1f} {r['predicted_step_ms']:8.1f} {r['step_ratio']:6.3f}"
              f"{'' if ok['step'] or r['params_b'] < 1 else '*'} "
              f"{r['measured_peak_gb']:8.2f} {r['predicted_peak_gb']:8.2f} {r['peak_ratio']:6.3f}"
              f"{'' if ok['peak'] else '*'}  {r['peak_moment']}")
    print("* outside the target (peak: -2%..+5%; step: +-10% from 1B parameters)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"targets": {"peak_over": PEAK_OVER, "peak_under": PEAK_UNDER, "step": STEP},
                                    "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
