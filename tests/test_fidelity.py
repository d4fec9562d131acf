"""The fidelity benchmark's parts against hand-computed truths, and the whole harness once at a
tiny size on 2 gloo ranks (so it cannot rot). Nothing here asserts a timing: how well predicted
step times rank the measured ones is bench/fidelity.py's figure (docs/benchmarks.md)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from autoshard.cluster import Cluster
from autoshard.runtime.memtrack import PeakMemory

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import fidelity  # noqa: E402

F32 = 4


# --- the tracker ---------------------------------------------------------------------------------
def test_peak_counts_each_storage_once_and_frees_it():
    held = torch.zeros(100)
    with PeakMemory() as mem:
        mem.track([held, held.view(10, 10), None, 3])       # one storage, however many views
        assert mem.current == 100 * F32
        a = torch.ones(1000)
        v = a.view(10, 100).t()                              # a view: no new bytes
        a.add_(1)                                            # in place: no new bytes
        b = a * 2
        assert mem.current == (100 + 2000) * F32
        del a, v, b
        assert mem.current == 100 * F32
        c = torch.empty(0)
        torch.mm(torch.ones(4, 8), torch.ones(8, 16), out=c)  # out= grows a storage counted empty
    assert mem.peak == (100 + 2000) * F32
    assert mem.current == (100 + 4 * 16) * F32               # c, and held
    assert mem.peak_op is not None and "mul" in mem.peak_op


def test_peak_sees_autograd_saved_tensors_and_their_release():
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(32, 64)
    with PeakMemory() as mem:
        mem.track([w, x])
        base = mem.current
        h = torch.tanh(x @ w)          # x @ w (8 KiB) is freed once tanh has run; tanh's output is saved
        mem.reset_peak()
        h.sum().backward()
    assert base == (64 * 64 + 32 * 64) * F32
    # after backward: w.grad stays, the saved output of tanh is gone with the graph
    del h
    assert mem.current == base + 64 * 64 * F32


# --- the statistics ------------------------------------------------------------------------------
def test_spearman_by_hand():
    assert fidelity.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert fidelity.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ties take their mean rank: ranks y = 0, 1, 2.5, 4, 2.5; cov 8, var 10 and 9.5
    assert fidelity.spearman([1, 2, 3, 4, 5], [5, 6, 7, 8, 7]) == pytest.approx(8 / math.sqrt(95))
    assert math.isnan(fidelity.spearman([1, 2, 3], [7, 7, 7]))


def test_normalized_estimate_undoes_the_load_its_probe_saw():
    true = [0.1, 0.2, 0.3]
    calibrated = 100e9
    load = [[1.0, 3.0, 1.2], [0.9, 2.5, 4.0], [1.0, 1.0, 5.0]]   # per sample: how much slower the host ran
    samples = [[t * f for t, f in zip(true, fs)] for fs in load]
    probes = [[2 * fidelity.PROBE**3 / calibrated * f for f in fs] for fs in load]
    median, normalized = fidelity.step_estimates(samples, probes, calibrated)
    assert normalized == pytest.approx(true)
    assert median == pytest.approx([0.1, 0.5, 1.2])


# --- the harness end to end ----------------------------------------------------------------------
PLANS = ["free", "ddp", "fsdp", "megatron", "fsdp+recompute", "megatron+recompute", "full_recompute", "tight"]
SAMPLES = 2   # interleaved rounds: the harness's shape, not its timings, is under test here


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    path = tmp_path_factory.mktemp("fidelity") / "cluster.json"
    # the built-in CPU figures stand in for a calibration (that is bench/fidelity.py's job, and
    # tests/test_calibrate.py's)
    path.write_text(Cluster.local(2).to_json())
    return fidelity.run("tiny", calibration=path, warmup=1, samples=SAMPLES, steps=1, timeout=600)


@pytest.mark.world(2)
def test_harness_runs_every_plan_on_two_ranks(tiny_report):
    rows = {r["plan"]: r for r in tiny_report["rows"]}
    assert list(rows) == PLANS
    for name, r in rows.items():
        assert r["meas_step_ms"] > 0 and r["meas_median_ms"] > 0 and len(r["samples_ms"]) == SAMPLES, name
        assert r["meas_peak_mib"] * 2**20 >= r["meas_state_bytes"] > 0, name
    assert rows["full_recompute"]["recomputed"] > 0 and rows["tight"]["memory_limit"] < rows["free"]["pred_peak_mib"] * 2**20
    assert rows["fsdp"]["storage"] != ["(R)"] and rows["ddp"]["storage"] == ["(R)"]
    json.dumps(tiny_report)
    assert "Spearman" in fidelity.table(tiny_report)


@pytest.mark.world(2)
def test_measured_state_is_what_the_plan_counts(tiny_report):
    """Parameters, AdamW state and the input shards the ranks hold between steps, counted by the
    tracker, equal the plan's params + working copies + optimizer + buffers + inputs: with
    ``zero_grad(set_to_none=True)`` (torch's default, the bench's and the memory model's) no
    gradient outlives its step (the tracker would count one left on a parameter)."""
    assert [r["plan"] for r in tiny_report["rows"]] == PLANS
    for r in tiny_report["rows"]:
        assert r["meas_state_bytes"] == pytest.approx(r["pred_state_bytes"], rel=0.01), r["plan"]
