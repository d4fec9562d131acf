"""passes/regions.py: token-local MoE dispatch regions, their strategies and the ILP's tie."""

import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

import autoshard
from autoshard import _torch, zoo
from autoshard.passes.regions import META_KEY, find_regions, runs_locally, split_dims
from autoshard.passes.strategies import find_strategies

sys.path.insert(0, str(Path(__file__).parent))
from zoo_cases import sharding_cluster  # noqa: E402

aten = torch.ops.aten


@pytest.fixture(scope="module")
def mixtral():
    """The tiny Mixtral on its bfloat16 path (grouped GEMMs over sorted tokens), 2 layers."""
    model, inputs = zoo.get("mixtral", dtype=torch.bfloat16)
    return autoshard.trace(model, inputs)


def _calls(traced, target):
    return traced.gm.graph.find_nodes(op="call_function", target=target)


def test_each_moe_layer_is_one_region_leaving_as_shards_and_partial_sums(mixtral):
    facts = find_regions(mixtral.gm)
    sorts = _calls(mixtral, aten.sort.default)
    assert len(sorts) == 2 and {facts[s].region for s in sorts} == {0, 1}
    for target in (aten.histc.default, aten.cumsum.default, aten._grouped_mm.default, aten.index_put.default):
        assert all(n in facts for n in _calls(mixtral, target)), target
    for rid, sort in enumerate(sorts):
        members = {n for n, f in facts.items() if f.region == facts[sort].region}
        exits = {n: [u for u in n.users if u not in members and u.target is not __import__("operator").getitem]
                 for n in members}
        exits = {n: us for n, us in exits.items() if us}
        # per layer, by hand: the output rows gathered back to token order, the gradients of the
        # hidden states and of the routing weights scattered back, and the two expert weights'
        # gradients (gate_up, down): sums over the rank's tokens
        kinds = sorted((str(n.target), tuple(facts[n].outputs)) for n in exits)
        assert kinds == sorted([
            (str(aten.index.Tensor), (Shard(0),)),
            (str(aten.index_put.default), (Shard(0),)),
            (str(aten.index_put.default), (Shard(0),)),
            (str(aten._grouped_mm.default), (Partial(),)),
            (str(aten._grouped_mm.default), (Partial(),)),
        ]), kinds
        # the routed rows (tokens x top-k) are split everywhere inside
        routed = mixtral.gm.graph.find_nodes(op="call_function", target=aten.index.Tensor)[0].meta["val"].shape[0]
        for n in members:
            for p, v in zip(facts[n].outputs, n.meta["val"] if isinstance(n.meta["val"], (tuple, list))
                            else (n.meta["val"],)):
                if isinstance(v, torch.Tensor) and v.ndim >= 1 and v.shape[0] == routed and v.ndim <= 2:
                    assert p is None or isinstance(p, (Shard, Partial)), (n.name, p)


class _LeakySort(nn.Module):
    """Sorts tokens by a score, then uses the sorted rows in a way that depends on their order."""

    def __init__(self, use: str):
        super().__init__()
        self.use = use
        self.w = nn.Parameter(torch.randn(16, 8))

    def forward(self, x):
        _, perm = torch.sort(x.sum(-1))
        if self.use == "position":     # each sorted row meets the weight row of its rank
            return (x[perm] * self.w).sum()
        return x[perm].view(8, 16).amax(-1).sum()   # "pairs": neighbours in sorted order combine


@pytest.mark.parametrize("use", ["position", "pairs"])
def test_a_sort_whose_order_leaks_stays_global(use):
    """No region: the sort is planned as DTensor plans any sort (replicated along it), and as it
    is no MoE dispatch (no per-expert counts or GEMMs), nothing is said about it."""
    traced = autoshard.trace(_LeakySort(use), (torch.randn(16, 8),))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        facts = find_regions(traced.gm)
    assert facts == {}
    find_strategies(traced.gm, _torch.planning_mesh((2,), ("d0",)))
    (sort,) = _calls(traced, aten.sort.default)
    assert [str(s) for s in sort.meta["autoshard.strategies"].strategies] == ["(R)->(R),(R)"]


def _members(traced, rid):
    return [n for n in traced.gm.graph.nodes if n.meta.get(META_KEY) is not None
            and n.meta[META_KEY].region == rid and not n.meta[META_KEY].neutral]


@pytest.mark.parametrize("cluster", [sharding_cluster((2,)), autoshard.Cluster.local(4, (2, 2))], ids=["2", "2x2"])
def test_plan_splits_each_region_on_the_same_dims_throughout(mixtral, cluster):
    """The ILP's tie: on each mesh dim every member of a region splits the tokens, or none does."""
    traced = mixtral
    plan = autoshard.plan(traced, cluster)
    chosen = {n.name: n.strategy for n in plan.nodes}
    split_somewhere = False
    for rid in (0, 1):
        members = _members(traced, rid)
        by_text = {n: {str(s): s for s in n.meta["autoshard.strategies"].strategies} for n in members}
        dims = {n: split_dims(n.meta[META_KEY], by_text[n][chosen[n.name]]) for n in members}
        assert len(set(dims.values())) == 1, {n.name: d for n, d in dims.items()}
        split_somewhere |= bool(next(iter(dims.values())))
    assert split_somewhere  # the routed rows are most of the layer's work: both clusters split them


