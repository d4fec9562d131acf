"""Cluster: cost formulas against hand arithmetic, presets, JSON, validation."""

from __future__ import annotations

import json

from dataclasses import replace

import pytest
import torch

from autoshard.cluster import PRESETS, Cluster, DeviceSpec, LinkSpec
from autoshard.errors import ClusterError

GiB = 2**30


def dgx_a100(nodes=1):
    return Cluster.preset("dgx-a100-80gb", nodes=nodes)


# --- collectives, one dim ---------------------------------------------------------------------
def test_all_reduce_one_dim():
    c = dgx_a100()
    # p=8 on NVLink 3: B = 300e9 * 0.8 = 240e9 bytes/s, alpha = 3e-6
    expected = 2 * 7 / 8 * GiB / 240e9 + 2 * 7 * 3e-6
    assert c.collective_time("all_reduce", GiB, 1) == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(7.8714e-3, rel=1e-4)


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "all_to_all"])
def test_single_pass_collectives_one_dim(kind):
    c = dgx_a100()
    expected = 7 / 8 * GiB / 240e9 + 7 * 3e-6
    assert c.collective_time(kind, GiB, 1) == pytest.approx(expected, rel=1e-12)
    assert c.collective_time(kind, GiB, [1]) == c.collective_time(kind, GiB, "gpu")


def test_inter_node_dim_uses_its_link():
    c = dgx_a100(nodes=4)
    # p=4 nodes on IB HDR: B = 25e9 * 0.8 = 20e9, alpha = 8e-6
    expected = 2 * 3 / 4 * GiB / 20e9 + 2 * 3 * 8e-6
    assert c.collective_time("all_reduce", GiB, 0) == pytest.approx(expected, rel=1e-12)


def test_trivial_collectives_are_free():
    c = dgx_a100(nodes=1)  # the "node" dim has p = 1
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        assert c.collective_time(kind, GiB, 0) == 0.0
        assert c.collective_time(kind, 0, 1) == 0.0
        assert c.collective_time(kind, GiB, ()) == 0.0
    assert Cluster.local(1).collective_time("all_reduce", GiB, 0) == 0.0


def test_unknown_kind_lists_kinds():
    with pytest.raises(ValueError, match="all_reduce, all_gather, reduce_scatter, all_to_all"):
        dgx_a100().collective_time("broadcast", GiB, 0)


def test_bad_mesh_dims():
    c = dgx_a100(2)
    with pytest.raises(ClusterError, match="not in mesh"):
        c.collective_time("all_reduce", GiB, 2)
    with pytest.raises(ClusterError, match="twice"):
        c.collective_time("all_reduce", GiB, (1, "gpu"))
    with pytest.raises(ValueError, match="nbytes"):
        c.collective_time("all_reduce", -1, 0)


# --- collectives, two dims --------------------------------------------------------------------
def test_hierarchical_all_reduce_by_hand():
    c = dgx_a100(nodes=2)  # (node=2, gpu=8)
    n = GiB
    nv, nv_a = 300e9 * 0.8, 3e-6  # fast: gpu dim
    ib, ib_a = 25e9 * 0.8, 8e-6  # slow: node dim
    rs_in_node = 7 / 8 * n / nv + 7 * nv_a
    ar_across = 2 * 1 / 2 * (n / 8) / ib + 2 * 1 * ib_a  # on 1/8 of the data
    ag_in_node = 7 / 8 * n / nv + 7 * nv_a
    expected = rs_in_node + ar_across + ag_in_node
    assert expected == pytest.approx(0.0145983, rel=1e-5)
    assert c.collective_time("all_reduce", n, (0, 1)) == pytest.approx(expected, rel=1e-12)
    # Order of the dims given does not matter: the fastest link is always innermost.
    assert c.collective_time("all_reduce", n, (1, 0)) == c.collective_time("all_reduce", n, (0, 1))


