"""Pipeline stages against plans without them, on Llama shapes across many nodes: the free
pipeline search for each stage count (stages over the node dim, micro-batches p and 4p, 1F1B,
interleaved 1F1B, zero bubble and ZB-V; the free pipeline plan is the fastest of them), the hand layout
FSDP x TP x PP 8 (``fsdp_tp_pp``, with and without full recompute), the free plan without
stages on the cluster's mesh, and the FSDP and TP x FSDP baselines without stages (each with
and without full recompute), with every planning time. Predicted figures (the cost model's), bf16, all on meta tensors. Writes bench/out/pipeline.json.

    .venv/bin/python bench/pipeline.py [--cases 70b-h100x16 70b-perlmutter64 405b-h100x64 0.5b-h100x4-10gbe
                                       70b-h100x16-10gbe]
                                       [--seq 4096] [--stages 2 4 8 16] [--time-limit 60]
                                       [--meshes auto-2d]

``--meshes``: also the free pipeline search over the outer dim of each logical mesh
(``plan_pipeline(meshes=...)``: which grid carries the stages is chosen too), one row.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import torch

import autoshard
from autoshard.errors import ConstraintError, InfeasibleError, SolverError
from autoshard.cluster.presets import ETHERNET_10G, PRESETS
from autoshard.planning.baselines import plan_baseline
from autoshard.planning.pipeline import PipelinePlan, plan_pipeline
from autoshard.zoo import Llama, LlamaConfig

CASES = {  # name: (model, preset, nodes, global batch)
    "70b-h100x16": ("70b", "dgx-h100", 16, 128),
    "70b-perlmutter64": ("70b", "perlmutter", 64, 256),
    "405b-h100x64": ("405b", "dgx-h100", 64, 512),
    # a small model on nodes joined by 10 Gb Ethernet: what stages are for
    "0.5b-h100x4-10gbe": ("0.5b", "dgx-h100-10gbe", 4, 8),
    # a model whose training state does not fit one node, on those nodes
    "70b-h100x16-10gbe": ("70b", "dgx-h100-10gbe", 16, 128),
}


def cluster_of(preset: str, nodes: int) -> autoshard.Cluster:
    if not preset.endswith("-10gbe"):
        return autoshard.Cluster.preset(preset, nodes=nodes)
    p = PRESETS[preset.removesuffix("-10gbe")]
    return autoshard.Cluster((nodes, p.gpus_per_node), ("node", "gpu"), p.device, [ETHERNET_10G, p.intra],
                             ranks_per_node=p.gpus_per_node)


def model_of(size: str, seq: int):
    if size == "0.5b":   # 8 layers of hidden 2048: 0.51B parameters
        cfg = LlamaConfig(vocab=32000, seq=seq, hidden=2048, heads=16, kv_heads=8, intermediate=5632, layers=8)
    elif size == "70b":
        cfg = LlamaConfig.llama3_70b(seq)
    else:   # the Llama-3.1-405B shape
        cfg = LlamaConfig(**{**LlamaConfig.llama3_70b(seq).__dict__, "hidden": 16384, "heads": 128, "kv_heads": 8,
                             "intermediate": 53248, "layers": 126})
    with torch.device("meta"):
        return Llama(cfg).to(torch.bfloat16)   # bf16 parameters and optimizer state, as bench/long_context.py


def row_of(name, p, seconds):
    if isinstance(p, Exception):
        return {"plan": name, "error": type(p).__name__, "min_memory_gb": getattr(p, "min_memory", None) and
                p.min_memory / 1e9, "plan_s": seconds}
    out = {"plan": name, "step_s": p.step_time, "peak_gb": p.peak_memory / 1e9, "plan_s": seconds}
    if isinstance(p, PipelinePlan):
        out.update(stages=p.stages, virtual=p.virtual, micro_batches=p.micro_batches, schedule=p.schedule,
                   layers=p.layers, stage_mesh=list(p.stage_mesh), bubble_s=p.bubble_time, send_s=p.send_time,
                   mesh=list(p.mesh_shape),
                   solves=p.stats.get("solves"), candidates=p.stats.get("candidates"), errors=p.stats.get("errors"),
                   stopped=p.stats.get("stopped"), status=p.stage_plan.solver["status"])
    else:
        out.update(mesh=list(p.mesh_shape), baseline=p.stats.get("baseline"), status=p.solver["status"])
    return out


def run(case: str, seq: int, time_limit: float, stages, meshes=None) -> list[dict]:
    size, preset, nodes, batch = CASES[case]
    model = model_of(size, seq)
    inputs = tuple(torch.empty(batch, seq, dtype=torch.long, device="meta") for _ in range(2))
    cluster = cluster_of(preset, nodes)
    rows = []
    jobs = [(f"pipeline, {p} stages", lambda p=p: plan_pipeline(model, cluster, inputs, stages=p, time_limit=time_limit))
            for p in stages if nodes % p == 0 and p <= len(model.blocks)]
    if meshes is not None:
        jobs.append((f"pipeline, meshes {meshes}", lambda: plan_pipeline(
            model, cluster, inputs, stages=[p for p in stages if p <= len(model.blocks)], meshes=meshes,
            time_limit=time_limit)))
    jobs += [("fsdp_tp_pp", lambda: plan_baseline(model, cluster, "fsdp_tp_pp", inputs, time_limit=time_limit)),
             ("fsdp_tp_pp+recompute", lambda: plan_baseline(model, cluster, "fsdp_tp_pp+recompute", inputs,
                                                            time_limit=time_limit))]
    traced = None

    def free():
        nonlocal traced
        traced = traced or autoshard.trace(model, inputs)
        return autoshard.plan(traced, cluster, time_limit=time_limit)

    jobs.append(("free, no stages", free))
    for name in ("fsdp", "fsdp+recompute", "tp_fsdp", "tp_fsdp+recompute"):
        def job(name=name):
            nonlocal traced
            traced = traced or autoshard.trace(model, inputs)
            return plan_baseline(traced, cluster, name, time_limit=time_limit)
        jobs.append((name, job))
    for name, job in jobs:
        start = time.perf_counter()
        try:
            p = job()
        except (InfeasibleError, SolverError, ConstraintError) as exc:
            p = exc
        rows.append(dict(row_of(name, p, time.perf_counter() - start), case=case))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--meshes", default=None, help='"auto", "auto-2d": pipelines over logical meshes too')
    ap.add_argument("--out", default="bench/out/pipeline.json")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    rows = [r for case in args.cases for r in run(case, args.seq, args.time_limit, args.stages, args.meshes)]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    print(f"{'case':18} {'plan':20} {'step s':>8} {'peak GB':>8} {'plan s':>7}  layout")
    for r in rows:
        layout = (f"PP {r['stages']} x{r['virtual']} {r['schedule']} m={r['micro_batches']} over {r['mesh']}, "
                  f"stage mesh {r['stage_mesh']}"
                  if "stages" in r else f"mesh {r.get('mesh')}" if "mesh" in r else r.get("error", ""))
        step = f"{r['step_s']:8.3f}" if "step_s" in r else f"{'-':>8}"
        peak = f"{r['peak_gb']:8.1f}" if "peak_gb" in r else f"{'-':>8}"
        print(f"{r['case']:18} {r['plan']:20} {step} {peak} {r['plan_s']:7.1f}  {layout}")


if __name__ == "__main__":
    main()
