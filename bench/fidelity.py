"""Predicted vs measured on this machine: calibrate 2 gloo ranks, plan a GPT several ways on the
calibrated cluster, run every plan on the 2 ranks, and compare each plan's predicted step time
and per-device peak memory with what it measures. Writes bench/out/fidelity.json.

    OMP_NUM_THREADS=1 .venv/bin/python bench/fidelity.py [--size small|tiny] [--samples 15]
        [--calibration saved.json [--recalibrate]]

Plans (8 named; :func:`build_plans`): the free plan; DDP, FSDP and Megatron tensor parallelism,
each as ``autoshard.baselines.plan_baseline`` writes it (parameter storage and use pinned per
role, activations left to the solver), and FSDP and Megatron with full activation recompute;
the free plan with full recompute (``recompute="full"``); the free plan under a tight memory cap
(0.7 of the free plan's predicted peak, else the next feasible cap of ``TIGHT_CAPS``). Every plan
must compile: one the rewrite cannot lower fails the run, naming the plan.

Measured, per plan, on every rank, with every plan compiled up front and the timed samples
interleaved round-robin (a burst of load from the shared host lands on all plans alike):

* step: forward + backward of the compiled module and the AdamW update that follows (what
  ``plan.step_time`` predicts: compute, exposed communication, recompute and the optimizer step);
  the update is also reported on its own (``opt_ms``), and forward + backward (``fb_ms``).
  A round times ``--steps`` steps of every plan in turn (the slower rank's time counts). The
  host is shared and its load swings 1x-5x within seconds, so a matmul probe (the calibration's,
  both ranks at once) runs just before and after every sample: ``meas ms`` is the median over rounds of
  each sample scaled by its probe's FLOP rate over the calibrated rate (the step on the machine
  the calibration saw; :func:`step_estimates`), ``raw median ms`` the plain median.
* memory: the peak bytes of live tensor storage over one whole training step (forward,
  backward, AdamW update; ``zero_grad(set_to_none=True)``, torch's default and what the plan's
  memory model assumes: no gradient between steps, each made during backward), by
  :class:`autoshard.memtrack.PeakMemory` (a TorchDispatchMode); the larger rank's. AdamW runs as
  the plan's device says (``DeviceSpec.optimizer``: for-loop on a CPU, foreach on CUDA).

Reported: Spearman rank correlation of predicted vs measured step times, and per plan the
memory error (predicted / measured - 1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

import autoshard
from autoshard.errors import InfeasibleError
from autoshard.runtime.launch import run_local
from autoshard.runtime.memtrack import PeakMemory
from autoshard.zoo import GPT, GPTConfig

OUT = Path(__file__).parent / "out"
# small: 3.7M parameters (14 MiB fp32), 512 tokens a step: ~6 GFLOP of fwd+bwd per rank under data
# parallelism (~75 ms at the calibrated rate) against 12-25 ms of predicted gloo traffic (DDP's
# gradient reduction, FSDP's gathers, Megatron's activation reductions): both matter.
SIZES = {
    "small": (GPTConfig(vocab=2048, seq=64, hidden=256, heads=4, layers=4), 8),
    "tiny": (GPTConfig(vocab=128, seq=16, hidden=32, heads=2, layers=2), 4),
}
IN2 = [["S(0)"], ["S(0)"]]
PINS = {
    "ddp": {"inputs": IN2, "*": ["R"]},
    "fsdp": {"inputs": IN2, "*": ["S(0)"]},
    "megatron": {"inputs": [["R"], ["R"]], "*.qkv.*": ["S(0)"], "*.fc.*": ["S(0)"],
                 "*.proj.weight": ["S(1)"], "*.out.weight": ["S(1)"]},
}
# plan.memory's parts held between steps (with set_to_none=True no gradient is)
STATE = ("params", "working_params", "optimizer", "buffers", "inputs")
# DeviceSpec.optimizer -> torch.optim.AdamW's arguments
ADAMW = {"foreach": {"foreach": True}, "fused": {"fused": True}, "for-loop": {"foreach": False}}
PROBE, PROBE_REPEATS = 512, 3   # the load probe around every sample: ~8 ms of fp32 matmul on one core
EXTRA = ("fsdp+recompute", "megatron+recompute")   # hand plans with full activation recompute
TIGHT_CAPS = (0.7, 0.75, 0.65, 0.8, 0.6)   # the tight plan's cap, a fraction of the free plan's peak


# --- on every rank ---------------------------------------------------------------------------------
def calibrate_job(path: str) -> str:
    return autoshard.Cluster.calibrate(save=path).to_json()


def _model(size: str):
    cfg, batch = SIZES[size]
    torch.manual_seed(0)
    model = GPT(cfg)
    return model, model.example_inputs(batch, generator=torch.Generator().manual_seed(1))


def _state(dm, opt, local) -> list:
    """Every tensor a training step keeps from one step to the next on this rank."""
    out = [p.to_local() for p in dm.parameters()] + [b for b in dm.buffers()] + list(local)
    out += [p.grad.to_local() for p in dm.parameters() if p.grad is not None]
    for st in opt.state.values():
        out += [v.to_local() if hasattr(v, "to_local") else v for v in st.values() if isinstance(v, torch.Tensor)]
    # gathered working copies of parameters the runtime keeps from one step to the next
    out += [t for t in tree_leaves(dm.__dict__.get("_working_cache", {})) if isinstance(t, torch.Tensor)]
    return out


def _probe(a, b) -> float:
    """Seconds per matmul of the calibration's kind, now: how loaded the shared host is."""
    t0 = time.perf_counter()
    for _ in range(PROBE_REPEATS):
        torch.mm(a, b)
    return (time.perf_counter() - t0) / PROBE_REPEATS


