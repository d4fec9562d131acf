"""The memory cap: sharding, storage and recompute chosen together under a byte-level limit.

A sweep of the cap from "everything fits" to "below the minimum" on a small GPT must give plans
whose predicted peak never exceeds the cap, whose predicted step time never drops as the cap
shrinks, which keep everything with ample memory and shard storage / recompute more as it
tightens, and a typed infeasible error below ``min_memory`` (which itself is feasible).
"""

from __future__ import annotations

import pytest
import torch

import autoshard
from autoshard.cluster import Cluster
from autoshard.errors import InfeasibleError
from autoshard.zoo import GPT, GPTConfig


@pytest.fixture(scope="module")
def traced():
    model = GPT(GPTConfig(vocab=128, seq=64, hidden=128, heads=4, layers=2))
    return autoshard.trace(model, model.example_inputs(16, generator=torch.Generator().manual_seed(0)))


@pytest.fixture(scope="module")
def sweep(traced):
    cluster = Cluster.local(2)
    free = autoshard.plan(traced, cluster)
    with pytest.raises(InfeasibleError) as info:
        autoshard.plan(traced, cluster, memory_limit=1024)
    least = info.value.min_memory
    caps = [free.peak_memory * f for f in (1.0, 0.8, 0.6, 0.45)] + [least]
    caps = [c for c in caps if c >= least]
    return cluster, free, least, [(cap, autoshard.plan(traced, cluster, memory_limit=cap)) for cap in caps]


def _sharded(plan) -> int:
    return sum("S" in pl for pl in plan.storage.values())


def _state_by_hand(traced, plan) -> float:
    """Bytes per rank of the fp32 parameters, their gradients and Adam's two moments (16 per
    element), split by each parameter's storage placement, and of the batch by its placement."""
    shards = lambda pl: 2 if "S" in pl else 1  # noqa: E731 - the mesh is (2,)
    params = sum(16 * node.meta["val"].numel() / shards(plan.storage[name]) for name, node in traced.params)
    return params + sum(node.meta["val"].nbytes / shards(pl) for node, pl in zip(traced.inputs, plan.inputs))


def test_ample_memory_keeps_everything(sweep):
    _, free, _, _ = sweep
    assert not any(n.recompute for n in free.nodes)
    assert free.peak_memory <= free.memory_limit


def test_peak_within_cap_and_step_time_monotone(sweep, traced):
    _, free, _, plans = sweep
    times = [p.step_time for _, p in plans]
    for cap, p in plans:
        assert p.peak_memory <= cap * (1 + 1e-9), (cap, p.peak_memory)
        state = _state_by_hand(traced, p)
        assert p.memory["params"] + p.memory["grads"] + p.memory["optimizer"] + p.memory["inputs"] == \
            pytest.approx(state, rel=1e-12)
        assert p.peak_memory > state   # and the activations on top
    assert all(b >= a * (1 - 1e-9) for a, b in zip(times, times[1:])), times
    assert times[-1] > free.step_time  # squeezing costs time


def test_tight_cap_recomputes_and_shards(sweep):
    _, free, _, plans = sweep
    tight = plans[-1][1]
    assert sum(n.recompute for n in tight.nodes) > 0
    assert _sharded(tight) >= _sharded(free)
    assert tight.memory["activations"] < free.memory["activations"]
    assert tight.breakdown["recompute"] > 0


def test_below_min_memory_is_infeasible_with_the_minimum(sweep, traced):
    cluster, _, least, plans = sweep
    assert plans[-1][0] == least  # min_memory itself was planned above
    with pytest.raises(InfeasibleError) as info:
        autoshard.plan(traced, cluster, memory_limit=least * 0.98)
    assert info.value.min_memory == pytest.approx(least, rel=1e-6)
    assert "GiB" in str(info.value) or "MiB" in str(info.value)


def test_no_recompute_needs_more_memory(traced, sweep):
    cluster, _, least, _ = sweep
    with pytest.raises(InfeasibleError) as info:
        autoshard.plan(traced, cluster, memory_limit=least, recompute=False)
    assert info.value.min_memory > least
