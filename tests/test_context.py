"""Context parallelism: attention split by its queries' sequence (passes/rules/attention.py).

Numerics on real gloo processes against the single-device step (tests/context_cases.py), the
strategies and their prices against hand formulas, and the solver's choice against the same
problem without the sequence split.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import autoshard
import context_cases as cc
from autoshard.cluster import costmodel
from autoshard.errors import InfeasibleError
from autoshard.passes.graph import META_KEY
from autoshard.passes.rules.attention import _pass_time, held_beyond, is_attention, sequence_mesh_dim
from autoshard.passes.strategies import find_strategies
from autoshard.planning.baselines import plan_baseline
from autoshard.runtime.launch import run_local
from autoshard.zoo import Llama, LlamaConfig

TOL = 1e-5
SEQ_SPLIT = {"causal": "(S(2)),(R),(R)->(S(2)),(S(2))",
             "backward": "(S(2)),(S(2)),(R),(R),(S(2)),(S(2))->(S(2)),(P),(P)"}

CASES_2 = {  # name: (causal, mesh shape, cp mesh dim, data mesh dim, causal variant, model, backend, heads mesh dim)
    "llama-causal": (True, (2,), 0, None),
    "llama-bidirectional": (False, (2,), 0, None),
    "transformers-bert-bidirectional": (False, (2,), 0, None, "", "bert"),
    "llama-causal-balanced-inductor": (True, (2,), 0, None, "balanced", "llama", "inductor"),
    "llama-bidirectional-ring": (False, (2,), 0, None, "ring"),
    "transformers-llama-causal-balanced-ring": (True, (2,), 0, None, "balanced ring", "hf_llama3"),
}
CASES_4 = {
    "llama-causal-balanced-ring-data_x_cp": (True, (2, 2), 1, 0, "balanced ring"),
    "llama-bidirectional-data_x_cp": (False, (2, 2), 1, 0),
    "llama-causal-balanced-heads_x_cp": (True, (2, 2), 1, None, "balanced", "llama", "eager", 0),
    "llama-causal-balanced-ring-cp4": (True, (4,), 0, None, "balanced ring"),
}
# all-to-alls the attention ops run themselves, per layer, at least (more where the partitioner
# runs a forward again): balanced, forward the query in and out and lse back, backward 4 in and
# grad_query back; ring, forward cp - 1 key passes, backward cp - 1 key passes and cp gradient
# passes; balanced ring, its 3 + 2 and 6 + 3 moves with those passes
ALL_TO_ALLS = {"": lambda cp: 0, "balanced": lambda cp: 3 + 5, "ring": lambda cp: (cp - 1) + (2 * cp - 1),
               "balanced ring": lambda cp: 3 + 2 + 6 + 3 + (cp - 1) + (2 * cp - 1)}


def _planned(cases: dict) -> dict:
    return {name: (spec, cc.plan_case(*spec)) for name, spec in cases.items()}


@pytest.fixture(scope="module")
def results_2():
    return run_local(cc.run_cases, 2, _planned(CASES_2), timeout=900)


@pytest.fixture(scope="module")
def results_4():
    return run_local(cc.run_cases, 4, _planned(CASES_4), timeout=900)


def _check(results, name, spec):
    causal, mesh_shape, cp_dim, data_dim = spec[:4]
    variant = spec[4] if len(spec) > 4 else ""
    for rank, res in enumerate(results):
        err = res[name]
        assert err["loss"] <= TOL and err["grad"] <= TOL and err["param"] <= TOL, (rank, err)
    err = results[0][name]
    # every attention op ran split by sequence on the cp dim (and by heads where asked), as the
    # case's variant (a ring's keys and values split too), and so did the batch
    heads_dim = spec[7] if len(spec) > 7 else None
    assert err["attention"]
    for strategy in err["attention"]:
        assert _query(strategy, len(mesh_shape))[cp_dim] == Shard(2), strategy
        assert heads_dim is None or _query(strategy, len(mesh_shape))[heads_dim] == Shard(1), strategy
        assert strategy[strategy.rindex(")") + 1:].strip() == variant, strategy
        if "ring" in variant:
            assert all(p[cp_dim] == Shard(2) for p in _placements(strategy, len(mesh_shape))), strategy
    # the in-op exchanges are in the program, run by the attention ops themselves (2 layers)
    least = 2 * ALL_TO_ALLS[variant](mesh_shape[cp_dim])
    assert err["all_to_all"] >= least if least else err["all_to_all"] == 0, err["all_to_all"]
    if spec[6:7] == ("inductor",):
        assert err["compiled_calls"] > 0
    for placements in err["inputs"]:
        p = autoshard.notation.parse_placements(placements, len(mesh_shape))
        assert p[cp_dim] == Shard(1) and (data_dim is None or p[data_dim] == Shard(0)), err["inputs"]


@pytest.mark.world(2)
@pytest.mark.parametrize("name", list(CASES_2))
def test_sequence_split_attention_matches_one_device_on_two_ranks(results_2, name):
    _check(results_2, name, CASES_2[name])


@pytest.mark.world(4)
@pytest.mark.parametrize("name", list(CASES_4))
def test_sequence_split_attention_matches_one_device_on_four_ranks(results_4, name):
    _check(results_4, name, CASES_4[name])


# ---------------------------------------------------------------------------- strategies, prices
def _attention_nodes(causal: bool, mesh_shape, seq: int = 64, heads: int = 4, batch: int = 2):
    model = Llama(LlamaConfig(seq=seq, heads=heads, kv_heads=2, causal=causal))
    traced = autoshard.trace(model, model.example_inputs(batch))
    names = tuple(f"d{i}" for i in range(len(mesh_shape)))
    find_strategies(traced.gm, autoshard._torch.planning_mesh(mesh_shape, names))
    return traced, [n for n in traced.gm.graph.nodes if is_attention(n)]


@pytest.mark.parametrize("causal", [True, False])
def test_sequence_split_is_offered_with_the_slowest_ranks_share(causal):
    _, nodes = _attention_nodes(causal, (4,))
    for node in nodes:
        split = [s for s in node.meta[META_KEY].strategies if sequence_mesh_dim(node, s) == 0]
        assert [s.variant for s in split] == (["", "balanced", "balanced ring"] if causal else ["", "ring"]), \
            [str(s) for s in split]
        for s in split:
            backward = len(s.outputs) == 3
            if "ring" in s.variant:   # keys, values and their gradients split like the queries
                assert all(p == (Shard(2),) for p in (*s.inputs, *s.outputs)), str(s)
                continue
            assert str(s).split(" ")[0] == SEQ_SPLIT["backward" if backward else "causal"]
            if backward:   # key and value gradients are sums over every rank's queries
                assert s.outputs[1:] == ((Partial(),), (Partial(),))
            # counted in (half-chunk x half-chunk) blocks, a diagonal one as half, causal attention
            # over 8 half-chunks is 32 blocks; the last contiguous rank (half-chunks 6, 7) computes
            # 6.5 + 7.5 = 14 of them (7/16, i.e. 2 cp - 1 of cp^2), a balanced rank (r, 7 - r)
            # r + 0.5 + 7.5 - r = 8 (1/4, an even share)
            share = 7 / 16 if causal and not s.variant else 4 / 16
            assert s.shards == 4 and s.work_shards == pytest.approx(1 / share)


def test_sequence_split_combines_with_batch_and_heads_on_a_2d_mesh():
    _, nodes = _attention_nodes(True, (2, 2))
    fwd = nodes[0]
    texts = {str(s) for s in fwd.meta[META_KEY].strategies}
    assert "(S(0),S(2)),(S(0),R),(S(0),R)->(S(0),S(2)),(S(0),S(2))" in texts   # data x cp
    assert "(S(2),S(1)),(R,S(1)),(R,S(1))->(S(2),S(1)),(S(2),S(1))" in texts   # cp x heads
    assert not any(str(s).startswith("(S(2),S(2))") for s in fwd.meta[META_KEY].strategies)


def test_sequence_split_is_priced_at_the_slowest_rank():
    """compute_time under the contiguous split is the whole op's at the slowest rank's share of the
    FLOPs and bytes (the cluster's roofline, applied by hand); under the balanced split an even
    share, plus one all-to-all per query-row tensor moved, each of its local shard."""
    traced, nodes = _attention_nodes(True, (4,), seq=256)
    cluster = autoshard.Cluster.local(4)
    fwd, bwd = nodes[0], next(n for n in nodes if len(n.meta["val"]) == 3)
    for node in (fwd, bwd):
        cost = node.meta[autoshard.passes.annotate.META_KEY]
        split = {s.variant: s for s in node.meta[META_KEY].strategies if sequence_mesh_dim(node, s) == 0}
        contiguous, balanced = split[""], split["balanced"]
        assert costmodel.compute_time(cluster, node, contiguous) == pytest.approx(
            cluster.compute_time(cost.flops * 7 / 16, cost.bytes * 7 / 16, cost.dtype))
        q = fwd.args[0].meta["val"]
        q_local = q.numel() * q.element_size() / 4
        lse_local = q_local / q.shape[-1]        # (batch, heads, seq) in fp32, like q
        rows = [q_local, q_local, lse_local] if node is fwd else [q_local] * 4 + [lse_local]
        moves = sum(cluster.collective_time("all_to_all", n, 0) for n in rows)
        assert costmodel.compute_time(cluster, node, balanced) == pytest.approx(
            cluster.compute_time(cost.flops / 4, cost.bytes / 4, cost.dtype) + moves)


@pytest.mark.parametrize("seq", [256, 16384])
def test_ring_exposes_what_its_passes_outlast(seq):
    """Under the ring, each of cp steps hides what passes during it behind a block's compute (the
    op's time / cp) and exposes the rest; a pass is the link's latency + bytes / bandwidth, by hand.
    Forward: cp - 1 key and value passes. Backward: step 0 passes keys, steps 1 .. cp-2 keys and
    the previous step's float32 gradient sums, step cp - 1 the sums alone, and the last sums
    arrive after the last block. A short sequence exposes its passes (the latency outlasts a
    block); a long one hides all but the last sums."""
    _, nodes = _attention_nodes(False, (8,), seq=seq, heads=8, batch=1)
    cluster = autoshard.Cluster.preset("dgx-h100").with_mesh((8,))
    link = cluster.links[0]
    cp = 8
    fwd, bwd = nodes[0], next(n for n in nodes if len(n.meta["val"]) == 3)
    k = fwd.args[1].meta["val"]
    kv = 2 * k.numel() * k.element_size() / cp          # keys and values, one block each
    grads = 2 * k.numel() * 4 / cp
    one_pass = lambda n: link.latency + n / link.effective_bandwidth  # noqa: E731
    hidden = []
    for node in (fwd, bwd):
        cost = node.meta[autoshard.passes.annotate.META_KEY]
        ring = next(s for s in node.meta[META_KEY].strategies if s.variant == "ring")
        compute = cluster.compute_time(cost.flops / cp, cost.bytes / cp, cost.dtype)
        b = compute / cp
        if node is fwd:
            exposed = (cp - 1) * max(0.0, one_pass(kv) - b)
        else:
            exposed = (max(0.0, one_pass(kv) - b) + (cp - 2) * max(0.0, one_pass(kv) + one_pass(grads) - b)
                       + max(0.0, one_pass(grads) - b) + one_pass(grads))
        assert costmodel.compute_time(cluster, node, ring) == pytest.approx(compute + exposed, rel=1e-9)
        hidden.append(exposed == (0.0 if node is fwd else one_pass(grads)))
    assert hidden == ([False, False] if seq == 256 else [True, True])


def test_a_ring_step_across_nodes_waits_on_the_slow_link():
    """A mesh dim over two 8-GPU nodes: the ring's pass to the next rank crosses the network at
    some step, and every step waits for the slowest: its price is the network link's, not the
    hierarchical all-gather's average step (which carries the slow hop once)."""
    one_level = autoshard.Cluster.preset("dgx-h100").with_mesh((8,))
    two_levels = autoshard.Cluster.preset("dgx-h100", nodes=2).with_mesh((16,))
    n = 64e6
    slow = min((link for _, link in two_levels.levels[0]), key=lambda l: l.effective_bandwidth)
    assert _pass_time(two_levels, 0, n) == pytest.approx(slow.latency + n / slow.effective_bandwidth)
    assert _pass_time(two_levels, 0, n) > two_levels.collective_time("all_gather", 16 * n, 0) / 15
    link = one_level.links[0]
    assert _pass_time(one_level, 0, n) == pytest.approx(link.latency + n / link.effective_bandwidth)


def test_ring_holds_key_blocks_not_the_gathered_keys():
    """Beyond its tensors, backward attention split by sequence holds: gathered, the whole keys
    and values (saved split, read whole); ring, three key and value blocks (attended, sent,
    arriving), four blocks' float32 gradient sums and the query's float32 gradient sum, counted
    by hand here; balanced ring adds the copies it moves (6 in, 3 back). At cp = 8 the ring
    holds less than the gathered split; at cp = 2 (fp32 sums, three blocks) more."""
    for cp in (2, 8):
        _, nodes = _attention_nodes(False, (cp,), seq=4096, heads=8, batch=1)
        bwd = next(n for n in nodes if len(n.meta["val"]) == 3)
        split = {s.variant: s for s in bwd.meta[META_KEY].strategies
                 if sequence_mesh_dim(bwd, s) == 0 and s.inputs[1] == (Shard(2),)}
        k, q = bwd.args[2].meta["val"], bwd.args[1].meta["val"]
        whole_kv = 2 * k.numel() * k.element_size()
        assert held_beyond(bwd, split[""], (cp,)) == whole_kv
        ring = held_beyond(bwd, split["ring"], (cp,))
        assert ring == pytest.approx(3 * whole_kv / cp + 4 * whole_kv / cp * 4 / k.element_size()
                                     + q.numel() * 4 / cp)
        assert (ring < whole_kv) == (cp == 8)
    _, nodes = _attention_nodes(True, (8,), seq=4096, heads=8, batch=1)
    bwd = next(n for n in nodes if len(n.meta["val"]) == 3)
    balanced = next(s for s in bwd.meta[META_KEY].strategies if s.variant == "balanced ring")
    rows = [bwd.args[i].meta["val"] for i in range(6)] + list(bwd.meta["val"])
    moved = sum(v.numel() * v.element_size() / 8 for v in rows)   # 6 in, 3 back
    assert held_beyond(bwd, balanced, (8,)) == pytest.approx(ring + moved)


def test_a_sequence_the_mesh_does_not_divide_gets_no_split():
    _, nodes = _attention_nodes(True, (3,), seq=64)
    assert all(sequence_mesh_dim(n, s) is None for n in nodes for s in n.meta[META_KEY].strategies)


# ---------------------------------------------------------------------------- the solver's choice
def _long(heads: int = 2, seq: int = 8192):
    """One long sequence through a model with fewer heads than devices: neither the batch nor the
    heads split attention 8 ways."""
    with torch.device("meta"):
        model = Llama(LlamaConfig(vocab=512, seq=seq, hidden=128, heads=heads, kv_heads=heads, intermediate=256,
                                  layers=2))
    inputs = tuple(torch.empty(1, seq, dtype=torch.long, device="meta") for _ in range(2))
    return autoshard.trace(model, inputs), autoshard.Cluster.preset("dgx-h100")


def _no_sequence_split(node, s) -> bool:
    return not is_attention(node) or sequence_mesh_dim(node, s) is None


def _placements(strategy: str, ndim: int) -> list:
    """The placements of every input, then every output, of a strategy's text."""
    body = strategy[:strategy.rindex(")") + 1]
    return [autoshard.notation.parse_placements(p, ndim) for p in re.findall(r"\((?:[^()]|\([^()]*\))*\)", body)]


def _query(strategy: str, ndim: int):
    """The placements of an attention strategy's query (its first input; the backward's second)."""
    inputs = _placements(strategy.split("->")[0], ndim)
    return inputs[1 if len(inputs) == 6 else 0]


def _split_attention(plan, mesh_dim: int | None = None) -> bool:
    """Every attention op of ``plan`` splits its queries' sequence (on ``mesh_dim``, or any)."""
    dims = range(len(plan.mesh_shape)) if mesh_dim is None else [mesh_dim]
    return all(any(_query(n.strategy, len(plan.mesh_shape))[d] == Shard(2) for d in dims)
               for n in plan.nodes if "flash_attention" in n.op)


def test_solver_splits_the_sequence_where_nothing_else_fits():
    traced, cluster = _long()
    try:
        autoshard.plan(traced, cluster, memory_limit=1.0, allow=_no_sequence_split)
    except InfeasibleError as exc:
        without = exc.min_memory
    try:
        autoshard.plan(traced, cluster, memory_limit=1.0)
    except InfeasibleError as exc:
        free = exc.min_memory
    assert free < 0.8 * without     # the sequence split holds a quarter of each score tile
    limit = (free + without) / 2
    with pytest.raises(InfeasibleError):
        autoshard.plan(traced, cluster, memory_limit=limit, allow=_no_sequence_split)
    plan = autoshard.plan(traced, cluster, memory_limit=limit)
    assert plan.peak_memory <= limit and _split_attention(plan)


def test_solver_splits_the_sequence_where_it_is_faster():
    traced, cluster = _long()
    free = autoshard.plan(traced, cluster)
    without = autoshard.plan(traced, cluster, allow=_no_sequence_split)
    assert _split_attention(free)
    assert free.step_time < without.step_time
    # and it takes the fastest of the causal variants, each pinned alone
    times = {}
    for variant in ("", "balanced", "balanced ring"):
        pinned = autoshard.plan(traced, cluster, allow=lambda n, s: not is_attention(n) or s.variant == variant)
        times[variant] = pinned.step_time
        assert free.step_time <= pinned.step_time * (1 + 1e-9), variant
    # at cp = 8 the contiguous split's last rank computes 15/8 of an even share: a balanced one
    # wins, and the plan's tables say which
    assert times[""] > min(times["balanced"], times["balanced ring"])
    variants = {n.strategy[n.strategy.rindex(")") + 1:].strip() for n in free.nodes if "flash_attention" in n.op}
    assert len(variants) == 1 and variants <= {"balanced", "balanced ring"}, variants
    assert f"({variants.pop()})" in free.summary()


def test_fsdp_cp_baseline_follows_its_definition():
    traced, cluster = _long(heads=4, seq=2048)
    p = plan_baseline(traced, cluster, "fsdp_cp")
    names = dict(zip(p.mesh_dim_names, range(len(p.mesh_shape))))
    cp = names["cp"]
    assert _split_attention(p, cp)
    for placements in p.inputs:
        assert autoshard.notation.parse_placements(placements, len(p.mesh_shape))[cp] == Shard(1)
    # parameters stored sharded on every dim (FSDP over the cp ranks too), none replicated
    for name, placements in p.storage.items():
        assert not any(isinstance(x, Replicate) for x in autoshard.notation.parse_placements(
            placements, len(p.mesh_shape))) or "norm" in name, (name, placements)


def test_attention_that_cannot_split_is_reported():
    """One sequence of 60 on 8 devices with 2 heads: no split of batch, heads or sequence is even,
    so attention is whole on every rank, and the plan says why."""
    with torch.device("meta"):
        model = Llama(LlamaConfig(vocab=64, seq=60, hidden=32, heads=2, kv_heads=2, intermediate=64, layers=1))
    inputs = tuple(torch.empty(1, 60, dtype=torch.long, device="meta") for _ in range(2))
    with pytest.warns(UserWarning, match=r"sequence \(60\) splits only over a mesh dim whose size divides it"):
        plan = autoshard.plan(model, autoshard.Cluster.preset("dgx-h100"), inputs)
    # the queries' gaps (forward input 0, backward input 1) name the next multiples of 8 and of
    # 16 above 60; the other inputs' gaps are not about the sequence
    hint = "the next lengths that split are 64 over a mesh dim of 8 (64 balanced if causal)"
    gaps = [g for g in plan.gaps if "flash_attention" in g["op"]]
    queries = [g for g in gaps if f"input {1 if 'backward' in g['op'] else 0} (" in g["reason"]]
    assert len(queries) == 2 and all(hint in g["reason"] for g in queries), gaps
    assert not any(hint in g["reason"] for g in gaps if g not in queries)


def test_fsdp_cp_that_cannot_split_says_what_each_grid_lacks():
    """FSDP x CP of one sequence of 60 on 8 devices: no grid splits a batch of one over its FSDP
    dim, and the error names the input, its shape and the placements it could take."""
    with torch.device("meta"):
        model = Llama(LlamaConfig(vocab=64, seq=60, hidden=32, heads=2, kv_heads=2, intermediate=64, layers=1))
    inputs = tuple(torch.empty(1, 60, dtype=torch.long, device="meta") for _ in range(2))
    with pytest.raises(InfeasibleError, match=r"shape \(1, 60\)\) satisfies the given limits; it has the "
                                              r"strategies ->\(R,R\), ->\(R,S\(1\)\)"):
        plan_baseline(model, autoshard.Cluster.preset("dgx-h100"), "fsdp_cp", inputs)
