"""Expert parallelism (passes/rules/experts.py): MoE regions whose experts split over a mesh dim.

Numerics on real gloo processes against the single-device step (tests/expert_cases.py), with
routing even and skewed on purpose: transformers' Mixtral and DeepSeek-V3 in bfloat16, a
torchtitan-style MoE in float32 at 1e-5, and a receive buffer sized by a capacity, exactly
enough and one row short; the placements, strategies, prices and buffer sizes against hand
counts; the ILP's tie; and an edited plan that mixes the two ways is refused.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

import autoshard
import expert_cases as ec
from autoshard.cluster import costmodel
from autoshard.errors import PlanMismatchError
from autoshard.passes.graph import META_KEY
from autoshard.passes.regions import META_KEY as REGION_KEY, ep_dim, ep_member, find_regions, split_dims
from autoshard.passes.rules import experts
from autoshard.passes.strategies import find_strategies
from autoshard.runtime.launch import run_local
from zoo_cases import sharding_cluster

aten = torch.ops.aten
BF16_STEP = 2 ** -8


def _assert_close(r: dict) -> None:
    """bf16 (torch traces grouped GEMMs in bfloat16 only): the bounds of the token-local Mixtral
    test (tests/test_zoo.py), scaled by this model's largest gradient. A wrong exchange errs by
    far more: received rows left in (source, expert) order instead of expert-major gave a
    gradient error of 1.6e-2 under even routing, 9x the bound (1.8e-3); the measured error is
    2.4e-4."""
    assert "error" not in r, r.get("error")
    assert r["loss"] <= 2 * 2 ** -5 and r["grad"] <= 4 * BF16_STEP * r["grad_scale"] and r["param"] < 1e-2, r


CASES_2 = {"even-capacity": ((2,), 0, "even", "mixtral", "exact"), "skewed": ((2,), 0, "skewed"),
           "deepseek_v3-even": ((2,), 0, "even", "deepseek_v3"),
           "titan_fp32-even": ((2,), 0, "even", "titan"), "titan_fp32-skewed": ((2,), 0, "skewed", "titan"),
           "even-capacity-short": ((2,), 0, "even", "mixtral", "short")}
CASES_4 = {"ep4-skewed": ((4,), 0, "skewed"), "data_x_ep-skewed": ((2, 2), 1, "skewed"),
           "data_x_ep-even": ((2, 2), 1, "even"), "titan_fp32-ep4-even": ((4,), 0, "even", "titan"),
           "titan_fp32-ep4-skewed": ((4,), 0, "skewed", "titan"),
           "titan_fp32-data_x_ep-even": ((2, 2), 1, "even", "titan"),
           "titan_fp32-data_x_ep-skewed": ((2, 2), 1, "skewed", "titan")}
FP32 = 1e-5   # float32 cases: the bound on loss, every gradient and every parameter


@pytest.fixture(scope="module")
def results_2():
    return run_local(ec.run_cases, 2, CASES_2, timeout=600)


@pytest.fixture(scope="module")
def results_4():
    return run_local(ec.run_cases, 4, CASES_4, timeout=900)


def _check(results, name):
    if name.endswith("short"):
        return _check_overflow(results, name)
    for rank, res in enumerate(results):
        r = res[name]
        if name.startswith("titan_fp32"):
            assert "error" not in r and max(r["loss"], r["grad"], r["param"]) <= FP32, r
        else:
            _assert_close(r)
        if r["capacity"] is not None:
            # a buffer smaller than every rank's rows, and every expert-parallel op planned with it
            assert r["capacity"] < 2 and r["ep_variants"] == [f"ep0@{r['capacity']!r}"], r
        # every member of both MoE layers ran expert-parallel, and each layer exchanged its rows:
        # forward, the hidden states and routing weights out and the output back; backward, the
        # output's gradient out and the two input gradients back (DeepSeek-V3's first layer is dense)
        assert r["ep_nodes"] > 0 and r["exchanges"] == {"fwd": 6, "bwd": 6}, (rank, r)
        if name.endswith("skewed"):
            # every token's first choice is expert 0: it receives half the routed rows (top-2)
            assert r["loads"][0] == pytest.approx(0.5), r["loads"]
        elif r["loads"] is not None:
            assert max(r["loads"]) < 0.4, r["loads"]


def _check_overflow(results, name):
    """A buffer one row short of the busiest rank's rows (from the single-device routing): the
    first layer whose busiest rank receives more than it holds raises CapacityError, on every
    rank alike, naming that rank and its rows."""
    from autoshard.passes.regions import received_rows

    messages = set()
    for res in results:
        r = res[name]
        assert r["raised"] == "CapacityError", r
        own = sum(r["received"][0]) // 2
        buffer = received_rows(own, 2, r["capacity"])
        layer = next(layer for layer in r["received"] if max(layer) > buffer)
        busiest = layer.index(max(layer))
        assert f"rank {busiest} of 2 received {max(layer)} routed rows, over its buffer of {buffer}" in r["message"], r
        # the capacity it names suffices for this step's routing
        need = float(re.search(r"needed moe_capacity >= ([0-9]+(?:\.[0-9]+)?)\. Plan", r["message"]).group(1))
        assert received_rows(own, 2, need) >= max(max(layer) for layer in r["received"]), (need, r)
        messages.add(r["message"])
    assert len(messages) == 1, messages


@pytest.mark.world(2)
@pytest.mark.parametrize("name", list(CASES_2))
def test_expert_parallel_trains_like_one_device_on_2_ranks(results_2, name):
    _check(results_2, name)


@pytest.mark.world(4)
@pytest.mark.parametrize("name", list(CASES_4))
def test_expert_parallel_trains_like_one_device_on_4_ranks(results_4, name):
    _check(results_4, name)


# --- in process -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def traced():
    model, inputs = ec.model_and_inputs()
    t = autoshard.trace(model, inputs)
    find_regions(t.gm)
    return t


def _calls(traced, target):
    return traced.gm.graph.find_nodes(op="call_function", target=target)


def test_placements_on_an_expert_parallel_dim(traced):
    """By hand, per layer: the expert weights (forward and input-gradient GEMMs) split by expert,
    the weight gradients whole per expert; the rows the experts compute are received rows (held
    whole, as replicated); the gathers into expert order send, the ones back to token order
    receive; the expert ids stay the rank's own."""
    for mm in _calls(traced, aten._grouped_mm.default):
        fact = mm.meta[REGION_KEY]
        assert fact.experts == ec.EXPERTS
        if fact.outputs == (Partial(),):
            assert fact.ep_outputs == (Shard(0),) and fact.ep_inputs == (Replicate(), Replicate(), Replicate())
        else:
            assert fact.ep_outputs == (Replicate(),) and fact.ep_inputs == (Replicate(), Shard(0), Replicate())
    sends = [n for n in _calls(traced, aten.index.Tensor) + _calls(traced, aten.index_put.default)
             if REGION_KEY in n.meta and n.meta[REGION_KEY].ep_outputs[0] == Replicate()]
    backs = [n for n in _calls(traced, aten.index.Tensor) + _calls(traced, aten.index_put.default)
             if REGION_KEY in n.meta and Replicate() in n.meta[REGION_KEY].ep_inputs]
    # per layer: hidden states and routing weights gathered, the output's gradient scattered in;
    # the output gathered back, the two input gradients scattered back
    assert len(sends) == 2 * 3 and len(backs) == 2 * 3
    (histc, *_) = _calls(traced, aten.histc.default)
    assert histc.meta[REGION_KEY].ep_inputs == (Shard(0),) and ep_member(histc)
    for sort in _calls(traced, aten.sort.default):
        fact = sort.meta[REGION_KEY]
        assert (fact.ep_outputs, fact.ep_inputs) == (fact.outputs, fact.inputs) and not ep_member(sort)


