"""Overlap: parameter gathers and gradient reductions hide behind compute; nothing else does."""

from dataclasses import replace

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import autoshard
from autoshard import Cluster
from autoshard.cluster import H100, NVLINK4
from autoshard.passes.annotate import is_free
from autoshard.passes.graph import tensor_inputs
from autoshard.zoo import GPT, GPTConfig
from test_planning import COMPUTE, GRADS, LOSS, OPTIMIZER, by_hand, linear_ddp

pytestmark = pytest.mark.filterwarnings("ignore:autoshard.*planned replicated")


def _h100_pair(overlap: float) -> Cluster:
    return Cluster((2,), ("d0",), replace(H100, comm_overlap=overlap), [NVLINK4])


def _ddp(traced):
    """Parameters stored, gathered and used replicated, the batch split: data parallelism by hand."""
    params = {node for _, node in traced.params}
    views = {u for p in params for u in p.users}
    batch = set(traced.inputs)
    rep = lambda pl: all(isinstance(q, Replicate) for q in pl)  # noqa: E731

    def allow(node, s):
        if node in params or node.op == "storage":
            return rep(s.outputs[0])
        if node in batch:
            return all(isinstance(q, Shard) and q.dim == 0 for q in s.outputs[0])
        return all(rep(pl) for a, pl in zip(tensor_inputs(node), s.inputs) if a in params or a in views)
    return allow


def _all_reduce(nbytes: float) -> float:
    """Ring all-reduce over 2 ranks on NVLink 4 (docs/cost_model.md): 2(p-1)/p n/B + 2(p-1) alpha, less
    the latency for a gradient: the runtime reduces gradients in flat buckets, one latency each
    (costmodel's ``bucketed``)."""
    return 2 * 0.5 * nbytes / (NVLINK4.bandwidth * NVLINK4.efficiency)


def _hand_step(plan, traced, a: float) -> float:
    """Step time from the plan's own nodes: compute, every activation collective, and per block
    (a layer copy; everything else is one block) max(0, moves - a * compute) of its parameter
    gathers (block of the consumer) and gradient reductions (block of the producer)."""
    layer = {n.name: n.layer for n in plan.nodes}
    params = {node.name for _, node in traced.params}
    views = {u.name for _, node in traced.params for u in node.users if is_free(u)}  # t, view: no compute
    compute, moves, total = {}, {}, plan.compute_time + plan.breakdown["recompute"]
    total += plan.breakdown["optimizer"] + plan.breakdown["recompute_comm"]  # per step, never hidden
    for n in plan.nodes:
        compute[n.layer] = compute.get(n.layer, 0.0) + n.compute
    for n in plan.nodes:
        for c in n.comm:
            if n.name in params:           # a gradient arriving at its parameter's storage
                moves[layer[c["src"]]] = moves.get(layer[c["src"]], 0.0) + c["time"]
            elif c["src"] in params | views:  # a parameter gathered for its consumer
                moves[n.layer] = moves.get(n.layer, 0.0) + c["time"]
            else:
                total += c["time"]
    return total + sum(max(0.0, m - a * compute.get(b, 0.0)) for b, m in moves.items())


@pytest.mark.parametrize("batch", [2, 64])
def test_ddp_gradient_all_reduce_hides_behind_compute(batch):
    """Data parallelism by hand on 2 H100s: each gradient lands by one all-reduce of its full size
    (the ring formula), and the step charges only what each layer's compute cannot hide; with
    comm_overlap 0 every collective counts."""
    c = GPTConfig(vocab=512, seq=64, hidden=256, heads=4, layers=2)
    with torch.device("meta"):
        model = GPT(c)
    idx = torch.zeros(batch, c.seq, dtype=torch.long, device="meta")
    traced = autoshard.trace(model, (idx, idx))
    plan = autoshard.plan(traced, _h100_pair(1.0), allow=_ddp(traced))
    by_name = {n.name: n for n in plan.nodes}
    sizes = {name: p.numel() * 4 for name, p in model.named_parameters()}
    for name, node in traced.params:
        (col,) = by_name[node.name].comm
        assert col["kind"] == "all_reduce" and col["time"] == pytest.approx(_all_reduce(sizes[name]), rel=1e-9)
    assert plan.step_time == pytest.approx(_hand_step(plan, traced, 1.0), rel=1e-9)
    assert plan.solver["objective"] == pytest.approx(plan.step_time, rel=1e-6)
    grads = sum(_all_reduce(b) for b in sizes.values())
    assert plan.breakdown["exposed_comm"] < plan.comm_time - grads * 0.5  # most of the all-reduce hidden

    blind = autoshard.plan(traced, _h100_pair(0.0), allow=_ddp(traced))
    assert blind.step_time == pytest.approx(_hand_step(blind, traced, 0.0), rel=1e-9)
    assert blind.step_time > plan.step_time