def measure_job(size: str, plans: dict[str, str], warmup: int, samples: int, steps: int) -> dict:
    """Compile every plan, time interleaved steps, then one tracked step per plan."""
    model, inputs = _model(size)
    runs = {}
    for name, text in plans.items():
        plan = autoshard.Plan.from_json(text)   # a baseline's mesh names its dims by role: its own cluster
        cluster = autoshard.Cluster.from_json(plan.cluster)
        try:
            dm = autoshard.compile(model, cluster, inputs, plan=plan)
        except Exception as exc:
            raise RuntimeError(f"plan {name!r} does not compile") from exc
        # the AdamW whose step temporaries the plan counts
        opt = torch.optim.AdamW(dm.parameters(), lr=1e-4, **ADAMW[cluster.device.optimizer])
        runs[name] = (dm, opt, dm.shard_inputs(*inputs))

    def step(name):
        dm, opt, local = runs[name]
        t0 = time.perf_counter()
        dm(*local).backward()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return t1 - t0, time.perf_counter() - t1

    for name in runs:
        for _ in range(warmup):
            step(name)
    a, b = torch.randn(PROBE, PROBE), torch.randn(PROBE, PROBE)
    names = list(runs)
    fb = torch.zeros(samples, len(names), dtype=torch.float64)
    up, probe = torch.zeros_like(fb), torch.zeros_like(fb)
    for s in range(samples):
        for i in [*range(s % len(names), len(names)), *range(s % len(names))]:   # rotate who goes first
            dist.barrier()
            before = _probe(a, b)
            dist.barrier()
            times = [step(names[i]) for _ in range(steps)]
            probe[s, i] = (before + _probe(a, b)) / 2   # the load on both sides of the sample
            fb[s, i] = sum(t for t, _ in times) / steps
            up[s, i] = sum(t for _, t in times) / steps
    peaks, state = torch.zeros(len(names), dtype=torch.float64), torch.zeros(len(names), dtype=torch.float64)
    peak_ops = []   # where each plan's peak fell on this rank (what to look at when it disagrees)
    for i, (dm, opt, local) in enumerate(runs.values()):
        with PeakMemory() as mem:
            mem.track(_state(dm, opt, local))
            state[i] = mem.current
            step(names[i])
        peaks[i] = mem.peak
        peak_ops.append(mem.peak_op)
    # per sample the slower rank sets the step; the fuller rank sets the memory
    for t in (fb, up, probe, peaks, state):
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {"names": names, "fb_s": fb.tolist(), "opt_s": up.tolist(),
            "probe_s": probe.tolist(), "peak_op": peak_ops,
            "peak_bytes": peaks.tolist(), "state_bytes": state.tolist()}


