"""One device, measured: autoshard's single-device plans trained next to eager PyTorch, on one GPU
(NCCL, world size 1) or, without one, on CPU at tiny sizes (gloo). Writes bench/out/gpu.json.

Models (bf16 parameters, AdamW with torch's defaults, lr 1e-3, random tokens): GPT-2 small
(autoshard.zoo's GPT, 12 layers, hidden 768, 12 heads, seq 1024, vocab 50304, batch 8), a
Llama-style 0.9B (hidden 2048, 16 layers, 16/8 heads, SwiGLU 5632, vocab 32000, batch 8 x 2048)
and the Llama-3-8B shape (32 layers, batch 2 x 2048). ``--size tiny``: the same three families at
a few layers of hidden 64 (seconds each), in fp32; tiny is the default where CUDA is absent.

Plans per model, for one device (an H200 at full size, ``Cluster.local(1)`` at tiny size):
``free`` (no memory cap), ``capped`` (the cap halfway between the free plan's predicted peak and
the per-layer plan's: the free plan does not fit and per-layer recompute would, so the solver
recomputes some activations, not all) and ``per_layer`` (``recompute="full"``: each layer's input
kept, everything else recomputed in backward). Where the per-layer plan is predicted to peak as
high as the free one (the peak lies where no activation is kept, in the optimizer step), no cap
forces recompute: ``capped`` is skipped, and the report says so.

Every case trains ``--steps`` (10) steps from the same initial weights on the same batches as
eager PyTorch on the same device, and the script prints three tables:

* loss: each step's loss next to eager's; a case passes when every step is within ``LOSS_RTOL``
  of eager's (bf16: 2^-6 relative, at least two rounding steps of a bf16 loss, which keeps 8
  significant bits; fp32: 1e-5);
* step time: the median of the steps after ``WARMUP`` (CUDA events around forward, backward and
  the optimizer step on the GPU; perf_counter on CPU) next to eager's with the same recompute
  (``torch.utils.checkpoint`` around every layer for ``per_layer``; none for ``free`` and
  ``capped``, for which eager has no partial form) and next to ``plan.step_time``;
* peak memory: ``torch.cuda.max_memory_allocated`` over the steps after ``WARMUP`` on the GPU (on
  CPU, the live tensor bytes of the last step by ``autoshard.memtrack.PeakMemory``, a step that is
  not timed), next to eager's and to ``plan.peak_memory``.

With ``--inductor`` (the default where CUDA is), GPT-2 small and the 0.9B Llama also get a
``free_inductor`` plan: the free plan priced for, and compiled by, inductor, whose eager reference
is ``torch.compile`` of the plain model ("compiled" in the step-time table); the ``free`` row is
the same plan's eager emitted module.

Last, when ``autoshard.simulate`` is installed, a tiny GPT's FSDP-like and Megatron-like plans
(2 ranks) and a 2-D data x tensor plan (2 x 2) run ``SIM_STEPS`` steps on simulated ranks in this
process on the same device, each compared with the same steps on one device
(``simulate.single_device``; fp32, ``SIM_RTOL``).

Plans are made where they run: a program is traced for its device (CPU and CUDA attention are
different kernels, so compile refuses a CPU-traced plan on a GPU: PlanMismatchError), and tracing
for CUDA needs a GPU. So the GPU machine plans too, and needs OR-Tools (where it has no package
index, carry the wheels over). ``--plan-only`` writes the plans and stops; ``--plans`` runs saved
ones (made on the same kind of device and torch release)::

    torchrun --nproc-per-node 1 bench/gpu.py                    # plan, then measure
    python bench/gpu.py --plan-only                              # writes bench/out/gpu_plans.json
    torchrun --nproc-per-node 1 bench/gpu.py --plans bench/out/gpu_plans.json

Without ``--plans`` the script plans in process. On a machine without CUDA (tiny sizes, gloo)::

    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 1 bench/gpu.py

Started without torchrun, it makes a process group of one itself. It exits with status 1 when a
case failed to run or its losses left the tolerance.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib.util
import json
import math
import os
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import autoshard
from autoshard.cluster import PRESETS
from autoshard.runtime.launch import free_port
from autoshard.runtime.memtrack import PeakMemory
from autoshard.zoo import GPT, GPTConfig, Llama, LlamaConfig

OUT = Path(__file__).parent / "out"
SEED = 0
WARMUP = 2             # steps before timing and the GPU's peak-memory window start
LOSS_RTOL = {torch.bfloat16: 2**-6, torch.float32: 1e-5}
SIM_RTOL = 1e-4        # fp32, sums split over ranks: added in another order than on one device
SIM_STEPS = 3          # AdamW steps on simulated ranks, as tests/test_local_ranks.py trains
PLANS = ("free", "capped", "per_layer")
# with --inductor: the free plan priced and compiled for inductor, against torch.compile of the
# plain model (and the eager ``free`` row)
INDUCTOR_MODELS = ("gpt2-small", "llama-0.9b")
SIMULATED = ("fsdp", "megatron", "2d")


@dataclasses.dataclass(frozen=True)
class Case:
    """One model: its family (``gpt`` or ``llama``), config and global batch (sequences)."""

    name: str
    family: str
    config: GPTConfig | LlamaConfig
    batch: int

    def build(self, device, dtype: torch.dtype) -> nn.Module:
        """The model with the weights of ``SEED`` (the same on every call on one device type)."""
        torch.manual_seed(SEED)
        with torch.device(device):
            model = GPT(self.config) if self.family == "gpt" else Llama(self.config)
        return model.to(dtype)

    def batches(self, steps: int, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One (token ids, targets) batch per step, drawn on CPU (the same on every device)."""
        g = torch.Generator().manual_seed(SEED + 1)
        shape = (self.batch, self.config.seq)
        return [tuple(torch.randint(0, self.config.vocab, shape, generator=g).to(device) for _ in range(2))
                for _ in range(steps)]

    def meta_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(torch.empty(self.batch, self.config.seq, dtype=torch.long, device="meta") for _ in range(2))


