"""Golden plan summaries: each zoo model (tiny size) planned for one Perlmutter-like node of 4
A100s. ``make golden`` (``python -m tests.golden_update``) rewrites tests/golden/*.json; review the
diff in the commit: a changed decision or a slower plan there is a change in what autoshard plans.
tests/test_golden.py re-plans every case and compares with the files.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

GOLDEN = Path(__file__).parent / "golden"
CLUSTER = ("perlmutter", 1)
SLOWER_BY = 0.01  # a plan more than 1% slower than its golden fails


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
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autoshard.plan(model, autoshard.Cluster.preset(*CLUSTER), inputs, time_limit=120)


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


def main(names: list[str]) -> None:
    GOLDEN.mkdir(exist_ok=True)
    for name in names or cases():
        path(name).write_text(json.dumps(summary(name, plan_case(name)), indent=1, sort_keys=True) + "\n")
        print(f"wrote {path(name)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
