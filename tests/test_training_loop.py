"""The loop users write, on real gloo processes (2 ranks, mesh (2,); 4 ranks, mesh (2, 2)):
AdamW + LR schedule + gradient clipping over 3 steps, and one step accumulated over K = 4
micro-batches (``no_sync`` and ``grad_accumulation``), in fp32 and under the bf16 policy, each
against the same loop on one device under the same policy (tests/train_cases.py).

Tolerances. fp32: 1e-5 absolute, as tests/test_numerics.py (the runs differ only in the order
of fp32 sums); the learning rate is 1e-3 because AdamW divides each gradient by its own size, so
a near-zero gradient turns a 1e-7 relative difference into a difference of up to lr.
bf16 (``MixedPrecision(torch.bfloat16, torch.float32)``): bf16 keeps 8 significant bits. The
loss is itself a bf16 value, and sums taken in another order (per-rank partial sums, reduced in
fp32, rounded once) may round a logit, and so the loss, to the neighbouring bf16 number: losses
must agree to 2 units in the last place of bf16 at the loss's size (2^-6 relative, 0.0625 at a
loss near 4.8). Gradient norms are fp32 sums of gradients computed in bf16: 2^-6 relative.
Parameters: the first AdamW step moves every parameter by at most lr (plus weight decay), so a
bf16 gradient whose sign flips moves it by up to 2 lr; after one (accumulated) step they agree
within 2 lr, and the fp32 master weights themselves are never rounded to bf16.

Collectives are counted by a dispatch mode on every rank and compared with the plan's edges by
role: the storage -> working gathers (once per step, on the first micro-batch), the gradient
moves to storage (once per step, on the synchronizing micro-batch), each bucketed into one flat
collective per mesh dim and kind, and nothing else outside the graphs. The 2-D setup pins every parameter: a parameter stored ``(S(0), S(0))`` with a gradient
``(P, S(0))`` takes DTensor two collectives where the cost model counts one (the outer shard of
a nested pair cannot move without the inner: one reduce-scatter would leave a strided layout).
"""

from __future__ import annotations

import math

import pytest
import torch

import train_cases as tc
from autoshard.launch import run_local

ATOL = 1e-5
LR32, LR16 = 1e-3, 1e-2

SETUPS_2 = {
    # name: (mesh, constraints, policy, lr, global batch[, K the plan is priced for]); a batch of
    # 64 makes DDP's gradient all-reduce cheaper than gathering activations, so the plan has
    # gradient collectives
    "ddp-fp32": (None, "ddp", None, LR32, 64),
    "megatron-fp32": (None, "megatron", None, LR32, 8),
    "fsdp-bf16-k4": (None, "fsdp", tc.BF16, LR16, 64, 4),  # planned for K = 4
}
SETUPS_4 = {
    "2d-ddp-fp32": ((2, 2), "ddp2d", None, LR32, 64),
    "2d-zero_x_tensor-bf16": ((2, 2), "zero_x_tensor", tc.BF16, LR16, 8, 4),
}


@pytest.fixture(scope="module")
def runs():
    return {2: run_local(tc.run_setups, 2, SETUPS_2, timeout=900),
            4: run_local(tc.run_setups, 4, SETUPS_4, timeout=900)}


CASES = [(2, n) for n in SETUPS_2] + [(4, n) for n in SETUPS_4]


def _bf16_ulp(x: float) -> float:
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7)


@pytest.mark.parametrize("world,name", CASES)
def test_adamw_schedule_and_clipping_track_single_device(runs, world, name):
    setups = SETUPS_2 if world == 2 else SETUPS_4
    bf16 = setups[name][2] is not None
    for rank, res in enumerate(runs[world]):
        r = res[name]
        s = r["steps"]
        assert r["param_dtypes"] == ["torch.float32"], (rank, r["param_dtypes"])  # fp32 master weights
        assert s["lr"] == pytest.approx([setups[name][3] / k for k in (2, 3, 4)])  # the schedule ran
        assert s["ref_norm"][0] > tc.MAX_NORM  # clipping clipped
        for got, want in zip(s["loss"], s["ref_loss"]):
            assert abs(got - want) <= (2 * _bf16_ulp(want) if bf16 else ATOL), (rank, name, s)
        for got, want in zip(s["norm"], s["ref_norm"]):
            assert got == pytest.approx(want, rel=2**-6, abs=0 if bf16 else ATOL), (rank, name, s)
        if not bf16:
            assert s["param"] < ATOL, (rank, name, s["param"])


