"""Strategy coverage on a corpus of real architectures (autoshard/zoo/corpus.py) and the zoo's tiny
models: each traced once, then planned on one DGX H100 node as a (8,) and a (2, 4) mesh. Prints
per model the graph's nodes, the coverage gaps and ops with no rule (passes/coverage.py) on each
mesh, and the seconds to trace and to plan; writes bench/out/coverage.json.

    .venv/bin/python bench/coverage.py [--only gptj t5 ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
import warnings
from pathlib import Path

from rich.console import Console
from rich.table import Table

import autoshard
from autoshard import _torch, zoo
from autoshard.zoo import corpus
from autoshard.cluster import Cluster
from autoshard.errors import SolverError
from autoshard.passes.coverage import coverage_gaps
from autoshard.passes.strategies import META_KEY, find_strategies

MESHES = ((8,), (2, 4))


def models() -> list[str]:
    return [*corpus.names(), *(f"zoo:{n}" for n in zoo.names())]


def build(name: str):
    if name.startswith("zoo:"):
        return zoo.get(name[4:], "tiny")
    return corpus.get(name)


def measure(name: str) -> dict:
    row: dict = {"model": name}
    try:
        model, inputs = build(name)
        t0 = time.perf_counter()
        traced = autoshard.trace(model, inputs)
        row["trace_s"] = time.perf_counter() - t0
        row["nodes"] = sum(1 for n in traced.gm.graph.nodes if n.op == "call_function")
        for shape in MESHES:
            cluster = Cluster.preset("dgx-h100").with_mesh(shape)
            key = "x".join(map(str, shape))
            t0 = time.perf_counter()
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    plan = autoshard.plan(traced, cluster, time_limit=60)
            except SolverError as exc:   # no plan within the limit: the gaps are known before the solve
                row[f"plan_s_{key}"] = time.perf_counter() - t0
                row[f"status_{key}"] = f"no plan: {exc}"
                find_strategies(traced.gm, _torch.planning_mesh(cluster.mesh_shape, cluster.mesh_dim_names))
                gaps = coverage_gaps(traced.gm)
                fallbacks = [n for n in traced.gm.graph.nodes if META_KEY in n.meta and n.meta[META_KEY].fallback]
                row[f"gaps_{key}"], row[f"fallbacks_{key}"] = len(gaps), len(fallbacks)
                row[f"gap_ops_{key}"] = sorted({g.op for g in gaps} | {str(n.target) for n in fallbacks})
                continue
            row[f"plan_s_{key}"] = time.perf_counter() - t0
            row[f"gaps_{key}"] = len(plan.gaps)
            row[f"fallbacks_{key}"] = len(plan.fallbacks)
            row[f"gap_ops_{key}"] = sorted({g["op"] for g in plan.gaps} | {r for _, r in plan.fallbacks})
            row[f"status_{key}"] = plan.solver["status"]
    except Exception as exc:  # noqa: BLE001 - a model that fails is a row, not the end of the table
        row["error"] = f"{type(exc).__name__}: {exc}"
        row["traceback"] = traceback.format_exc()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", default=None, help="models (corpus names, or zoo:NAME)")
    ap.add_argument("--out", default="bench/out/coverage.json")
    args = ap.parse_args()
    rows = [measure(name) for name in (args.only or models())]
    table = Table(title="strategy coverage (gaps + ops with no rule, per mesh)")
    for col in ("model", "nodes", "gaps 8", "gaps 2x4", "trace s", "plan s 8", "plan s 2x4", "note"):
        table.add_column(col)
    for r in rows:
        if "error" in r:
            table.add_row(r["model"], "", "", "", "", "", "", r["error"][:80])
            continue
        note = ", ".join(sorted(set(r["gap_ops_8"]) | set(r["gap_ops_2x4"]))) or corpus.KNOWN_GAPS.get(r["model"], "")
        seconds = {k: f"{r[f'plan_s_{k}']:.1f}" + ("" if r[f"status_{k}"] == "optimal" else
                                                    f" ({r[f'status_{k}'].split(':')[0]})") for k in ("8", "2x4")}
        table.add_row(r["model"], str(r["nodes"]), str(r["gaps_8"] + r["fallbacks_8"]),
                      str(r["gaps_2x4"] + r["fallbacks_2x4"]), f"{r['trace_s']:.1f}", seconds["8"],
                      seconds["2x4"], note)
    Console(width=160).print(table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
