"""bench/gpu.py and examples/train.py under torchrun with one process: on this CPU-only machine
gloo at tiny sizes, the same code a GPU runs under NCCL at world size 1 (so it cannot rot before
one does). Each run is a subprocess in its own session, killed whole if it overruns."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import autoshard
from autoshard import zoo
from autoshard.cluster import PRESETS

ROOT = Path(__file__).resolve().parents[1]
FP32_RTOL = 1e-5   # fp32 and the same kernels on both sides: the compiled plan is eager's arithmetic


def _load(path: Path):
    """A script of the repository as a module (bench/ and examples/ are not packages)."""
    spec = importlib.util.spec_from_file_location(path.stem + "_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _torchrun(nproc: int, *args: str, timeout: float) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:   # overran (or the test was interrupted): torchrun and its workers go
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.fixture(scope="module")
def bench():
    return _load(ROOT / "bench" / "gpu.py")


@pytest.mark.world(1)
def test_gpu_bench_at_tiny_size_matches_eager(bench, tmp_path):
    out = tmp_path / "gpu.json"
    run = _torchrun(1, "bench/gpu.py", "--out", str(out), timeout=240)
    assert out.exists(), run.stderr[-4000:]
    report = json.loads(out.read_text())
    assert (report["size"], report["device"], report["dtype"]) == ("tiny", "cpu", "float32")
    cases = {c.name: c for c in bench.CASES["tiny"]}
    rows = {(r["model"], r["plan"]): r for r in report["rows"]}
    assert set(rows) == {(m, p) for m in cases for p in bench.PLANS} and report["skipped"] == {}
    for (model, plan), r in rows.items():
        assert r["error"] is None and r["eager_error"] is None, (model, plan, r["error"], r["eager_error"])
        assert len(r["losses"]) == report["steps"] == 10
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["eager_losses"]), rtol=FP32_RTOL, atol=0)
        assert r["step_ms"] > 0 and r["eager_step_ms"] > 0 and r["peak_bytes"] > 0 and r["eager_peak_bytes"] > 0
    for model, case in cases.items():
        free, capped, per_layer = (rows[model, p] for p in bench.PLANS)
        # the cap sits below the free plan's peak, so the capped plan recomputes, yet less than per layer
        assert capped["memory_limit_bytes"] < free["pred_peak_bytes"]
        assert free["recomputed_nodes"] == 0 < capped["recomputed_nodes"] < per_layer["recomputed_nodes"]
        # The comparison can fail: the 9 AdamW updates moved the last step's loss far beyond the
        # tolerance (the initial weights on the last batch, computed here, give another loss).
        model_ = case.build("cpu", torch.float32)
        with torch.no_grad():
            untrained = model_(*case.batches(report["steps"], "cpu")[-1]).item()
        assert abs(untrained - free["eager_losses"][-1]) > 100 * FP32_RTOL * abs(untrained), model
    sim = report["simulate"]
    if importlib.util.find_spec("autoshard.runtime.simulate") is None:
        assert sim == {"status": "autoshard.simulate is not installed: nothing simulated"}
    else:
        assert sim["reference_error"] is None
        assert {n: (p["error"], p["match"]) for n, p in sim["plans"].items()} == {
            n: (None, True) for n in bench.SIMULATED}
    assert run.returncode == 0, run.stderr[-4000:]   # and nothing else failed


@pytest.mark.world(1)
def test_gpu_bench_inductor_rows_match_eager(bench, tmp_path):
    """``--inductor``: the free plan priced and compiled for inductor trains as eager PyTorch does,
    and its reference is torch.compile of the plain model."""
    out = tmp_path / "gpu.json"
    run = _torchrun(1, "bench/gpu.py", "--out", str(out), "--inductor", "--models", "gpt2-small", timeout=400)
    assert out.exists(), run.stderr[-4000:]
    rows = {r["plan"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {*bench.PLANS, "free_inductor"}
    r = rows["free_inductor"]
    assert r["error"] is None and r["eager_error"] is None, (r["error"], r["eager_error"])
    assert r["eager_recompute"] == "compiled" and r["step_ms"] > 0 and r["eager_step_ms"] > 0
    torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["eager_losses"]), rtol=FP32_RTOL, atol=0)
    assert run.returncode == 0, run.stderr[-4000:]


@pytest.mark.world(1)
def test_train_example_under_torchrun_matches_eager():
    run = _torchrun(1, "examples/train.py", "--steps", "3", timeout=120)
    assert run.returncode == 0, run.stderr[-4000:]
    printed = [float(x) for x in re.findall(r"step +\d+ +loss ([0-9.]+)", run.stdout)]
    # the example's own model, batches and AdamW on one device, here
    train = _load(ROOT / "examples" / "train.py")
    args = argparse.Namespace(**{**vars(_defaults(train)), "steps": 3})
    config = train.GPTConfig(vocab=args.vocab, seq=args.seq, hidden=args.hidden, heads=args.heads, layers=args.layers)
    torch.manual_seed(args.seed)
    model = train.GPT(config)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    expected = []
    for step in range(args.steps):
        loss = model(*train.batch_for(step, config, args.batch, "cpu"))
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(loss.item())
    assert printed == pytest.approx(expected, abs=1e-4)   # printed with 4 decimals


def _defaults(train) -> argparse.Namespace:
    argv, sys.argv = sys.argv, ["train.py"]
    try:
        return train.parse_args()
    finally:
        sys.argv = argv


def test_train_example_plans_one_gpu_for_its_preset():
    """On a GPU, fewer processes than a node's GPUs make a flat mesh of that node's devices and
    links (one GPU: mesh (1,)); before, any world size but a multiple of 8 stopped the example."""
    train = _load(ROOT / "examples" / "train.py")
    one = train.make_cluster(argparse.Namespace(preset="hgx-h200"), 1, on_gpu=True)
    h200 = PRESETS["hgx-h200"]
    assert (one.mesh_shape, one.device, one.links) == ((1,), h200.device, (h200.intra,))
    model, inputs = zoo.get("gpt", "tiny")
    assert autoshard.plan(model, one, inputs).mesh_shape == (1,)
    assert train.make_cluster(argparse.Namespace(preset="hgx-h200"), 16, on_gpu=True).mesh_shape == (2, 8)
    with pytest.raises(SystemExit, match="multiple"):
        train.make_cluster(argparse.Namespace(preset="hgx-h200"), 12, on_gpu=True)
