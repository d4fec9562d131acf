"""Emitted-code efficiency: autoshard's module against torch's own implementation of the same
plan, on the GPT of bench/fidelity.py. Writes bench/out/overhead.json.

    OMP_NUM_THREADS=1 .venv/bin/python bench/overhead.py [--size small|tiny] [--samples 9]

Pairs (each pair timed in one launch, samples interleaved round-robin, median of each):

* fsdp: autoshard pinned to the FSDP plan (every parameter stored Shard(0), batch split) vs
  ``torch.distributed.fsdp.fully_shard`` on every block and the root; 2 ranks.
* megatron: autoshard pinned to the Megatron plan (qkv/fc column-, proj/out row-parallel, batch
  replicated) vs ``parallelize_module`` with ColwiseParallel on qkv (DTensor output, so the
  model's split/view/attention run on DTensors) and fc, RowwiseParallel on proj and out; 2 ranks.
* eager: autoshard's all-replicated plan on one rank vs the plain model; 1 rank. On one device
  the module's parameters are plain tensors (autoshard/runtime/module.py says why), so the optimizer
  steps the same tensors on both sides.

A step is forward + backward + AdamW (foreach=False on both sides) + zero_grad; ``fb`` is the
forward + backward part alone. The host is shared and its load swings within seconds, so each
pair runs back to back in every round (which side first alternates) and ``ratio`` is the median
over rounds of the round's autoshard / torch time (below 1: autoshard faster); the ratio of the
two medians is kept too (``ratio_of_medians``).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

import autoshard
from autoshard.planning.baselines import plan_baseline
from autoshard.runtime.launch import run_local

sys.path.insert(0, str(Path(__file__).parent))
from fidelity import OUT, _model  # noqa: E402


def _native_fsdp(model):
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


def _native_megatron(model):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    plan = {}
    for i in range(len(model.blocks)):
        plan |= {f"blocks.{i}.qkv": ColwiseParallel(use_local_output=False), f"blocks.{i}.proj": RowwiseParallel(),
                 f"blocks.{i}.fc": ColwiseParallel(), f"blocks.{i}.out": RowwiseParallel()}
    return parallelize_module(model, mesh, plan)


def _interleave(runs: dict, warmup: int, samples: int, steps: int) -> dict:
    """runs: name -> step() returning (fwd+bwd seconds, whole step seconds). Medians per name."""
    for step in runs.values():
        for _ in range(warmup):
            step()
    fb = {n: [] for n in runs}
    whole = {n: [] for n in runs}
    names = list(runs)
    for s in range(samples):
        # which pair goes first rotates; within a pair, which side goes first alternates
        pairs = [names[i:i + 2] for i in range(0, len(names), 2)]
        pairs = pairs[s % len(pairs):] + pairs[:s % len(pairs)]
        for name in [n for pair in pairs for n in (pair if s % 2 == 0 else pair[::-1])]:
            if dist.get_world_size() > 1:
                dist.barrier()
            times = [runs[name]() for _ in range(steps)]
            fb[name].append(sum(a for a, _ in times) / steps)
            whole[name].append(sum(b for _, b in times) / steps)
    keys = list(runs)
    agreed = torch.tensor([statistics.median(fb[n]) for n in keys] + [statistics.median(whole[n]) for n in keys],
                          dtype=torch.float64)
    if dist.get_world_size() > 1:
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    k = len(keys)
    per_round = torch.tensor([fb[n] for n in keys] + [whole[n] for n in keys], dtype=torch.float64)
    if dist.get_world_size() > 1:   # the slower rank's time, round by round
        dist.all_reduce(per_round, op=dist.ReduceOp.MAX)
    return {n: {"fb_s": agreed[i].item(), "step_s": agreed[k + i].item(), "fb_samples_s": per_round[i].tolist(),
                "samples_s": per_round[k + i].tolist()} for i, n in enumerate(keys)}


def _stepper(module, opt, inputs, call=None):
    def step():
        t0 = time.perf_counter()
        loss = module(*inputs) if call is None else call()
        loss.backward()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return t1 - t0, time.perf_counter() - t0
    return step


def _adamw(module):
    return torch.optim.AdamW(module.parameters(), lr=1e-4, foreach=False)


def two_rank_job(size: str, cluster_json: str, plans: dict[str, str], warmup: int, samples: int, steps: int) -> dict:
    warnings.simplefilter("ignore")   # in the ranks too (torch's deprecation notices per collective)
    model, inputs = _model(size)
    cluster = autoshard.Cluster.from_json(cluster_json)
    mods = {}
    for name, text in plans.items():
        dm = autoshard.compile(model, cluster, inputs, plan=autoshard.Plan.from_json(text))
        mods[f"autoshard_{name}"] = _stepper(dm, _adamw(dm), dm.shard_inputs(*inputs))
    half = inputs[0].shape[0] // dist.get_world_size()
    mine = tuple(t[dist.get_rank() * half:(dist.get_rank() + 1) * half] for t in inputs)
    fsdp = _native_fsdp(copy.deepcopy(model))
    mods["torch_fsdp"] = _stepper(fsdp, _adamw(fsdp), mine)
    tp = _native_megatron(copy.deepcopy(model))
    mods["torch_megatron"] = _stepper(tp, _adamw(tp), inputs)
    # each pair back to back, so that its two samples of a round see the same load
    order = ["autoshard_fsdp", "torch_fsdp", "autoshard_megatron", "torch_megatron"]
    return _interleave({k: mods[k] for k in order}, warmup, samples, steps)


def one_rank_job(size: str, cluster_json: str, plan_json: str, warmup: int, samples: int, steps: int) -> dict:
    warnings.simplefilter("ignore")
    model, inputs = _model(size)
    cluster = autoshard.Cluster.from_json(cluster_json)
    dm = autoshard.compile(model, cluster, inputs, plan=autoshard.Plan.from_json(plan_json))
    eager = copy.deepcopy(model)
    runs = {"autoshard_replicated": _stepper(dm, _adamw(dm), dm.shard_inputs(*inputs)),
            "torch_eager": _stepper(eager, _adamw(eager), inputs)}
    return _interleave(runs, warmup, samples, steps)


def run(size: str = "small", *, calibration: Path | None = None, warmup: int = 2, samples: int = 9,
        steps: int = 2, timeout: float = 1800.0) -> dict:
    cluster = (autoshard.Cluster.from_json(calibration.read_text()) if calibration and calibration.is_file()
               else autoshard.Cluster.local(2))
    model, inputs = _model(size)
    traced = autoshard.trace(model, inputs)
    # the hand strategies as autoshard.baselines writes them: storage, working placements and the
    # batch split pinned per role (storage pins alone leave the solver free to mix in other
    # parallelism, which is then not the plan torch's side runs)
    plans = {name: plan_baseline(traced, cluster, name).to_json() for name in ("fsdp", "megatron")}
    one = cluster.with_mesh((1,))
    replicated = autoshard.plan(traced, one).to_json()
    t0 = time.perf_counter()
    two = run_local(two_rank_job, 2, size, cluster.to_json(), plans, warmup, samples, steps, timeout=timeout)[0]
    single = run_local(one_rank_job, 1, size, one.to_json(), replicated, warmup, samples, steps, timeout=timeout)[0]
    pairs = [("fsdp", "autoshard_fsdp", "torch_fsdp", 2), ("megatron", "autoshard_megatron", "torch_megatron", 2),
             ("replicated vs eager", "autoshard_replicated", "torch_eager", 1)]
    measured = {**two, **single}
    def paired(a, b, key):   # the median over rounds of each round's ratio (same load on both)
        return statistics.median(x / y for x, y in zip(measured[a][key], measured[b][key]))

    rows = [{"pair": label, "ranks": ranks, "autoshard_ms": measured[a]["step_s"] * 1e3,
             "torch_ms": measured[b]["step_s"] * 1e3, "ratio": paired(a, b, "samples_s"),
             "ratio_of_medians": measured[a]["step_s"] / measured[b]["step_s"],
             "autoshard_fb_ms": measured[a]["fb_s"] * 1e3, "torch_fb_ms": measured[b]["fb_s"] * 1e3,
             "fb_ratio": paired(a, b, "fb_samples_s")} for label, a, b, ranks in pairs]
    return {"size": size, "rows": rows, "raw_ms": {k: [s * 1e3 for s in v["samples_s"]] for k, v in measured.items()},
            "method": {"warmup": warmup, "samples": samples, "steps_per_sample": steps},
            "measure_s": time.perf_counter() - t0}


def table(report: dict) -> str:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"autoshard vs torch, same plan ({report['size']} GPT): median step; ratio = median of "
                    "per-round autoshard / torch")
    cols = [("pair", "pair", "{}"), ("ranks", "ranks", "{}"), ("autoshard ms", "autoshard_ms", "{:.1f}"),
            ("torch ms", "torch_ms", "{:.1f}"), ("ratio", "ratio", "{:.3f}"), ("fwd+bwd ratio", "fb_ratio", "{:.3f}")]
    for head, _, _ in cols:
        t.add_column(head, justify="left" if head == "pair" else "right")
    for r in report["rows"]:
        t.add_row(*(fmt.format(r[key]) for _, key, fmt in cols))
    console = Console(width=120, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(t)
    return console.export_text()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=["small", "tiny"], default="small")
    ap.add_argument("--calibration", type=Path, default=OUT / "calibration.json",
                    help="the cluster to plan for (default: bench/fidelity.py's; Cluster.local(2) if absent)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--samples", type=int, default=9)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", type=Path, default=OUT / "overhead.json")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    report = run(args.size, calibration=args.calibration, warmup=args.warmup, samples=args.samples, steps=args.steps)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(table(report))


if __name__ == "__main__":
    main()
