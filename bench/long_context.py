"""Long sequences: the free plan (which may split attention by sequence: context parallelism)
against FSDP alone, against the free plan without a sequence split of attention (attention then
split by batch and heads only), and against FSDP x CP with the CP degree fixed by hand; and the
free plan again without the ring (keys and values gathered for every sequence split). Predicted,
planned on meta with bf16 weights. Writes bench/out/long_context.json and prints a table.

    OMP_NUM_THREADS=1 .venv/bin/python bench/long_context.py [--seqs 32768 65536 ...] [--quick]

Cases: the Llama-3-8B shape (32 layers) on one 8 x H100 node at 32k to 256k tokens, one sequence
per step (a rank cannot hold less by splitting the batch); an 8-layer Llama-3-8B shape on 8 x 8
H100 at 512k and 1M tokens, one sequence per step too. ``tok/s/GPU`` is the step's
tokens over its predicted time and the GPUs. ``cp`` is the number of ranks one attention's
queries are split over by sequence (1: none), with the split's variant ("bal": the balanced causal
split; "ring": keys and values passed around a ring, not gathered). ``grids`` gives
each grid a row tried (a baseline's, or the free plan's logical meshes) and its step. ``plan_s`` is the planning time of that row
(trace excluded, shared by all rows of a case).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
import warnings
from pathlib import Path

import torch

import autoshard
from autoshard.errors import InfeasibleError, SolverError
from autoshard.notation import split_top
from autoshard.passes.rules.attention import is_attention, sequence_mesh_dim
from autoshard.planning.baselines import plan_baseline
from autoshard.zoo import Llama, LlamaConfig

OUT = Path(__file__).parent / "out"
CASES = [  # (label, nodes, layers, batch, seq)
    *[("8 H100", 1, 32, 1, s) for s in (32768, 65536, 131072, 262144)],
    *[("8x8 H100", 8, 8, 1, s) for s in (524288, 1048576)],
]


def _no_sequence_split(node, s) -> bool:
    return not is_attention(node) or sequence_mesh_dim(node, s) is None


def _no_ring(node, s) -> bool:
    return not is_attention(node) or "ring" not in s.variant.split()


def _cp_degree(plan) -> int:
    """Ranks one attention's queries are split over by sequence, from the plan's strategies."""
    best = 1
    for n in plan.nodes:
        if "flash_attention" in n.op:
            query = split_top(re.match(r"\((?:[^()]|\([^()]*\))*\)", n.strategy).group(0)[1:-1])
            best = max(best, math.prod(plan.mesh_shape[d] for d, p in enumerate(query) if p == "S(2)"))
    return best


def _row(name: str, make, tokens: int, world: int) -> dict:
    t0 = time.perf_counter()
    try:
        p = make()
    except (InfeasibleError, SolverError) as exc:
        return {"plan": name, "fits": False, "min_gb": getattr(exc, "min_memory", None) and exc.min_memory / 1e9,
                "plan_s": time.perf_counter() - t0}
    return {"plan": name, "fits": True, "step_s": p.step_time, "tok_s_gpu": tokens / p.step_time / world,
            "peak_gb": p.peak_memory / 1e9, "cp": _cp_degree(p), "mesh": list(p.mesh_shape),
            "plan_s": time.perf_counter() - t0, "status": p.solver["status"],
            "variant": "/".join(sorted({n.strategy[n.strategy.rindex(")") + 1:].strip() for n in p.nodes
                                        if "flash_attention" in n.op} - {""})),
            "grids": p.stats.get("meshes")}


def case(label: str, nodes: int, layers: int, batch: int, seq: int, quick: bool) -> list[dict]:
    cfg = LlamaConfig(**{**LlamaConfig.llama3_8b(seq).__dict__, "layers": layers})
    with torch.device("meta"):
        model = Llama(cfg).to(torch.bfloat16)
    inputs = tuple(torch.empty(batch, seq, dtype=torch.long, device="meta") for _ in range(2))
    cluster = autoshard.Cluster.preset("dgx-h100", nodes=nodes)
    traced = autoshard.trace(model, inputs)
    world, tokens = cluster.world_size, batch * seq
    meshes = None if quick else "auto-2d"
    rows = [
        _row("free", lambda: autoshard.plan(traced, cluster, meshes=meshes), tokens, world),
        _row("no sequence split", lambda: autoshard.plan(traced, cluster, meshes=meshes, allow=_no_sequence_split),
             tokens, world),
        _row("free, keys gathered", lambda: autoshard.plan(traced, cluster, meshes=meshes, allow=_no_ring),
             tokens, world),
        _row("fsdp", lambda: plan_baseline(traced, cluster, "fsdp+recompute"), tokens, world),
        _row("fsdp_cp", lambda: plan_baseline(traced, cluster, "fsdp_cp+recompute"), tokens, world),
    ]
    for r in rows:
        r.update(case=label, seq=seq, layers=layers, batch=batch)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, nargs="*", help="only these sequence lengths")
    ap.add_argument("--quick", action="store_true", help="the cluster's own mesh only (no other 2-D grids)")
    ap.add_argument("--out", default=str(OUT / "long_context.json"))
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    rows = []
    for label, nodes, layers, batch, seq in CASES:
        if args.seqs and seq not in args.seqs:
            continue
        rows += case(label, nodes, layers, batch, seq, args.quick)
        Path(args.out).parent.mkdir(exist_ok=True)
        Path(args.out).write_text(json.dumps({"rows": rows}, indent=1))
    from rich.console import Console
    from rich.table import Table

    t = Table(title="long sequences, Llama-3-8B shape, bf16 (predicted)")
    for col in ("cluster", "seq", "plan", "step s", "tok/s/GPU", "peak GB", "cp", "mesh", "plan s", "grids (step s)"):
        t.add_column(col, justify="left" if col in ("cluster", "plan") else "right")
    for r in rows:
        if r["fits"]:
            cp = f"{r['cp']} {r['variant'].replace('balanced', 'bal')}".strip()
            grids = " ".join(f"{k}:{'-' if v is None else f'{v:.2f}'}" for k, v in (r["grids"] or {}).items())
            t.add_row(r["case"], f"{r['seq'] // 1024}k", r["plan"], f"{r['step_s']:.2f}", f"{r['tok_s_gpu']:.0f}",
                      f"{r['peak_gb']:.1f}", cp, "x".join(map(str, r["mesh"])), f"{r['plan_s']:.1f}", grids)
        else:
            need = f"needs {r['min_gb']:.0f}" if r["min_gb"] else "no plan"
            t.add_row(r["case"], f"{r['seq'] // 1024}k", r["plan"], "does not fit", "", need, "", "", f"{r['plan_s']:.1f}")
    Console(width=220).print(t)


if __name__ == "__main__":
    main()