def test_hierarchical_gather_and_scatter_by_hand():
    c = dgx_a100(nodes=2)
    n = GiB
    nv, nv_a, ib, ib_a = 240e9, 3e-6, 20e9, 8e-6
    # all-gather: across nodes first to n/8 gathered, then inside the node to n.
    ag = (1 / 2 * (n / 8) / ib + 1 * ib_a) + (7 / 8 * n / nv + 7 * nv_a)
    # reduce-scatter: inside the node on n, then across nodes on n/8.
    rs = (7 / 8 * n / nv + 7 * nv_a) + (1 / 2 * (n / 8) / ib + 1 * ib_a)
    assert c.collective_time("all_gather", n, (0, 1)) == pytest.approx(ag, rel=1e-12)
    assert c.collective_time("reduce_scatter", n, (0, 1)) == pytest.approx(rs, rel=1e-12)


def test_hierarchical_all_to_all_by_hand():
    c = dgx_a100(nodes=2)
    n, P = GiB, 16
    # 7 peers in the node over NVLink, 8 peers in the other node over IB, n/16 bytes to each.
    expected = 7 * (n / P / 240e9 + 3e-6) + 8 * (n / P / 20e9 + 8e-6)
    assert c.collective_time("all_to_all", n, (0, 1)) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"])
def test_equal_links_match_flat_ring_bandwidth(kind):
    # alpha = 0 isolates the bandwidth term: hierarchy over equal links costs what a flat ring does.
    link = LinkSpec("l", latency=0.0, bandwidth=10e9, efficiency=1.0)
    two_d = Cluster((4, 2), links=[link, link])
    flat = Cluster((8,), links=[link])
    assert two_d.collective_time(kind, GiB, (0, 1)) == pytest.approx(
        flat.collective_time(kind, GiB, 0), rel=1e-12)


# --- compute ------------------------------------------------------------------------------------
def test_roofline_compute_bound():
    c = Cluster.preset("dgx-h100")
    flops, nbytes = 2 * 8192**3, 3 * 8192**2 * 2  # bf16 GEMM 8192^3
    expected = flops / (989e12 * 0.7) + 5e-6
    assert c.compute_time(flops, nbytes, torch.bfloat16) == pytest.approx(expected, rel=1e-12)


def test_roofline_memory_bound():
    c = Cluster.preset("dgx-h100")
    nbytes = 2 * GiB  # elementwise: read 1 GiB, write 1 GiB
    flops = GiB // 4
    expected = nbytes / (3.35e12 * 0.8) + 5e-6
    assert c.compute_time(flops, nbytes) == pytest.approx(expected, rel=1e-12)


def test_launch_floor_and_zero_work():
    c = Cluster.preset("dgx-h100")
    assert c.compute_time(0, 0) == 0.0
    assert c.compute_time(1, 4) == pytest.approx(5e-6, rel=1e-6)
    assert Cluster.local(2).compute_time(1, 0) == pytest.approx(10e-6, rel=1e-3)
    with pytest.raises(ValueError):
        c.compute_time(-1, 0)


def test_dtype_specific_peak():
    c = Cluster.preset("dgx-a100-40gb")
    assert c.peak_flops() == 19.5e12  # float32 is not tf32
    assert c.peak_flops(torch.float32) == 19.5e12
    assert c.peak_flops("tf32") == 156e12
    assert c.peak_flops(torch.bfloat16) == 312e12
    assert c.peak_flops(torch.float16) == 312e12
    assert c.peak_flops(torch.int64) == 19.5e12
    assert c.peak_flops(torch.float64) == 19.5e12  # missing key -> float32
    assert Cluster.local(2).peak_flops(torch.float64) == 25e9
    t32 = c.compute_time(1e12, 0, torch.float32)
    t16 = c.compute_time(1e12, 0, torch.bfloat16)
    assert t32 - 5e-6 == pytest.approx(16 * (t16 - 5e-6))


# --- presets, local -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["dgx-a100-40gb", "dgx-a100-80gb", "dgx-h100", "hgx-h200", "perlmutter", "cpu"])
def test_presets(name):
    c = Cluster.preset(name, nodes=3)
    _, intra, inter, gpus, _ = PRESETS[name]
    assert c.mesh_shape == (3, gpus)
    assert c.mesh_dim_names == ("node", "gpu")
    assert c.links == (inter, intra)
    assert c.world_size == 3 * gpus and c.ndim == 2
    assert c.memory_limit == pytest.approx(c.device.memory * 0.9)