def test_strategies_only_where_the_experts_divide(traced):
    """4 experts: a dim of 2 or 4 ranks may hold them, one of 8 may not; on a (2, 2) mesh each dim
    may, with the tokens split on the other dim too or not."""
    for shape, dims in (((2,), {0}), ((4,), {0}), ((8,), set()), ((2, 2), {0, 1})):
        find_strategies(traced.gm, autoshard._torch.planning_mesh(shape, tuple(f"d{i}" for i in range(len(shape)))))
        (mm, *_) = _calls(traced, aten._grouped_mm.default)
        got = {ep_dim(s) for s in mm.meta[META_KEY].strategies} - {None}
        assert got == dims, (shape, got)
        if shape == (2, 2):
            texts = {s.text for s in mm.meta[META_KEY].strategies if ep_dim(s) == 1}
            assert texts == {"(R,R),(R,S(0)),(R,R)->(R,R) ep1", "(S(0),R),(R,S(0)),(R,R)->(S(0),R) ep1"}, texts
            for s in mm.meta[META_KEY].strategies:
                if ep_dim(s) is not None:
                    assert split_dims(mm.meta[REGION_KEY], s) >= {ep_dim(s)}


def test_exchange_priced_by_hand(traced):
    """The gather of the hidden states into expert order on 2 ranks: the counts' all-gather and
    the host sync, then the rank's own rows (half the routed rows, bf16) by all-to-all, the
    busiest receiver taking ``imbalance`` times its share."""
    cluster = sharding_cluster((2,))
    find_strategies(traced.gm, autoshard._torch.planning_mesh((2,), ("d0",)))
    send = next(n for n in _calls(traced, aten.index.Tensor)
                if REGION_KEY in n.meta and n.meta[REGION_KEY].ep_outputs[0] == Replicate()
                and n.meta["val"].ndim == 2)
    s = next(s for s in send.meta[META_KEY].strategies if ep_dim(s) == 0)
    rows, hidden = send.meta["val"].shape
    counts = cluster.collective_time("all_gather", 2 * ec.EXPERTS * 8, 0) + experts.HOST_SYNC_S
    own = rows // 2 * hidden * 2
    assert experts.exchange_time(cluster, send, s, 0.0) == pytest.approx(
        counts + cluster.collective_time("all_to_all", own, 0))
    skewed = type(s)(s.outputs, s.inputs, s.shards, 2.0, s.variant)
    assert experts.exchange_time(cluster, send, skewed, 0.0) == pytest.approx(
        counts + cluster.collective_time("all_to_all", 2 * own, 0))
    # and the op's price includes it
    assert costmodel.compute_time(cluster, send, s) >= counts


