"""autoshard.plan end to end in one process: a Linear on 2 devices priced by hand, GPT-2 small for
16 H100s, JSON, constraints."""

import json
import math
import re

import pytest
import torch

import autoshard
from autoshard import Cluster, DeviceSpec, LinkSpec, Plan
from autoshard.errors import ConstraintError, PlanError, PlanMismatchError
from autoshard.passes.annotate import META_KEY as COST_KEY
from autoshard.zoo import GPT, GPTConfig, MLP

pytestmark = pytest.mark.filterwarnings("ignore:autoshard.*planned replicated")

_PL = re.compile(r"R|S\((\d+)\)|P")


def _shard_factor(placements: str, mesh_shape) -> int:
    """'(S(1),R)' on mesh (2, 8) -> 2: the product of the mesh sizes of the sharded dims."""
    assert placements.startswith("(") and placements.endswith(")"), placements
    items = placements[1:-1].split(",")
    assert len(items) == len(mesh_shape), placements
    f = 1
    for item, m in zip(items, mesh_shape):
        assert _PL.fullmatch(item), placements
        if item.startswith("S"):
            f *= m
    return f


# ---------------------------------------------------------------------------- GPT-2 small, 16 GPUs
@pytest.fixture(scope="module")
def gpt2():
    with torch.device("meta"):
        model = GPT(GPTConfig.gpt2_small())
    idx = torch.zeros(8, 1024, dtype=torch.long, device="meta")
    traced = autoshard.trace(model, (idx, idx))
    cluster = Cluster.preset("dgx-h100", nodes=2)
    plan = autoshard.plan(traced, cluster)
    single_cluster = cluster.with_mesh((1,))
    single = autoshard.plan(traced, single_cluster)  # re-plans the same trace for one device
    return model, traced, cluster, plan, single_cluster, single


def test_gpt2_plan_basic(gpt2):
    model, _, cluster, plan, _, _ = gpt2
    assert cluster.world_size == 16 and plan.mesh_shape == (2, 8)
    assert plan.solver["status"] in ("optimal", "feasible")
    assert 0 < plan.step_time < math.inf
    assert 0 <= plan.breakdown["exposed_comm"] <= plan.comm_time
    assert plan.compute_time > 0 and plan.comm_time >= 0
    assert plan.solver["objective"] == pytest.approx(plan.step_time, rel=1e-6)
    assert 0 < plan.peak_memory <= cluster.memory_limit
    assert list(plan.storage) == [name for name, _ in model.named_parameters()]
    for name, pl in plan.storage.items():
        _shard_factor(pl, plan.mesh_shape)
    assert plan.fallbacks == []
    assert all(p.device.type == "meta" for p in model.parameters())


def test_gpt2_memory_by_hand(gpt2):
    model, _, _, plan, _, _ = gpt2
    params = dict(model.named_parameters())
    want = sum(params[n].numel() * 4 / _shard_factor(pl, plan.mesh_shape) for n, pl in plan.storage.items())
    assert plan.memory["params"] == pytest.approx(want, rel=1e-12)
    assert plan.memory["optimizer"] == pytest.approx(2 * want, rel=1e-12)  # Adam: two moments
    # the gradients backward has made by the peak's moment; every one of them at the optimizer step,
    # with foreach AdamW's temporary (the H100's: one more copy of the parameters)
    assert plan.memory["grads"] <= want * (1 + 1e-12)
    kept = plan.memory["working_params"] + plan.memory["buffers"]
    assert plan.memory_timeline[-1][0] == "optimizer step"
    # parameters, gradients, two moments, the temporary: five times the parameters' bytes
    assert plan.memory_timeline[-1][1] == pytest.approx(5 * want + kept + plan.memory["inputs"], rel=1e-12)
    inputs = sum(8 * 1024 * 8 / _shard_factor(pl, plan.mesh_shape) for pl in plan.inputs)
    assert plan.memory["inputs"] == pytest.approx(inputs, rel=1e-12)
    assert plan.memory["activations"] > 0
    # parameter count by hand (the LM head is tied to the token embedding, as in GPT-2):
    # embeddings, 12h^2 + 13h per block, final LayerNorm; sharding only shrinks the fp32 copy
    c = GPTConfig.gpt2_small()
    total = sum(p.numel() for p in params.values())
    assert total == c.vocab * c.hidden + c.seq * c.hidden + c.layers * (12 * c.hidden**2 + 13 * c.hidden) \
        + 2 * c.hidden
    assert plan.memory["params"] <= total * 4


