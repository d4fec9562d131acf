"""Logical meshes (autoshard.planning.meshes): the documented candidate rule, link pricing of logical dims,
the pruned 3-D candidates (data parallel outside, free inside) and planning over all of them."""

import math
import re

import pytest
import torch

import autoshard
from autoshard import Cluster
from autoshard.cluster import H100, IB_NDR, NVLINK4
from autoshard.planning.meshes import DATA_NAMES, allow_data_outer, candidates
from autoshard.zoo import MLP

pytestmark = pytest.mark.filterwarnings("ignore:autoshard.*planned replicated")
_PLACEMENT = re.compile(r"R|P\(\w+\)|P|S\(\d+\)")  # e.g. S(0)


def _cluster(nodes: int, gpus: int) -> Cluster:
    return Cluster((nodes, gpus), ("node", "gpu"), H100, [IB_NDR, NVLINK4], ranks_per_node=gpus)


def _expected(nodes: int, gpus: int) -> list[tuple[int, ...]]:
    """The rule of meshes.py's docstring, written out independently."""
    w = nodes * gpus
    grids = [(nodes, gpus), (w,)] + [(w // k, k) for k in range(2, w) if w % k == 0 and (gpus % k == 0 or k % gpus == 0)]
    if nodes > 1 and gpus >= 4:
        grids += [(nodes, gpus // 2, 2), (nodes, 2, gpus // 2)]
        if nodes >= 4 and nodes % 2 == 0:
            grids.append((nodes // 2, 2, gpus))
    if nodes == 1 and gpus % 8 == 0:   # AxoNN's single-node grid: z = 2, y * x = gpus / 2, x >= y
        y = max(d for d in range(1, gpus) if (gpus // 2) % d == 0 and d * d <= gpus // 2)
        grids.append((2, y, gpus // 2 // y))
    seen, out = set(), []
    for s in grids:
        key = tuple(p for p in s if p > 1)
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


@pytest.mark.parametrize("nodes,gpus", [(1, 8), (1, 16), (4, 8), (8, 8), (16, 4), (2, 2), (2, 4)])
def test_candidates_rule(nodes, gpus):
    got = candidates(_cluster(nodes, gpus))
    assert [shape for shape, _ in got] == _expected(nodes, gpus)
    assert len(got) <= 10 and all(math.prod(s) == nodes * gpus for s, _ in got)
    # only the 3-D grids are pruned (named "data", ...), so a 2-D plan keeps its full freedom
    assert all((names == DATA_NAMES) == (len(shape) == 3) for shape, names in got)


def test_axonn_style_grid_is_a_candidate_on_eight_nodes():
    assert (4, 2, 8) in [shape for shape, _ in candidates(_cluster(8, 8))]


def test_every_axonn_baseline_grid_is_a_candidate_on_one_node():
    # the free plan's space holds each hand-written grid: AxoNN's (1, z, y, x) is (z, y, x)
    from autoshard.planning.baselines import BASELINES

    for gpus in (8, 16):
        got = [shape for shape, _ in candidates(_cluster(1, gpus))]
        for grid in BASELINES["axonn_4d"].grids(_cluster(1, gpus)):
            squeezed = tuple(p for p in grid if p > 1)
            assert any(tuple(p for p in s if p > 1) == squeezed for s in got), (grid, got)


def test_logical_dims_priced_by_links_they_span():
    c = _cluster(2, 8)
    ring = lambda n, p, link: 2 * (p - 1) / p * n / link.effective_bandwidth + 2 * (p - 1) * link.latency  # noqa: E731
    n = 2.0**28
    inside = c.with_mesh((4, 4), ("outer", "inner"))        # inner 4: GPUs of one node
    assert inside.collective_time("all_reduce", n, "inner") == pytest.approx(ring(n, 4, NVLINK4))
    # outer 4 spans 2 GPUs x 2 nodes: slower than NVLink alone, faster than the network alone
    outer = inside.collective_time("all_reduce", n, "outer")
    assert ring(n, 4, NVLINK4) < outer < ring(n, 4, IB_NDR)
    # a 3-D grid (2, 4, 2) over 2 nodes of 8: the outer dim is exactly the network
    grid = c.with_mesh((2, 4, 2), DATA_NAMES)
    assert grid.collective_time("all_reduce", n, "data") == pytest.approx(ring(n, 2, IB_NDR))
    assert grid.collective_time("all_reduce", n, "inner") == pytest.approx(ring(n, 2, NVLINK4))


@pytest.fixture(scope="module")
def mlp():
    torch.manual_seed(0)
    model = MLP()
    inputs = (torch.randn(64, 32), torch.randn(64, 16))
    return model, autoshard.trace(model, inputs)


@pytest.fixture(scope="module")
def pruned(mlp):
    """The MLP on the pruned 3-D candidate of 2 nodes of 4, (2, 2, 2)."""
    _, traced = mlp
    grid = _cluster(2, 4).with_mesh((2, 2, 2), DATA_NAMES)
    return autoshard.plan(traced, grid, allow=allow_data_outer(traced, None), time_limit=60)


def test_pruned_grid_is_data_parallel_on_its_outer_dim(pruned):
    p = pruned
    assert all(_PLACEMENT.findall(pl)[0] == "S(0)" for pl in p.inputs)    # the batch, split over the data dim
    matmuls = [n for n in p.nodes if n.phase == "fwd" and n.op.endswith(("aten.mm.default", "aten.addmm.default"))]
    assert matmuls
    for n in matmuls:
        weight, x = n.strategy.split("->")[0].split("),(")[::-1][:2]
        assert _PLACEMENT.findall(weight)[0] == "R", n.strategy            # whole weights on the data dim
        assert _PLACEMENT.findall(x)[0] in ("R", "S(0)"), n.strategy       # activations split by batch only


def test_auto_plans_every_candidate_and_keeps_the_fastest(mlp, pruned):
    _, traced = mlp
    cluster = _cluster(2, 4)
    free = autoshard.plan(traced, cluster, meshes="auto", time_limit=60)
    shapes = [str(s) for s, _ in candidates(cluster)]
    assert list(free.stats["meshes"]) == shapes and "(2, 2, 2)" in shapes
    assert free.step_time == pytest.approx(min(t for t in free.stats["meshes"].values() if t is not None))
    # each grid planned on its own, in full: the kept plan is the fastest of them (within the
    # solve's 0.1% gap); a grid the cutoff dropped ("slower") is no faster than the kept plan
    alone = {str(s): autoshard.plan(traced, cluster.with_mesh(s, n), time_limit=60,
                                    allow=allow_data_outer(traced, None) if n == DATA_NAMES else None)
             for s, n in candidates(cluster)}
    assert alone["(2, 2, 2)"].step_time == pytest.approx(pruned.step_time)
    assert free.step_time <= min(p.step_time for p in alone.values()) * (1 + 1e-3)
    for shape, t in free.stats["meshes"].items():
        if t is None:
            assert free.stats["mesh_errors"][shape] == "slower"
            assert alone[shape].step_time >= free.step_time * (1 - 1e-3)
        else:
            assert t == pytest.approx(alone[shape].step_time, rel=1e-3)
    assert set(free.stats["mesh_errors"]) == {k for k, v in free.stats["meshes"].items() if v is None}


def test_cutoff_stops_a_plan_that_cannot_beat_it(mlp):
    _, traced = mlp
    cluster = _cluster(2, 4)
    best = autoshard.plan(traced, cluster, time_limit=60)
    # proven infeasible under a cutoff 1% below the optimum; the same plan above it
    with pytest.raises(autoshard.errors.CutoffError, match="no plan predicts a step under"):
        autoshard.plan(traced, cluster, time_limit=60, cutoff=best.solver["objective"] * 0.99)
    again = autoshard.plan(traced, cluster, time_limit=60, cutoff=best.solver["objective"] * 1.01)
    assert again.step_time == pytest.approx(best.step_time, rel=1e-3)
    with pytest.raises(autoshard.errors.CutoffError):   # no mesh of "auto" beats it either
        autoshard.plan(traced, cluster, meshes="auto-2d", time_limit=60, cutoff=best.step_time * 0.5)


def test_failure_names_why_a_mesh_has_no_plan():
    from autoshard.errors import ConstraintError, CutoffError, InfeasibleError, SolverError
    from autoshard.planning.meshes import failure

    assert failure(SolverError("HIGHS found no plan within 120s")) == "time_limit"
    assert failure(CutoffError("no plan predicts a step under 1 s")) == "slower"
    assert failure(InfeasibleError("no plan fits", min_memory=1.0)) == "infeasible"
    assert failure(ConstraintError("batch 3 over 2")) == "constraint"


def test_auto_2d_skips_only_the_3d_candidates(mlp):
    _, traced = mlp
    cluster = _cluster(2, 4)
    p = autoshard.plan(traced, cluster, meshes="auto-2d", time_limit=60)
    assert list(p.stats["meshes"]) == [str(s) for s, _ in candidates(cluster) if len(s) < 3]


def test_bad_logical_mesh_is_a_typed_error(mlp):
    _, traced = mlp
    with pytest.raises(autoshard.errors.ClusterError, match="multiply to 8"):
        autoshard.plan(traced, _cluster(2, 4), meshes=[(3, 2)])
    with pytest.raises(autoshard.errors.ClusterError, match="auto-2d"):
        autoshard.plan(traced, _cluster(2, 4), meshes="every")
