"""Plan quality: the free plan against the best hand-written baseline, on the same solver and cost
model (autoshard.baselines). For each zoo model (real sizes, on meta) and cluster: the predicted
step time of the free plan (every logical mesh of autoshard.planning.meshes, 3-D ones included) and of the
fastest feasible baseline, their ratio (free / best baseline: <= 1 means the free plan is no
slower), peak memory and MFU of both, and the geometric-mean speed-up (best baseline / free) over
the memory-tight cases. Writes bench/out/plan_quality.json and prints a table.

Models (zoo real sizes, bf16): GPT-2 124M, Llama-3 8B, BERT-large, ViT-L/16, Mixtral-8x7B,
ResNet-50. Clusters: one DGX H100 (8 GPUs); 4 DGX H100 nodes (32); 16 Perlmutter-like nodes of 4
A100-40GB (64); "tight": DGX A100-40GB nodes, as few as hold the fully sharded training state
(16 bytes a parameter over all devices) in half a device, with the per-device cap at 2/3 of the
peak the DDP plan reaches there unconstrained (the device's usable memory if DDP does not fit
at all; ``--tight-fraction`` changes the 2/3). Global batch: the zoo's default, raised to a
multiple of the device count (one sample per device at least).

    .venv/bin/python bench/plan_quality.py           # GPT-2 124M on h100x8 and tight (~3 min), for make bench
    .venv/bin/python bench/plan_quality.py --all     # every model on every cluster (hours on 2 cores)
    .venv/bin/python bench/plan_quality.py --models llama3 bert --clusters tight --baselines ddp fsdp megatron

A model is a key of MODELS or any zoo name[:size]. Cases run one after another and each row is
printed (and the JSON rewritten) as it finishes, so a long run can be stopped at any point.

A solve that finds no plan within --time-limit leaves its mesh or grid unpriced: each plan's
``mesh_errors`` says "time_limit" for it and the row's ``time_limited`` (the table's last column:
plan:count) lists them, so a ratio that rests on an unpriced mesh is visible as such.
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
from autoshard.planning.baselines import BASELINES, RECOMPUTE, best_baseline, compare, plan_baseline
from autoshard.errors import InfeasibleError, SolverError
from autoshard.planning.plan import Plan

CLUSTERS = {
    "h100x8": lambda: autoshard.Cluster.preset("dgx-h100", nodes=1),
    "h100x32": lambda: autoshard.Cluster.preset("dgx-h100", nodes=4),
    "perlmutter64": lambda: autoshard.Cluster.preset("perlmutter", nodes=16),
    "tight": None,  # sized per model: _tight
}
TIGHT = {"tight"}
MODELS = {"gpt2": "hf_gpt2:124m", "llama3": "hf_llama3:8b", "bert": "bert:large", "vit": "vit:l16",
          "mixtral": "mixtral:8x7b", "resnet50": "resnet50:real"}
QUICK = (["gpt2"], ["h100x8", "tight"])
FULL = (list(MODELS), list(CLUSTERS))
TIGHT_FRACTION = 2 / 3
STATE_BYTES = 16  # per parameter: fp32 master + grad + Adam moments, the usual ZeRO accounting


def _tight_cluster(params: int) -> autoshard.Cluster:
    """DGX A100-40GB nodes, the fewest (a power of two) whose devices hold the fully sharded state
    in half their usable memory."""
    nodes = 1
    while STATE_BYTES * params / (8 * nodes) > autoshard.Cluster.preset("dgx-a100-40gb").memory_limit / 2:
        nodes *= 2
    return autoshard.Cluster.preset("dgx-a100-40gb", nodes=nodes)


def _tight_limit(traced, cluster: autoshard.Cluster, time_limit: float, fraction: float = TIGHT_FRACTION) -> float:
    """``fraction`` of the unconstrained DDP plan's peak (whatever dominates it: state for the
    LLMs, activations for ResNet-50), or the usable memory when DDP does not fit even that. At 1/2,
    on one A100 node, no baseline fits GPT-2 or ViT-L (only the free plan does), so the default
    leaves the baselines some room."""
    try:
        ddp = plan_baseline(traced, cluster, "ddp", time_limit=time_limit)
    except (InfeasibleError, SolverError):
        return cluster.memory_limit
    return min(cluster.memory_limit, ddp.peak_memory * fraction)


def _model(spec: str, world: int):
    name, _, size = MODELS.get(spec, spec).partition(":")
    size = size or "real"
    base = zoo.get(name, size, device="meta")[1][0].shape[0]
    batch = world * math.ceil(base / world)
    return zoo.get(name, size, device="meta", batch=batch)


def _row(plan) -> dict:
    if not isinstance(plan, Plan):
        need = getattr(plan, "min_memory", None)
        return {"error": type(plan).__name__, "min_memory_gb": need and need / 1e9}
    return {"step_ms": plan.step_time * 1e3, "peak_gb": plan.peak_memory / 1e9, "mfu": plan.mfu,
            "mesh": list(plan.mesh_shape), "status": plan.solver["status"],
            # per logical mesh tried: step ms (None: no plan) and seconds to plan
            "meshes": {k: v and v * 1e3 for k, v in plan.stats.get("meshes", {}).items()},
            # why a mesh above has no plan: "time_limit" (not priced), "slower" (proven no faster
            # than the mesh kept: not priced), "infeasible", "constraint"
            "mesh_errors": plan.stats.get("mesh_errors", {}),
            "mesh_seconds": plan.stats.get("mesh_seconds", {})}


def run_case(model_spec: str, cluster_name: str, baselines, time_limit: float,
             tight_fraction: float = TIGHT_FRACTION) -> dict:
    if cluster_name in TIGHT:
        name, _, size = MODELS.get(model_spec, model_spec).partition(":")
        meta, _ = zoo.get(name, size or "real", device="meta")
        cluster = _tight_cluster(sum(p.numel() for p in meta.parameters()))
    else:
        cluster = CLUSTERS[cluster_name]()
    model, inputs = _model(model_spec, cluster.world_size)
    t0 = time.perf_counter()
    traced = autoshard.trace(model, inputs)
    limit = _tight_limit(traced, cluster, time_limit, tight_fraction) if cluster_name in TIGHT else None
    plans = compare(traced, cluster, memory_limit=limit, baselines=baselines, time_limit=time_limit)
    row = {"model": model_spec, "cluster": cluster_name, "world": cluster.world_size,
           "batch": int(inputs[0].shape[0]), "memory_limit_gb": (limit or cluster.memory_limit) / 1e9,
           "tight": cluster_name in TIGHT, "plans": {k: _row(p) for k, p in plans.items()},
           "seconds": time.perf_counter() - t0}
    # every solve that ran out of time_limit without a plan (its mesh or grid was not priced):
    # plan -> meshes; a ratio over 1.00 next to a free-plan entry here is a time-limit artefact
    row["time_limited"] = {k: [m for m, why in (p.get("mesh_errors") or {}).items() if why == "time_limit"]
                           or (["all"] if p.get("error") == "SolverError" else [])
                           for k, p in row["plans"].items()}
    row["time_limited"] = {k: v for k, v in row["time_limited"].items() if v}
    best = best_baseline(plans)
    free = plans["auto"]
    row["best_baseline"] = best and best[0]
    if best and isinstance(free, Plan):
        row["ratio"] = free.step_time / best[1].step_time
    return row


def summarize(rows: list[dict]) -> dict:
    tight = [r["ratio"] for r in rows if r["tight"] and r.get("ratio")]
    return {"geomean_speedup_tight": math.exp(sum(-math.log(x) for x in tight) / len(tight)) if tight else None,
            "tight_cases": len(tight),
            "max_ratio": max((r["ratio"] for r in rows if r.get("ratio")), default=None)}


def table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="plan quality: free plan vs best baseline (predicted)")
    for col in ("model", "cluster", "world", "free ms", "free mesh", "free GB", "free MFU", "best baseline",
                "baseline ms", "baseline mesh", "baseline GB", "baseline MFU", "ratio", "s", "time-limited"):
        t.add_column(col)
    for r in rows:
        free, best = r["plans"]["auto"], r["plans"].get(r["best_baseline"] or "", {})
        fmt = lambda d, k, f: f.format(d[k]) if d.get(k) is not None else d.get("error", "-")  # noqa: E731
        t.add_row(r["model"], r["cluster"], str(r["world"]), fmt(free, "step_ms", "{:.2f}"),
                  str(tuple(free.get("mesh", ()))), fmt(free, "peak_gb", "{:.1f}"), fmt(free, "mfu", "{:.3f}"),
                  str(r["best_baseline"]), fmt(best, "step_ms", "{:.2f}") if best else "-",
                  str(tuple(best.get("mesh", ()))) if best else "-",
                  fmt(best, "peak_gb", "{:.1f}") if best else "-", fmt(best, "mfu", "{:.3f}") if best else "-",
                  f"{r['ratio']:.3f}" if r.get("ratio") else "-", f"{r['seconds']:.0f}",
                  # solves with no plan within the time limit: the free plan's meshes, then baselines
                  " ".join(f"{k}:{len(v)}" for k, v in r.get("time_limited", {}).items()) or "-")
    Console(width=220).print(t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=None,
                    help=f"keys of MODELS ({', '.join(MODELS)}) or zoo name[:size]")
    ap.add_argument("--clusters", nargs="+", default=None, choices=list(CLUSTERS))
    ap.add_argument("--all", action="store_true", help=f"models {FULL[0]} on clusters {FULL[1]} "
                    f"(default: {QUICK[0]} on {QUICK[1]})")
    ap.add_argument("--baselines", nargs="+", default=list(BASELINES), choices=list(BASELINES))
    ap.add_argument("--no-recompute-variants", action="store_true", help="only the no-recompute form of each")
    ap.add_argument("--time-limit", type=float, default=120.0, help="seconds per solve")
    ap.add_argument("--tight-fraction", type=float, default=TIGHT_FRACTION, help="the tight cap over DDP's peak")
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "plan_quality.json"))
    ap.add_argument("--show", nargs="+", default=None, metavar="JSON",
                    help="print the table of earlier runs' JSON files (rows merged in order) and exit")
    args = ap.parse_args()
    if args.show:
        rows = [r for f in args.show for r in json.loads(Path(f).read_text())["rows"]]
        table(rows)
        print(json.dumps(summarize(rows)))
        return
    models, clusters = FULL if args.all else QUICK
    args.models, args.clusters = args.models or models, args.clusters or clusters
    warnings.simplefilter("ignore")
    names = [b + s for b in args.baselines for s in RECOMPUTE if not (args.no_recompute_variants and s)]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for m in args.models:
        for c in args.clusters:
            row = run_case(m, c, names, args.time_limit, args.tight_fraction)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "plans"}), flush=True)
            out.write_text(json.dumps({"rows": rows, "summary": summarize(rows)}, indent=1))
    table(rows)
    print(json.dumps(summarize(rows)))


if __name__ == "__main__":
    main()
