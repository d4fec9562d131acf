"""Baselines (autoshard.baselines) on small models: each hand strategy's plan obeys its definition
and the free plan (over the logical meshes of autoshard.planning.meshes) is no slower than any of them.
The candidate rule is in test_meshes.py, the textbook behaviour of the free plan in test_sanity.py."""

import re

import pytest
import torch

import autoshard
from autoshard import Cluster, Plan
from autoshard.planning.baselines import BASELINES, allow_for, compare, logical_meshes, plan_baseline
from autoshard.cluster import H100, IB_NDR, NVLINK4
from autoshard.errors import InfeasibleError
from autoshard.planning.meshes import candidates
from autoshard.solver.formulation import Storage
from autoshard.zoo import GPT, MLP, GPTConfig

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


def _weight_operands(plan: Plan, model) -> list[list[str]]:
    out = _operands(plan, -1)
    assert len(out) == len(model.layers), out   # one forward matmul per Linear
    return out


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
def test_auto_mesh_is_best_of_candidates(small):
    _, traced, cluster, plans = small
    free = plans["auto"]
    each = {str(s): autoshard.plan(traced, cluster.with_mesh(s, names), time_limit=60).step_time
            for s, names in candidates(cluster)}
    assert list(free.stats["meshes"]) == list(each)
    for shape, t in free.stats["meshes"].items():   # priced, or cut off as no faster than the kept plan
        assert t == pytest.approx(each[shape]) if t is not None else \
            free.stats["mesh_errors"][shape] == "slower" and each[shape] >= free.step_time * (1 - 1e-3)
    assert free.step_time == pytest.approx(min(each.values()))
    assert str(tuple(free.mesh_shape)) in each


# ---------------------------------------------------------------------------- baselines
def test_compare_names_and_free_plan_no_slower(small):
    _, traced, cluster, plans = small
    assert set(plans) == {"auto"} | {b + s for b in BASELINES for s in ("", "+recompute")}
    assert isinstance(plans["auto"], Plan)
    for name, p in plans.items():
        assert isinstance(p, (Plan, InfeasibleError)), name
        if isinstance(p, Plan):
            assert p.step_time >= plans["auto"].step_time * (1 - 1e-6), name
    for b in BASELINES:
        plain, full = plans[b], plans[b + "+recompute"]
        if b == "fsdp_ep":   # experts over a mesh dim: a dense model has none to split
            assert all(isinstance(p, InfeasibleError) and "mixture-of-experts" in str(p) for p in (plain, full))
            continue
        assert not any(n.recompute for n in plain.nodes)
        assert any(n.recompute for n in full.nodes)


