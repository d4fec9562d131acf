"""Baselines (autoshard.baselines) and logical meshes (autoshard.meshes) on small models: each hand
strategy's plan obeys its definition, the free plan is no slower than any of them, and the free
plan shows the textbook behaviour (data parallel on a large batch, tensor parallel inside a node on
a tiny batch, sharded storage when replicated state does not fit)."""

import math
import re

import pytest
import torch

import autoshard
from autoshard import Cluster, Plan
from autoshard.baselines import BASELINES, compare, logical_meshes, plan_baseline
from autoshard.cluster import H100, IB_NDR, NVLINK4
from autoshard.errors import InfeasibleError
from autoshard.meshes import candidates
from autoshard.zoo import MLP

pytestmark = pytest.mark.filterwarnings("ignore:autoshard.*planned replicated")
_ITEM = re.compile(r"R|P|S\((\d+)\)")
_GROUP = re.compile(r"\((?:[^()]|\(\d+\))*\)")  # one tensor's placements, e.g. (S(0),R)


def _pl(text: str) -> list[str]:
    """'(S(0),R)' -> ['S(0)', 'R']"""
    assert text[0] == "(" and text[-1] == ")", text
    items = text[1:-1].split(",")
    assert all(_ITEM.fullmatch(i) for i in items), text
    return items


def _operands(plan: Plan, k: int) -> list[list[str]]:
    """Placements of input ``k`` of every forward matmul (-1: the weight, -2: the activation)."""
    out = []
    for n in plan.nodes:
        if n.phase == "fwd" and n.op.endswith(("aten.mm.default", "aten.addmm.default")):
            out.append(_pl(_GROUP.findall(n.strategy.split("->")[0])[k]))
    return out


def _weight_operands(plan: Plan) -> list[list[str]]:
    return _operands(plan, -1)


def _cluster(nodes: int, gpus: int) -> Cluster:
    return Cluster((nodes, gpus), ("node", "gpu"), H100, [IB_NDR, NVLINK4], ranks_per_node=gpus)


@pytest.fixture(scope="module")
def small():
    """MLP on one 4-GPU node: every baseline has a grid there (AxoNN's is 2 x 2)."""
    torch.manual_seed(0)
    model = MLP()
    inputs = (torch.randn(64, 32), torch.randn(64, 16))
    traced = autoshard.trace(model, inputs)
    cluster = _cluster(1, 4)
    return model, traced, cluster, compare(traced, cluster, time_limit=60)