CASES = {
    "full": (
        Case("gpt2-small", "gpt", GPTConfig.gpt2_small(), 8),
        Case("llama-0.9b", "llama", LlamaConfig(vocab=32000, seq=2048, hidden=2048, heads=16, kv_heads=8,
                                                intermediate=5632, layers=16), 8),
        Case("llama3-8b", "llama", LlamaConfig.llama3_8b(seq=2048), 2),
    ),
    "tiny": (
        Case("gpt2-small", "gpt", GPTConfig.tiny(), 8),
        Case("llama-0.9b", "llama", LlamaConfig(kv_heads=2), 8),
        Case("llama3-8b", "llama", LlamaConfig(vocab=256, seq=32, hidden=64, heads=8, kv_heads=2, intermediate=224,
                                               layers=3, rope_theta=500000.0), 2),
    ),
}
SIM_CASE = Case("gpt-tiny", "gpt", GPTConfig.tiny(), 8)


# --- planning (needs OR-Tools) -------------------------------------------------------------------
def one_device(size: str) -> autoshard.Cluster:
    """The cluster of one: an H200 (the HGX H200 preset's device) at full size, this host's CPU at tiny."""
    if size == "tiny":
        return autoshard.Cluster.local(1)
    preset = PRESETS["hgx-h200"]
    return autoshard.Cluster((1,), ("gpu",), preset.device, [preset.intra], ranks_per_node=1)