def step_estimates(samples_s, probes_s, calibrated_flops: float) -> tuple[list[float], list[float]]:
    """(median, normalized) seconds per plan from ``samples_s[round][plan]`` and the matmul
    probe timed just before each (``probes_s``, same shape). Normalized: each sample scaled by
    the FLOP rate its probe saw over the calibrated rate, i.e. the step on the machine the
    calibration measured (the host is shared: other jobs take 1x-5x of its cores for seconds
    at a time); then the median over rounds."""
    k = len(samples_s[0])
    median = [statistics.median(r[i] for r in samples_s) for i in range(k)]
    rate = lambda p: 2 * PROBE**3 / p  # noqa: E731
    normalized = [statistics.median(r[i] * rate(q[i]) / calibrated_flops for r, q in zip(samples_s, probes_s))
                  for i in range(k)]
    return median, normalized


# --- in the driver -----------------------------------------------------------------------------------
def build_plans(size: str, cluster) -> dict[str, autoshard.Plan]:
    """The eight plans. DDP, FSDP and Megatron are autoshard.baselines' hand strategies (parameter
    storage and use pinned per role, activations left to the solver) on the same ILP. The tight
    plan's cap is the first of TIGHT_CAPS times the free plan's peak that the solver can meet."""
    from autoshard.planning.baselines import plan_baseline

    model, inputs = _model(size)
    traced = autoshard.trace(model, inputs)
    plans = {"free": autoshard.plan(traced, cluster)}
    for name in (*PINS, *EXTRA):
        plans[name] = plan_baseline(traced, cluster, name)
    plans["full_recompute"] = autoshard.plan(traced, cluster, recompute="full")
    for fraction in TIGHT_CAPS:
        try:
            plans["tight"] = autoshard.plan(traced, cluster, memory_limit=fraction * plans["free"].peak_memory)
            break
        except InfeasibleError:
            continue
    else:
        raise InfeasibleError(f"no tight cap of {TIGHT_CAPS} x the free plan's peak is feasible")
    return plans


def spearman(xs, ys) -> float:
    """Spearman's rho: Pearson correlation of the ranks (ties get their mean rank)."""
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sx = sum((a - mx) ** 2 for a in rx) ** 0.5
    sy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (sx * sy) if sx and sy else float("nan")


def run(size: str = "small", *, calibration: Path | None = None, recalibrate: bool = False, warmup: int = 2,
        samples: int = 15, steps: int = 1, timeout: float = 1800.0) -> dict:
    """The whole benchmark; returns the report (what ``main`` writes as JSON)."""
    t0 = time.perf_counter()
    if calibration is None or recalibrate or not calibration.is_file():
        path = calibration or OUT / "calibration.json"
        cluster_json = run_local(calibrate_job, 2, str(path), timeout=timeout)[0]
    else:
        cluster_json = calibration.read_text()
    cluster = autoshard.Cluster.from_json(cluster_json)
    t1 = time.perf_counter()
    plans = build_plans(size, cluster)
    t2 = time.perf_counter()
    measured = run_local(measure_job, 2, size, {n: p.to_json() for n, p in plans.items()},
                         warmup, samples, steps, timeout=timeout)[0]
    names = measured["names"]
    flops = cluster.device.flops("float32")
    whole = [[a + b for a, b in zip(fb, up)] for fb, up in zip(measured["fb_s"], measured["opt_s"])]
    median, normalized = step_estimates(whole, measured["probe_s"], flops)
    _, fb_normalized = step_estimates(measured["fb_s"], measured["probe_s"], flops)
    opt = [statistics.median(r[i] for r in measured["opt_s"]) for i in range(len(names))]
    probe_flops = 2 * PROBE**3 / statistics.median(q for r in measured["probe_s"] for q in r)
    rows = []
    for i, name in enumerate(names):
        p = plans[name]
        rows.append({"plan": name, "pred_step_ms": p.step_time * 1e3, "meas_step_ms": normalized[i] * 1e3,
                     "meas_median_ms": median[i] * 1e3, "step_ratio": p.step_time / normalized[i], "opt_ms": opt[i] * 1e3,
                     "meas_fb_ms": fb_normalized[i] * 1e3, "pred_opt_ms": p.breakdown.get("optimizer", 0.0) * 1e3,
                     "pred_recompute_comm_ms": p.breakdown.get("recompute_comm", 0.0) * 1e3,
                     "pred_comm_ms": p.comm_time * 1e3, "pred_compute_ms": p.compute_time * 1e3,
                     "pred_recompute_ms": p.breakdown.get("recompute", 0.0) * 1e3,
                     "pred_peak_mib": p.peak_memory / 2**20, "meas_peak_mib": measured["peak_bytes"][i] / 2**20,
                     "mem_err": p.peak_memory / measured["peak_bytes"][i] - 1, "pred_memory": p.memory,
                     "pred_state_bytes": sum(p.memory.get(k, 0.0) for k in STATE), "meas_state_bytes": measured["state_bytes"][i],
                     "storage": sorted(set(p.storage.values())), "inputs": p.inputs, "mesh": list(p.mesh_dim_names),
                     "recomputed": sum(n.recompute for n in p.nodes), "memory_limit": p.memory_limit,
                     "samples_ms": [r[i] * 1e3 for r in whole], "peak_op": measured["peak_op"][i]})
    cfg, batch = SIZES[size]
    rho = spearman([r["pred_step_ms"] for r in rows], [r["meas_step_ms"] for r in rows])
    rho_median = spearman([r["pred_step_ms"] for r in rows], [r["meas_median_ms"] for r in rows])
    dev = cluster.device
    return {"size": size, "config": cfg.__dict__, "batch": batch, "ranks": 2,
            "params": sum(p.numel() for p in GPT(cfg).parameters()),
            "cluster": {"flops": dev.flops("float32"), "memory_bandwidth": dev.memory_bandwidth,
                        "launch_overhead": dev.launch_overhead, "latency": cluster.links[0].latency,
                        "bandwidth": cluster.links[0].bandwidth},
            "spearman_step": rho, "spearman_step_plain_median": rho_median,
            "probe_flops": probe_flops, "load_factor": cluster.device.flops("float32") / probe_flops,
            "max_abs_mem_err": max(abs(r["mem_err"]) for r in rows),
            "rows": rows, "timing": {"calibrate_s": t1 - t0, "plan_s": t2 - t1, "measure_s": time.perf_counter() - t2},
            "method": {"warmup": warmup, "samples": samples, "steps_per_sample": steps,
                       "memory_tracker": "autoshard.memtrack.PeakMemory (TorchDispatchMode, live storage bytes)"}}


