"""Strategy coverage: enumeration equals brute force, every gap is reported, and a corpus of real
architectures (autoshard/zoo/corpus.py) plans without gaps; a subset trains on 2 gloo ranks like one
device (tests/zoo_cases.py)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard

import autoshard
import brute_force
import zoo_cases as zc
from autoshard import _torch, zoo
from autoshard.zoo import corpus
from autoshard.cluster import Cluster
from autoshard.errors import CoverageGapError
from autoshard.runtime.launch import run_local
from autoshard.passes.coverage import coverage_gaps
from autoshard.passes.graph import tensor_inputs
from autoshard.passes.strategies import META_KEY, find_strategies

pytestmark = pytest.mark.filterwarnings("ignore:autoshard")

ATOL = 1e-5


def _mesh(shape):
    return _torch.planning_mesh(shape, tuple(f"d{i}" for i in range(len(shape))))


def _build(name):
    return zoo.get(name[4:], "tiny") if name.startswith("zoo:") else corpus.get(name)


_TRACED: dict = {}


def _traced(name):
    if name not in _TRACED:
        _TRACED[name] = autoshard.trace(*_build(name))
    return _TRACED[name]


# ------------------------------------------------------------------ enumeration vs brute force
# every op of the zoo, and the hand-written styles (stack, unbind, view_as_complex, einsum, chunk)
BRUTE = ["rope_stack", "rope_unbind", "rope_complex", "einsum_attention", "chunk_swiglu",
         *(f"zoo:{n}" for n in zoo.names())]
_CHECKED: dict = {}   # (mesh shape, op and argument shapes) -> model: each distinct node once


@pytest.mark.parametrize("shape", [(4,), (2, 2)], ids=["1d", "2d"])
@pytest.mark.parametrize("name", BRUTE)
def test_enumeration_matches_brute_force(name, shape):
    from autoshard.passes.strategies import _cache_key

    traced = _traced(name)
    mesh = _mesh(shape)
    find_strategies(traced.gm, mesh)
    checked = 0
    for node in traced.gm.graph.nodes:
        ns = node.meta.get(META_KEY)
        if node.op != "call_function" or ns is None or ns.alias_of is not None or ns.fallback:
            continue
        if node.meta.get("autoshard.region") is not None:
            continue   # token-local MoE regions add strategies no DTensor rule has (test_regions.py)
        if not tensor_inputs(node):
            continue   # a factory: every rank builds it whole (no rule to ask)
        key = (shape, _cache_key(node))
        if key in _CHECKED:
            continue
        _CHECKED[key] = name
        mine = {(s.outputs, s.inputs) for s in ns.strategies}
        want, asked, total = brute_force.strategies(node, mesh)
        want = {s for s in want if not _writes_global_positions_into_own_rows(node, s)}
        assert want <= mine, f"{node.name} ({node.target}) misses {sorted(map(str, want - mine))[:4]}"
        if asked == total:   # exhaustive: nothing more either
            assert mine <= want, f"{node.name} ({node.target}) adds {sorted(map(str, mine - want))[:4]}"
        checked += 1
    assert checked > 0 or any(k[0] == shape for k in _CHECKED), name


def _writes_global_positions_into_own_rows(node, strategy) -> bool:
    """An ``index_put`` with its destination split on a dim the indices select: every rank would
    write at global positions into its own rows, so no plan may take it. torch 2.11's rule offers
    it where the values have the destination's rank; later releases do not."""
    if node.target is not torch.ops.aten.index_put.default:
        return False
    outs, ins = strategy
    selected = [d for d, index in enumerate(node.args[1]) if index is not None]
    return any(p == Shard(d) for d in selected for p in (*outs[0], *ins[0]))