# The Linear of test_planning, data parallel on 2 ranks, priced there by hand; the gradients'
# all-reduces (GRADS) may hide behind a block's compute (all of it here: one block), the loss's
# all-reduce (LOSS) never.
@pytest.mark.parametrize("overlap, micro_batches, exposed", [
    (0.0, 1, LOSS + GRADS),
    (0.1, 1, LOSS + GRADS - 0.1 * COMPUTE),   # a tenth of 24.4 us hides 2.4 us of 5.4
    (1.0, 1, LOSS),
    # 3 micro-batches: compute and the loss's all-reduce 3 times; the gradients reduced once,
    # after the last backward, where nothing is left to hide behind
    (1.0, 3, 3 * LOSS + GRADS),
], ids=["none", "tenth", "all", "accumulated"])
def test_exposed_communication_by_hand(overlap, micro_batches, exposed):
    plan = linear_ddp(overlap, micro_batches)
    assert plan.compute_time == by_hand(micro_batches * COMPUTE)
    assert plan.breakdown["exposed_comm"] == by_hand(exposed)
    assert plan.step_time == by_hand(micro_batches * COMPUTE + exposed + OPTIMIZER)
    assert plan.solver["objective"] == pytest.approx(plan.step_time, rel=1e-9, abs=0)
    # between micro-batches the gradients stay unreduced: full copies (Partial) of the weight's and bias's
    assert plan.memory.get("grad_accumulation", 0) == (0 if micro_batches == 1 else (8 * 16 + 8) * 4)


def test_tensor_parallel_collectives_stay_exposed():
    """On a GPT planned for 8 GPUs with a tiny batch (tensor parallelism pays), every collective on
    an activation is charged in full; only parameter and gradient moves may be hidden."""
    c = GPTConfig(vocab=512, seq=64, hidden=512, heads=8, layers=2)
    with torch.device("meta"):
        model = GPT(c)
    idx = torch.zeros(1, c.seq, dtype=torch.long, device="meta")
    traced = autoshard.trace(model, (idx, idx))
    cluster = Cluster.preset("dgx-h100")
    plan = autoshard.plan(traced, cluster)
    params = {node.name for _, node in traced.params}
    # views and casts of parameters (and of those): they depend on no activation
    views = set()
    for node in traced.gm.graph.nodes:
        args = tensor_inputs(node) if node.op == "call_function" else []
        if len(args) == 1 and args[0].name in params | views and (is_free(node) or "_to_copy" in str(node.target)):
            views.add(node.name)
    hidden_any = False
    for n in plan.nodes:
        for e in n.comm:
            movable = n.name in params or e["src"] in params or e["src"] in views
            if not movable:
                assert e["exposed"] == e["time"]
            hidden_any |= e["exposed"] < e["time"]
    assert plan.solver["objective"] == pytest.approx(plan.step_time, rel=1e-6)
    # the same plan with nothing hidden can only be slower
    blind = autoshard.plan(traced, Cluster((1, 8), ("node", "gpu"), replace(cluster.device, comm_overlap=0.0),
                                           cluster.links))
    assert blind.step_time >= plan.step_time * (1 - 1e-9)
    assert hidden_any or blind.step_time == pytest.approx(plan.step_time)


def test_grad_accumulation_charges_the_reduction_once():
    """K micro-batches: compute and activation collectives K times, gradient reductions once, and
    each gradient held unreduced (where backward made it; Partial = a full copy) in between."""
    from autoshard.build import choice_from_plan
    from autoshard.passes.graph import value_of

    c = GPTConfig(vocab=512, seq=64, hidden=256, heads=4, layers=2)
    with torch.device("meta"):
        model = GPT(c)
    idx = torch.zeros(16, c.seq, dtype=torch.long, device="meta")
    traced = autoshard.trace(model, (idx, idx))
    cluster = _h100_pair(0.0)  # nothing hidden: the step is a plain sum
    one = autoshard.plan(traced, cluster)
    four = autoshard.plan(traced, cluster, grad_accumulation=4)
    assert four.grad_accumulation == 4 and one.grad_accumulation == 1
    params = {node.name for _, node in traced.params}
    # a parameter's moves (its gradient's reduction, its gathers) run bucketed: no latency
    moved = params | {u.name for _, node in traced.params for u in node.users if is_free(u)}
    for n in four.nodes:
        for e in n.comm:
            calls = 1 if n.name in params else 4
            assert e["calls"] == calls
            t = lambda b: cluster.collective_time(e["kind"], b, e["mesh_dim"])  # noqa: E731
            latency = 2 * t(1.0) - t(2.0) if e["src"] in moved or n.name in params else 0.0
            assert e["time"] == pytest.approx(calls * (t(e["bytes"]) - latency))
    same = {n.name: n.compute for n in one.nodes}
    for n in four.nodes:
        if n.strategy == next(m.strategy for m in one.nodes if m.name == n.name):
            assert n.compute == pytest.approx(4 * same[n.name], rel=1e-9)
    assert four.step_time <= 4 * one.step_time * (1 + 1e-6)  # one reduction per 4 micro-batches pays
    # the accumulation buffers by hand, from the chosen placements of the gradients' producers
    choice = choice_from_plan(traced, four)
    held = 0.0
    for g in traced.grads.values():
        u, k = value_of(g)
        pl, val = choice[u].outputs[k], (u.meta["val"][k] if isinstance(u.meta["val"], (tuple, list)) else u.meta["val"])
        shards = 1
        for q, m in zip(pl, four.mesh_shape):
            shards *= m if isinstance(q, Shard) else 1
        held += val.numel() * val.element_size() / shards
    assert four.memory["grad_accumulation"] == pytest.approx(held, rel=1e-12) and held > 0
    assert "grad_accumulation" not in one.memory