def test_gpt2_parallel_beats_single_device(gpt2):
    _, traced, cluster, plan, single_cluster, single = gpt2
    assert single.solver["status"] == "optimal"
    assert single.comm_time == 0.0
    # one device: every strategy runs the whole op, so the step is the roofline sum over nodes
    d = single_cluster.device
    hand, flops = 0.0, 0.0
    for n in traced.gm.graph.nodes:
        if n.op != "call_function":
            continue
        c = n.meta[COST_KEY]
        flops += c.flops
        if c.flops or c.bytes:
            hand += max(c.flops / (d.flops(c.dtype) * d.compute_efficiency),
                        c.bytes / (d.memory_bandwidth * d.memory_efficiency)) + d.launch_overhead
    # plus AdamW on each whole parameter, foreach (the H100's, torch's default on CUDA): 20 passes
    # over its bytes, its kernels shared by every parameter (autoshard/cluster/costmodel.py)
    for _, node in traced.params:
        hand += 20 * node.meta["val"].nbytes / (d.memory_bandwidth * d.memory_efficiency)
    assert single.step_time == pytest.approx(hand, rel=1e-9)
    # by hand: 6 * tokens * (matmul weights) for the Linears (forward, input and weight gradients),
    # plus attention, 4*B*S^2*h forward and 10*B*S^2*h backward per layer (torch's sdpa counts)
    c = GPTConfig.gpt2_small()
    b, s, h = 8, c.seq, c.hidden
    assert flops == 6 * b * s * (c.layers * 12 * h * h + c.vocab * h) + 14 * b * s * s * h * c.layers
    assert plan.step_time < single.step_time
    # ... but no faster than perfect 16-way compute scaling allows
    peak = cluster.device.flops(torch.float32) * cluster.device.compute_efficiency
    assert plan.compute_time >= flops / 16 / peak * (1 - 1e-9)


def test_gpt2_plan_json_round_trip(gpt2):
    plan = gpt2[3]
    text = plan.to_json()
    again = Plan.from_json(text)
    assert again.to_json() == text
    assert again.storage == plan.storage and again.step_time == plan.step_time
    assert "stats" not in json.loads(text)


def test_gpt2_plan_summary(gpt2):
    plan = gpt2[3]
    text = plan.summary(max_rows=5)
    assert "step" in text and "parameter storage (148 parameters)" in text and "blocks.[0-11]." in text


# ---------------------------------------------------------------------------- one Linear, by hand
B, IN, OUT = 32, 16, 8
# Data parallelism on 2 ranks, node by node of the traced graph (Linear(16, 8) + mse_loss, which
# traces as torch's decomposition: (prediction - target) ** 2, its mean; backward 2/256 times the
# difference times the loss's gradient): the batch split, the parameters replicated, each rank's
# mean of its half a partial average, all-reduced for the loss.
DDP = {"primals_1": "->(R)", "primals_2": "->(R)", "primals_3": "->(S(0))", "primals_4": "->(S(0))",
       "t": "(R)->(R)", "addmm": "(R),(S(0)),(R)->(S(0))", "sub": "(S(0)),(S(0))->(S(0))",
       "pow_1": "(S(0))->(S(0))", "mean": "(S(0))->(P(avg))", "sub_1": "(S(0)),(S(0))->(S(0))",
       "mul": "(S(0))->(S(0))", "mul_1": "(S(0)),(R)->(S(0))", "t_1": "(S(0))->(S(1))",
       "mm": "(S(1)),(S(0))->(P)", "t_2": "(P)->(P)", "sum_1": "(S(0))->(P)", "view": "(P)->(P)", "t_3": "(P)->(P)"}
