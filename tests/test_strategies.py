"""passes/strategies.py: candidate shardings per node on a planning mesh."""

import operator

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import autoshard
from autoshard import _torch
from autoshard.errors import NoShardingRuleError
from autoshard.passes.graph import tensor_inputs
from autoshard.passes.strategies import META_KEY, Strategy, find_strategies
from autoshard.zoo import GPT, GPTConfig, MLP
from custom_ops import MLPOwnLoss

aten = torch.ops.aten
FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
FLASH_BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
R, P = Replicate(), Partial()
S = Shard

pytestmark = pytest.mark.filterwarnings("ignore:autoshard.*planned replicated")


def mesh(*shape):
    return _torch.planning_mesh(shape, tuple(f"d{i}" for i in range(len(shape))))


def _mlp(dims=(32, 64, 64, 16), batch=8):
    return autoshard.trace(MLP(dims), (torch.randn(batch, dims[0]), torch.randn(batch, dims[-1])))


def _gpt():
    model = GPT(GPTConfig.tiny())
    return autoshard.trace(model, model.example_inputs(2))


def _calls(traced, target):
    return [n for n in traced.gm.graph.nodes if n.op == "call_function" and n.target == target]


def _strategies(node):
    return node.meta[META_KEY].strategies


def _vals(val):
    return list(val) if isinstance(val, (tuple, list)) else [val]


def _assert_even(node, strategy, mesh_shape):
    """Every Shard(d) on the tensors of this strategy divides dim d by the mesh sizes sharding it."""
    tensors = list(zip(strategy.outputs, _vals(node.meta["val"])))
    if node.op == "call_function":
        tensors += [(p, a.meta["val"]) for p, a in zip(strategy.inputs, tensor_inputs(node))]
        assert len(strategy.inputs) == len(tensor_inputs(node)), f"{node.name}: {strategy}"
    for placements, val in tensors:
        if placements is None:
            continue
        assert isinstance(val, torch.Tensor)
        assert len(placements) == len(mesh_shape)
        split = [1] * val.ndim
        for p, m in zip(placements, mesh_shape):
            # no strided/uneven shard subclasses; Partial subclasses (the embedding's masked
            # partial) are DTensor placements like any other
            assert type(p) in (Replicate, Shard) or isinstance(p, Partial), f"{node.name}: {strategy} has {p!r}"
            if isinstance(p, Shard):
                assert 0 <= p.dim < val.ndim, f"{node.name}: {strategy}"
                split[p.dim] *= m
        for size, k in zip(val.shape, split):
            assert size % k == 0, f"{node.name}: {strategy} shards a dim of {size} {k} ways"


def _hand_shards(strategy, mesh_shape):
    n = 1
    for d, m in enumerate(mesh_shape):
        if any(p is not None and not isinstance(p[d], Replicate) for p in (*strategy.outputs, *strategy.inputs)):
            n *= m
    return n


@pytest.fixture(scope="module")
def mlp_1d():
    traced = _mlp()
    fallbacks = find_strategies(traced.gm, mesh(2))
    return traced, fallbacks


def test_mm_has_dp_column_and_row_strategies(mlp_1d):
    traced, _ = mlp_1d
    mms = _calls(traced, aten.mm.default)
    assert mms
    for n in mms:
        got = set(_strategies(n))
        assert Strategy(((R,),), ((R,), (R,)), 1) in got, n.name
        assert Strategy(((S(0),),), ((S(0),), (R,)), 2) in got, f"{n.name}: no data-parallel strategy"
        assert Strategy(((S(1),),), ((R,), (S(1),)), 2) in got, f"{n.name}: no column strategy"
        assert Strategy(((P,),), ((S(1),), (S(0),)), 2) in got, f"{n.name}: no row/k-split strategy"


def test_addmm_has_dp_and_column_strategies(mlp_1d):
    traced, _ = mlp_1d
    for n in _calls(traced, aten.addmm.default):
        outs = {(s.outputs, s.inputs[1:]) for s in _strategies(n)}
        assert (((S(0),),), ((S(0),), (R,))) in outs
        assert (((S(1),),), ((R,), (S(1),))) in outs


def test_strategies_are_distinct_and_shards_counted(mlp_1d):
    traced, _ = mlp_1d
    for n in traced.gm.graph.nodes:
        ns = n.meta.get(META_KEY)
        if ns is None or ns.alias_of is not None:
            continue
        assert ns.strategies, n.name
        assert len(set(ns.strategies)) == len(ns.strategies), n.name
        for s in ns.strategies:
            assert s.shards == _hand_shards(s, (2,)), f"{n.name}: {s}"


def test_placeholders_offer_every_even_shard(mlp_1d):
    traced, _ = mlp_1d
    for name, node in traced.params:
        shape = node.meta["val"].shape
        want = {(R,)} | {(S(d),) for d in range(len(shape)) if shape[d] % 2 == 0}
        assert {s.outputs[0] for s in _strategies(node)} == want, name
    for node in traced.tangents:
        assert [s.outputs for s in _strategies(node)] == [((R,),)]


@pytest.mark.parametrize("shape", [(2,), (2, 2), (4,)])
@pytest.mark.parametrize("model", ["gpt", "mlp_odd"])
def test_every_strategy_shards_evenly(shape, model):
    traced = _gpt() if model == "gpt" else _mlp(dims=(6, 3, 10), batch=6)
    find_strategies(traced.gm, mesh(*shape))
    checked = 0
    for n in traced.gm.graph.nodes:
        ns = n.meta.get(META_KEY)
        if ns is None or ns.alias_of is not None:
            continue
        for s in ns.strategies:
            _assert_even(n, s, shape)
            checked += 1
    assert checked > 0


