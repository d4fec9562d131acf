"""The emitted module compiled by inductor against the same module run op by op, on 2 gloo ranks
(CPU: inductor's C++ backend). Writes bench/out/inductor.json.

    OMP_NUM_THREADS=1 .venv/bin/python bench/inductor.py [--sizes tiny small] [--samples 9]

For each GPT of bench/fidelity.py, the free plan is made once per backend (``plan(backend=...)``:
inductor's prices fused elementwise chains) and compiled on both ranks; ``compile_s`` is the
first step under inductor (torch.compile compiles the forward and the backward that reduces the
gradients then; a second process finds them in torch's caches), ``eager_first_step_s`` the
eager module's. Then steps (forward + backward + AdamW, foreach=False) run interleaved as in
bench/overhead.py, and ``ratio`` is the median over rounds of inductor / eager (below 1:
inductor faster), next to the ratio the two plans predict. A run in which the inductor module's
programs never ran compiled is an error, not a figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch.distributed as dist

import autoshard
from autoshard.cluster.costmodel import BACKENDS
from autoshard.runtime.launch import run_local

sys.path.insert(0, str(Path(__file__).parent))
from fidelity import OUT, _model  # noqa: E402
from overhead import _adamw, _interleave, _stepper  # noqa: E402



def job(size: str, cluster_json: str, plans: dict[str, str], warmup: int, samples: int, steps: int) -> dict:
    warnings.simplefilter("ignore")
    model, inputs = _model(size)
    cluster = autoshard.Cluster.from_json(cluster_json)
    runs, first, modules = {}, {}, {}
    for backend in BACKENDS:
        dm = modules[backend] = autoshard.compile(model, cluster, inputs, plan=autoshard.Plan.from_json(plans[backend]))
        step = _stepper(dm, _adamw(dm), dm.shard_inputs(*inputs))
        dist.barrier()
        t0 = time.perf_counter()
        step()
        first[backend] = time.perf_counter() - t0
        runs[backend] = step
    out = _interleave(runs, warmup, samples, steps)
    out["first_step_s"] = first
    out["compiled_calls"] = sum(getattr(run, "compiled_calls", 0) for run in modules["inductor"]._run.values()
                                if run is not None)
    if out["compiled_calls"] == 0:
        raise RuntimeError("the inductor module ran no compiled program: its timings would be eager's")
    return out


def run(sizes=("tiny", "small"), *, warmup: int = 2, samples: int = 9, steps: int = 2,
        timeout: float = 1800.0) -> dict:
    cluster = autoshard.Cluster.local(2)
    rows = []
    for size in sizes:
        model, inputs = _model(size)
        traced = autoshard.trace(model, inputs)
        plans = {b: autoshard.plan(traced, cluster, backend=b, progress=False) for b in BACKENDS}
        differ = len(plans["eager"].diff(plans["inductor"]).nodes)
        measured = run_local(job, 2, size, cluster.to_json(), {b: p.to_json() for b, p in plans.items()},
                             warmup, samples, steps, timeout=timeout)[0]
        ratio = statistics.median(a / b for a, b in zip(measured["inductor"]["samples_s"],
                                                        measured["eager"]["samples_s"]))
        fb = statistics.median(a / b for a, b in zip(measured["inductor"]["fb_samples_s"],
                                                     measured["eager"]["fb_samples_s"]))
        rows.append({"size": size, "params": sum(p.numel() for p in model.parameters()),
                     "eager_ms": measured["eager"]["step_s"] * 1e3, "inductor_ms": measured["inductor"]["step_s"] * 1e3,
                     "ratio": ratio, "fb_ratio": fb,
                     "predicted_ratio": plans["inductor"].step_time / plans["eager"].step_time,
                     "compile_s": measured["first_step_s"]["inductor"], "compiled_calls": measured["compiled_calls"],
                     "eager_first_step_s": measured["first_step_s"]["eager"], "plans_differ_in_nodes": differ,
                     "raw_ms": {b: [s * 1e3 for s in measured[b]["samples_s"]] for b in BACKENDS}})
    return {"rows": rows, "cluster": "Cluster.local(2), gloo",
            "method": {"warmup": warmup, "samples": samples, "steps_per_sample": steps}}


def table(report: dict) -> str:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="emitted module, inductor vs eager (2 gloo ranks): median step; ratio = median of per-round "
                    "inductor / eager")
    cols = [("GPT", "size", "{}"), ("params", "params", "{:,}"), ("eager ms", "eager_ms", "{:.1f}"),
            ("inductor ms", "inductor_ms", "{:.1f}"), ("ratio", "ratio", "{:.3f}"),
            ("fwd+bwd ratio", "fb_ratio", "{:.3f}"), ("predicted", "predicted_ratio", "{:.3f}"),
            ("compile s", "compile_s", "{:.1f}")]
    for head, _, _ in cols:
        t.add_column(head, justify="left" if head == "GPT" else "right")
    for r in report["rows"]:
        t.add_row(*(fmt.format(r[key]) for _, key, fmt in cols))
    console = Console(width=130, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(t)
    return console.export_text()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=["tiny", "small"])
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--samples", type=int, default=9)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", type=Path, default=OUT / "inductor.json")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    report = run(tuple(args.sizes), warmup=args.warmup, samples=args.samples, steps=args.steps)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(table(report))


if __name__ == "__main__":
    main()
