"""Plan quality: the free plan against the best hand-written baseline, on the same solver and cost
model (autoshard.baselines). For each zoo model (real sizes, on meta) and cluster: the predicted
step time of the free plan (every logical mesh of autoshard.meshes) and of the fastest feasible
baseline, their ratio (free / best baseline: <= 1 means the free plan is no slower), peak memory
and MFU of both, and the geometric-mean speed-up (best baseline / free) over the memory-tight
cases. Writes bench/out/plan_quality.json and prints a table.

Clusters: one DGX H100 (8 GPUs); 4 DGX H100 nodes (32); 16 Perlmutter-like nodes of 4 A100-40GB
(64); "tight": one node of 8 A100-40GB with the per-device cap at 4x the fully sharded training
state (16 bytes a parameter / 8), so replicated state does not fit. Global batch: the zoo's
default, raised to a multiple of the device count (one sample per device at least).

    .venv/bin/python bench/plan_quality.py          # GPT-2 124M on h100x8 and tight (~5 min on 2 cores)
    .venv/bin/python bench/plan_quality.py --all    # GPT-2 124M and Llama-3 8B on every cluster (~1 h)
    .venv/bin/python bench/plan_quality.py --models llama:8b bert --clusters tight --baselines ddp fsdp megatron
"""

from __future__ import annotations

import argparse
import json
import math
import time
import warnings
from pathlib import Path

import autoshard
from autoshard import zoo
from autoshard.baselines import BASELINES, RECOMPUTE, best_baseline, compare
from autoshard.plan import Plan

CLUSTERS = {
    "h100x8": lambda: autoshard.Cluster.preset("dgx-h100", nodes=1),
    "h100x32": lambda: autoshard.Cluster.preset("dgx-h100", nodes=4),
    "perlmutter64": lambda: autoshard.Cluster.preset("perlmutter", nodes=16),
    "tight": lambda: autoshard.Cluster.preset("dgx-a100-40gb", nodes=1),
}
TIGHT = {"tight"}
QUICK = (["gpt:124m"], ["h100x8", "tight"])
FULL = (["gpt:124m", "llama:8b"], list(CLUSTERS))


def _model(spec: str, world: int):
    name, _, size = spec.partition(":")
    size = size or "real"
    base = zoo.get(name, size, device="meta")[1][0].shape[0]
    batch = world * math.ceil(base / world)
    return zoo.get(name, size, device="meta", batch=batch)


def _row(plan) -> dict:
    if not isinstance(plan, Plan):
        need = getattr(plan, "min_memory", None)
        return {"error": type(plan).__name__, "min_memory_gb": need and need / 1e9}
    return {"step_ms": plan.step_time * 1e3, "peak_gb": plan.peak_memory / 1e9, "mfu": plan.mfu,
            "mesh": list(plan.mesh_shape), "status": plan.solver["status"]}


def run_case(model_spec: str, cluster_name: str, baselines, time_limit: float) -> dict:
    cluster = CLUSTERS[cluster_name]()
    model, inputs = _model(model_spec, cluster.world_size)
    t0 = time.perf_counter()
    traced = autoshard.trace(model, inputs)
    limit = None
    if cluster_name in TIGHT:
        params = sum(p.numel() for p in model.parameters())
        limit = min(cluster.memory_limit, 4 * 16 * params / cluster.world_size)
    plans = compare(traced, cluster, memory_limit=limit, baselines=baselines, time_limit=time_limit)
    row = {"model": model_spec, "cluster": cluster_name, "world": cluster.world_size,
           "batch": int(inputs[0].shape[0]), "memory_limit_gb": (limit or cluster.memory_limit) / 1e9,
           "tight": cluster_name in TIGHT, "plans": {k: _row(p) for k, p in plans.items()},
           "seconds": time.perf_counter() - t0}
    best = best_baseline(plans)
    free = plans["auto"]
    row["best_baseline"] = best and best[0]
    if best and isinstance(free, Plan):
        row["ratio"] = free.step_time / best[1].step_time
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=None,
                    help=f"zoo name[:size] (sizes: zoo.sizes; default real); known: {', '.join(zoo.names())}")
    ap.add_argument("--clusters", nargs="+", default=None, choices=list(CLUSTERS))
    ap.add_argument("--all", action="store_true", help=f"models {FULL[0]} on every cluster")
    ap.add_argument("--baselines", nargs="+", default=list(BASELINES), choices=list(BASELINES))
    ap.add_argument("--no-recompute-variants", action="store_true", help="only the no-recompute form of each")
    ap.add_argument("--time-limit", type=float, default=120.0, help="seconds per solve")
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "plan_quality.json"))
    args = ap.parse_args()
    models, clusters = FULL if args.all else QUICK
    args.models, args.clusters = args.models or models, args.clusters or clusters
    warnings.simplefilter("ignore")
    names = [b + s for b in args.baselines for s in RECOMPUTE if not (args.no_recompute_variants and s)]
    rows = []
    for m in args.models:
        for c in args.clusters:
            row = run_case(m, c, names, args.time_limit)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "plans"}), flush=True)
    tight = [r["ratio"] for r in rows if r["tight"] and r.get("ratio")]
    summary = {"geomean_speedup_tight": math.exp(sum(-math.log(x) for x in tight) / len(tight)) if tight else None,
               "max_ratio": max((r["ratio"] for r in rows if r.get("ratio")), default=None)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))

    from rich.console import Console
    from rich.table import Table

    table = Table(title="plan quality: free plan vs best baseline (predicted)")
    for col in ("model", "cluster", "free ms", "free mesh", "free GB", "free MFU", "best baseline", "baseline ms",
                "baseline GB", "ratio", "s"):
        table.add_column(col)
    for r in rows:
        free, best = r["plans"]["auto"], r["plans"].get(r["best_baseline"] or "", {})
        fmt = lambda d, k, f: f.format(d[k]) if d.get(k) is not None else d.get("error", "-")  # noqa: E731
        table.add_row(r["model"], r["cluster"], fmt(free, "step_ms", "{:.2f}"), str(free.get("mesh", "-")),
                      fmt(free, "peak_gb", "{:.1f}"), fmt(free, "mfu", "{:.3f}"), str(r["best_baseline"]),
                      fmt(best, "step_ms", "{:.2f}") if best else "-", fmt(best, "peak_gb", "{:.1f}") if best else "-",
                      f"{r['ratio']:.3f}" if r.get("ratio") else "-", f"{r['seconds']:.0f}")
    Console(width=200).print(table)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