def plan_case(case: Case, cluster: autoshard.Cluster, dtype: torch.dtype,
              device: torch.device, inductor: bool = False) -> tuple[dict[str, autoshard.Plan], dict]:
    """The free, capped and per-layer plans of ``case``, planned on ``meta``, and {plan: why it is
    missing}: no cap forces recompute where the per-layer plan peaks as high as the free one (the
    peak is then where no activation lives, e.g. in the optimizer step). With ``inductor``, for
    the INDUCTOR_MODELS, also the free plan for the inductor backend (``free_inductor``)."""
    traced = autoshard.trace(case.build("meta", dtype), case.meta_inputs(), device=device)
    free = autoshard.plan(traced, cluster)
    compiled = ({"free_inductor": autoshard.plan(traced, cluster, backend="inductor")}
                if inductor and case.name in INDUCTOR_MODELS else {})
    per_layer = autoshard.plan(traced, cluster, recompute="full")
    if per_layer.peak_memory >= free.peak_memory:
        why = (f"no cap forces recompute: the per-layer plan's predicted peak ({per_layer.peak_memory / 2**30:.2f} "
               f"GiB) is the free plan's ({free.peak_memory / 2**30:.2f} GiB)")
        return {"free": free, "per_layer": per_layer, **compiled}, {"capped": why}
    capped = autoshard.plan(traced, cluster, memory_limit=(free.peak_memory + per_layer.peak_memory) / 2)
    return {"free": free, "capped": capped, "per_layer": per_layer, **compiled}, {}


def plan_simulated(device: torch.device) -> dict[str, autoshard.Plan]:
    """The tiny GPT's multi-rank plans: autoshard.baselines' FSDP and Megatron on 2 ranks, and the
    Megatron roles (data parallel x tensor parallel) on a 2 x 2 mesh."""
    from autoshard.planning.baselines import plan_baseline
    from autoshard.planning.roles import allow_for

    traced = autoshard.trace(SIM_CASE.build("meta", torch.float32), SIM_CASE.meta_inputs(), device=device)
    two = autoshard.Cluster.local(2)
    return {"fsdp": plan_baseline(traced, two, "fsdp"), "megatron": plan_baseline(traced, two, "megatron"),
            "2d": autoshard.plan(traced, autoshard.Cluster.local(4, (2, 2)), allow=allow_for(traced, ("dp", "tp")))}


def make_plans(size: str, dtype: torch.dtype, device: torch.device, names: list[str] | None = None,
               inductor: bool = False) -> dict:
    """Every plan the run needs, traced for ``device``, as the JSON document ``--plan-only`` writes."""
    cluster = one_device(size)
    doc = {"size": size, "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__,
           "device": device.type, "models": {}, "skipped": {}}
    for case in CASES[size]:
        if names and case.name not in names:
            continue
        t0 = time.perf_counter()
        plans, skipped = plan_case(case, cluster, dtype, device, inductor)
        doc["models"][case.name] = {name: json.loads(p.to_json()) for name, p in plans.items()}
        doc["skipped"][case.name] = skipped
        print(f"planned {case.name} in {time.perf_counter() - t0:.1f}s: " + ", ".join(
            [f"{n} {p.step_time * 1e3:.1f} ms {p.peak_memory / 2**20:.1f} MiB" for n, p in plans.items()]
            + [f"{n} skipped ({why})" for n, why in skipped.items()]), file=sys.stderr, flush=True)
    doc["simulate"] = {name: json.loads(p.to_json()) for name, p in plan_simulated(device).items()}
    return doc


def _plan(doc: dict) -> autoshard.Plan:
    return autoshard.Plan.from_json(json.dumps(doc))


# --- measuring (on the device) ---------------------------------------------------------------------
@dataclasses.dataclass
class Run:
    losses: list[float]
    step_s: float
    peak_bytes: float


