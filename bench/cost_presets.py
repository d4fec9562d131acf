"""Predicted step time, MFU and memory of hand-style plans on vendor-sheet clusters.

For GPT-2 small (batch 8 x 1024) and a Llama-2 7B shape (batch 8 x 2048), on one DGX A100-80GB
and one DGX H100 node (mesh (1, 8)), plan under three pinned strategies:

    DDP          inputs batch-sharded over the GPUs, every parameter replicated
    FSDP         inputs batch-sharded, every parameter stored sharded (dim 0) over the GPUs
    Megatron-TP  inputs replicated; per layer column-parallel (qkv/fc, q/k/v/gate/up: S(0))
                 and row-parallel (proj/out, o/down: S(1)) weights, vocab-parallel embedding and
                 head (S(0)), everything else (norms, row-parallel biases, wpe) replicated

and print what the cost model predicts, so a reader can hold it against published runs.
Constraints pin parameter *storage* and input placements only; the solver still picks how each
op computes (a TP-stored weight may be all-gathered and used data-parallel), so a row is "the best
plan with this storage", which can come out equal to another row's step time. Plans are
made without a memory cap and without recompute, so each row is the pinned strategy as such; the
"fits" column says whether its predicted peak fits the device's usable memory.
MFU = model FLOPs / (step time x peak x devices), model FLOPs = (6 N + 12 L h s) x tokens
(docs/cost_model.md). The zoo models are fp32, so the plans are priced at the fp32 peak (A100 19.5,
H100 67 TFLOP/s) and MFU is against that peak: not comparable to bf16 MFUs people publish.

The 7B shape is planned at its full 32 layers (~40 s a plan on this 2-core host). ``--llama-layers
4`` plans it at 2 and 4 layers instead and extrapolates every figure linearly to 32
(x_32 = x_4 + 28 (x_4 - x_2) / 2: the layers are identical and pinned alike); the table then says
"extrapolated". (Checked once: FSDP on dgx-h100 extrapolated 2122.5 ms / 34.4 GiB, full 2122.5 / 34.4.)

    python bench/cost_presets.py [--llama-layers 0] [--models gpt2,llama7b] [--presets dgx-a100-80gb,dgx-h100]

Writes bench/out/cost_presets.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
import warnings
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

import autoshard
from autoshard.cluster import training_state_bytes
from autoshard.zoo import GPT, GPTConfig, Llama, LlamaConfig

OUT = Path(__file__).resolve().parent / "out" / "cost_presets.json"
GiB = 2**30
BATCH_SHARDED = [["R", "S(0)"]] * 2          # (idx, targets): batch over the "gpu" dim
REPLICATED = [["R", "R"]] * 2
COL, ROW = ["R", "S(0)"], ["R", "S(1)"]      # nn.Linear weight (out, in): S(0) column-, S(1) row-parallel

CONSTRAINTS = {
    "gpt2": {
        "DDP": {"inputs": BATCH_SHARDED, "*": ["R", "R"]},
        "FSDP": {"inputs": BATCH_SHARDED, "*": ["R", "S(0)"]},
        "Megatron-TP": {"inputs": REPLICATED, "*": ["R", "R"], "wte.weight": COL,  # vocab-parallel (tied head)
                        "blocks.*.qkv.weight": COL, "blocks.*.qkv.bias": COL,
                        "blocks.*.fc.weight": COL, "blocks.*.fc.bias": COL,
                        "blocks.*.proj.weight": ROW, "blocks.*.out.weight": ROW},
    },
    "llama7b": {
        "DDP": {"inputs": BATCH_SHARDED, "*": ["R", "R"]},
        "FSDP": {"inputs": BATCH_SHARDED, "*": ["R", "S(0)"]},
        "Megatron-TP": {"inputs": REPLICATED, "*": ["R", "R"], "embed.weight": COL, "head.weight": COL,
                        **{f"blocks.*.{m}.weight": COL for m in ("q", "k", "v", "gate", "up")},
                        "blocks.*.o.weight": ROW, "blocks.*.down.weight": ROW},
    },
}


def model_flops(n_params: int, layers: int, hidden: int, seq: int, tokens: int) -> float:
    """Training FLOPs of one step (docs/cost_model.md): (6 N + 12 L h s) per token."""
    return (6 * n_params + 12 * layers * hidden * seq) * tokens


def build(name: str, layers: int | None, batch: int):
    """(traced model, full-depth config) for ``name`` at ``layers`` (None: the full depth)."""
    if name == "gpt2":
        cfg = GPTConfig.gpt2_small()
        model_cls = GPT
    else:
        cfg = LlamaConfig.llama2_7b(seq=2048)
        model_cls = Llama
    planned = cfg if layers is None else dataclasses.replace(cfg, layers=layers)
    with torch.device("meta"):
        model = model_cls(planned)
    idx = torch.zeros(batch, cfg.seq, dtype=torch.long, device="meta")
    return autoshard.trace(model, (idx, idx)), cfg


def plan_row(traced, cluster, constraints) -> dict:
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # No memory cap and no recompute: the pinned strategy as such, so its memory is what it
        # needs (the "fits" column compares it with the device) and depths extrapolate linearly.
        p = autoshard.plan(traced, cluster, constraints=constraints, memory_limit=float("inf"), recompute=False,
                           time_limit=300)
    state = sum(p.memory.get(k, 0.0) for k in ("params", "grads", "optimizer"))
    return {"step_time": p.step_time, "compute_time": p.compute_time, "comm_time": p.comm_time,
            "recompute_time": (getattr(p, "breakdown", None) or {}).get("recompute", 0.0),
            "peak_memory": p.peak_memory, "state_memory": state, "plan_mfu": getattr(p, "mfu", None),
            "solver": p.solver.get("status"), "gap": p.solver.get("gap"), "plan_s": time.perf_counter() - t0,
            "fallbacks": [list(f) for f in p.fallbacks], "warnings": sorted({str(w.message)[:200] for w in caught})}


LINEAR = ("step_time", "compute_time", "comm_time", "recompute_time", "peak_memory", "state_memory")


def extrapolate(small: dict, big: dict, l_small: int, l_big: int, l_full: int) -> dict:
    out = dict(big)
    for k in LINEAR:
        per_layer = (big[k] - small[k]) / (l_big - l_small)
        out[k] = big[k] + (l_full - l_big) * per_layer
    out["plan_s"] = small["plan_s"] + big["plan_s"]
    out["plan_mfu"] = None  # the plan's own MFU is of the shallow model
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gpt2,llama7b")
    ap.add_argument("--presets", default="dgx-a100-80gb,dgx-h100")
    ap.add_argument("--llama-layers", type=int, default=0,
                    help="plan the 7B shape at this depth and half of it, extrapolating to 32 (0: full depth)")
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    console = Console(width=170)
    rows = []
    for name in args.models.split(","):
        depths: list[int | None] = [None]
        if name == "llama7b" and args.llama_layers:
            depths = [args.llama_layers // 2, args.llama_layers]
        traced = {}
        for d in depths:
            t0 = time.perf_counter()
            traced[d], cfg = build(name, d, args.batch)
            console.print(f"[dim]traced {name} at {d or cfg.layers} layers in {time.perf_counter() - t0:.1f} s[/dim]")
        with torch.device("meta"):
            n_params = sum(p.numel() for p in (GPT if name == "gpt2" else Llama)(cfg).parameters())
        tokens = args.batch * cfg.seq
        flops = model_flops(n_params, cfg.layers, cfg.hidden, cfg.seq, tokens)
        for preset in args.presets.split(","):
            cluster = autoshard.Cluster.preset(preset)
            for strategy, cons in CONSTRAINTS[name].items():
                results = {d: plan_row(traced[d], cluster, cons) for d in depths}
                if len(depths) == 2:
                    r = extrapolate(results[depths[0]], results[depths[1]], depths[0], depths[1], cfg.layers)
                    note = f"planned at {depths[0]} and {depths[1]} layers, extrapolated to {cfg.layers}"
                else:
                    r, note = results[None], f"planned at full depth ({cfg.layers} layers)"
                peak = cluster.peak_flops(torch.float32)
                r |= {"model": name, "preset": preset, "strategy": strategy, "devices": cluster.world_size,
                      "batch": args.batch, "seq": cfg.seq, "layers": cfg.layers, "params": n_params,
                      "model_flops": flops, "peak_flops_fp32": peak, "note": note,
                      "mfu": flops / (r["step_time"] * peak * cluster.world_size),
                      "memory_limit": cluster.memory_limit, "fits": r["peak_memory"] <= cluster.memory_limit,
                      "tokens_per_s": tokens / r["step_time"],
                      "state_formula_ddp_fp32": training_state_bytes(n_params, "fp32"),
                      "per_depth": {str(d): results[d] for d in depths} if len(depths) == 2 else None}
                rows.append(r)
                console.print(f"[dim]{name} {preset} {strategy}: step {r['step_time'] * 1e3:.1f} ms, "
                              f"planned in {r['plan_s']:.1f} s ({r['solver']})[/dim]")

    table = Table(title="Predicted training step, 1 node x 8 GPUs, fp32 (MFU vs the fp32 peak)",
                  title_justify="left")
    for col in ("model", "cluster", "plan", "step ms", "compute", "comm", "recomp", "MFU", "tok/s",
                "peak GiB", "state GiB", "fits", "plan s", "note"):
        table.add_column(col, justify="left" if col in ("model", "cluster", "plan", "note") else "right")
    for r in rows:
        table.add_row(r["model"], r["preset"], r["strategy"], f"{r['step_time'] * 1e3:.1f}",
                      f"{r['compute_time'] * 1e3:.1f}", f"{r['comm_time'] * 1e3:.1f}",
                      f"{r['recompute_time'] * 1e3:.1f}", f"{r['mfu']:.1%}", f"{r['tokens_per_s']:,.0f}",
                      f"{r['peak_memory'] / GiB:.1f}", f"{r['state_memory'] / GiB:.1f}",
                      "yes" if r["fits"] else "NO", f"{r['plan_s']:.0f}",
                      "extrapolated" if r["per_depth"] else "")
    console.print(table)
    for r in rows:
        if r["fallbacks"]:
            console.print(f"{r['model']} {r['preset']} {r['strategy']}: replicated for lack of a rule: "
                          f"{r['fallbacks']}")
    notes = sorted({r["note"] for r in rows})
    console.print("MFU = (6N + 12 L h s) x tokens / (step x fp32 peak x 8). " + "; ".join(
        f"{r}: {n}" for r, n in {r["model"]: r["note"] for r in rows}.items()) + ".")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"rows": rows, "notes": notes}, indent=1, sort_keys=True))
    console.print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
