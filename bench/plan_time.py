"""Plan time per stage for Llama shapes on a 64-GPU DGX H100 mesh (8 nodes x 8), under a memory
cap that forces sharded storage and some recompute. Each case runs in a fresh process so its peak
RSS is its own. Writes bench/out/plan_time.json and prints a table.

``--cap-gb auto`` sets each case's cap to 90% of the least memory any plan of it needs without
recompute (found by a separate, untimed trace and solve), so every depth is planned equally tight:
sharding and some recompute are forced at 2 layers as at 80. A fixed cap (default 40 GB) binds
only the deep models. ``--no-followers`` also times the problem without follower coarsening.

    .venv/bin/python bench/plan_time.py [--layers 2 8 32 80] [--hidden 4096 8192] [--cap-gb 40|auto] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import time
from pathlib import Path


def case(hidden: int, layers: int, cap_gb: float | str, batch: int, seq: int, share: bool,
         followers: bool = True) -> dict:
    import warnings

    import torch

    import autoshard
    from autoshard.zoo import Llama, LlamaConfig

    warnings.simplefilter("ignore")
    base = LlamaConfig.llama3_8b(seq) if hidden == 4096 else LlamaConfig.llama3_70b(seq)
    cfg = LlamaConfig(**{**base.__dict__, "layers": layers})
    with torch.device("meta"):
        model = Llama(cfg)
    inputs = tuple(torch.empty(batch, seq, dtype=torch.long, device="meta") for _ in range(2))
    cluster = autoshard.Cluster.preset("dgx-h100", nodes=8)
    if cap_gb == "auto":  # on its own trace: the timed plan must not find strategies cached
        try:
            autoshard.plan(autoshard.trace(model, inputs), cluster, memory_limit=1.0, recompute=False)
        except autoshard.errors.InfeasibleError as exc:
            cap_gb = 0.9 * exc.min_memory / 1e9
    t0 = time.perf_counter()
    traced = autoshard.trace(model, inputs)
    trace_s = time.perf_counter() - t0
    row = {"hidden": hidden, "layers": layers, "cap_gb": cap_gb, "batch": batch, "seq": seq, "share": share,
           "followers": followers, "trace_s": trace_s, "nodes": len(traced.gm.graph.nodes)}
    t1 = time.perf_counter()
    try:
        plan = autoshard.plan(traced, cluster, memory_limit=cap_gb * 1e9, share_layers=share, time_limit=300,
                              followers=followers)
        row.update({k: plan.stats[k] for k in ("strategies_s", "formulate_s", "solve_s")})
        row.update({"after_trace_s": time.perf_counter() - t1, "step_ms": plan.step_time * 1e3,
                    "peak_gb": plan.peak_memory / 1e9, "status": plan.solver["status"],
                    "recomputed": sum(n.recompute for n in plan.nodes),
                    "sharded_params": sum("S" in p for p in plan.storage.values()), "params": len(plan.storage),
                    "ilp_nodes": plan.stats["shared_nodes"][1], "mfu": plan.mfu})
    except autoshard.errors.InfeasibleError as exc:
        row.update({"after_trace_s": time.perf_counter() - t1, "status": "infeasible",
                    "min_memory_gb": exc.min_memory / 1e9})
    row["total_s"] = time.perf_counter() - t0
    row["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return row


def _run(args, queue):
    queue.put(case(*args))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32, 80])
    ap.add_argument("--hidden", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--cap-gb", type=lambda v: v if v == "auto" else float(v), default=40.0)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--no-share", action="store_true", help="also time the problem without layer sharing")
    ap.add_argument("--no-followers", action="store_true", help="also time the problem without followers")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "plan_time.json")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    rows = []
    for hidden in args.hidden:
        for layers in args.layers:
            variants = [(True, True)] + [(False, True)] * args.no_share + [(True, False)] * args.no_followers
            for share, followers in variants:
                queue = ctx.Queue()
                proc = ctx.Process(target=_run, args=((hidden, layers, args.cap_gb, args.batch, args.seq, share,
                                                       followers), queue))
                proc.start()
                rows.append(queue.get())
                proc.join()
                print(json.dumps(rows[-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))

    from rich.console import Console
    from rich.table import Table

    cap = args.cap_gb if args.cap_gb == "auto" else f"{args.cap_gb:g} GB"
    table = Table(title=f"autoshard.plan on 8x8 DGX H100, Llama shapes, batch {args.batch} x seq {args.seq}, "
                        f"cap {cap}/device")
    cols = ["hidden", "layers", "share", "followers", "cap_gb", "trace_s", "strategies_s", "formulate_s", "solve_s", "after_trace_s",
            "total_s", "step_ms", "peak_gb", "recomputed", "sharded_params", "ilp_nodes", "status", "peak_rss_gib"]
    for c in cols:
        table.add_column(c)
    for r in rows:
        table.add_row(*[f"{r[c]:.2f}" if isinstance(r.get(c), float) else str(r.get(c, "-")) for c in cols])
    Console(width=220).print(table)
    os.sys.stdout.flush()


if __name__ == "__main__":
    main()