class _Checkpointed(nn.Module):
    """A layer whose activations eager PyTorch recomputes in backward (per-layer checkpointing)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, *args):
        return checkpoint(self.layer, *args, use_reentrant=False)


def _mark(device: torch.device):
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _seconds(begin, end) -> float:
    return end - begin if isinstance(begin, float) else begin.elapsed_time(end) / 1e3


def _state(module: nn.Module, opt, batch) -> list:
    """Every tensor a step starts with: parameters, buffers, the batch, gradients, optimizer state."""
    out = [*module.parameters(), *module.buffers(), *batch]
    out += [p.grad for p in module.parameters() if p.grad is not None]
    return out + [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


def train(step_input, module: nn.Module, batches: list, device: torch.device, lr: float) -> Run:
    """``len(batches)`` AdamW steps of ``module``; ``step_input(batch)`` is what it is called with."""
    opt = torch.optim.AdamW(module.parameters(), lr=lr)
    cuda = device.type == "cuda"
    marks, losses, peak = [], [], math.nan
    for i, batch in enumerate(batches):
        if cuda and i == WARMUP:   # the first steps allocate the optimizer state and warm the caches
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        tracked = not cuda and i == len(batches) - 1
        with PeakMemory() if tracked else contextlib.nullcontext() as mem:
            if tracked:
                mem.track(_state(module, opt, batch))
            begin = _mark(device)
            loss = module(*step_input(batch))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            marks.append((begin, _mark(device)))
        losses.append(loss.detach())   # read after the loop: no host sync between steps
        if tracked:
            peak = float(mem.peak)
    if cuda:
        torch.cuda.synchronize(device)
        peak = float(torch.cuda.max_memory_allocated(device))
    times = [_seconds(b, e) for b, e in marks][WARMUP:len(marks) - (0 if cuda else 1)]
    return Run([float(x) for x in losses], statistics.median(times), peak)


def _release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_eager(case: Case, batches, device, dtype, lr: float, mode: str) -> Run:
    """The plain model: ``mode`` "none", "per layer" (checkpointed layers) or "compiled"
    (``torch.compile`` of the whole model, the reference of an inductor plan)."""
    model = case.build(device, dtype)
    if mode == "per layer":
        model.blocks = nn.ModuleList(_Checkpointed(b) for b in model.blocks)
    if mode == "compiled":
        model = torch.compile(model)
    try:
        return train(lambda b: b, model, batches, device, lr)
    finally:
        del model
        _release()


def run_plan(case: Case, plan: autoshard.Plan, batches, device, dtype, lr: float) -> Run:
    model = case.build(device, dtype)
    module = autoshard.compile(model, autoshard.Cluster.from_json(plan.cluster), batches[0], plan=plan)
    del model   # the module holds its own copy of every parameter
    _release()
    try:
        return train(lambda b: module.shard_inputs(*b), module, batches, device, lr)
    finally:
        del module
        _release()


def _attempt(what: str, fn, *args):
    """(fn(*args), None), or (None, the error) with its traceback on stderr: one failing case must
    not cost the others their measurement."""
    try:
        return fn(*args), None
    except Exception as exc:  # noqa: BLE001 - recorded in the report and the exit status
        print(f"--- {what} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        error = f"{type(exc).__name__}: {exc}"
    _release()   # what the failed run held, its traceback's frames kept alive until here
    return None, error


def losses_match(got: list[float], want: list[float], rtol: float) -> bool:
    return len(got) == len(want) and all(abs(a - b) <= rtol * abs(b) for a, b in zip(got, want))


def measure_case(case: Case, plans: dict[str, autoshard.Plan], device, dtype, steps: int, lr: float) -> list[dict]:
    batches = case.batches(steps, device)
    modes = ("none", "per layer") + (("compiled",) if "free_inductor" in plans else ())
    eager = {mode: _attempt(f"{case.name} eager ({mode})", run_eager, case, batches, device, dtype, lr, mode)
             for mode in modes}
    rows = []
    for name, plan in plans.items():
        mode = {"per_layer": "per layer", "free_inductor": "compiled"}.get(name, "none")
        run, error = _attempt(f"{case.name} {name}", run_plan, case, plan, batches, device, dtype, lr)
        ref, ref_error = eager[mode]
        plain = eager["none"][0]   # the loss reference: recompute changes no value
        row = {"model": case.name, "plan": name, "recomputed_nodes": sum(n.recompute for n in plan.nodes),
               "memory_limit_bytes": plan.memory_limit, "eager_recompute": mode,
               "pred_step_ms": plan.step_time * 1e3, "pred_peak_bytes": plan.peak_memory,
               "error": error, "eager_error": eager["none"][1] or ref_error}
        if run is not None:
            row.update(losses=run.losses, step_ms=run.step_s * 1e3, peak_bytes=run.peak_bytes)
        if ref is not None:
            row.update(eager_step_ms=ref.step_s * 1e3, eager_peak_bytes=ref.peak_bytes)
        if run is not None and plain is not None:
            row.update(eager_losses=plain.losses,
                       max_loss_diff=max(abs(a - b) for a, b in zip(run.losses, plain.losses)),
                       loss_ok=losses_match(run.losses, plain.losses, LOSS_RTOL[dtype]))
        rows.append(row)
    return rows


def simulate(plans: dict[str, autoshard.Plan], device, steps: int, lr: float) -> dict:
    """Each multi-rank plan of the tiny GPT on simulated ranks (``autoshard.simulate.run_ranks``)
    against the same AdamW steps on one device (``simulate.single_device``), on ``device``;
    {"status": ...} alone while that module is absent."""
    if importlib.util.find_spec("autoshard.runtime.simulate") is None:
        return {"status": "autoshard.simulate is not installed: nothing simulated"}
    from autoshard.runtime import simulate as sim

    model, batches = SIM_CASE.build("cpu", torch.float32), SIM_CASE.batches(steps, "cpu")
    reference, error = _attempt("simulate: one device", lambda: sim.single_device(
        model, batches, lr=lr, device=device).losses)
    out = {"status": "ran", "steps": steps, "reference_losses": reference, "reference_error": error, "rtol": SIM_RTOL,
           "plans": {}}
    for name, plan in plans.items():
        got, error = _attempt(f"simulate {name}", lambda: sim.run_ranks(model, plan, batches, lr=lr,
                                                                        device=device).losses)
        out["plans"][name] = {"ranks": math.prod(plan.mesh_shape), "mesh": list(plan.mesh_shape), "losses": got,
                              "error": error, "match": None if got is None or reference is None
                              else losses_match(got, reference, SIM_RTOL)}
    return out


# --- reporting -----------------------------------------------------------------------------------
def _bytes(v, unit: int) -> str:
    return "n/a" if v is None or math.isnan(v) else f"{v / unit:.2f}"


def _ratio(a, b) -> str:
    return "-" if a is None or b is None or math.isnan(a) or math.isnan(b) or not b else f"{a / b:.2f}"


def _f(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def tables(report: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) of the three comparisons and the simulated ranks."""
    rows = report["rows"]
    unit, unit_name = (2**30, "GiB") if max((r["pred_peak_bytes"] for r in rows), default=0) > 2**30 else (2**20, "MiB")
    where = f"{report['device']}, {report['dtype']}, {report['steps']} AdamW steps"
    out = [(f"loss: compiled plan vs eager PyTorch, same weights and batches ({where}; rtol {report['loss_rtol']:g})",
            ["model", "plan", "recomputed", "first loss", "last loss", "eager last", "max |diff|", "ok", "error"],
            [[r["model"], r["plan"], str(r["recomputed_nodes"]), _f((r.get("losses") or [None])[0], ".4f"),
              _f((r.get("losses") or [None])[-1], ".4f"), _f((r.get("eager_losses") or [None])[-1], ".4f"),
              _f(r.get("max_loss_diff"), ".2e"), {True: "yes", False: "NO", None: "-"}[r.get("loss_ok")],
              (r["error"] or r["eager_error"] or "")[:60]] for r in rows]),
           (f"step time, median of steps {WARMUP + 1}-{report['steps']} ms ({report['timer']})",
            ["model", "plan", "measured", "eager", "eager recompute", "vs eager", "predicted", "measured/pred"],
            [[r["model"], r["plan"], _f(r.get("step_ms"), ".1f"), _f(r.get("eager_step_ms"), ".1f"),
              r["eager_recompute"], _ratio(r.get("step_ms"), r.get("eager_step_ms")), f"{r['pred_step_ms']:.1f}",
              _ratio(r.get("step_ms"), r["pred_step_ms"])] for r in rows]),
           (f"peak memory {unit_name} ({report['memory']})",
            ["model", "plan", "measured", "eager", "predicted", "measured/pred", "cap"],
            [[r["model"], r["plan"], _bytes(r.get("peak_bytes"), unit), _bytes(r.get("eager_peak_bytes"), unit),
              _bytes(r["pred_peak_bytes"], unit), _ratio(r.get("peak_bytes"), r["pred_peak_bytes"]),
              _bytes(r["memory_limit_bytes"], unit) if r["plan"] == "capped" else ""] for r in rows])]
    sim = report["simulate"]
    if sim.get("status") == "ran":
        out.append((f"simulated ranks (autoshard.simulate) vs one device, tiny GPT, {sim['steps']} AdamW steps "
                    f"(rtol {sim['rtol']:g})",
                    ["plan", "ranks", "mesh", "last loss", "one device last", "match", "error"],
                    [[name, str(p["ranks"]), str(p["mesh"]), _f((p["losses"] or [None])[-1], ".5f"),
                      _f((sim["reference_losses"] or [None])[-1], ".5f"),
                      {True: "yes", False: "NO", None: "-"}[p["match"]], (p["error"] or "")[:60]]
                     for name, p in sim["plans"].items()]))
    return out