@pytest.fixture(scope="module")
def layered():
    """A 2-layer GPT on the same node: per-layer recompute has values inside each layer to drop
    (the MLP's repeated layers are its lone GELUs, every value of which crosses a layer's
    boundary and stays saved)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=64, seq=16, hidden=32, heads=4, layers=2))
    traced = autoshard.trace(model, model.example_inputs(4, generator=torch.Generator().manual_seed(0)))
    return traced, _cluster(1, 4)


@pytest.mark.parametrize("baseline", [b for b in BASELINES if b != "fsdp_ep"])  # (a dense GPT)
def test_full_recompute_saves_less_than_the_same_plan_without(layered, baseline):
    """Recompute saves less for backward than the same strategies without it (the two baselines'
    plans may differ in strategies, and so in what a saved value weighs): the recompute plan's
    strategies and storage pinned, solved again without recompute."""
    traced, cluster = layered
    full = plan_baseline(traced, cluster, baseline + "+recompute", time_limit=60)
    assert any(n.recompute for n in full.nodes)
    picked = {n.name: n.strategy for n in full.nodes}
    stored = {node.name: "->" + full.storage[name] for name, node in traced.params}

    def pinned(node, s) -> bool:   # a Storage is named after its parameter's node
        want = stored[node.name] if isinstance(node, Storage) else picked.get(node.name)
        return want is None or str(s) == want
    same = autoshard.plan(traced, cluster.with_mesh(full.mesh_shape, full.mesh_dim_names), recompute=False,
                          allow=pinned, time_limit=60)
    assert [n.strategy for n in same.nodes] == [n.strategy for n in full.nodes]
    assert same.storage == full.storage
    assert not any(n.recompute for n in same.nodes)
    assert 0 < full.saved_for_backward < same.saved_for_backward


def test_baselines_follow_their_definitions(small):
    model, _, cluster, plans = small
    params = {n for n, _ in model.named_parameters()}
    mats = {n for n, p in model.named_parameters() if p.ndim >= 2}
    assert len(mats) == len(model.layers)
    for name in ("ddp", "fsdp", "hsdp", "megatron", "tp_fsdp", "axonn_4d"):   # each storage check sees every parameter
        assert set(plans[name].storage) == params, name

    ddp = plans["ddp"]
    assert set(ddp.storage.values()) == {"(R)"} and ddp.inputs == ["(S(0))"] * 2
    assert all(w == ["R"] for w in _weight_operands(ddp, model))

    fsdp = plans["fsdp"]
    assert all(_pl(pl)[0].startswith("S") for pl in fsdp.storage.values())
    assert all(w == ["R"] for w in _weight_operands(fsdp, model))

    hsdp = plans["hsdp"]                                   # (dp, fsdp): replicated across, sharded within
    assert tuple(hsdp.mesh_dim_names) == ("dp", "fsdp")
    assert all(_pl(pl)[0] == "R" and _pl(pl)[1].startswith("S") for pl in hsdp.storage.values())

    roles = set()
    for name in ("megatron", "tp_fsdp"):
        p = plans[name]
        tp = p.mesh_dim_names.index("tp")
        assert all(_pl(pl)[tp].startswith("S") for k, pl in p.storage.items() if k in mats)
        assert all(w[tp].startswith("S") for w in _weight_operands(p, model))
        if "dp" in p.mesh_dim_names:
            roles.add("dp")
            assert all(_pl(pl)[p.mesh_dim_names.index("dp")] == "R" for pl in p.storage.values())
        if "fsdp" in p.mesh_dim_names:
            roles.add("fsdp")
            assert all(_pl(pl)[p.mesh_dim_names.index("fsdp")].startswith("S") for k, pl in p.storage.items()
                       if k in mats)
    assert roles == {"dp", "fsdp"}, "a 2-D grid's outer role went unchecked"   # both keep a (2, 2) grid here

    axonn = plans["axonn_4d"]                              # weights as 2-D blocks over (y, x)
    assert tuple(axonn.mesh_dim_names) == ("y", "x")
    for w in _weight_operands(axonn, model):
        assert w[0].startswith("S") and w[1].startswith("S") and w[0] != w[1]


def test_best_grid_is_kept():
    torch.manual_seed(0)
    traced = autoshard.trace(MLP(), (torch.randn(64, 32), torch.randn(64, 16)))
    cluster = _cluster(1, 4)
    p = plan_baseline(traced, cluster, "megatron", time_limit=60)
    assert [shape for shape, _, _ in logical_meshes("megatron", cluster)] == [(2, 2), (4,)]
    assert set(p.stats["meshes"]) == {"dp=2,tp=2", "tp=4"}
    assert p.step_time == min(t for t in p.stats["meshes"].values() if t is not None)


def test_grid_two_baselines_share_is_solved_once(monkeypatch):
    """On one node megatron and tp_fsdp coincide at t = G: both are (tp,) on (G,), one problem."""
    import autoshard.api

    torch.manual_seed(0)
    traced = autoshard.trace(MLP(), (torch.randn(64, 32), torch.randn(64, 16)))
    cluster = _cluster(1, 4)
    alone = {b: plan_baseline(traced, cluster, b, time_limit=60) for b in ("megatron", "tp_fsdp")}
    solves, real = [], autoshard.api.plan
    monkeypatch.setattr(autoshard.api, "plan",
                        lambda *a, **k: solves.append(k.get("allow") is not None) or real(*a, **k))
    plans = compare(traced, cluster, baselines=["megatron", "tp_fsdp"], meshes=[(1, 4)], time_limit=60)
    grids = [g for b in ("megatron", "tp_fsdp") for g in logical_meshes(b, cluster)]
    assert len(grids) == 4 and len(set(grids)) == 3
    assert solves.count(True) == 3                     # baseline solves: the free plan's have no allow
    for b, p in alone.items():
        assert plans[b].step_time == p.step_time and plans[b].stats["meshes"] == p.stats["meshes"]
        assert plans[b].stats["baseline"] == b and plans[b].stats["mesh_errors"] == {}


def test_baseline_keeps_its_fastest_grid_and_cuts_off_slower_ones():
    """A baseline's later grids are solved with its best grid so far as cutoff: the kept plan is
    the fastest of the grids solved one by one in full, and a grid cut off is no faster."""
    torch.manual_seed(0)
    traced = autoshard.trace(MLP(), (torch.randn(64, 32), torch.randn(64, 16)))
    cluster = _cluster(2, 4)
    cut = 0
    for b in ("hsdp", "tp_fsdp", "axonn_4d"):
        best = plan_baseline(traced, cluster, b, time_limit=60)
        # the same problems as the baseline's own (no recompute unless "+recompute")
        full = {",".join(f"{n}={p}" for n, p in zip(names, shape)):
                autoshard.plan(traced, cluster.with_mesh(shape, names), allow=allow_for(traced, roles), time_limit=60,
                               recompute=False)
                for shape, names, roles in logical_meshes(b, cluster)}
        assert best.step_time == pytest.approx(min(p.step_time for p in full.values()), rel=1e-3), b
        for key, t in best.stats["meshes"].items():
            if t is None:
                assert best.stats["mesh_errors"][key] == "slower", (b, key)
                assert full[key].step_time >= best.step_time * (1 - 1e-3), (b, key)
                cut += 1
            else:
                assert t == pytest.approx(full[key].step_time, rel=1e-3), (b, key)
    assert cut, "no grid was cut off: the check above tested nothing"


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
    from autoshard.runtime.launch import run_local

    names = ["megatron", "fsdp+recompute"]
    for res in run_local(baseline_job, 2, names, timeout=600):
        for name in names:
            r = res[name]
            assert r["mesh"] == (2,), (name, r)          # a logical mesh: the cluster's own is (1, 2)
            assert r["err"] < 1e-5, (name, r)
        assert any(pl == "(S(0))" for pl in res["megatron"]["storage"].values())


def test_free_plan_no_slower_than_baselines_on_two_nodes():
    """2 nodes of 4: the baselines' grids include 3-D ones (AxoNN's (z, y, x) = (2, 2, 2)), which
    the free plan reaches through the pruned 3-D candidates of autoshard.planning.meshes."""
    torch.manual_seed(0)
    traced = autoshard.trace(MLP(), (torch.randn(64, 32), torch.randn(64, 16)))
    plans = compare(traced, _cluster(2, 4), baselines=["hsdp", "megatron", "tp_fsdp", "axonn_4d"], time_limit=60)
    assert isinstance(plans["auto"], Plan)
    assert "(2, 2, 2)" in plans["auto"].stats["meshes"]
    feasible = {k: p for k, p in plans.items() if k != "auto" and isinstance(p, Plan)}
    assert feasible
    for name, p in feasible.items():
        assert plans["auto"].step_time <= p.step_time * (1 + 1e-6), name
