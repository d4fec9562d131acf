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


def _state_by_hand(traced, plan) -> tuple[float, float]:
    """Bytes per rank of the fp32 parameters and Adam's two moments (12 per element), split by each
    parameter's storage placement, with the batch by its placement; and of the gradients (4)."""
    shards = lambda pl: 2 if "S" in pl else 1  # noqa: E731 - the mesh is (2,)
    params = sum(4 * node.meta["val"].numel() / shards(plan.storage[name]) for name, node in traced.params)
    batch = sum(node.meta["val"].nbytes / shards(pl) for node, pl in zip(traced.inputs, plan.inputs))
    return 3 * params + batch, params


def test_ample_memory_keeps_everything(sweep):
    _, free, _, _ = sweep
    assert not any(n.recompute for n in free.nodes)
    assert free.peak_memory <= free.memory_limit


def test_peak_within_cap_and_step_time_monotone(sweep, traced):
    _, free, _, plans = sweep
    times = [p.step_time for _, p in plans]
    for cap, p in plans:
        assert p.peak_memory <= cap * (1 + 1e-9), (cap, p.peak_memory)
        state, grads = _state_by_hand(traced, p)
        assert p.memory["params"] + p.memory["optimizer"] + p.memory["inputs"] == pytest.approx(state, rel=1e-12)
        # the gradients backward has made by the peak's moment, all of them by the optimizer step
        assert 0 <= p.memory["grads"] <= grads * (1 + 1e-12)
        assert p.memory_timeline[-1][0] == "optimizer step" and p.memory_timeline[-1][1] >= state + grads
        assert p.peak_memory > state + p.memory["grads"]   # and the activations on top
    assert all(b >= a * (1 - 1e-9) for a, b in zip(times, times[1:])), times
    assert times[-1] > free.step_time  # squeezing costs time


def test_tight_cap_recomputes_and_shards(sweep):
    _, free, _, plans = sweep
    tight = plans[-1][1]
    assert sum(n.recompute for n in tight.nodes) > 0
    assert _sharded(tight) >= _sharded(free)
    assert tight.saved_for_backward < free.saved_for_backward
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


# ----------------------------------------------------------------- the step's moments, by hand
class _Stack(torch.nn.Module):
    """LAYERS identical blocks x -> tanh(x W^T + b) (D x D), then a D -> 1 head and the mean
    squared error: a repeated layer whose bytes are easy to count."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(D, D) for _ in range(LAYERS))
        self.head = torch.nn.Linear(D, 1)

    def forward(self, x, y):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return torch.nn.functional.mse_loss(self.head(x), y)


B, D, LAYERS = 8, 16, 3
P = 4 * (LAYERS * (D * D + D) + D + 1)   # the fp32 parameters' bytes: 3332
BATCH = 4 * (B * D + B)                  # x and y: 544


def _one_device(optimizer: str) -> Cluster:
    from autoshard import DeviceSpec, LinkSpec

    device = DeviceSpec("hand", {"float32": 1e12}, memory_bandwidth=1e12, memory=2**30, optimizer=optimizer)
    return Cluster((1,), device=device, links=[LinkSpec("none", 1e-6, 1e9)])


@pytest.fixture(scope="module")
def stack():
    torch.manual_seed(0)
    return autoshard.trace(_Stack(), (torch.randn(B, D), torch.randn(B, 1)))


@pytest.mark.filterwarnings("ignore:autoshard.*planned replicated")
@pytest.mark.parametrize(("optimizer", "temporary"), [
    ("foreach", P),                  # sqrt(v) of every parameter at once: one more copy of them
    ("for-loop", 2 * 4 * D * D),     # two temporaries of the largest parameter, a D x D weight
    ("fused", 0),
])
def test_the_optimizer_step_holds_state_gradients_and_its_temporaries(stack, optimizer, temporary):
    """With no activation left, the optimizer step holds the parameters, Adam's two moments, every
    gradient and its own temporaries: 4 P + the temporaries + the batch, by hand."""
    plan = autoshard.plan(stack, _one_device(optimizer), recompute=False)
    assert plan.memory_timeline[-1] == ("optimizer step", 4 * P + temporary + BATCH)
    if optimizer == "foreach":   # this small batch's activations weigh less than that copy
        assert plan.peak_moment == "optimizer step" and plan.peak_memory == 5 * P + BATCH
        assert (plan.memory["grads"], plan.memory["optimizer_step"], plan.memory["activations"]) == (P, P, 0)
    # what forward saves: each block's tanh output and the prediction the loss reads
    assert plan.saved_for_backward == LAYERS * 4 * B * D + 4 * B


@pytest.mark.filterwarnings("ignore:autoshard.*planned replicated")
def test_gradients_grow_through_backward_while_activations_shrink(stack):
    """``zero_grad(set_to_none=True)``: backward starts with no gradient and every activation, and
    ends with every gradient and none; in between each layer's backward adds its block's gradients
    (weight and bias, by hand) and frees activations. Before the layers only the head's gradient is
    there, so no moment holds every gradient on top of every activation."""
    from autoshard import _torch
    from autoshard.passes.coarsen import repeated_layers
    from autoshard.passes.strategies import find_strategies
    from autoshard.solver.formulation import formulate
    from autoshard.solver.memory import memory_model, moments

    cluster = _one_device("fused")
    find_strategies(stack.gm, _torch.planning_mesh(cluster.mesh_shape, cluster.mesh_dim_names))
    repeated_layers(stack)
    problem = formulate(stack, cluster)
    mm = memory_model(stack, problem, cluster, float("inf"), 2.0)
    every = moments(mm, {v: 0 for v in problem.nodes}, set())   # one device: one strategy each
    backward = [every[name] for name in mm.phase_names]
    saved = LAYERS * 4 * B * D + 4 * B   # each block's tanh output, and the prediction the loss reads
    assert every["forward"]["grads"] == 0 and every["forward"]["activations"] == saved
    assert (backward[0]["grads"], backward[0]["activations"]) == (4 * (D + 1), saved)   # the head's
    assert (backward[-1]["grads"], backward[-1]["activations"]) == (P, 0)
    layer = 4 * (D * D + D)
    assert all(b["grads"] - a["grads"] in (0, layer) and b["activations"] <= a["activations"]
               for a, b in zip(backward, backward[1:]))
    assert sum(b["grads"] > a["grads"] for a, b in zip(backward, backward[1:])) == LAYERS
    assert max(b["grads"] + b["activations"] for b in backward) < P + saved