def render(title: str, header: list[str], rows: list[list[str]]) -> str:
    """A rich table where rich is installed (the GPU machine may lack it), plain columns otherwise."""
    left = [h in ("model", "plan", "error") for h in header]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(x) for x in col) for col in zip(header, *rows)]

        def line(cells: list[str]) -> str:
            return "  ".join(c.ljust(w) if l else c.rjust(w) for c, w, l in zip(cells, widths, left))
        return "\n".join([title, line(header), *map(line, rows)])
    t = Table(title=title)
    for h, l in zip(header, left):
        t.add_column(h, justify="left" if l else "right")
    for r in rows:
        t.add_row(*r)
    console = Console(width=160, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(t)
    return console.export_text()


def failures(report: dict) -> list[str]:
    bad = [f"{r['model']} {r['plan']}: {r['error'] or r['eager_error'] or 'losses outside the tolerance'}"
           for r in report["rows"] if r["error"] or r["eager_error"] or not r.get("loss_ok")]
    sim = report["simulate"]
    if sim.get("status") == "ran":
        bad += [f"simulated {n}: {p['error'] or 'losses differ from one device'}" for n, p in sim["plans"].items()
                if not p["match"]]
    return bad


# --- driver --------------------------------------------------------------------------------------
def _device() -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cuda", torch.cuda.current_device())


def _init_group(device: torch.device) -> None:
    """The world-size-1 process group compile runs in: torchrun's, else one made here."""
    if "RANK" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    if device.type == "cuda":
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    if dist.get_world_size() != 1:
        raise SystemExit(f"bench/gpu.py measures one device; it was launched on {dist.get_world_size()} "
                         "processes: use --nproc-per-node 1")


def _saved_plans(ap: argparse.ArgumentParser, args) -> dict:
    """The document ``--plan-only`` wrote, checked against the other options."""
    if args.size or args.dtype:
        ap.error("--size and --dtype choose what to plan; with --plans the saved plans' own apply")
    try:
        doc = json.loads(args.plans.read_text())
    except (OSError, ValueError) as exc:
        ap.error(f"--plans {args.plans}: cannot read it ({type(exc).__name__}: {exc})")
    fields = {"size", "dtype", "torch", "models", "skipped", "simulate"}
    if not isinstance(doc, dict) or not fields <= set(doc):
        ap.error(f"--plans {args.plans}: not a plans file written by --plan-only (one has the fields "
                 f"{', '.join(sorted(fields))})")
    missing = [m for m in args.models or () if m not in doc["models"]]
    if missing:
        ap.error(f"--plans {args.plans} has no plans for {', '.join(missing)} (it has {', '.join(doc['models'])})")
    return doc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(CASES), default=None,
                    help="model sizes (default: full with CUDA or --plan-only, tiny otherwise)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                    help="parameter dtype (default: bfloat16 at full size, float32 at tiny)")
    ap.add_argument("--plan-only", action="store_true", help="plan, write --plans, and stop (needs OR-Tools)")
    ap.add_argument("--plans", type=Path, default=None,
                    help="with --plan-only the file to write (default bench/out/gpu_plans.json); otherwise "
                         "the saved plans to run (default: plan in process)")
    ap.add_argument("--models", nargs="*", default=None, choices=[c.name for c in CASES["full"]],
                    help="a subset of the models")
    ap.add_argument("--inductor", action=argparse.BooleanOptionalAction, default=None,
                    help="also the free plan compiled by inductor, against torch.compile of the plain model, for "
                         f"{' and '.join(INDUCTOR_MODELS)} (default: with CUDA)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--out", type=Path, default=OUT / "gpu.json")
    args = ap.parse_args(argv)
    if args.steps < WARMUP + 2:
        ap.error(f"--steps must be at least {WARMUP + 2} ({WARMUP} warm-up steps, then timed ones)")
    warnings.simplefilter("ignore")
    start = time.perf_counter()
    if args.plans is not None and not args.plan_only:
        doc = _saved_plans(ap, args)
    else:
        size = args.size or ("full" if args.plan_only or torch.cuda.is_available() else "tiny")
        dtype = getattr(torch, args.dtype or ("bfloat16" if size == "full" else "float32"))
        inductor = torch.cuda.is_available() if args.inductor is None else args.inductor
        doc = make_plans(size, dtype, _device(), args.models, inductor)
        if args.plan_only:
            path = args.plans or OUT / "gpu_plans.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(doc))
            print(f"wrote {path}", file=sys.stderr)
            return 0
    size, dtype = doc["size"], getattr(torch, doc["dtype"])
    if doc["torch"].split("+")[0] != torch.__version__.split("+")[0]:
        print(f"note: the plans were made with torch {doc['torch']}, this is torch {torch.__version__}; compile "
              "refuses a plan whose strategies this torch does not offer (plan with this torch)", file=sys.stderr)
    device = _device()
    if doc.get("device", device.type) != device.type:
        print(f"note: the plans were traced for {doc['device']}, this run is on {device.type}; compile refuses "
              "them (plan on this device)", file=sys.stderr)
    _init_group(device)
    ran = [c for c in CASES[size] if c.name in doc["models"] and (not args.models or c.name in args.models)]
    try:
        rows = []
        for case in ran:
            plans = {name: _plan(p) for name, p in doc["models"][case.name].items()}
            rows += measure_case(case, plans, device, dtype, args.steps, args.lr)
    finally:
        dist.destroy_process_group()   # simulated ranks make a process group of their own
    cuda = device.type == "cuda"
    report = {"size": size, "dtype": doc["dtype"], "device": torch.cuda.get_device_name(device) if cuda else "cpu",
              "torch": torch.__version__, "planned_with_torch": doc["torch"], "steps": args.steps, "warmup": WARMUP,
              "lr": args.lr, "loss_rtol": LOSS_RTOL[dtype], "timer": "CUDA events" if cuda else "perf_counter",
              "memory": "torch.cuda.max_memory_allocated" if cuda else
              "live tensor bytes of the last step, autoshard.memtrack.PeakMemory",
              "rows": rows, "skipped": {c.name: doc["skipped"][c.name] for c in ran if doc["skipped"].get(c.name)},
              "simulate": simulate({n: _plan(p) for n, p in doc["simulate"].items()}, device, SIM_STEPS, args.lr)}
    report["elapsed_s"] = time.perf_counter() - start
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    for table in tables(report):
        print(render(*table))
    bad = failures(report)
    skipped = [f"{model} {plan}: skipped, {why}" for model, plans in report["skipped"].items()
               for plan, why in plans.items()]
    print("\n".join([f"wrote {args.out} in {report['elapsed_s']:.0f}s", *skipped, *bad]), file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