def test_a_plan_mixing_the_two_ways_is_refused(traced):
    """An edited plan in which one member of an expert-parallel region runs token-local would
    multiply received rows by the whole expert stack: compile refuses it, naming both nodes."""
    from autoshard.build import choice_from_plan

    plan = autoshard.plan(traced, sharding_cluster((2,)), allow=ec.pinned(0), share_layers=False)
    choice_from_plan(traced, plan)
    mm = next(n for n in plan.nodes if n.name == "_grouped_mm")
    assert mm.strategy.endswith(" ep0"), mm.strategy
    mm.strategy = "(S(0)),(R),(R)->(S(0))"
    with pytest.raises(PlanMismatchError, match=r"expert-parallel on mesh dim 0, _grouped_mm on None"):
        choice_from_plan(traced, plan)


def test_the_tie_keeps_a_region_one_way(traced):
    """Pinning one GEMM expert-parallel makes its whole region so, where the free plan keeps it
    token-local (near-free links and no compute: the replicated experts cost nothing to read)."""
    mm = _calls(traced, aten._grouped_mm.default)[0]
    region = mm.meta[REGION_KEY].region
    members = [n for n in traced.gm.graph.nodes if REGION_KEY in n.meta
               and n.meta[REGION_KEY].region == region and ep_member(n)]
    for pin, want in ((None, None), (0, 0)):
        plan = autoshard.plan(traced, sharding_cluster((2,)), share_layers=False,
                              allow=None if pin is None else (lambda n, s: n is not mm or ep_dim(s) == pin))
        chosen = {n.name: n.strategy for n in plan.nodes}
        eps = {n.name: ep_dim(next(s for s in n.meta[META_KEY].strategies if s.text == chosen[n.name]))
               for n in members}
        assert set(eps.values()) == {want}, (pin, eps)