def test_negative_dims_enumerate_as_their_positive_twins():
    """GPT-J concatenates its keys onto a legacy empty 1-D tensor along dim -2 (DTensor's cat rule
    reads a dim against its first operand's rank, here 1)."""
    class Cat(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.dim, self.w = dim, nn.Parameter(torch.ones(4, 4, 8, 6))

        def forward(self, x):
            return torch.cat((torch.empty(0), x * self.w), dim=self.dim).sum()

    x = torch.randn(4, 4, 8, 6)
    found = []
    for dim in (-2, 2):
        traced = autoshard.trace(Cat(dim), (x,))
        find_strategies(traced.gm, _mesh((2, 2)))
        (cat,) = [n for n in traced.gm.graph.nodes if n.target is torch.ops.aten.cat.default]
        found.append({str(s) for s in cat.meta[META_KEY].strategies})
    assert found[0] == found[1]
    assert not any("S(2)" in s for s in found[0]), sorted(found[0])   # never the concatenated dim
    # the real operand and the result split along dim 0 on one mesh dim and on both (how the empty
    # operand is placed meanwhile differs between torch releases: like the other, or replicated)
    for split in ("(R,S(0))", "(S(0),S(0))"):
        assert any(s.endswith(f",{split}->{split}") for s in found[0]), (split, sorted(found[0]))


# ------------------------------------------------------------------ gaps are reported
class GroupedConv(nn.Module):
    """A grouped convolution (1 < groups < channels): no rule splits its channels (a split must
    hold whole groups), so every strategy replicates its weight, which could be sharded."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1, groups=2)

    def forward(self, x, y):
        return (self.conv(x).mean((2, 3)) - y).pow(2).mean()


@pytest.fixture(scope="module")
def gap_plan():
    model = GroupedConv()
    inputs = (torch.randn(4, 8, 6, 6), torch.randn(4, 8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = autoshard.plan(model, Cluster.local(2), inputs)
    return model, inputs, plan, [str(w.message) for w in caught]


def test_gap_is_in_the_plan_with_its_model_line(gap_plan):
    _, _, plan, _ = gap_plan
    convs = [g for g in plan.gaps if g["op"] == "aten.convolution.default"]
    assert len(convs) == 2 and {g["node"] for g in convs} == {"convolution"}, plan.gaps   # weight, bias
    assert all(g["input"].startswith("primals") for g in convs), convs
    assert convs[0]["source"].startswith(f"{__file__}:"), convs[0]["source"]
    line = int(convs[0]["source"].split(":")[1].split()[0])
    assert "self.conv(x)" in open(__file__).read().splitlines()[line - 1]
    back = autoshard.Plan.from_json(plan.to_json())
    assert back.gaps == plan.gaps


def test_gap_is_warned_once_per_op(gap_plan):
    _, _, plan, messages = gap_plan
    for op in {g["op"] for g in plan.gaps}:
        assert sum(f"{op} node(s)" in m for m in messages) == 1, (op, messages)


def test_gap_shows_in_summary_and_html(gap_plan):
    _, _, plan, _ = gap_plan
    assert "Coverage gaps" in plan.summary()
    html = plan.to_html()
    assert "<h2>Coverage gaps</h2>" in html and "aten.convolution.default" in html


def test_gap_raises_under_strict(gap_plan):
    model, inputs, _, _ = gap_plan
    with pytest.raises(CoverageGapError, match="convolution"):
        autoshard.plan(model, Cluster.local(2), inputs, strict=True)


def test_no_gap_where_replicating_is_the_answer():
    """Integer indices and a norm's weight are not gaps; the loss is none either, because it keeps
    the batch split (on torch 2.14 and 2.15 only once passes/normalize.py has rewritten it)."""
    traced = _traced("zoo:gpt")
    find_strategies(traced.gm, _mesh((2,)))
    assert coverage_gaps(traced.gm) == []


# ------------------------------------------------------------------ the corpus
@pytest.mark.parametrize("name", corpus.names())
def test_corpus_model_plans_without_gaps(name):
    traced = _traced(name)
    gaps = {}
    for shape in [(8,), (2, 4)]:
        find_strategies(traced.gm, _mesh(shape))
        gaps[shape] = coverage_gaps(traced.gm) + [n for n in traced.gm.graph.nodes
                                                   if META_KEY in n.meta and n.meta[META_KEY].fallback]
    if name in corpus.KNOWN_GAPS:
        assert gaps[(8,)], f"{name} is listed as a known gap but has none: take it off corpus.KNOWN_GAPS"
        return
    assert gaps == {(8,): [], (2, 4): []}, {k: [str(g) for g in v][:3] for k, v in gaps.items()}
    plan = autoshard.plan(traced, Cluster.preset("dgx-h100"), time_limit=60)
    assert plan.gaps == [] and plan.fallbacks == []
    assert any("S(" in n.strategy for n in plan.nodes)


TRAINED = ["rope_stack", "gptj", "mistral", "t5", "convnext", "roberta", "clip", "bloom"]


@pytest.fixture(scope="module")
def trained():
    cases = {name: (f"corpus:{name}", (2,), None) for name in TRAINED}
    return run_local(zc.run_zoo, 2, cases, timeout=1200)


@pytest.mark.world(2)
@pytest.mark.parametrize("name", TRAINED)
def test_corpus_model_trains_like_single_device(trained, name):
    for rank, res in enumerate(trained):
        r = res[name]
        assert "error" not in r, f"rank {rank}:\n{r.get('error')}"
        assert r["loss"] < ATOL and r["grad"] < ATOL and r["param"] < ATOL, (rank, name, r)
        assert r["sharded_nodes"] > 0, (rank, name)
        assert r["gaps"] == [] and r["fallbacks"] == [], (rank, name, r["gaps"], r["fallbacks"])
