"""Cluster.calibrate on 2 live gloo ranks, and the fitting arithmetic it rests on."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch.distributed as dist

from autoshard.calibrate import fit_line, link_from_fit, size_switch_latency, time_collective
from autoshard.cluster import COLLECTIVES, Cluster, DeviceSpec, LinkSpec
from autoshard.errors import ClusterError
from autoshard.launch import run_local

KiB, MiB = 2**10, 2**20
HELD_OUT = 6 * MiB       # an all-reduce size the fit never saw (it sees 64 KiB .. 16 MiB)
ATTEMPTS = 3             # the host is shared: a burst of load can land on one measurement only


@pytest.fixture(autouse=True)
def _no_calibration(monkeypatch, tmp_path):
    monkeypatch.delenv("AUTOSHARD_CALIBRATION", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))


# --- on 2 ranks: one launch for everything ------------------------------------------------------------
def calibrate_job(path: str) -> dict:
    """Calibrate (saving on rank 0), then time an all-reduce of a held-out size afresh and
    compare with the fitted prediction; retried as a pair, so each comparison is of numbers
    measured seconds apart. Then a 2-D mesh calibration with few sizes (its wiring, not its
    accuracy)."""
    attempts = []
    for _ in range(ATTEMPTS):
        cluster = Cluster.calibrate(save=path)
        nbytes, measured = time_collective("all_reduce", HELD_OUT, repeats=15)
        # the fitted line, without the size-switch term: time_collective repeats one size
        ar = cluster.calibration["mesh_dims"][0]["fits"]["all_reduce"]
        predicted = ar["a"] + ar["b"] * nbytes
        attempts.append({"json": cluster.to_json(), "measured": measured, "predicted": predicted})
        if abs(predicted - measured) <= 0.5 * measured:
            break
    two_d = Cluster.calibrate(mesh_shape=(2, 1), mesh_dim_names=("a", "b"),
                              message_sizes=(64 * KiB, 4 * MiB, 16 * MiB), repeats=3)
    return {"attempts": attempts, "two_d": two_d.to_json(), "rank": dist.get_rank()}


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    path = tmp_path_factory.mktemp("calib") / "calibration.json"
    results = run_local(calibrate_job, 2, str(path), timeout=120)
    return results, path


@pytest.mark.world(2)
def test_all_ranks_agree_and_rank0_saves(calibrated):
    (r0, r1), path = calibrated
    assert [a["json"] for a in r0["attempts"]] == [a["json"] for a in r1["attempts"]]
    assert r0["two_d"] == r1["two_d"]
    assert path.read_text() == r0["attempts"][-1]["json"]


@pytest.mark.world(2)
def test_calibrated_figures_are_positive_and_finite(calibrated):
    (r0, _), _ = calibrated
    c = Cluster.from_json(r0["attempts"][-1]["json"])
    assert c.mesh_shape == (2,) and c.mesh_dim_names == ("d0",)
    ok = lambda v: 0 < v < math.inf  # noqa: E731
    assert ok(c.device.flops("float32")) and ok(c.device.memory_bandwidth) and ok(c.device.memory)
    assert 1e8 < c.device.flops("float32") < 1e13            # a CPU core: 0.1 .. 10000 GFLOP/s
    assert 1e8 < c.device.memory_bandwidth < 1e12
    assert c.device.compute_efficiency == c.device.memory_efficiency == 1.0  # measured = achieved
    link = c.links[0]
    assert ok(link.latency) and ok(link.bandwidth) and link.efficiency == 1.0
    dim = c.calibration["mesh_dims"][0]
    assert dim["measured"] and set(dim["fits"]) == set(COLLECTIVES)
    for kind, fit in dim["fits"].items():
        assert ok(fit["bandwidth"]) and 0 <= fit["latency"] < math.inf, kind
        assert len(fit["sizes"]) == len(fit["times"]) == 6 and min(fit["sizes"]) == 64 * KiB
        assert max(fit["sizes"]) == 16 * MiB
    # The stored link is the all-reduce fit, and reproduces its line exactly.
    ar = dim["fits"]["all_reduce"]
    assert (link.latency, link.bandwidth) == (ar["latency"], ar["bandwidth"])
    for n in ar["sizes"]:
        assert c.collective_time("all_reduce", n, 0) == pytest.approx(ar["a"] + ar["switch"] + ar["b"] * n, rel=1e-9)
    # every other kind is priced by its own fit, not by the all-reduce link's ring ratios
    for kind, fit in dim["fits"].items():
        assert fit["switch"] == size_switch_latency(fit["sizes"], fit["mixed"], fit["a"], fit["b"]) >= 0
        for n in fit["sizes"]:
            assert c.collective_time(kind, n, 0) == pytest.approx(fit["a"] + fit["switch"] + fit["b"] * n,
                                                                  rel=1e-9), kind
    assert c.calibration["dtensor_op_overhead"] >= 0


@pytest.mark.world(2)
def test_prediction_of_a_held_out_size(calibrated):
    (r0, _), _ = calibrated
    seen = [a for a in r0["attempts"]]
    report = [f"predicted {a['predicted'] * 1e3:.2f} ms, measured {a['measured'] * 1e3:.2f} ms" for a in seen]
    last = seen[-1]
    assert abs(last["predicted"] - last["measured"]) <= 0.5 * last["measured"], report


@pytest.mark.world(2)
def test_saved_calibration_feeds_cluster_local(calibrated, monkeypatch):
    (r0, _), path = calibrated
    saved = Cluster.from_json(path.read_text())
    monkeypatch.setenv("AUTOSHARD_CALIBRATION", str(path))
    c = Cluster.local(2)
    # local ranks wait on each collective in turn: nothing overlaps, whatever was calibrated
    assert c.links == saved.links and c.device == dataclasses.replace(saved.device, comm_overlap=0.0)
    four = Cluster.local(4, (2, 2))
    assert four.links == (saved.links[0],) * 2
    assert four.device.memory == pytest.approx(saved.device.memory / 2)  # host memory over 4 ranks, not 2
    assert four.device.flops("float32") == saved.device.flops("float32")


@pytest.mark.world(2)
def test_two_dim_mesh(calibrated):
    (r0, _), _ = calibrated
    c = Cluster.from_json(r0["two_d"])
    assert c.mesh_shape == (2, 1) and c.mesh_dim_names == ("a", "b")
    dims = c.calibration["mesh_dims"]
    assert dims[0]["measured"] and not dims[1]["measured"]
    assert c.links[1] == c.links[0]  # a 1-rank dim never talks; it gets the slowest measured link
    assert len(dims[0]["fits"]["all_gather"]["sizes"]) == 3


# --- in one process ----------------------------------------------------------------------------------
def test_calibrate_needs_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(ClusterError, match="initialized process group"):
        Cluster.calibrate()


def test_fit_recovers_a_line():
    sizes = [64 * KiB, 256 * KiB, MiB, 4 * MiB, 8 * MiB, 16 * MiB]
    a, b = 80e-6, 1 / 1.5e9
    fit = fit_line(sizes, [a + b * n for n in sizes])
    assert fit["a"] == pytest.approx(a, rel=1e-9) and fit["b"] == pytest.approx(b, rel=1e-9)
    assert not fit["clamped"] and fit["rms_rel_err"] < 1e-9


def test_fit_clamps_a_negative_intercept():
    sizes = [MiB, 2 * MiB, 4 * MiB]
    fit = fit_line(sizes, [1e-3 * n / MiB - 1e-4 for n in sizes])
    assert fit["clamped"] and fit["a"] == 0.0 and fit["b"] > 0


def test_size_switch_latency_by_hand():
    sizes = [MiB, 4 * MiB]
    a, b = 100e-6, 1e-9
    same = [a + b * n for n in sizes]
    assert size_switch_latency(sizes, sum(same), a, b) == 0.0
    assert size_switch_latency(sizes, sum(same) + 2e-3, a, b) == pytest.approx(1e-3)   # 1 ms per call
    assert size_switch_latency(sizes, 0.5 * sum(same), a, b) == 0.0                      # never negative


@pytest.mark.parametrize("sizes, times, match", [
    ([MiB], [1e-3], "2 or more"),
    ([MiB, MiB], [1e-3, 2e-3], "2 or more"),
    ([MiB, 2 * MiB], [1e-3, 0.0], "positive"),
    ([MiB, 2 * MiB, 4 * MiB], [3e-3, 2e-3, 1e-3], "do not grow"),
])
def test_fit_rejects_bad_data(sizes, times, match):
    with pytest.raises(ClusterError, match=match):
        fit_line(sizes, times)


@pytest.mark.parametrize("kind", COLLECTIVES)
@pytest.mark.parametrize("p", [2, 4, 8])
def test_link_from_fit_inverts_the_ring_formula(kind, p):
    a, b = 300e-6, 1 / 2e9
    link = link_from_fit(kind, p, a, b, "fit")
    c = Cluster((p,), links=[link])
    for n in (64 * KiB, 16 * MiB):
        assert c.collective_time(kind, n, 0) == pytest.approx(a + b * n, rel=1e-12)
    # By hand for the all-reduce: alpha = a / (2(p-1)), B = 2(p-1)/p / b.
    if kind == "all_reduce":
        assert link.latency == pytest.approx(a / (2 * (p - 1)))
        assert link.bandwidth == pytest.approx(2 * (p - 1) / p / b)
    with pytest.raises(ClusterError, match="p >= 2"):
        link_from_fit(kind, 1, a, b, "fit")


def test_calibration_metadata_travels_with_json():
    meta = {"backend": "gloo", "device_type": "cpu", "mesh_dims": [{"name": "d0", "size": 2}]}
    c = Cluster((2,), device=DeviceSpec("m", {"float32": 1e11}, 2e10, 8e9), links=[LinkSpec("l", 5e-5, 1e9, 1.0)],
                calibration=meta)
    back = Cluster.from_json(c.to_json())
    assert back.calibration == meta and back == c
    assert back != Cluster((2,), device=c.device, links=c.links)   # the measurement is part of the identity
    assert "calibration" not in json.loads(Cluster.preset("dgx-h100").to_json())  # presets: unchanged JSON
    with pytest.raises(ClusterError, match="calibration must be a dict"):
        Cluster((2,), calibration=[1, 2])