def test_preset_figures():
    assert Cluster.preset("perlmutter").mesh_shape == (1, 4)
    assert Cluster.preset("cpu").mesh_shape == (1, 2)
    h200 = Cluster.preset("hgx-h200")
    assert h200.device.memory == 141e9 and h200.device.memory_bandwidth == 4.8e12
    assert h200.links[1].bandwidth == 450e9 and h200.links[0].bandwidth == 50e9
    assert Cluster.preset("dgx-a100-40gb").links[0].bandwidth == 25e9
    assert Cluster.preset("perlmutter").links[0].bandwidth == 25e9


def test_unknown_preset_lists_names():
    with pytest.raises(ClusterError, match="dgx-a100-40gb.*dgx-h100.*perlmutter"):
        Cluster.preset("tpu-v5")
    with pytest.raises(ClusterError, match="nodes"):
        Cluster.preset("dgx-h100", nodes=0)


def test_local_defaults():
    c = Cluster.local(4)
    assert c.mesh_shape == (4,) and c.mesh_dim_names == ("d0",) and c.world_size == 4
    assert c.device.name == "cpu" and c.device.memory == 24 * GiB / 4
    assert c.links[0].latency == 50e-6
    assert Cluster.local(4, (2, 2)).mesh_shape == (2, 2)
    with pytest.raises(ClusterError, match="multiply to 4"):
        Cluster.local(4, (3,))


def test_local_uses_calibration(monkeypatch, tmp_path):
    calib = Cluster((2,), device=DeviceSpec("measured", {"float32": 7e10}, 9e9, 5e9, compute_efficiency=1.0),
                    links=[LinkSpec("measured gloo", 4e-5, 2e9, 1.0)])
    path = tmp_path / "calib.json"
    path.write_text(calib.to_json())
    monkeypatch.setenv("AUTOSHARD_CALIBRATION", str(path))
    c = Cluster.local(4, (2, 2))
    # local processes never overlap collectives with compute, whatever was calibrated
    assert c.mesh_shape == (2, 2) and c.device == replace(calib.device, comm_overlap=0.0)
    assert c.links == (calib.links[0],) * 2
    # The default location works too.
    monkeypatch.delenv("AUTOSHARD_CALIBRATION")
    default = tmp_path / ".cache" / "autoshard" / "calibration.json"
    default.parent.mkdir(parents=True)
    default.write_text(calib.to_json())
    assert Cluster.local(2).device.name == "measured"
    default.write_text("{not json")
    with pytest.raises(ClusterError, match="calibration.json"):
        Cluster.local(2)


def test_local_missing_explicit_calibration(monkeypatch, tmp_path):
    monkeypatch.setenv("AUTOSHARD_CALIBRATION", str(tmp_path / "nope.json"))
    with pytest.raises(ClusterError, match="does not exist"):
        Cluster.local(2)


# --- JSON, identity -------------------------------------------------------------------------------
def test_json_round_trip_and_fingerprint():
    c = Cluster.preset("dgx-h100", nodes=2)
    text = c.to_json()
    assert json.loads(text)["schema"] == 1
    back = Cluster.from_json(text)
    assert back == c and back.to_json() == text and hash(back) == hash(c)
    assert c.fingerprint() == back.fingerprint() == Cluster.preset("dgx-h100", nodes=2).fingerprint()
    assert len(c.fingerprint()) == 16 and int(c.fingerprint(), 16) >= 0
    assert c.fingerprint() != Cluster.preset("dgx-h100", nodes=4).fingerprint()
    assert c != Cluster.preset("hgx-h200", nodes=2)
    assert "H100" in repr(c) and "(2, 8)" in repr(c)


def test_int_and_float_numbers_are_the_same_hardware():
    a = DeviceSpec("x", {"float32": 1e12}, 1e12, 40e9)
    b = DeviceSpec("x", {"float32": 10**12}, 10**12, 40 * 10**9)
    assert Cluster(2, device=a) == Cluster(2, device=b)


@pytest.mark.parametrize("text, match", [
    ("{not json", "corrupt"),
    ('{"schema": 2}', "schema"),
    ("[1, 2]", "schema"),
    ('{"schema": 1, "mesh_shape": [2]}', "missing"),
])
def test_corrupt_json(text, match):
    with pytest.raises(ClusterError, match=match):
        Cluster.from_json(text)