# ---------------------------------------------------------------------------- logical meshes
def test_candidates_rule():
    def expected(w, g):  # the documented rule, written out independently
        grids = [(w // g, g), (w,)] + [(w // k, k) for k in range(2, w) if w % k == 0 and (g % k == 0 or k % g == 0)]
        seen, out = set(), []
        for s in grids:
            key = tuple(p for p in s if p > 1)
            if key not in seen:
                seen.add(key)
                out.append(s)
        return out

    for nodes, gpus in ((1, 8), (4, 8), (16, 4), (2, 2)):
        got = [shape for shape, _ in candidates(_cluster(nodes, gpus))]
        assert got == expected(nodes * gpus, gpus)
        assert len(got) <= 7 and all(math.prod(s) == nodes * gpus for s in got)


def test_logical_dims_priced_by_links_they_span():
    c = _cluster(2, 8)
    ring = lambda n, p, link: 2 * (p - 1) / p * n / link.effective_bandwidth + 2 * (p - 1) * link.latency  # noqa: E731
    n = 2.0**28
    inside = c.with_mesh((4, 4), ("outer", "inner"))        # inner 4: GPUs of one node
    assert inside.collective_time("all_reduce", n, "inner") == pytest.approx(ring(n, 4, NVLINK4))
    # outer 4 spans 2 GPUs x 2 nodes: slower than NVLink alone, faster than the network alone
    outer = inside.collective_time("all_reduce", n, "outer")
    assert ring(n, 4, NVLINK4) < outer < ring(n, 4, IB_NDR)


def test_auto_mesh_is_best_of_candidates(small):
    _, traced, cluster, plans = small
    free = plans["auto"]
    each = {str(s): autoshard.plan(traced, cluster.with_mesh(s, names), time_limit=60).step_time
            for s, names in candidates(cluster)}
    assert free.stats["meshes"] == pytest.approx(each)
    assert free.step_time == pytest.approx(min(each.values()))
    assert str(tuple(free.mesh_shape)) in each


# ---------------------------------------------------------------------------- baselines
def test_compare_names_and_free_plan_no_slower(small):
    _, _, _, plans = small
    assert set(plans) == {"auto"} | {b + s for b in BASELINES for s in ("", "+recompute")}
    assert isinstance(plans["auto"], Plan)
    for name, p in plans.items():
        assert isinstance(p, (Plan, InfeasibleError)), name
        if isinstance(p, Plan):
            assert p.step_time >= plans["auto"].step_time * (1 - 1e-6), name
    for b in BASELINES:
        plain, full = plans[b], plans[b + "+recompute"]
        assert not any(n.recompute for n in plain.nodes)
        assert any(n.recompute for n in full.nodes)
        assert full.memory["activations"] <= plain.memory["activations"]


def test_baselines_follow_their_definitions(small):
    model, _, cluster, plans = small
    mats = {n for n, p in model.named_parameters() if p.ndim >= 2}

    ddp = plans["ddp"]
    assert set(ddp.storage.values()) == {"(R)"} and ddp.inputs == ["(S(0))"] * 2
    assert all(w == ["R"] for w in _weight_operands(ddp))

    fsdp = plans["fsdp"]
    assert all(_pl(pl)[0].startswith("S") for pl in fsdp.storage.values())
    assert all(w == ["R"] for w in _weight_operands(fsdp))

    hsdp = plans["hsdp"]                                   # (dp, fsdp): replicated across, sharded within
    assert tuple(hsdp.mesh_dim_names) == ("dp", "fsdp")
    assert all(_pl(pl)[0] == "R" and _pl(pl)[1].startswith("S") for pl in hsdp.storage.values())

    for name in ("megatron", "tp_fsdp"):
        p = plans[name]
        tp = p.mesh_dim_names.index("tp")
        assert all(_pl(pl)[tp].startswith("S") for k, pl in p.storage.items() if k in mats)
        assert all(w[tp].startswith("S") for w in _weight_operands(p))
        if "dp" in p.mesh_dim_names:
            assert all(_pl(pl)[p.mesh_dim_names.index("dp")] == "R" for pl in p.storage.values())
        if "fsdp" in p.mesh_dim_names:
            assert all(_pl(pl)[p.mesh_dim_names.index("fsdp")].startswith("S") for k, pl in p.storage.items()
                       if k in mats)

    axonn = plans["axonn_4d"]                              # weights as 2-D blocks over (y, x)
    assert tuple(axonn.mesh_dim_names) == ("y", "x")
    for w in _weight_operands(axonn):
        assert w[0].startswith("S") and w[1].startswith("S") and w[0] != w[1]


def test_best_grid_is_kept():
    torch.manual_seed(0)
    traced = autoshard.trace(MLP(), (torch.randn(64, 32), torch.randn(64, 16)))
    cluster = _cluster(1, 4)
    p = plan_baseline(traced, cluster, "megatron", time_limit=60)
    assert [shape for shape, _, _ in logical_meshes("megatron", cluster)] == [(2, 2), (4,)]
    assert set(p.stats["meshes"]) == {"dp=2,tp=2", "tp=4"}
    assert p.step_time == min(t for t in p.stats["meshes"].values() if t is not None)


def test_infeasible_baseline_is_reported_not_dropped():
    torch.manual_seed(0)
    model = MLP((256, 1024, 1024, 256))
    traced = autoshard.trace(model, (torch.randn(64, 256), torch.randn(64, 256)))
    cluster = _cluster(1, 4)
    state = 16 * sum(p.numel() for p in model.parameters())  # fp32 params + grads + Adam moments
    plans = compare(traced, cluster, memory_limit=0.5 * state, baselines=["ddp", "fsdp"], meshes=[(1, 4)],
                    time_limit=60)
    assert isinstance(plans["ddp"], InfeasibleError) and plans["ddp"].min_memory > 0.5 * state
    assert isinstance(plans["fsdp"], Plan) and isinstance(plans["auto"], Plan)
    assert plans["auto"].step_time <= plans["fsdp"].step_time * (1 + 1e-6)


def test_unknown_baseline_is_a_typed_error():
    with pytest.raises(autoshard.errors.ConstraintError, match="unknown baseline"):
        plan_baseline(None, _cluster(1, 4), "zero7")


# ---------------------------------------------------------------------------- known behaviour
def _meta_mlp(dims, batch):
    with torch.device("meta"):
        model = MLP(dims)
    inputs = (torch.empty(batch, dims[0], device="meta"), torch.empty(batch, dims[-1], device="meta"))
    return model, autoshard.trace(model, inputs)


def test_large_batch_one_node_is_data_parallel():
    _, traced = _meta_mlp((1024, 1024, 1024, 1024), 65536)
    p = autoshard.plan(traced, _cluster(1, 8))
    assert all(set(w) == {"R"} for w in _weight_operands(p))     # every rank computes with whole weights
    assert all(x == ["R", "S(0)"] for x in _operands(p, -2))     # on its share of the batch


def test_tiny_batch_big_model_uses_tensor_parallelism_in_node():
    _, traced = _meta_mlp((8192, 32768, 32768, 8192), 8)
    p = autoshard.plan(traced, _cluster(1, 8))
    assert all(w[1].startswith("S") for w in _weight_operands(p))  # weights split over the node's GPUs


def test_tensor_parallel_all_reduce_stays_inside_nodes():
    # 2 nodes of 4 GPUs; on the logical (4, 2) a degree-2 partial sum can ride NVLink
    _, traced = _meta_mlp((4096, 16384, 16384, 4096), 64)
    cluster = _cluster(2, 4)
    p = autoshard.plan(traced, cluster, memory_limit=80e9, meshes=[(2, 4), (4, 2)])
    logical = Cluster.from_json(p.cluster)
    reduced = {n.name: [c["mesh_dim"] for c in n.comm if c["kind"] == "all_reduce" and c.get("role", "input") == "input"]
               for n in p.nodes}  # activation all-reduces (tensor parallel), not gradient reductions
    reduced = {k: v for k, v in reduced.items() if v}
    assert reduced, "expected tensor parallelism on this batch"
    for name, dims in reduced.items():
        if math.prod(logical.mesh_shape[d] for d in dims) <= cluster.ranks_per_node:  # fits in a node
            links = {link.name for d in dims for _, link in logical.levels[d]}
            assert links == {NVLINK4.name}, (name, p.mesh_shape, dims)


def test_storage_sharded_when_replicated_state_does_not_fit():
    model, traced = _meta_mlp((4096, 4096, 4096, 4096), 64)
    state = 16 * sum(p.numel() for p in model.parameters())
    free = autoshard.plan(traced, _cluster(1, 8))
    tight = autoshard.plan(traced, _cluster(1, 8), memory_limit=0.5 * state)
    assert tight.peak_memory <= 0.5 * state
    assert any("S" in pl for pl in tight.storage.values())
    assert tight.memory["params"] + tight.memory["grads"] + tight.memory["optimizer"] < state
    assert free.step_time <= tight.step_time


# ---------------------------------------------------------------------------- running a baseline
def baseline_job(names: list[str]) -> dict:
    """On each rank: plan each baseline on rank 0, compile it, run one step; the deviation of loss
    and gradients from the single-device step."""
    import copy

    import torch.distributed as dist

    torch.manual_seed(0)
    model = MLP()
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randn(8, 32, generator=g), torch.randn(8, 16, generator=g))
    world = dist.get_world_size()
    cluster = Cluster.local(world, (1, world))
    out = {}
    for name in names:
        box = [plan_baseline(model, cluster, name, inputs).to_json() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        plan = Plan.from_json(box[0])
        ref = copy.deepcopy(model)
        dm = autoshard.compile(copy.deepcopy(model), cluster, inputs, plan=plan)
        loss = dm(*dm.shard_inputs(*inputs))
        loss.backward()
        ref_loss = ref(*inputs)
        ref_loss.backward()
        err = (loss.detach() - ref_loss.detach()).abs().item()
        for pname, p in dm.named_parameters():
            err = max(err, (p.grad.full_tensor() - ref.get_parameter(pname).grad).abs().max().item())
        out[name] = {"mesh": tuple(dm.plan.mesh_shape), "err": err, "storage": dict(plan.storage)}
    return out


@pytest.mark.world(2)
def test_baseline_plans_on_logical_meshes_run():
    from autoshard.launch import run_local

    names = ["megatron", "fsdp+recompute"]
    for res in run_local(baseline_job, 2, names, timeout=600):
        for name in names:
            r = res[name]
            assert r["mesh"] == (2,), (name, r)          # a logical mesh: the cluster's own is (1, 2)
            assert r["err"] < 1e-5, (name, r)
        assert any(pl == "(S(0))" for pl in res["megatron"]["storage"].values())


def test_bad_logical_mesh_is_a_typed_error(small):
    _, traced, cluster, _ = small
    with pytest.raises(autoshard.errors.ClusterError, match="multiply to 4"):
        autoshard.plan(traced, cluster, meshes=[(3, 2)])
