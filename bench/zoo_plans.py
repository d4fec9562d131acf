"""Plan every real-size zoo model on ``meta`` for DGX H100 nodes: parameters, global batch,
the fewest nodes (of 1, 2, 4, 8) it fits on, trace and solve time, predicted step time, MFU, peak
memory per device, the ops planned replicated for lack of a rule, and this process's peak RSS
(nothing is materialized). Writes bench/out/zoo_plans.json. tests/test_zoo.py plans two of
these; this plans them all (minutes).

    .venv/bin/python bench/zoo_plans.py [--only hf_llama3:8b mixtral:8x7b]
"""

from __future__ import annotations

import argparse
import json
import resource
import time
import warnings
from pathlib import Path

import autoshard
from autoshard import zoo


def specs() -> list[str]:
    return [f"{name}:{size}" for name in zoo.names() for size in zoo.sizes(name)[1:]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4, 8], help="node counts to try, in order")
    ap.add_argument("--only", nargs="*", default=None, help="name:size entries (default: every real size)")
    ap.add_argument("--time-limit", type=float, default=300.0)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    rows = []
    for spec in args.only or specs():
        name, size = spec.split(":")
        model, inputs = zoo.get(name, size, device="meta")
        row = {"model": spec, "params_b": sum(p.numel() for p in model.parameters()) / 1e9,
               "batch": list(inputs[0].shape), "dtype": str(next(model.parameters()).dtype)}
        t0 = time.perf_counter()
        traced = autoshard.trace(model, inputs)
        for nodes in args.nodes:
            try:
                cluster = autoshard.Cluster.preset("dgx-h100", nodes=nodes)
                plan = autoshard.plan(traced, cluster, time_limit=args.time_limit)
            except autoshard.errors.InfeasibleError as exc:
                row["error"] = f"{type(exc).__name__} on {nodes} node(s): {exc}"
                continue
            except autoshard.errors.AutoshardError as exc:  # e.g. the solver's time limit: say so, go on
                row["error"] = f"{type(exc).__name__} on {nodes} node(s): {exc}"
                break
            row.pop("error", None)
            row.update({"nodes": nodes, "trace_s": traced.trace_time, "solve_s": plan.stats["solve_s"],
                        "step_ms": plan.step_time * 1e3, "mfu": plan.mfu, "peak_gib": plan.peak_memory / 2**30,
                        "status": plan.solver["status"], "fallbacks": sorted({r for _, r in plan.fallbacks})})
            break
        row["total_s"] = time.perf_counter() - t0
        row["rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        rows.append(row)
        print(_line(row), flush=True)
    out = Path(__file__).parent / "out" / "zoo_plans.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"cluster": "dgx-h100", "rows": rows}, indent=1))
    print(f"wrote {out}")


def _line(r: dict) -> str:
    if "error" in r:
        return f"{r['model']:<18} {r['params_b']:8.3f}B  {r['error'][:200]}"
    mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
    return (f"{r['model']:<14} {r['params_b']:7.3f}B batch {str(r['batch']):<18} nodes {r['nodes']} "
            f"trace {r['trace_s']:5.1f}s "
            f"solve {r['solve_s']:6.1f}s step {r['step_ms']:8.1f}ms MFU {mfu:>6} peak {r['peak_gib']:5.1f}GiB "
            f"{r['status']} rss {r['rss_gib']:.2f}GiB fallbacks {r['fallbacks'] or '-'}")


if __name__ == "__main__":
    main()