def test_fsdp_ep_is_torchtitans_layout(traced):
    """The ``fsdp_ep`` baseline planned for 4 CPU ranks: on its (fsdp, ep) grid every MoE op runs
    expert-parallel over ep, the experts are stored split by expert there and sharded over fsdp
    too, every other parameter is sharded over both dims, and the batch splits over both."""
    from autoshard.planning.baselines import plan_baseline

    plan = plan_baseline(traced, autoshard.Cluster.local(4), "fsdp_ep")
    assert plan.mesh_dim_names == ("fsdp", "ep") and tuple(plan.mesh_shape) == (2, 2), plan.mesh_shape
    chosen = {n.name: n.strategy for n in plan.nodes}
    members = [n for n in traced.gm.graph.nodes if n.op == "call_function" and ep_member(n)]
    assert members and all(chosen[n.name].endswith(" ep1") for n in members)
    assert plan.inputs == ["(S(0),S(0))"] * 2
    for name, placements in plan.storage.items():
        fsdp, ep = placements[1:-1].split(",")
        if "experts" in name:
            assert ep == "S(0)" and fsdp.startswith("S("), (name, placements)
        else:
            assert fsdp.startswith("S(") and ep.startswith("S("), (name, placements)


def test_moe_imbalance_prices_the_busiest_rank(traced):
    """The same expert-parallel problem priced for a router that sends the busiest rank twice
    its share: slower; a factor below 1 is refused. (The exchange's own price at a factor:
    test_exchange_priced_by_hand.)"""
    from autoshard.errors import ConstraintError

    cluster = autoshard.Cluster.local(2)
    even = autoshard.plan(traced, cluster, allow=ec.pinned(0))
    skewed = autoshard.plan(traced, cluster, allow=ec.pinned(0), moe_imbalance=2.0)
    assert skewed.step_time > even.step_time
    with pytest.raises(ConstraintError, match="moe_imbalance"):
        autoshard.plan(traced, cluster, moe_imbalance=0.5)