# round numbers: 1 GFLOP/s, 1 GB/s, 1 us per kernel; 10 us per ring step, 100 MB/s per rank
FLOPS, BW, LAUNCH, ALPHA, LINK = 1e9, 1e9, 1e-6, 1e-5, 1e8
# Seconds, by the formulas of docs/cost_model.md. Each kernel max(FLOPs / 1e9, bytes / 1e9) + 1 us,
# on its rank's share (half where the batch is split; 128 of the 256 prediction floats):
#   addmm, 16 rows: 2*16*16*8 = 4096 FLOPs (bytes: (8 + 512 + 128 + 256) * 4 / 2 = 1808)
#   sub, sub_1: read prediction and target, write their difference: 3 * 128 * 4 = 1536 bytes each
#   pow_1, mul (times 2/256): read 128 floats, write 128: 1024 bytes each
#   mean: reads 256, writes 1, halved as a whole (the scalar too): (256 + 1) * 4 / 2 = 514 bytes
#   mul_1 (times the loss's gradient): reads 256 and the scalar, writes 256: (513 * 4) / 2 = 1026 bytes
#   mm (weight gradient), 16 rows: 2*8*16*16 = 4096 FLOPs (bytes: (256 + 512 + 128) * 4 / 2 = 1792)
#   sum (bias gradient): (256 + 8) * 4 / 2 = 528 bytes
COMPUTE = (4096 + 2 * 1536 + 2 * 1024 + 514 + 1026 + 4096 + 528) / 1e9 + 9 * LAUNCH
# the loss's partial averages all-reduced (4 bytes): 2(p-1)/p * 4 / 1e8 + 2(p-1) * 10 us
LOSS = 4 / LINK + 2 * ALPHA
# the gradients' all-reduces, bucketed (one latency per bucket, left out): 2 * 1/2 * n / 1e8
GRADS = (8 * 16 + 8) * 4 / LINK
# AdamW per parameter: 9 kernels, 7 passes over its bytes
OPTIMIZER = 2 * 9 * LAUNCH + 7 * (8 * 16 + 8) * 4 / BW


def by_hand(seconds: float):
    """The same float terms summed in another order: equal up to rounding (pytest's default
    absolute 1e-12 would be 1e-8 of these steps)."""
    return pytest.approx(seconds, rel=1e-12, abs=0)


def linear_ddp(overlap: float = 0.0, grad_accumulation: int = 1) -> Plan:
    torch.manual_seed(0)
    model = MLP((IN, OUT))
    traced = autoshard.trace(model, (torch.randn(B, IN), torch.randn(B, OUT)))
    device = DeviceSpec("hand", {"float32": FLOPS}, memory_bandwidth=BW, memory=2**30, compute_efficiency=1.0,
                        memory_efficiency=1.0, launch_overhead=LAUNCH, comm_overlap=overlap)
    cluster = Cluster((2,), device=device, links=[LinkSpec("hand", latency=ALPHA, bandwidth=LINK, efficiency=1.0)])
    assert {n.name for n in traced.gm.graph.nodes if n.op == "call_function"} <= DDP.keys()
    return autoshard.plan(traced, cluster, allow=lambda node, s: str(s) == DDP.get(node.name, str(s)),
                          grad_accumulation=grad_accumulation)


def test_step_time_and_memory_by_hand():
    plan = linear_ddp()
    assert {n.name: n.strategy for n in plan.nodes if n.name in DDP} == DDP
    # nothing overlaps: every collective counts
    assert plan.compute_time == by_hand(COMPUTE)
    assert plan.comm_time == by_hand(LOSS + GRADS)
    assert plan.breakdown["exposed_comm"] == by_hand(LOSS + GRADS)
    assert plan.breakdown["optimizer"] == by_hand(OPTIMIZER)
    assert plan.breakdown["recompute"] == plan.breakdown["recompute_comm"] == 0.0
    assert plan.step_time == by_hand(COMPUTE + LOSS + GRADS + OPTIMIZER)
    # the ILP's objective, from its own rows: as far off as the solver's 1e-9 tolerances allow
    assert plan.solver["objective"] == pytest.approx(plan.step_time, rel=1e-9, abs=0)
    # bytes per rank: weight 8x16 and bias 8, fp32, replicated, with gradients and Adam's two moments
    params = (8 * 16 + 8) * 4
    want = {"params": params, "working_params": 0, "grads": params, "optimizer": 2 * params, "buffers": 0,
            "inputs": (B * IN + B * OUT) * 4 / 2,   # each rank's half of the batch
            "activations": B * OUT * 4 / 2,         # the prediction's rows, which the loss's backward reads
            "recomputed": 0,
            # while backward packs its bucket: each unreduced gradient (a full Partial) and its flat copy;
            # more than any op's working set here
            "transient": 2 * params,
            "grad_delivery": 0,
            "optimizer_step": 0}        # the peak is not the optimizer step's
    assert plan.memory == want
    # the start of backward: state, the batch, the saved prediction, the gradients in flight
    assert plan.peak_memory == 4 * params + want["inputs"] + want["activations"] + want["transient"]


# ---------------------------------------------------------------------------- tiny GPT
@pytest.fixture(scope="module")
def tiny():
    model = GPT(GPTConfig.tiny())
    inputs = model.example_inputs(2, generator=torch.Generator().manual_seed(0))
    return model, inputs, autoshard.trace(model, inputs)