def table(report: dict) -> str:
    from rich.console import Console
    from rich.table import Table

    cfg = report["config"]
    t = Table(title=f"GPT vocab {cfg['vocab']} seq {cfg['seq']} hidden {cfg['hidden']} heads {cfg['heads']} "
                    f"layers {cfg['layers']}, batch {report['batch']}, 2 gloo ranks: Spearman(step) "
                    f"{report['spearman_step']:.2f} (raw medians {report['spearman_step_plain_median']:.2f}), "
                    f"max |mem err| {report['max_abs_mem_err']:.1%}, matmul {report['probe_flops'] / 1e9:.0f} GFLOP/s "
                    f"while timing vs {report['cluster']['flops'] / 1e9:.0f} calibrated")
    cols = [("plan", "plan", "{}"), ("pred ms", "pred_step_ms", "{:.1f}"), ("meas ms (load-norm)", "meas_step_ms", "{:.1f}"),
            ("raw median ms", "meas_median_ms", "{:.1f}"), ("pred/meas", "step_ratio", "{:.2f}"),
            ("pred comm ms", "pred_comm_ms", "{:.1f}"), ("pred opt ms", "pred_opt_ms", "{:.1f}"),
            ("opt ms", "opt_ms", "{:.1f}"),
            ("pred MiB", "pred_peak_mib", "{:.2f}"), ("meas MiB", "meas_peak_mib", "{:.2f}"), ("mem err", "mem_err", "{:+.1%}")]
    for head, _, _ in cols:
        t.add_column(head, justify="left" if head == "plan" else "right")
    for r in report["rows"]:
        t.add_row(*(fmt.format(r[key]) for _, key, fmt in cols))
    console = Console(width=200, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(t)
    return console.export_text()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--calibration", type=Path, default=None,
                    help="reuse this saved calibration (default: calibrate now, save bench/out/calibration.json)")
    ap.add_argument("--recalibrate", action="store_true")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--samples", type=int, default=15, help="timed rounds (every plan once per round)")
    ap.add_argument("--steps", type=int, default=1, help="steps per timed sample")
    ap.add_argument("--out", type=Path, default=OUT / "fidelity.json")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    report = run(args.size, calibration=args.calibration, recalibrate=args.recalibrate, warmup=args.warmup,
                 samples=args.samples, steps=args.steps)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(table(report))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