def test_with_mesh():
    c = Cluster.preset("dgx-a100-80gb", nodes=2)
    same = c.with_mesh((2, 8))
    assert same.links == c.links and same.mesh_dim_names == ("node", "gpu") and same.device == c.device
    nv, ib = c.links[1], c.links[0]
    # (16,) over 2 nodes of 8 spans NVLink x 8 then IB x 2: priced like the 2-D collective over both
    flat = c.with_mesh((16,), ("dp",))
    assert flat.levels == (((8, nv), (2, ib)),) and flat.mesh_dim_names == ("dp",)
    n = 2**30
    assert flat.collective_time("all_reduce", n, 0) == pytest.approx(c.collective_time("all_reduce", n, (0, 1)))
    # ... which is far cheaper than pricing all 16 ranks on the slow link alone
    assert flat.collective_time("all_reduce", n, 0) < 0.5 * Cluster((16,), device=c.device, links=[ib]).collective_time(
        "all_reduce", n, 0)
    # (4, 4): the inner dim is 4 GPUs of a node; the outer dim 2 GPUs x 2 nodes
    grid = c.with_mesh((4, 4))
    assert grid.levels == (((2, nv), (2, ib)), ((4, nv),))
    assert grid.links == (ib, nv)
    three = c.with_mesh((2, 2, 4))
    assert three.mesh_dim_names == ("d0", "d1", "d2") and three.levels == (((2, ib),), ((2, nv),), ((4, nv),))
    assert Cluster.from_json(grid.to_json()) == grid


# --- validation -------------------------------------------------------------------------------------
LINK = LinkSpec("l", 1e-6, 1e9)


@pytest.mark.parametrize("kwargs, match", [
    (dict(mesh_shape=()), "empty"),
    (dict(mesh_shape=(2, 0)), "positive int"),
    (dict(mesh_shape=(2, -1)), "positive int"),
    (dict(mesh_shape=(2.0,)), "positive int"),
    (dict(mesh_shape=(2, 2), mesh_dim_names=("a",)), "one name per dimension"),
    (dict(mesh_shape=(2, 2), mesh_dim_names=("a", "a")), "duplicates"),
    (dict(mesh_shape=(2, 2), links=[LINK]), "exactly one LinkSpec per mesh dimension"),
    (dict(mesh_shape=(2,), ranks_per_node=0), "ranks_per_node"),
])
def test_cluster_validation(kwargs, match):
    with pytest.raises(ClusterError, match=match):
        Cluster(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(peak_flops={"float32": 0.0}), "peak_flops"),
    (dict(peak_flops={"bfloat16": 1e12}), "'float32' entry"),
    (dict(peak_flops={"float32": 1e12, "bfloat16": -1}), "bfloat16"),
    (dict(memory_bandwidth=0), "memory_bandwidth"),
    (dict(memory=-5), "memory"),
    (dict(memory=float("nan")), "memory"),
    (dict(usable_fraction=0.0), "usable_fraction"),
    (dict(compute_efficiency=1.5), "compute_efficiency"),
    (dict(memory_efficiency=-0.1), "memory_efficiency"),
    (dict(launch_overhead=-1e-6), "launch_overhead"),
])
def test_device_validation(kwargs, match):
    args = dict(name="d", peak_flops={"float32": 1e12}, memory_bandwidth=1e12, memory=1e9) | kwargs
    with pytest.raises(ClusterError, match=match):
        DeviceSpec(**args)


@pytest.mark.parametrize("kwargs, match", [
    (dict(latency=-1e-6), "latency"),
    (dict(bandwidth=0), "bandwidth"),
    (dict(efficiency=0), "efficiency"),
    (dict(efficiency=1.01), "efficiency"),
])
def test_link_validation(kwargs, match):
    with pytest.raises(ClusterError, match=match):
        LinkSpec(**(dict(name="l", latency=1e-6, bandwidth=1e9) | kwargs))


def test_device_spec_is_frozen_and_hashable():
    flops = {"float32": 1e12}
    d = DeviceSpec("d", flops, 1e12, 1e9)
    flops["float32"] = 5.0  # the spec keeps its own copy
    assert d.flops(torch.float32) == 1e12
    with pytest.raises(AttributeError):
        d.memory = 2.0
    assert hash(d) == hash(DeviceSpec("d", {"float32": 1e12}, 1e12, 1e9))
