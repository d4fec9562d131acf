"""What the planner chooses as memory tightens: a Llama shape on one DGX H100 node (mesh 1 x 8)
at three per-device caps. For each: parameter storage (how many sharded, over which mesh dims),
the tensor-parallel degree of the matmuls (how many ranks split a weight's compute), the share of
forward activations recomputed, predicted step time, peak memory and solve time. Writes
bench/out/memory_caps.json.

    .venv/bin/python bench/memory_caps.py [--layers 8] [--caps-gb 60 30 15]
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import torch

import autoshard
from autoshard.zoo import Llama, LlamaConfig


def tp_degree(plan, mesh_shape) -> float:
    """Mean number of ranks that split a weight matmul's weight operand (1 = data parallel)."""
    degrees = []
    for n in plan.nodes:
        if n.op.endswith(("aten.mm.default", "aten.addmm.default")) and n.phase == "fwd":
            weight = n.strategy.split("->")[0].split("),(")[-1]
            deg = 1
            for d, p in enumerate(weight.strip("()").split(",")):
                deg *= mesh_shape[d] if p.startswith("S") else 1
            degrees.append(deg)
    return sum(degrees) / max(len(degrees), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--caps-gb", type=float, nargs="+", default=[60.0, 30.0, 15.0])
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    cfg = LlamaConfig(**{**LlamaConfig.llama2_7b(args.seq).__dict__, "layers": args.layers})
    with torch.device("meta"):
        model = Llama(cfg)
    inputs = tuple(torch.empty(args.batch, args.seq, dtype=torch.long, device="meta") for _ in range(2))
    traced = autoshard.trace(model, inputs)
    cluster = autoshard.Cluster.preset("dgx-h100", nodes=1)
    rows = []
    for cap in args.caps_gb:
        t0 = time.perf_counter()
        row = {"cap_gb": cap}
        try:
            plan = autoshard.plan(traced, cluster, memory_limit=cap * 1e9, time_limit=300)
            fwd = [n for n in plan.nodes if n.phase == "fwd" and n.op != "placeholder"]
            row.update({
                "step_ms": plan.step_time * 1e3, "peak_gb": plan.peak_memory / 1e9,
                "sharded_params": sum("S" in p for p in plan.storage.values()), "params": len(plan.storage),
                "tp_degree": tp_degree(plan, plan.mesh_shape),
                "recompute_frac": sum(n.recompute for n in fwd) / max(len(fwd), 1),
                "activations_gb": plan.memory["activations"] / 1e9, "status": plan.solver["status"],
                "gap": plan.solver["gap"]})
        except autoshard.errors.InfeasibleError as exc:
            row.update({"status": "infeasible", "min_memory_gb": exc.min_memory / 1e9})
        row["solve_s"] = time.perf_counter() - t0
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = Path(__file__).parent / "out"
    out.mkdir(exist_ok=True)
    (out / "memory_caps.json").write_text(json.dumps(rows, indent=1))

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Llama-2-7B shape, {args.layers} layers, batch {args.batch} x {args.seq}, DGX H100 x 8 (fp32)")
    cols = ["cap_gb", "step_ms", "peak_gb", "sharded_params", "tp_degree", "recompute_frac", "activations_gb",
            "status", "solve_s"]
    for c in cols:
        table.add_column(c)
    for r in rows:
        table.add_row(*[f"{r[c]:.3g}" if isinstance(r.get(c), float) else str(r.get(c, "-")) for c in cols])
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
