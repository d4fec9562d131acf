"""Cluster.calibrate on 2 live gloo ranks, and the fitting arithmetic it rests on."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch.distributed as dist

from autoshard.cluster.calibrate import fit_line, link_from_fit, size_switch_latency, time_collective
from autoshard.cluster import COLLECTIVES, Cluster, DeviceSpec, LinkSpec
from autoshard.errors import ClusterError
from autoshard.runtime.launch import run_local

KiB, MiB = 2**10, 2**20
HELD_OUT = 6 * MiB       # an all-reduce size the calibration does not use (64 KiB .. 16 MiB)


# --- on 2 ranks: one launch for everything ------------------------------------------------------------
def calibrate_job(path: str) -> dict:
    """Calibrate (saving on rank 0), time one all-reduce of another size, then a 2-D mesh
    calibration with few sizes (its wiring). How well a calibration predicts is measured by
    bench/fidelity.py, not here: timings on a shared host make no assertion."""
    cluster = Cluster.calibrate(save=path)
    held_out = time_collective("all_reduce", HELD_OUT, repeats=3)
    two_d = Cluster.calibrate(mesh_shape=(2, 1), mesh_dim_names=("a", "b"),
                              message_sizes=(64 * KiB, 4 * MiB, 16 * MiB), repeats=3)
    return {"json": cluster.to_json(), "held_out": held_out, "two_d": two_d.to_json(), "rank": dist.get_rank()}


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    path = tmp_path_factory.mktemp("calib") / "calibration.json"
    results = run_local(calibrate_job, 2, str(path), timeout=120)
    return results, path


@pytest.mark.world(2)
def test_all_ranks_agree_and_rank0_saves(calibrated):
    (r0, r1), path = calibrated
    assert r0["json"] == r1["json"] and r0["two_d"] == r1["two_d"]
    assert path.read_text() == r0["json"]
    # time_collective: the slowest rank's time on both, the bytes it moved (6 MiB: whole floats)
    assert r0["held_out"] == r1["held_out"] and r0["held_out"][0] == HELD_OUT and r0["held_out"][1] > 0


@pytest.mark.world(2)
def test_calibrated_cluster_is_built_from_its_measurements(calibrated):
    (r0, _), _ = calibrated
    c = Cluster.from_json(r0["json"])
    cal = c.calibration
    assert c.mesh_shape == (2,) and c.mesh_dim_names == ("d0",)
    ok = lambda v: 0 < v < math.inf  # noqa: E731
    assert ok(c.device.memory)
    # the device is its best measured rates, reached as measured (efficiency 1)
    assert set(cal["matmul_flops"]["float32"]) == {"256", "512", "1024"}
    assert c.device.flops("float32") == max(cal["matmul_flops"]["float32"].values()) > 0
    assert set(cal["memory_bandwidth"]) == {"copy", "add"}
    assert c.device.memory_bandwidth == max(cal["memory_bandwidth"].values()) > 0
    assert c.device.launch_overhead == cal["launch_overhead"] > 0 and cal["dtensor_op_overhead"] >= 0
    assert c.device.compute_efficiency == c.device.memory_efficiency == 1.0
    dim = cal["mesh_dims"][0]
    assert dim["measured"] and set(dim["fits"]) == set(COLLECTIVES)
    for kind, fit in dim["fits"].items():
        sizes, times, a, b = fit["sizes"], fit["times"], fit["a"], fit["b"]
        assert len(sizes) == len(times) == 6 and min(sizes) == 64 * KiB and max(sizes) == 16 * MiB, kind
        assert all(ok(t) for t in times) and b > 0 and a >= 0, kind
        # the weighted least-squares optimum (weights 1/t): the relative residuals r/t have
        # sum n r / t = 0, and sum r / t = 0 unless the intercept was clamped to 0 (rounding
        # leaves ~1e-15 of sum n, resp. of the count)
        rel = [(a + b * n - t) / t for n, t in zip(sizes, times)]
        assert abs(sum(n * e for n, e in zip(sizes, rel))) <= 1e-12 * sum(sizes), kind
        assert fit["clamped"] == (a == 0.0), kind
        if not fit["clamped"]:
            assert abs(sum(rel)) <= 1e-12 * len(rel), kind
        # what the sizes cost on top of the line when they change call to call, spread over the calls
        assert fit["switch"] == pytest.approx(max(0.0, (fit["mixed"] - sum(a + b * n for n in sizes)) / 6),
                                              rel=1e-12, abs=0), kind
        # the ring's (alpha, B) of the line a + switch + b n on 2 ranks: 2(p-1) = 2 latency steps and
        # 2(p-1)/p = 1 of the bytes for the all-reduce, 1 and 1/2 for the others
        steps, share = (2, 1.0) if kind == "all_reduce" else (1, 0.5)
        assert fit["latency"] == pytest.approx((a + fit["switch"]) / steps, rel=1e-12, abs=0), kind
        assert fit["bandwidth"] == pytest.approx(share / b, rel=1e-12, abs=0), kind
        # each kind priced by its own line, not by the all-reduce link's ring ratios
        for n in sizes:
            assert c.collective_time(kind, n, 0) == pytest.approx(a + fit["switch"] + b * n, rel=1e-9), kind
    ar = dim["fits"]["all_reduce"]
    assert c.links[0] == LinkSpec(c.links[0].name, ar["latency"], ar["bandwidth"], 1.0)


@pytest.mark.world(2)
def test_saved_calibration_feeds_cluster_local(calibrated, monkeypatch):
    _, path = calibrated
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
    assert fit["a"] == pytest.approx(a, rel=1e-9, abs=0) and fit["b"] == pytest.approx(b, rel=1e-9, abs=0)
    assert not fit["clamped"] and fit["rms_rel_err"] < 1e-9


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather"])
def test_synthetic_measurements_give_back_their_link(kind):
    """Times a known ring link takes on 4 ranks (docs/cost_model.md), plus 30 us per call when
    the sizes change call to call: the fit, the size-switch cost and the ring inversion give back
    the link, its latency raised by the switch cost per ring step."""
    sizes = [64 * KiB, 256 * KiB, MiB, 4 * MiB, 8 * MiB, 16 * MiB]
    alpha, bw, p, switch = 7e-6, 2.5e9, 4, 30e-6
    steps, share = (2 * (p - 1), 2 * (p - 1) / p) if kind == "all_reduce" else (p - 1, (p - 1) / p)
    times = [steps * alpha + share * n / bw for n in sizes]
    # exact up to rounding (~1e-15 here; the switch cost is a difference of sums 100x larger);
    # abs=0: pytest's default 1e-12 is more than these seconds per byte
    exact = dict(rel=1e-12, abs=0)
    fit = fit_line(sizes, times)
    assert fit["a"] == pytest.approx(steps * alpha, **exact) and fit["b"] == pytest.approx(share / bw, **exact)
    extra = size_switch_latency(sizes, sum(times) + len(sizes) * switch, fit["a"], fit["b"])
    assert extra == pytest.approx(switch, **exact)
    link = link_from_fit(kind, p, fit["a"] + extra, fit["b"], "fit")
    assert link.latency == pytest.approx(alpha + switch / steps, **exact)
    assert link.bandwidth == pytest.approx(bw, **exact) and link.efficiency == 1.0


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