def test_plan_accepts_model_or_traced(tiny):
    model, inputs, traced = tiny
    a = autoshard.plan(traced, Cluster.local(2))
    b = autoshard.plan(model, Cluster.local(2), inputs)
    assert a.fingerprint == b.fingerprint == traced.fingerprint
    assert a.storage == b.storage and a.step_time == pytest.approx(b.step_time, rel=1e-9)


def test_json_round_trip_tiny(tiny):
    _, _, traced = tiny
    p = autoshard.plan(traced, Cluster.local(4, (2, 2)))
    assert Plan.from_json(p.to_json()).to_json() == p.to_json()


@pytest.fixture(scope="module")
def tiny_plan_json(tiny):
    return autoshard.plan(tiny[2], Cluster.local(2)).to_json()


@pytest.mark.parametrize("mutate", [
    lambda t: t[: len(t) // 2],                                            # truncated file
    lambda t: "not a plan",
    lambda t: "[1, 2, 3]",
    lambda t: json.dumps({**json.loads(t), "schema": 999}),
    lambda t: json.dumps({k: v for k, v in json.loads(t).items() if k != "schema"}),
    lambda t: json.dumps({k: v for k, v in json.loads(t).items() if k != "nodes"}),
    lambda t: json.dumps({k: v for k, v in json.loads(t).items() if k != "step_time"}),
    lambda t: json.dumps({**json.loads(t), "nodes": [{"name": "x"}]}),
    lambda t: json.dumps({**json.loads(t), "nodes": 5}),
    lambda t: json.dumps({**json.loads(t), "unknown_field": 1}),
], ids=["truncated", "text", "list", "schema", "no-schema", "no-nodes", "no-step-time", "bad-node",
        "nodes-int", "extra-field"])
def test_corrupt_json_raises_plan_error(tiny_plan_json, mutate):
    text = tiny_plan_json
    Plan.from_json(text)  # the intact file reads
    with pytest.raises(PlanError):
        Plan.from_json(mutate(text))


def test_check_matches(tiny):
    _, _, traced = tiny
    cluster = Cluster.local(2)
    p = autoshard.plan(traced, cluster)
    p.check_matches(traced.fingerprint, cluster.to_json())
    with pytest.raises(PlanMismatchError):
        p.check_matches("0" * 16, cluster.to_json())
    with pytest.raises(PlanMismatchError):
        p.check_matches(traced.fingerprint, Cluster.local(4).to_json())


def test_pin_every_parameter_s0(tiny):
    model, _, traced = tiny
    free = autoshard.plan(traced, Cluster.local(2))
    pinned = autoshard.plan(traced, Cluster.local(2), constraints={"*": ["S(0)"]})
    assert list(pinned.storage) == [n for n, _ in model.named_parameters()]
    assert set(pinned.storage.values()) == {"(S(0))"}
    # a constraint only removes options: never better than the free optimum
    assert pinned.step_time >= free.step_time * (1 - 1e-9)


def test_pin_one_parameter_and_inputs(tiny):
    _, _, traced = tiny
    p = autoshard.plan(traced, Cluster.local(2), constraints={"wte.weight": "S(1)", "inputs": [["S(0)"], None]})
    assert p.storage["wte.weight"] == "(S(1))"
    assert p.inputs[0] == "(S(0))"


def test_pin_on_2d_mesh(tiny):
    _, _, traced = tiny
    p = autoshard.plan(traced, Cluster.local(4, (2, 2)), constraints={"blocks.*.fc.weight": ["S(0)", "R"]})
    assert p.storage["blocks.0.fc.weight"] == p.storage["blocks.1.fc.weight"] == "(S(0),R)"


@pytest.mark.parametrize("constraints, match", [
    ({"nonexistent.*": ["S(0)"]}, "nonexistent"),
    ({"*": ["X(0)"]}, "placement"),
    ({"*": ["S(0)", "R"]}, "placements"),
    ({"inputs": [["S(0)"]]}, "inputs"),
    ({"wte.weight": ["S(7)"]}, "wte.weight"),
])
def test_bad_constraint_raises(tiny, constraints, match):
    _, _, traced = tiny
    with pytest.raises(ConstraintError, match=match):
        autoshard.plan(traced, Cluster.local(2), constraints=constraints)


def test_unsatisfiable_shape_constraint_raises(tiny):
    _, _, traced = tiny
    # hidden 64 does not split 3 ways
    with pytest.raises(ConstraintError, match="ln_f.weight"):
        autoshard.plan(traced, Cluster.local(3), constraints={"ln_f.weight": ["S(0)"]})