@pytest.mark.parametrize("world,name", CASES)
@pytest.mark.parametrize("mode", ["accum", "accum_auto"])
def test_accumulation_equals_single_device_over_the_same_micro_batches(runs, world, name, mode):
    setups = SETUPS_2 if world == 2 else SETUPS_4
    lr, bf16 = setups[name][3], setups[name][2] is not None
    for rank, res in enumerate(runs[world]):
        a = res[name][mode]
        assert a["grad_dtypes"] == ["torch.float32"]
        assert a["param"] <= (2 * lr if bf16 else ATOL), (rank, name, a["param"])
        assert a["norm"] == pytest.approx(a["ref_norm"], rel=2**-6 if bf16 else ATOL)


@pytest.mark.parametrize("world,name", CASES)
def test_gradient_collectives_counted_match_the_plan(runs, world, name):
    for rank, res in enumerate(runs[world]):
        a = res[name]["accum"]
        first, middle, last = a["counts"][0], a["counts"][1:-1], a["counts"][-1]
        graph = a["graph_collectives"]
        # the first micro-batch also gathers the working copies the plan keeps for the step, once
        assert first - graph == a["gathers_planned"], (rank, name, a)
        # no_sync micro-batches issue exactly the emitted graphs' collectives: no gradient move
        assert middle == [graph] * (tc.K - 2), (rank, name, a)
        # the synchronizing one adds the plan's gradient collectives (edges into storage), once
        assert last - graph == a["grad_collectives_planned"], (rank, name, a)
        assert res[name]["accum_auto"]["counts"] == a["counts"]


def test_compile_takes_the_accumulation_into_plan_and_module(runs):
    for world, setups in ((2, SETUPS_2), (4, SETUPS_4)):
        for name, spec in setups.items():
            k = spec[5] if len(spec) > 5 else 1
            assert (runs[world][0][name]["plan_k"], runs[world][0][name]["module_k"]) == (k, k), name


def test_data_parallel_plans_defer_their_gradient_collectives(runs):
    for world, name in ((2, "ddp-fp32"), (4, "2d-ddp-fp32")):
        a = runs[world][0][name]["accum"]
        assert a["grad_collectives_planned"] > 0, (world, name, a)
        # per step: K x the graph's collectives, the gradient and gather collectives once
        assert sum(a["counts"]) == (tc.K * a["graph_collectives"] + a["grad_collectives_planned"]
                                    + a["gathers_planned"])


def test_bf16_parameter_gathers_move_bf16(runs):
    moved = 0
    for world, setups in ((2, SETUPS_2), (4, SETUPS_4)):
        for name, spec in setups.items():
            if spec[2] is None:
                continue
            a = runs[world][0][name]["accum"]
            # gathers in the graph, at the parameter's consumers
            assert set(a["param_gathers"]) <= {"torch.bfloat16"}, (name, a["param_gathers"])
            # and the working copies gathered once per step (what micro-batch 0 adds to the graph's)
            once = {k: v - a["kinds"][1].get(k, 0) for k, v in a["kinds"][0].items()}
            assert not any(v > 0 for k, v in once.items() if k.startswith("all_gather") and "float32" in k), once
            moved += len(a["param_gathers"]) + sum(v for k, v in once.items() if k.startswith("all_gather"))
    assert moved > 0


def test_policy_changes_the_fingerprint_and_trace_keeps_names():
    import autoshard
    from autoshard.zoo import MLP

    model = MLP()
    batch = (torch.randn(8, 32), torch.randn(8, 16))
    fp32 = autoshard.trace(model, batch)
    bf16 = autoshard.trace(model, batch, mixed_precision=tc.BF16)
    bf16_reduce = autoshard.trace(model, batch,
                                  mixed_precision=autoshard.MixedPrecision(torch.bfloat16, torch.bfloat16))
    assert len({fp32.fingerprint, bf16.fingerprint, bf16_reduce.fingerprint}) == 3
    assert [n for n, _ in bf16.params] == [n for n, _ in model.named_parameters()]
    assert all(node.meta["val"].dtype == torch.float32 for _, node in bf16.params)
    assert bf16.grads["layers.0.weight"].meta["val"].dtype == torch.float32


