"""Mixture-of-experts plans at real sizes on ``meta``: the free plan (expert parallelism one of its
choices) against the same problem without expert parallelism and against hand layouts, among
them torchtitan's (``fsdp_ep``: experts split over an ep dim and FSDP-sharded over the rest,
every other parameter FSDP). Per row: predicted step time, peak memory per device, the (logical)
mesh, the mesh dims that went to expert parallelism, and the planning time. The free plans try
the 2-D logical meshes over the same devices (``meshes="auto-2d"``), as the baselines try their
grids. Writes bench/out/moe.json.

    OMP_NUM_THREADS=1 .venv/bin/python bench/moe.py [--only mixtral:4 deepseek_v3:8] [--baselines fsdp_ep fsdp]
        [--capacity 1.25 2] [--skip-without-ep]

Models: Mixtral-8x7B (8 experts, top-2) and a fine-grained MoE of DeepSeek-V3's architecture at
16B (64 small experts, top-6, two shared experts), both bfloat16, one sequence of 4096 tokens
per GPU per step. Clusters: DGX H100 nodes (8 GPUs each), 4 and 8 nodes.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
import warnings
from pathlib import Path

import torch

import autoshard
from autoshard.errors import AutoshardError
from autoshard.passes.regions import ep_dim
from autoshard.planning.baselines import plan_baseline

SEQ = 4096
BASELINES = ["fsdp_ep", "fsdp_ep+recompute", "fsdp", "fsdp+recompute", "tp_fsdp", "tp_fsdp+recompute"]


def model(name: str, batch: int):
    import transformers
    from autoshard import zoo
    from autoshard.zoo import hf

    if name == "mixtral":
        return zoo.get("mixtral", "8x7b", device="meta", dtype=torch.bfloat16, batch=batch)
    with torch.device("meta"):
        m = hf.CausalLM(transformers.DeepseekV3ForCausalLM(hf.deepseek_v3_config("16b"))).to(torch.bfloat16)
    ids = torch.zeros(batch, SEQ, dtype=torch.long, device="meta")
    return m, (ids, ids)


def _ep_dims(plan) -> dict[str, int]:
    """Mesh dim name -> the MoE ops the plan runs expert-parallel over it."""
    counts = collections.Counter(d for d, _ in plan.expert_parallel().values())
    return {plan.mesh_dim_names[d]: k for d, k in counts.items()}


def _row(label: str, fn) -> dict:
    start = time.perf_counter()
    try:
        p = fn()
    except AutoshardError as exc:
        return {"plan": label, "error": f"{type(exc).__name__}: {str(exc)[:160]}", "plan_s": time.perf_counter() - start}
    return {"plan": label, "step_s": p.step_time, "peak_gib": p.peak_memory / 2**30, "mesh": list(p.mesh_shape),
            "ep_dims": _ep_dims(p), "status": p.solver["status"], "plan_s": time.perf_counter() - start}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", default=["deepseek_v3:8", "mixtral:8", "deepseek_v3:4", "mixtral:4"],
                    help="model:nodes entries")
    ap.add_argument("--baselines", nargs="*", default=BASELINES)
    ap.add_argument("--time-limit", type=float, default=300.0)
    ap.add_argument("--batch", type=int, default=None, help="global sequences per step (default: one per GPU)")
    ap.add_argument("--meshes", default="auto-2d", help="the free plans' logical meshes (autoshard.plan's meshes)")
    ap.add_argument("--capacity", type=float, nargs="*", default=[],
                    help="also the free plan with these moe_capacity values (receive buffers in own rows)")
    ap.add_argument("--skip-without-ep", action="store_true", help="no 'free without EP' row")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    out = Path(__file__).parent / "out" / ("moe.json" if args.batch is None else f"moe_batch{args.batch}.json")
    out.parent.mkdir(exist_ok=True)
    results = []
    for spec in args.only:
        name, nodes = spec.split(":")
        cluster = autoshard.Cluster.preset("dgx-h100", nodes=int(nodes))
        m, inputs = model(name, args.batch or cluster.world_size)
        start = time.perf_counter()
        traced = autoshard.trace(m, inputs)
        trace_s = time.perf_counter() - start
        free = dict(time_limit=args.time_limit, meshes=args.meshes)
        rows = [_row("free", lambda: autoshard.plan(traced, cluster, **free))]
        rows += [_row(f"free, capacity {c:g}", lambda: autoshard.plan(traced, cluster, **free, moe_capacity=c))
                 for c in args.capacity]
        if not args.skip_without_ep:
            rows.append(_row("free without EP", lambda: autoshard.plan(traced, cluster, **free,
                                                                       allow=lambda n, s: ep_dim(s) is None)))
        for b in args.baselines:
            rows.append(_row(b, lambda: plan_baseline(traced, cluster, b, time_limit=args.time_limit)))
        entry = {"model": name, "nodes": int(nodes), "cluster": f"{nodes} x 8 H100", "batch": list(inputs[0].shape),
                 "trace_s": trace_s, "rows": rows}
        results.append(entry)
        for r in rows:
            print(_line(spec, r), flush=True)
        out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")


def _line(spec: str, r: dict) -> str:
    if "error" in r:
        return f"{spec:<14} {r['plan']:<20} {r['error']}  ({r['plan_s']:.0f} s)"
    return (f"{spec:<14} {r['plan']:<20} step {r['step_s'] * 1e3:8.1f} ms  peak {r['peak_gib']:5.1f} GiB  "
            f"mesh {r['mesh']}  EP {r['ep_dims'] or '-'}  {r['status']}  planned in {r['plan_s']:.0f} s")


if __name__ == "__main__":
    main()