def test_uneven_dims_lose_their_shards():
    """A Linear(6, 3) on a mesh of 2: its 3-wide output cannot be sharded, so no strategy of the
    forward addmm shards its output on dim 1 -- but its 6-row batch still can be."""
    traced = _mlp(dims=(6, 3, 10), batch=6)
    find_strategies(traced.gm, mesh(2))
    first = _calls(traced, aten.addmm.default)[0]
    assert tuple(first.meta["val"].shape) == (6, 3)
    outs = {s.outputs[0] for s in _strategies(first)}
    assert (S(1),) not in outs
    assert (S(0),) in outs
    # (2,2): 6 rows split 4 ways is uneven, split 2 ways on either mesh dim is fine
    find_strategies(traced.gm, mesh(2, 2))
    outs = {s.outputs[0] for s in _strategies(first)}
    assert (S(0), S(0)) not in outs
    assert (S(0), R) in outs and (R, S(0)) in outs


def test_cpu_flash_attention_batch_and_head_sharded():
    traced = _gpt()
    find_strategies(traced.gm, mesh(2))
    for n in _calls(traced, FLASH):
        strategies = _strategies(n)
        for d, what in ((0, "batch"), (1, "heads")):
            match = [s for s in strategies if s.inputs[:3] == ((S(d),),) * 3]
            assert match, f"{n.name}: no {what}-sharded strategy"
            assert all(s.outputs[0] == (S(d),) for s in match)
            assert all(s.shards == 2 for s in match)
        # never along the head dim; along the sequence the queries, with keys and values whole
        # or, passed around the ring, split alike (context parallelism, tests/test_context.py)
        assert not any(s.inputs[0] == (S(3),) for s in strategies)
        assert all(s.inputs[1:] == ((R,), (R,)) or "ring" in s.variant and s.inputs[1:] == ((S(2),), (S(2),))
                   for s in strategies if s.inputs[0] == (S(2),))
    for n in _calls(traced, FLASH_BWD):
        strategies = _strategies(n)
        for d in (0, 1):
            assert any(all(p == (S(d),) for p in s.outputs if p is not None) and s.inputs[0] == (S(d),)
                       for s in strategies)


def test_strategy_counts_grow_on_2x2_mesh():
    traced = _gpt()
    find_strategies(traced.gm, mesh(2))
    one = {n: len(n.meta[META_KEY].strategies) for n in traced.gm.graph.nodes
           if META_KEY in n.meta and n.meta[META_KEY].alias_of is None}
    find_strategies(traced.gm, mesh(2, 2))
    two = {n: len(n.meta[META_KEY].strategies) for n in one}
    for n in one:
        assert two[n] >= one[n], f"{n.name}: {one[n]} strategies on (2,), {two[n]} on (2,2)"
    mms = _calls(traced, aten.mm.default)
    for n in mms:
        assert two[n] > one[n]
        dims = [*n.args[0].meta["val"].shape, n.args[1].meta["val"].shape[1]]
        if all(d % 4 == 0 for d in dims):
            # every single-dim rule on each of the 2 mesh dims: the Cartesian square
            assert two[n] == one[n] ** 2, n.name
    for n in _calls(traced, FLASH):
        assert two[n] > one[n]
        # R, S(0), S(1) per mesh dim: 3 x 3 when B=2 and H=4 divide (S(0),S(0) splits B=2 4 ways:
        # dropped); and the causal sequence split on one mesh dim, contiguous, balanced and
        # balanced ring, with R, S(0) or S(1) on the other: 2 x 3 x 3
        assert two[n] == 3 * 3 - 1 + 2 * 3 * 3
    assert sum(two.values()) > sum(one.values())


def _own_loss_mlp(batch=8):
    return autoshard.trace(MLPOwnLoss(), (torch.randn(batch, 32), torch.randn(batch, 16)))


def test_op_without_rule_falls_back_to_replicate_and_is_listed():
    traced = _own_loss_mlp()
    with pytest.warns(UserWarning, match="squared_error planned replicated"):
        fallbacks = find_strategies(traced.gm, mesh(2))
    names = dict(fallbacks)
    (loss,) = _calls(traced, torch.ops.autoshard_tests.squared_error.default)
    assert loss.name in names and "squared_error" in names[loss.name]
    rep = (R,)
    assert _strategies(loss) == [Strategy((rep,), (rep, rep), 1)]
    assert loss.meta[META_KEY].fallback == names[loss.name]
    # ops with rules are not fallbacks
    for n in _calls(traced, aten.mm.default) + _calls(traced, aten.addmm.default):
        assert n.name not in names and n.meta[META_KEY].fallback is None


def test_strict_raises_no_sharding_rule():
    traced = _own_loss_mlp()
    with pytest.raises(NoShardingRuleError, match="squared_error"):
        find_strategies(traced.gm, mesh(2), strict=True)


def test_plan_lists_fallbacks():
    traced = _own_loss_mlp()
    plan = autoshard.plan(traced, autoshard.Cluster.local(2))
    assert any("squared_error" in reason for _, reason in plan.fallbacks)
    with pytest.raises(NoShardingRuleError):
        autoshard.plan(traced, autoshard.Cluster.local(2), strict=True)


def test_getitem_aliases_its_producer():
    traced = _gpt()
    find_strategies(traced.gm, mesh(2))
    items = [n for n in traced.gm.graph.nodes if n.op == "call_function" and n.target is operator.getitem
             and isinstance(n.args[0].meta.get("val"), (tuple, list))]
    assert items
    for n in items:
        assert n.meta[META_KEY].alias_of == (n.args[0], n.args[1])
        assert not n.meta[META_KEY].strategies