def test_plan_takes_the_policy_and_the_accumulation():
    import autoshard
    from autoshard.zoo import MLP

    model = MLP()
    batch = (torch.randn(8, 32), torch.randn(8, 16))
    cluster = autoshard.Cluster.local(2)
    traced = autoshard.trace(model, batch)
    with pytest.raises(autoshard.errors.ConstraintError, match="mixed_precision"):
        autoshard.plan(traced, cluster, batch, mixed_precision=tc.BF16)
    bf16 = autoshard.plan(model, cluster, batch, mixed_precision=tc.BF16, progress=False)
    assert bf16.fingerprint != autoshard.plan(traced, cluster, batch, progress=False).fingerprint
    with pytest.raises(autoshard.errors.ConstraintError, match="grad_accumulation"):
        autoshard.plan(traced, cluster, batch, grad_accumulation=0)
    assert autoshard.plan(traced, cluster, batch, grad_accumulation=4, progress=False).grad_accumulation == 4


@pytest.mark.parametrize("reduce_dtype", [torch.float32, torch.bfloat16])
def test_planner_prices_the_moves_the_policy_makes(reduce_dtype):
    """FSDP pinned on a 2-D mesh under bf16 compute: every gather of a parameter's bf16 copy the
    plan charges (the storage -> working copy or at a consumer) moves numel x 2 bytes (an op
    reading the fp32 parameter itself moves fp32), every reduction of a gradient (in the graph or
    its move to storage) numel x the reduce dtype's size -- what the runtime sends (counted in
    test_bf16_parameter_gathers_move_bf16), not the fp32 master weights' size."""
    import autoshard
    from autoshard.passes.strategies import value_of
    from autoshard.zoo import GPT, GPTConfig

    model = GPT(GPTConfig(vocab=64, seq=32, hidden=64, heads=2, layers=2))
    batch = model.example_inputs(8, generator=torch.Generator().manual_seed(0))
    policy = autoshard.MixedPrecision(torch.bfloat16, reduce_dtype)
    traced = autoshard.trace(model, batch, mixed_precision=policy)
    plan = autoshard.plan(traced, autoshard.Cluster.preset("dgx-h100"), constraints={"*": "(R,S(0))"},
                          progress=False)
    numel = {node.name: node.meta["val"].numel() for _, node in traced.params}
    # a parameter's bf16 copy (its cast), by the name of the node that casts it
    cast_of = {n.name: value_of(n.args[0])[0].name for n in traced.gm.graph.nodes
               if n.op == "call_function" and n.args and getattr(n.args[0], "name", None) in numel
               and n.meta["val"].dtype == torch.bfloat16}
    from autoshard.passes.annotate import feeds_only_grads

    to_grads = {n.name for n in feeds_only_grads(traced.gm, traced)}
    vals = {n.name: n.meta.get("val") for n in traced.gm.graph.nodes}
    seen = {"gather": 0, "grad": 0}
    for node in plan.nodes:
        for c in node.comm:
            src = c["src"]
            if c["role"] == "grad":
                assert c["bytes"] == numel[node.name] * reduce_dtype.itemsize, (node.name, c)
                seen["grad"] += 1
            elif node.name in to_grads and c["kind"] in ("all_reduce", "reduce_scatter"):
                # a gradient's partial sums reduced in the graph, on the way to its parameter
                val = vals[src][0] if isinstance(vals[src], (tuple, list)) else vals[src]
                assert c["bytes"] == val.numel() * reduce_dtype.itemsize, (node.name, c)
                seen["grad"] += 1
            elif c["role"] == "gather" or src in cast_of:
                param = src if src in numel else cast_of[src]
                assert c["kind"] == "all_gather" and c["bytes"] == numel[param] * 2, (node.name, c)
                seen["gather"] += 1
            elif src in numel:  # an op reading the fp32 parameter itself (a norm's backward)
                assert c["bytes"] == numel[src] * 4, (node.name, c)
    # storage is pinned sharded, so most parameters are gathered; a few are read sharded where
    # that is as fast and lighter (solve.PEAK_TIE_BREAK)
    assert seen["gather"] >= len(numel) // 2 and seen["grad"] >= 2, seen