def test_forbidding_one_member_keeps_the_whole_region_global(mixtral):
    """Layer 0's sort may not split tokens: its whole region stays global, layer 1's still splits
    (layers planned apart: shared, the classes would carry the limit to layer 1)."""
    traced = mixtral
    first_sort = _calls(traced, aten.sort.default)[0]
    allow = lambda node, s: node is not first_sort or s.inputs[0] == (Replicate(),)  # noqa: E731
    plan = autoshard.plan(traced, sharding_cluster((2,)), allow=allow, share_layers=False)
    chosen = {n.name: n.strategy for n in plan.nodes}
    for rid, expect_local in ((0, False), (1, True)):
        for n in _members(traced, rid):
            s = {str(s): s for s in n.meta["autoshard.strategies"].strategies}[chosen[n.name]]
            assert runs_locally(n, s) == (expect_local and n.meta[META_KEY].local), (n.name, chosen[n.name])


def test_a_plan_that_splits_a_region_unevenly_is_refused(mixtral):
    """An edited plan file in which one member of a region stops splitting tokens would run a
    rank-local sort next to global gathers: compile refuses it, naming both nodes."""
    from autoshard.build import choice_from_plan
    from autoshard.errors import PlanMismatchError

    plan = autoshard.plan(mixtral, sharding_cluster((2,)))
    choice_from_plan(mixtral, plan)   # the solver's own plan runs
    edited = next(n for n in plan.nodes if n.name == "sort_1")
    assert edited.strategy == "(S(0))->(S(0)),(S(0))"
    edited.strategy = "(R)->(R),(R)"
    with pytest.raises(PlanMismatchError, match=r"sort_1 splits the tokens .* sorted at sort_1 on mesh dims \[\], "
                                                 r"floor_divide_1 on \[0\]"):
        choice_from_plan(mixtral, plan)


class _Dispatch(nn.Module):
    """A hand-written grouped-GEMM dispatch (bf16: the grouped GEMM's meta kernel takes no other):
    the counts' range explicit or left to the data (``histc`` without min and max), the counts
    used outside or not, a stable sort (``argsort(stable=True)``, as torchtitan's MoE) or not."""

    def __init__(self, explicit_range=True, counts_out=False, stable=False):
        super().__init__()
        self.explicit_range, self.counts_out, self.stable = explicit_range, counts_out, stable
        self.w = nn.Parameter(torch.randn(4, 8, 8, dtype=torch.bfloat16))

    def forward(self, x):
        _, perm = torch.sort(x.argmax(-1), stable=True) if self.stable else torch.sort(x.argmax(-1))
        ids = x.argmax(-1)[perm]
        kw = dict(min=0, max=3) if self.explicit_range else {}
        counts = torch.histc(ids.float(), bins=4, **kw)
        y = torch._grouped_mm(x[perm], self.w, offs=torch.cumsum(counts, 0, dtype=torch.int32))
        out = torch.empty_like(y)
        out[perm] = y
        return out.float().sum() + ((counts // 2).sum() if self.counts_out else 0)


def _dispatch(**kw):
    return autoshard.trace(_Dispatch(**kw), (torch.randn(16, 8, dtype=torch.bfloat16),))


def test_counts_over_a_range_from_the_data_are_not_token_local():
    """Each rank would bin its own ids by its own range (DTensor's histc rule asks for min and
    max too); and integer ops on the counts are rejected, not a crash."""
    with pytest.warns(UserWarning, match=r"sorted at sort stays replicated: .*range taken from the data"):
        assert find_regions(_dispatch(explicit_range=False).gm) == {}
    with pytest.warns(UserWarning, match=r"sorted at sort stays replicated: floor_divide.*counts or positions"):
        assert find_regions(_dispatch(counts_out=True).gm) == {}


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)])
def test_a_regions_counts_and_offsets_stay_replicated(mesh_shape, monkeypatch):
    """Once a region splits tokens, its counts (histc) and offsets (their cumsum) are each rank's
    own, replicated in name only: a Partial offsets tensor would hand mesh coordinate 0's offsets to
    every rank. torch 2.15's cumsum rule offers Partial -> Partial, and the tiny bf16 Mixtral's plan
    took it (gradients off by 7.8e-3, 21x the rounding); the same offer is made here on any torch,
    and only the replicated strategy is kept."""
    from autoshard.passes import strategies as st

    real = st._strategies

    def offering_partial(node, mesh, shape, rep):
        found, reason = real(node, mesh, shape, rep)
        if node.target is aten.cumsum.default:
            p = tuple(Partial() for _ in shape)
            found = [*found, st.Strategy((p,), (p,), 2 ** len(shape))]
        return found, reason

    monkeypatch.setattr(st, "_strategies", offering_partial)
    traced = _dispatch()
    find_strategies(traced.gm, _torch.planning_mesh(mesh_shape, None))
    (cumsum,) = _calls(traced, aten.cumsum.default)
    rep = tuple(Replicate() for _ in mesh_shape)
    assert [(s.outputs, s.inputs) for s in cumsum.meta["autoshard.strategies"].strategies] == [((rep,), (rep,))]


@pytest.mark.parametrize("stable", [False, True])
def test_a_hand_written_dispatch_is_one_region(stable):
    """Not only transformers' layer: a dispatch written by hand, with a stable sort or not, is a
    region whose rows (the sort's input, the gathered tokens) split."""
    traced = _dispatch(stable=stable)
    facts = find_regions(traced.gm)
    targets = {n.target for n in facts}
    assert {aten.histc.default, aten.cumsum.default, aten._grouped_mm.default, aten.index_put.default} <= targets
    assert (aten.sort.stable if stable else aten.sort.default) in targets
    assert {f.region for f in facts.values()} == {0}