def test_a_capacity_sizes_the_receive_buffer(traced):
    """At ``moe_capacity=1.5`` on 2 ranks a rank's received rows fill 1.5 times its own rows, not
    every rank's (2 times): the memory model holds the gathered hidden states at that size (by
    hand: 96 of the 128 routed rows), leaves the rank's own tensors alone, and prices an op over
    the buffer at its rows; the dropless plan keeps the replicated size."""
    from autoshard.passes.regions import ep_capacity, moved_tensors, received_rows
    from autoshard.solver import memory

    mesh = autoshard._torch.planning_mesh((2,), ("d0",))
    send = next(n for n in _calls(traced, aten.index.Tensor)
                if REGION_KEY in n.meta and n.meta[REGION_KEY].ep_outputs[0] == Replicate()
                and n.meta["val"].ndim == 2)
    rows, hidden = send.meta["val"].shape
    over = next(n for n in _calls(traced, aten.mul.Tensor)
                if (moved_tensors(n) or ((False,),))[0][0] and n.meta["val"].shape[0] == rows)
    sizes = {}
    for capacity in (None, 1.5):
        find_strategies(traced.gm, mesh, moe_capacity=capacity)
        ss = send.meta[META_KEY].strategies
        (k,) = [i for i, s in enumerate(ss) if ep_dim(s) == 0]
        assert ep_capacity(ss[k]) == capacity and ss[k].variant == ("ep0" if capacity is None else "ep0@1.5")
        sizes[capacity] = memory._local_outputs(send, (2,))[k]
        (s,) = [s for s in over.meta[META_KEY].strategies if ep_dim(s) == 0]
        assert s.work_shards == pytest.approx(1 / (1.0 if capacity is None else 0.75)), s
    # the gather's inputs are the rank's own rows (token order) and positions: unscaled
    assert moved_tensors(send)[0] == (True,) and not any(moved_tensors(send)[1])
    assert rows == 128 and received_rows(rows // 2, 2, 1.5) == 96
    assert sizes[None] == rows * hidden * 2 and sizes[1.5] == 96 * hidden * 2, sizes


def test_a_plan_records_its_capacity_and_holds_less(traced):
    """The same expert-parallel plan, dropless and at capacity 1: the plan records the capacity
    (compile reads it back from a plan file), and saves fewer bytes for backward, as the received
    rows it keeps are half the size."""
    cluster = autoshard.Cluster.local(2)
    dropless = autoshard.plan(traced, cluster, allow=ec.pinned(0), recompute=False)
    capped = autoshard.plan(traced, cluster, allow=ec.pinned(0), recompute=False, moe_capacity=1.0)
    assert dropless.moe_capacity is None and capped.moe_capacity == 1.0
    assert capped.saved_for_backward < dropless.saved_for_backward
    assert capped.peak_memory <= dropless.peak_memory
    # compile runs a plan as it is: the load the planner priced with is a planning option, and a
    # capacity other than the plan's is refused (a fake group: both fail before any tracing)
    import torch.distributed as dist
    from autoshard.errors import ConstraintError

    model, inputs = ec.model_and_inputs()
    dist.init_process_group("fake", rank=0, world_size=2)
    try:
        with pytest.raises(ConstraintError, match="moe_imbalance only apply when planning"):
            autoshard.compile(model, cluster, inputs, plan=capped, moe_imbalance=1.5)
        with pytest.raises(ConstraintError, match="holds moe_capacity=1.0, not 1.5"):
            autoshard.compile(model, cluster, inputs, plan=capped, moe_capacity=1.5)
    finally:
        dist.destroy_process_group()


def test_moe_capacity_is_checked(traced):
    """A capacity below the imbalance the plan is priced at, or not a number, is refused."""
    from autoshard.errors import ConstraintError

    mesh = autoshard._torch.planning_mesh((2,), ("d0",))
    for bad in (dict(moe_capacity=1.2, moe_imbalance=1.5), dict(moe_capacity=0.5), dict(moe_capacity=True)):
        with pytest.raises(ConstraintError, match="moe_capacity"):
            find_strategies(traced.gm, mesh, **bad)


def test_received_rows_are_laid_out_expert_major():
    """The dispatch's reordering against a brute-force walk: rows arrive source by source, each
    source's rows expert by expert; the grouped GEMMs need them expert by expert, each expert's
    rows source by source (empty blocks included)."""
    g = torch.Generator().manual_seed(0)
    for sources, local_experts in ((2, 3), (4, 2), (3, 5)):
        received = torch.randint(0, 4, (sources, local_experts), generator=g)
        received[0, 0] = 0
        arrival = [(s, e, r) for s in range(sources) for e in range(local_experts) for r in range(received[s, e])]
        want = sorted(range(len(arrival)), key=lambda i: (arrival[i][1], arrival[i][0], arrival[i][2]))
        assert experts._expert_major(received, len(arrival)).tolist() == want


class _TinyMoE(nn.Module):
    """A grouped-GEMM MoE written as in torchtitan's style: routed rows through two grouped GEMMs,
    back to token order by the inverse permutation; ``"scaled"`` scales the expert output by a
    shared weight (its gradient sums over routed rows), ``"like"`` scatters back into a buffer
    sized by the routed rows (``empty_like``), ``"view"`` reshapes the routed rows by their count
    between the GEMMs."""

    def __init__(self, variant: str, experts: int = 4, hidden: int = 16, inner: int = 32):
        super().__init__()
        self.variant, self.experts = variant, experts
        self.router = nn.Linear(hidden, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, inner, hidden) * 0.1)
        self.w2 = nn.Parameter(torch.randn(experts, hidden, inner) * 0.1)
        self.g = nn.Parameter(torch.ones(hidden))

    def forward(self, x, y):
        weights, chosen = self.router(x).softmax(-1).topk(2)
        ids, perm = torch.sort(chosen.reshape(-1))
        offs = torch.cumsum(torch.histc(ids.float(), bins=self.experts, min=0, max=self.experts - 1), 0,
                            dtype=torch.int32)
        h = F.silu(torch._grouped_mm(x[perm // 2], self.w1.transpose(-2, -1), offs))
        if self.variant == "view":
            h = h.view(h.shape[0], -1, 2).flatten(1)
        h = torch._grouped_mm(h, self.w2.transpose(-2, -1), offs)
        if self.variant == "scaled":
            h = h * self.g
        h = h * weights.reshape(-1)[perm].unsqueeze(-1)
        if self.variant == "like":
            back = torch.empty_like(h)
            back[perm] = h
        else:
            inverse = torch.empty_like(perm)
            inverse[perm] = torch.arange(perm.numel())
            back = h[inverse]
        return ((back.view(x.shape[0], 2, -1).sum(1) - y) ** 2).mean()


@pytest.mark.parametrize("variant,why", [("plain", None), ("scaled", "sums over routed rows"),
                                         ("like", "a scatter's buffer the size of routed rows")])
def test_regions_expert_parallelism_cannot_run_get_none(variant, why):
    """A sum over received rows would add other ranks' tokens and the buffer's padding, and a
    buffer sized like received rows is not the rank's own rows: those regions stay token-local,
    with a warning that says why; the plain one may run expert-parallel."""
    model = _TinyMoE(variant).to(torch.bfloat16)
    inputs = (torch.randn(32, 16, dtype=torch.bfloat16), torch.randn(32, 16, dtype=torch.bfloat16))
    traced = autoshard.trace(model, inputs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        facts = find_regions(traced.gm)
    said = [str(w.message) for w in caught if "not expert-parallel" in str(w.message)]
    assert facts and {f.experts for f in facts.values()} == ({4} if why is None else {0})
    assert (said == []) if why is None else (len(said) == 1 and why in said[0]), said


def test_a_view_sized_by_the_routed_rows_keeps_the_buffer_dropless():
    """A row-wise view over received rows that names their count runs through DTensor with the
    traced sizes, which a capacity-sized buffer would not match: with ``moe_capacity`` set its
    region keeps every rank's rows (the dropless variant), with a warning naming the view; a
    region without one takes the capacity."""
    mesh = autoshard._torch.planning_mesh((2,), ("d0",))
    for variant, want in (("view", "ep0"), ("plain", "ep0@1.5")):
        model = _TinyMoE(variant).to(torch.bfloat16)
        inputs = (torch.randn(32, 16, dtype=torch.bfloat16), torch.randn(32, 16, dtype=torch.bfloat16))
        traced = autoshard.trace(model, inputs)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            find_strategies(traced.gm, mesh, moe_capacity=1.5)
        said = [str(w.message) for w in caught if "whatever moe_capacity says" in str(w.message)]
        (mm, *_) = _calls(traced, aten._grouped_mm.default)
        assert {s.variant for s in mm.meta[META_KEY].strategies if ep_dim(s) is not None} == {want}
        assert (len(said) == 1 and "names the routed rows' count" in said[0]) if variant == "view" else not said, said
