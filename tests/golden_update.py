"""Golden plan summaries: each zoo model (tiny size) planned for one Perlmutter-like node of 4
A100s. ``make golden`` (``python -m tests.golden_update [CASE ...]``) re-plans the cases, prints
per case what changed against its file (decisions, step time and peak before -> after) and
rewrites the files that changed. A case whose solve did not prove its plan optimal is refused: its
file is left as it was and the command exits non-zero. tests/test_golden.py re-plans every case
and compares with the files.

Each torch minor release has its own goldens (tests/golden/torch-2.13/, ...; ``make golden
TORCH=2.15.0`` writes that release's). Releases trace some ops to other ATen decompositions and
list DTensor's strategies in another order, so where several plans are equally fast (the same
step time to the last bit) the solver's choice among them differs from release to release, and a
golden pins each release's choice. A change of autoshard moves every release's goldens.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path



def _release() -> str:
    import torch

    return "torch-" + ".".join(torch.__version__.split(".")[:2])


GOLDEN = Path(__file__).parent / "golden" / _release()
CLUSTER = ("perlmutter", 1)
TIME_LIMIT = 120  # seconds; every case plans, solve proven optimal, in under 10 s here
# Relative tolerance on step time and peak memory, both directions. A plan is deterministic (one
# HiGHS thread, fixed seed) and its step and peak are float sums over its nodes that re-planning
# reproduces bit for bit here (every case, measured); 1e-9 only leaves room for a summation order
# or a libm rounding differing in the last bits elsewhere (a few ulps of each of a few thousand
# terms). Real changes are far above it: 5% more AdamW memory passes (costmodel.ADAMW_PASSES)
# moves these steps by 6e-6 to 2e-5, and 1e-9 of a peak here (at most 28 MB) is under one byte.
REL = 1e-9
SHOWN = 20  # decision changes printed per case


# Extra cases: (zoo name, dtype). Mixtral's bfloat16 path is the one real sizes take (grouped
# GEMMs over tokens each rank sorts itself: passes/regions.py); float32 runs batched_mm.
EXTRA = {"mixtral_bf16": ("mixtral", "bfloat16")}


def cases() -> list[str]:
    from autoshard import zoo

    return [*zoo.names(), *EXTRA]


def plan_case(name: str):
    import torch

    import autoshard
    from autoshard import zoo

    zoo_name, dtype = EXTRA.get(name, (name, None))
    model, inputs = zoo.get(zoo_name, "tiny", dtype=dtype and getattr(torch, dtype))
    return autoshard.plan(model, autoshard.Cluster.preset(*CLUSTER), inputs, time_limit=TIME_LIMIT)


def summary(name: str, plan) -> dict:
    """What a golden pins: predicted step time and peak memory, the mesh, parameter storage, and
    every node's decision (strategy, and whether it is recomputed) grouped by repeated block."""
    blocks: dict[str, dict[str, str]] = {}
    for n in plan.nodes:
        block = "outside layers" if n.layer is None else f"layer {n.layer}"
        blocks.setdefault(block, {})[n.name] = n.strategy + (" recompute" if n.recompute else "")
    return {"case": name, "size": "tiny", "cluster": f"{CLUSTER[0]} x{CLUSTER[1]}",
            "step_time": plan.step_time, "peak_memory": plan.peak_memory, "mesh": list(plan.mesh_shape),
            "storage": plan.storage, "inputs": plan.inputs, "decisions": blocks}


def path(name: str) -> Path:
    return GOLDEN / f"{name}.json"


def decisions(s: dict) -> dict[str, object]:
    """A summary's decisions flat: each node's (by block), each parameter's storage, each input's
    placement, and the mesh."""
    return {**{f"{block} {n}": d for block, nodes in s["decisions"].items() for n, d in nodes.items()},
            **{f"storage {p}": v for p, v in s["storage"].items()},
            **{f"input {i}": v for i, v in enumerate(s["inputs"])}, "mesh": s["mesh"]}


def changes(old: dict, new: dict) -> list[str]:
    """One line per decision that differs between two summaries ("-": the summary lacks it)."""
    was, now = decisions(old), decisions(new)
    return [f"{k}: {was.get(k, '-')} -> {now.get(k, '-')}" for k in sorted(was.keys() | now.keys())
            if was.get(k) != now.get(k)]


def same(old: dict, new: dict) -> bool:
    """Two summaries alike: step time and peak within REL, every other field equal."""
    floats = ("step_time", "peak_memory")
    return old.keys() == new.keys() and all(old[k] == new[k] for k in old if k not in floats) and \
        all(math.isclose(old[k], new[k], rel_tol=REL, abs_tol=0) for k in floats)


def report(old: dict | None, new: dict) -> str:
    """``new`` against the golden ``old``: step time and peak before -> after, then the decisions
    that changed."""
    if old is None:
        return f"{new['case']}: new golden, step {new['step_time'] * 1e3:.6f} ms, peak {new['peak_memory']:.0f} B"
    lines = changes(old, new)
    step, peak = new["step_time"] / old["step_time"] - 1, new["peak_memory"] / old["peak_memory"] - 1
    head = (f"{new['case']}: step {old['step_time'] * 1e3:.6f} -> {new['step_time'] * 1e3:.6f} ms ({step:+.2e}), "
            f"peak {old['peak_memory']:.0f} -> {new['peak_memory']:.0f} B ({peak:+.2e}), "
            f"{len(lines)} decisions changed")
    more = [f"  ... {len(lines) - SHOWN} more"] if len(lines) > SHOWN else []
    return "\n".join([head, *(f"  {line}" for line in lines[:SHOWN]), *more])


def main(names: list[str]) -> int:
    from autoshard.errors import SolverError

    unknown = sorted(set(names) - set(cases()))
    if unknown:
        sys.exit(f"golden: unknown cases {unknown}; the cases are {cases()}")
    GOLDEN.mkdir(parents=True, exist_ok=True)
    refused = []
    for name in names or cases():
        try:
            plan = plan_case(name)
            status = plan.solver["status"]
            if status != "optimal":
                status += f" (gap {plan.solver['gap']:.3%})"
        except SolverError as exc:   # no plan at all within the time limit
            status = str(exc)
        if status != "optimal":
            refused.append(name)
            print(f"{name}: REFUSED, the solve is not proven optimal: {status} (time_limit={TIME_LIMIT}s); "
                  f"{path(name)} left as it was", file=sys.stderr, flush=True)
            continue
        new = json.loads(json.dumps(summary(name, plan)))   # as the file will read back
        old = json.loads(path(name).read_text()) if path(name).is_file() else None
        if old is not None and same(old, new):
            print(f"{name}: unchanged", flush=True)
            continue
        print(report(old, new), flush=True)
        path(name).write_text(json.dumps(new, indent=1, sort_keys=True) + "\n")
        print(f"  wrote {path(name)}", flush=True)
    if refused:
        print(f"golden: refused {refused}: no plan proven optimal, goldens not written", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
