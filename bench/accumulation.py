"""How the plan moves with gradient accumulation and precision: a Llama shape on DGX H100 nodes,
planned for K = 1, 4, 16 micro-batches per optimizer step, in fp32 and under the bf16 policy
(``MixedPrecision(param_dtype=bf16, reduce_dtype=fp32)``: fp32 master weights, bf16 compute).

For each: predicted time per optimizer step and per micro-batch, its compute and exposed
communication, the gradient collectives' time per step (the comm of the edges into parameter
storage, run once per step; plan nodes list it with role "grad"), parameter storage
(how many sharded), the tensor-parallel degree of the forward matmuls, peak memory and the
unreduced-gradient buffers accumulation keeps. Writes bench/out/accumulation.json.

    .venv/bin/python bench/accumulation.py [--layers 4] [--batch 16] [--seq 2048] [--nodes 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch

import autoshard
from autoshard.zoo import Llama, LlamaConfig

sys.path.insert(0, str(Path(__file__).parent))
from memory_caps import tp_degree  # noqa: E402

POLICIES = {"fp32": None, "bf16": autoshard.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}


def row(plan, precision: str, k: int, solve_s: float) -> dict:
    grad = [c for n in plan.nodes for c in n.comm if c.get("role") == "grad"]
    grad_comm = sum(c["time"] for c in grad)
    return {"precision": precision, "K": k, "step_ms": plan.step_time * 1e3,
            "per_micro_batch_ms": plan.step_time * 1e3 / k, "comm_ms": plan.comm_time * 1e3,
            "grad_comm_ms": grad_comm * 1e3,
            "grad_collectives": len(grad),
            "sharded_params": sum("S" in p for p in plan.storage.values()), "params": len(plan.storage),
            "exposed_comm_ms": plan.breakdown.get("exposed_comm", plan.comm_time) * 1e3,
            "compute_ms": plan.compute_time * 1e3,
            "tp_degree": tp_degree(plan, plan.mesh_shape), "peak_gb": plan.peak_memory / 1e9,
            "unreduced_grads_gb": plan.memory.get("grad_accumulation", 0.0) / 1e9,
            "status": plan.solver["status"], "solve_s": solve_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16, help="global batch of one micro-batch")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 4, 16])
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    cfg = LlamaConfig(**{**LlamaConfig.llama2_7b(args.seq).__dict__, "layers": args.layers})
    with torch.device("meta"):
        model = Llama(cfg)
    inputs = tuple(torch.empty(args.batch, args.seq, dtype=torch.long, device="meta") for _ in range(2))
    cluster = autoshard.Cluster.preset("dgx-h100", nodes=args.nodes)
    rows = []
    for precision, policy in POLICIES.items():
        traced = autoshard.trace(model, inputs, mixed_precision=policy)
        for k in args.ks:
            t0 = time.perf_counter()
            plan = autoshard.plan(traced, cluster, mixed_precision=policy, grad_accumulation=k, time_limit=300,
                                  progress=False)
            rows.append(row(plan, precision, k, time.perf_counter() - t0))
            print(json.dumps(rows[-1]), flush=True)
    out = Path(__file__).parent / "out"
    out.mkdir(exist_ok=True)
    (out / "accumulation.json").write_text(json.dumps(
        {"model": f"Llama-2-7B shape, {args.layers} layers", "micro_batch": [args.batch, args.seq],
         "cluster": f"dgx-h100 x {args.nodes}", "rows": rows}, indent=1))

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Llama-2-7B shape, {args.layers} layers, micro-batch {args.batch} x {args.seq}, "
                        f"DGX H100 x {args.nodes} (mesh {tuple(cluster.mesh_shape)})")
    cols = ["precision", "K", "step_ms", "per_micro_batch_ms", "compute_ms", "exposed_comm_ms", "grad_comm_ms",
            "grad_collectives", "sharded_params", "tp_degree", "peak_gb", "unreduced_grads_gb", "status", "solve_s"]
    for c in cols:
        table.add_column(c)
    for r in rows:
        table.add_row(*[f"{r[c]:.3g}" if isinstance(r.get(c), float) else str(r.get(c, "-")) for c in cols])
    Console(width=220).print(table)


if __name__ == "__main__":
    main()
