"""The memory and time model against eager PyTorch measured on one H200 (bench/h200_model.py):
the Llama-3-8B shape, with and without per-layer checkpointing, foreach and fused AdamW, and the
0.9B Llama. Each shape is traced once on ``meta`` (seconds at 8B) and planned for one H200.

Targets: the predicted peak within 5% above the measured one and never more than 2% below it;
the predicted step within 10% (from 1B parameters; the 0.9B rows meet it too). The 0.9B
checkpointed rows differ from eager by what autoshard's runtime keeps and eager's
``torch.utils.checkpoint`` does not: each layer's attention output (a seeded op, never replayed:
solver/memory.py), measured here off the trace. The 0.9B row without checkpointing is left out of
the peak target: eager on the GPU held one more hidden-sized bf16 tensor per layer than this
torch's trace of the model saves (bench/h200_model.py prints it)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from autoshard.passes.annotate import META_KEY as COST_KEY, tensor_bytes

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("h200_model_under_test", ROOT / "bench" / "h200_model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def rows(bench):
    """The rows of 0.85B parameters and more, predicted."""
    return {m.name: (m, bench.predict(m)) for m in bench.MEASURED if m.name.startswith(("0.9b", "8b"))}


def test_the_8b_rows_meet_the_peak_and_step_targets(bench, rows):
    eight = {name: r for name, (_, r) in rows.items() if name.startswith("8b")}
    assert len(eight) == 4 and all(r["params_b"] > 8 for r in eight.values())
    for name, r in eight.items():
        assert bench.meets(r) == {"peak": True, "step": True}, (name, r["peak_ratio"], r["step_ratio"])
    # foreach AdamW's temporary puts the peak in the optimizer step (five times the bf16
    # parameters' bytes); fused AdamW has none, so the peak is elsewhere and lower
    assert rows["8b"][1]["peak_moment"] == rows["8b-ckpt"][1]["peak_moment"] == "optimizer step"
    assert rows["8b"][1]["predicted_peak_gb"] == pytest.approx(5 * 2 * 8.030261248, rel=1e-6)
    for fused in ("8b-fused", "8b-ckpt-fused"):
        assert rows[fused][1]["peak_moment"] != "optimizer step"
        assert rows[fused][1]["predicted_peak_gb"] < rows[fused.removesuffix("-fused")][1]["predicted_peak_gb"]


def test_the_09b_rows_meet_the_step_target(bench, rows):
    for name, (_, r) in rows.items():
        assert bench.meets(r)["step"], (name, r["step_ratio"])


def test_checkpointed_09b_peak_but_the_attention_outputs_meets_the_target(bench, rows):
    """Eager replays the attention inside each checkpointed layer; autoshard's runtime saves its
    output (seeded: CPU flash attention takes a dropout seed), which the prediction counts."""
    for name in ("0.9b-ckpt", "0.9b-ckpt-fused"):
        m, r = rows[name]
        graph = bench.traced(m.config, m.batch).gm.graph
        seeded = sum(tensor_bytes(n.meta["val"]) for n in graph.nodes if n.op == "call_function"
                     and n.meta[COST_KEY].phase == "fwd"
                     and torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ()))
        assert seeded > 0 and r["peak_moment"].startswith("backward")
        eager_like = dict(r, peak_ratio=(r["predicted_peak_gb"] - seeded / 1e9) / m.peak_gb)
        assert bench.meets(eager_like)["peak"], (name, r["peak_ratio"], eager_like["peak_ratio"])
