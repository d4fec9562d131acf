"""The loop users write, on real gloo processes (2 ranks, mesh (2,); 4 ranks, mesh (2, 2)):
AdamW + LR schedule + gradient clipping over 3 steps, and one SGD step accumulated over K = 4
micro-batches (``no_sync`` and ``grad_accumulation``), in fp32 and under the bf16 policy, each
against the same loop on one device under the same policy (tests/train_cases.py).

Tolerances. fp32: 1e-5 absolute on the loss, every gradient element, the norm and every
parameter, as tests/test_numerics.py (the runs differ only in the order of fp32 sums; measured:
gradients 1.5e-7, norms 2.4e-7, parameters after the AdamW steps 6.2e-6). The AdamW learning
rate is 1e-3 because AdamW divides each gradient by its own size, so a near-zero gradient turns a
1e-7 relative difference into a difference of up to lr. AdamW's and clipping's steps do not see a
gradient's scale (both divide by it), so gradients and norms are compared before them, and the
accumulated step is SGD with lr 1: it moves each parameter by its clipped gradient.

bf16 (``MixedPrecision(torch.bfloat16, torch.float32)``): bf16 keeps 8 significant bits. The
loss is itself a bf16 value, and sums taken in another order (per-rank partial sums, reduced in
fp32, rounded once) may round a logit, and so the loss, to the neighbouring bf16 number: losses
must agree to 2 units in the last place of bf16 at the loss's size (measured: 1). Gradients
from the same parameters (the first step, the accumulated one) agree to 2 bf16 steps (2 x 2^-8)
of the largest gradient (measured 0.9 x 2^-8), their norms, fp32 sums of ~10^5 of them whose
rounding errors average out, to 2^-10 relative (measured 9.4e-5). AdamW's first step moves every
element by lr whatever its gradient's size, so an element whose bf16 gradient is near zero and
flips sign ends 2 lr apart: steps 2 and 3 start from parameters that differ, and their gradients
agree to 2^-4 of the largest (measured 3.9%), their norms to 2^-7 (measured 0.37%); after the
three steps the parameters' distance from the single device's is at most 5% of how far the steps
moved them (measured 2.6%: the flipped elements are few). The SGD step moves a parameter by its
clipped gradient (clipping only shrinks), so it agrees as the gradients do.

Under inductor (the ``-inductor`` setups: ``compile(backend="inductor")``) the same loops run the
compiled programs against the same single-device eager loop. Loss, gradients and norms keep their
bounds. Fused kernels evaluate fp32 expressions in another order and keep bf16 elementwise chains
in fp32 between ops (eager rounds after each), so AdamW's sign flips of near-zero gradients (above)
happen in fp32 too: the fp32 parameters after three AdamW steps are bounded as the bf16 ones are,
relative to how far the steps moved them, at 1e-3 (measured 4.3e-5; the largest element 1.6e-5
apart, against eager's 6.2e-6), and bf16's at 10% (measured 6.1% and 6.2%, eager 2.6%). The
gradients accumulated in bf16 over K micro-batches agree to 4 bf16 steps of the largest
(measured 2.06; eager's bound is 2); the fp32 ones keep 1e-5 (measured 6e-8).

Collectives are counted by a dispatch mode on every rank of the eager setups (torch.compile does
not run under one, so the inductor setups' micro-batches are not counted): each micro-batch issues exactly its
emitted graphs' collectives, the first one adds the storage -> working gathers (once per step)
and the synchronizing one the gradient moves to storage (once per step), each bucketed into one
flat collective per mesh dim, kind and dtype; what each setup moves once is read off the module
and its collectives counted by hand (ONCE). The 2-D setup pins every parameter's storage: a
parameter stored ``(S(0), S(0))`` with a gradient ``(P, S(0))`` takes DTensor two collectives
where the cost model counts one (the outer shard of a nested pair cannot move without the inner:
one reduce-scatter would leave a strided layout).
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

import train_cases as tc
from autoshard.runtime.launch import run_local

pytestmark = pytest.mark.world(4)

ATOL = 1e-5
LR32, LR16 = 1e-3, 1e-2
BF16_GRAD, BF16_GRAD_LATER = 2 * 2**-8, 2**-4   # of the largest gradient
BF16_NORM, BF16_NORM_LATER = 2**-10, 2**-7      # relative
BF16_UPDATE = 0.05                               # of the distance the AdamW steps moved the parameters

SETUPS_2 = {
    # name: (mesh, constraints, policy, lr, global batch[, K the plan is priced for[, backend]]);
    # a batch of 64 makes DDP's gradient all-reduce cheaper than gathering activations, so the
    # plan has gradient collectives
    "ddp-fp32": (None, "ddp", None, LR32, 64),
    "megatron-fp32": (None, "megatron", None, LR32, 8),
    "fsdp-bf16-k4": (None, "fsdp", tc.BF16, LR16, 64, 4),  # planned for K = 4
    "ddp-fp32-inductor": (None, "ddp", None, LR32, 64, 1, "inductor"),
    "fsdp-bf16-k4-inductor": (None, "fsdp", tc.BF16, LR16, 64, 4, "inductor"),
}
SETUPS_4 = {
    "2d-ddp-fp32": ((2, 2), "ddp2d", None, LR32, 64),
    "2d-zero_x_tensor-bf16": ((2, 2), "zero_x_tensor", tc.BF16, LR16, 8, 4),
    "2d-data_x_tensor-fp32-inductor": ((2, 2), "data_x_tensor", None, LR32, 8, 1, "inductor"),
    "2d-zero_x_tensor-bf16-inductor": ((2, 2), "zero_x_tensor", tc.BF16, LR16, 8, 4, "inductor"),
}
# inductor's parameters after the AdamW steps (module doc): fp32 relative to how far the steps
# moved them, bf16 as the eager update bound, wider
INDUCTOR_UPDATE_FP32, INDUCTOR_UPDATE_BF16 = 1e-3, 0.1
INDUCTOR_BF16_GRAD = 4 * 2**-8   # of the largest gradient, summed over the K micro-batches

# name: ({(gradient's placements, storage)} of the gradients that move, {(storage, working copy)}
# of the parameters gathered once per step: what the module holds; the collectives micro-batch 0
# adds to its graphs', those the synchronizing one adds), counted by hand: one flat collective per
# kind, mesh dim and dtype (the tiny GPT's 0.4 MB of gradients fit one 64 MiB bucket), so one
# all-reduce per summed mesh dim, one reduce-scatter for all partial sums on mesh dim 0 into a
# shard on it (whichever tensor dim), one all-gather for all shards on mesh dim 0 gathered;
# gradients move in fp32 (the reduce dtype), working copies in the compute dtype.
F32, B16 = "torch.float32", "torch.bfloat16"
ONCE = {
    "ddp-fp32": ({("(P)", "(R)")}, set(), {}, {f"all_reduce_:{F32}": 1}),
    "megatron-fp32": ({("(P)", "(S(0))"), ("(P)", "(S(1))")}, {("(S(0))", "(R)"), ("(S(1))", "(R)")},
                      {f"all_gather_into_tensor:{F32}": 1}, {f"reduce_scatter_tensor:{F32}": 1}),
    "fsdp-bf16-k4": ({("(P)", "(S(0))")}, {("(S(0))", "(R)")},
                     {f"all_gather_into_tensor:{B16}": 1}, {f"reduce_scatter_tensor:{F32}": 1}),
    "2d-ddp-fp32": ({("(P,P)", "(R,R)")}, set(), {}, {f"all_reduce_:{F32}": 2}),
    "2d-zero_x_tensor-bf16": ({("(P,R)", "(S(0),R)"), ("(P,R)", "(S(1),R)"), ("(P,S(0))", "(S(1),S(0))"),
                               ("(P,S(1))", "(S(0),S(1))")}, {("(S(0),R)", "(R,R)"), ("(S(1),R)", "(R,R)")},
                              {f"all_gather_into_tensor:{B16}": 1}, {f"reduce_scatter_tensor:{F32}": 1}),
}


@pytest.fixture(scope="module")
def runs():
    return {2: run_local(tc.run_setups, 2, SETUPS_2, timeout=900),
            4: run_local(tc.run_setups, 4, SETUPS_4, timeout=900)}


CASES = [(2, n) for n in SETUPS_2] + [(4, n) for n in SETUPS_4]
EAGER = [(w, n) for w, n in CASES if not n.endswith("-inductor")]   # collectives counted (train_cases)


def _inductor(world: int, name: str) -> bool:
    spec = (SETUPS_2 if world == 2 else SETUPS_4)[name]
    return len(spec) > 6 and spec[6] == "inductor"


def _bf16_ulp(x: float) -> float:
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7)


def _off(errors: dict, bounds: dict) -> str:
    """Every check whose error exceeds its bound, named (not just the first)."""
    return ", ".join(f"{k} {errors[k]:.3g} > {bounds[k]:.3g}" for k in bounds if not errors[k] <= bounds[k])


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
        errors, bounds = {}, {}
        for i, want in enumerate(s["ref_norm"]):
            errors |= {f"loss{i}": abs(s["loss"][i] - s["ref_loss"][i]), f"grad{i}": s["grad"][i],
                       f"norm{i}": abs(s["norm"][i] - want)}
            if bf16:  # from step 2 on, the parameters AdamW moved differ (module doc)
                bounds |= {f"loss{i}": 2 * _bf16_ulp(s["ref_loss"][i]),
                           f"grad{i}": (BF16_GRAD_LATER if i else BF16_GRAD) * s["grad_scale"][i],
                           f"norm{i}": (BF16_NORM_LATER if i else BF16_NORM) * want}
        assert r["backend"] == ("inductor" if _inductor(world, name) else "eager"), (rank, r["backend"])
        assert (r["compiled_calls"] > 0) == _inductor(world, name), (rank, name, r["compiled_calls"])
        if bf16:
            errors["update"] = s["update"]
            bounds["update"] = INDUCTOR_UPDATE_BF16 if _inductor(world, name) else BF16_UPDATE
        elif _inductor(world, name):
            bounds = dict.fromkeys(errors, ATOL)
            errors["update"], bounds["update"] = s["update"], INDUCTOR_UPDATE_FP32
        else:
            errors["param"] = s["param"]
            bounds = dict.fromkeys(errors, ATOL)
        off = _off(errors, bounds)
        assert not off, f"rank {rank}, {name}: {off}"


@pytest.mark.parametrize("world,name", CASES)
@pytest.mark.parametrize("mode", ["accum", "accum_auto"])
def test_accumulation_equals_single_device_over_the_same_micro_batches(runs, world, name, mode):
    bf16 = (SETUPS_2 if world == 2 else SETUPS_4)[name][2] is not None
    for rank, res in enumerate(runs[world]):
        a = res[name][mode]
        assert a["grad_dtypes"] == ["torch.float32"], (rank, name, a["grad_dtypes"])
        errors = {"grad": a["grad"], "norm": abs(a["norm"] - a["ref_norm"]), "param": a["param"]}
        if bf16:
            steps = INDUCTOR_BF16_GRAD if _inductor(world, name) else BF16_GRAD
            bounds = {"grad": steps * a["grad_scale"], "norm": BF16_NORM * a["ref_norm"],
                      "param": steps * a["grad_scale"]}
        else:
            bounds = dict.fromkeys(errors, ATOL)
        off = _off(errors, bounds)
        assert not off, f"rank {rank}, {name}: {off}"


@pytest.mark.parametrize("world,name", EAGER)
def test_once_per_step_collectives_counted_match_a_hand_count(runs, world, name):
    grads, gathers, first, last = ONCE[name]
    for rank, res in enumerate(runs[world]):
        a = res[name]["accum"]
        moved = a["moves"].values()
        assert {(g, s) for g, s, _ in moved if g is not None and g != s} == grads, (rank, name, a["moves"])
        assert {(s, w) for _, s, w in moved if w is not None} == gathers, (rank, name, a["moves"])
        graph, kinds = Counter(a["graph_kinds"]), [Counter(k) for k in a["kinds"]]
        assert graph, (rank, name)
        # the first micro-batch also gathers the working copies the plan keeps for the step, once
        assert kinds[0] == graph + Counter(first), (rank, name, kinds[0], graph)
        # no_sync micro-batches issue exactly the emitted graphs' collectives: no gradient move
        assert kinds[1:-1] == [graph] * (tc.K - 2), (rank, name, kinds)
        # the synchronizing one adds the gradient moves to storage, once
        assert kinds[-1] == graph + Counter(last), (rank, name, kinds[-1], graph)
        assert res[name]["accum_auto"]["kinds"] == a["kinds"], (rank, name)


def test_compile_takes_the_accumulation_into_plan_and_module(runs):
    for world, setups in ((2, SETUPS_2), (4, SETUPS_4)):
        for name, spec in setups.items():
            k = spec[5] if len(spec) > 5 else 1
            for rank, res in enumerate(runs[world]):
                got = (res[name]["plan_k"], res[name]["module_k"])
                assert got == (k, k), (rank, name, got)


def test_bf16_parameter_gathers_move_bf16(runs):
    for world, setups in ((2, SETUPS_2), (4, SETUPS_4)):
        for name, spec in setups.items():
            if spec[2] is None:
                continue
            for rank, res in enumerate(runs[world]):
                a = res[name]["accum"]
                if _inductor(world, name):
                    # not counted (train_cases._accumulate): the graph gathers what the eager twin's
                    # graph gathers (the same pinned plan); the working copies are gathered outside
                    # the graphs, by the eager setups' code
                    twin = res[name.removesuffix("-inductor")]["accum"]["param_gathers"]
                    assert a["param_gathers"] == twin, (rank, name, a["param_gathers"], twin)
                    continue
                # gathers in the graph, at the parameter's consumers, and the working copies
                # gathered once per step (what micro-batch 0 adds to the graph's)
                once = Counter(a["kinds"][0]) - Counter(a["graph_kinds"])
                moved = a["param_gathers"] + [k.split(":")[1] for k in once.elements() if k.startswith("all_gather")]
                assert moved and set(moved) == {"torch.bfloat16"}, (rank, name, a["param_gathers"], once)


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
    from autoshard.passes.graph import value_of
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
