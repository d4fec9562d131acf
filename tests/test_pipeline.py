"""Pipeline stages, priced (autoshard/planning/pipeline.py): the schedules' bubble and in-flight
micro-batches against a simulated schedule and the published formula, the layer split against
brute force, the in-flight activations in the ILP's memory, and planning a transformers model
whose layers the stages do not divide. Run (autoshard/runtime/pipeline.py): 4 gloo processes
against the single-device step, and checkpoints across plans with and without stages."""

from __future__ import annotations

import itertools
import json
import math
import random

import pytest
import torch

import autoshard
from autoshard import _torch
from autoshard.errors import ConstraintError, InfeasibleError
from autoshard.planning import pipeline
from autoshard.planning.baselines import compare, plan_baseline
from autoshard.planning.driver import prepare, solve, trace
from autoshard.zoo import Llama, LlamaConfig, hf


def _simulate(schedule: str, p: int, m: int, v: int = 1, forward: float = 1.0, backward: float = 2.0):
    """Run GPipe, 1F1B or interleaved 1F1B on p ranks, each doing its own list of tasks in order
    as soon as their inputs exist, and return the makespan and each rank's most micro-batches
    between their forward and their backward (in units of all its layers: a chunk counts 1/v).

    Virtual stage j = c p + s is chunk c of rank s; F(j, i) follows F(j - 1, i), B(j, i) follows
    B(j + 1, i) and F(j, i). Rank order (Megatron's, and torch's): GPipe every forward then
    every backward; otherwise ``warm`` forwards, then forward-backward pairs, then the rest of the
    backwards, with warm = p - 1 - s (1F1B) or (v - 1) p + 2 (p - 1 - s) (interleaved), at most
    m v; interleaved forwards go in groups of p micro-batches, chunk by chunk (backwards with
    the chunks reversed)."""
    def order_of(s):
        def task(kind, k):
            c = (k // p) % v
            return kind, (v - 1 - c if kind == "B" else c) * p + s, (k // (p * v)) * p + k % p
        n = m * v
        if schedule == "gpipe":
            return [task("F", k) for k in range(n)] + [task("B", k) for k in range(n)]
        warm = min(p - 1 - s if v == 1 else (v - 1) * p + 2 * (p - 1 - s), n)
        ops, f, b = [task("F", k) for k in range(warm)], warm, 0
        while b < n:
            if f < n:
                ops.append(task("F", f))
                f += 1
            ops.append(task("B", b))
            b += 1
        return ops

    order = [order_of(s) for s in range(p)]
    last = p * v - 1
    done, clock, pos, most = {}, [0.0] * p, [0] * p, [0] * p
    while any(pos[s] < len(order[s]) for s in range(p)):
        moved = False
        for s in range(p):
            if pos[s] == len(order[s]):
                continue
            kind, j, i = order[s][pos[s]]
            deps = ([("F", j - 1, i)] if j > 0 else []) if kind == "F" else \
                [("F", j, i)] + ([("B", j + 1, i)] if j < last else [])
            if all(d in done for d in deps):
                begin = max([clock[s]] + [done[d] for d in deps])
                clock[s] = done[(kind, j, i)] = begin + (forward if kind == "F" else backward) / v
                pos[s] += 1
                moved = True
                live = sum(("F", c * p + s, i) in done and ("B", c * p + s, i) not in done
                           for c in range(v) for i in range(m))
                most[s] = max(most[s], live)
        assert moved, "the schedule deadlocked"
    return max(clock), [n / v for n in most]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 2), (2, 5), (4, 4), (4, 8), (3, 2)])
def test_bubble_and_held_match_a_simulated_schedule(schedule, p, m):
    makespan, most = _simulate(schedule, p, m)
    assert makespan == pytest.approx((m + pipeline.bubble(schedule, p)) * 3.0)
    assert most == [pipeline.held(schedule, p, m, s) for s in range(p)]


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 2, 4), (2, 3, 6), (4, 4, 16)])
def test_interleaved_matches_a_simulated_schedule(p, v, m):
    makespan, most = _simulate("interleaved", p, m, v)
    # the bubble also as Narayanan et al. (SC'21) publish it: (p - 1) / (v m) of the ideal step
    assert (makespan - m * 3.0) / (m * 3.0) == pytest.approx((p - 1) / (v * m))
    assert makespan == pytest.approx((m + pipeline.bubble("interleaved", p, v)) * 3.0)
    assert most == pytest.approx([pipeline.held("interleaved", p, m, s, v) for s in range(p)])


@pytest.mark.parametrize("p,m", [(2, 2), (2, 8), (4, 4), (4, 16), (8, 32)])
@pytest.mark.parametrize("work", [(1.0, 1.0, 1.0), (1.0, 1.3, 0.7), (2.0, 1.5, 1.5)])
def test_zero_bubble_idle_is_the_published_one(p, m, work):
    """torch's zero-bubble order with one program per rank is ZB-H1 (Qi et al., ICLR 2024): idle
    (p - 1)(F + I - W) where W <= F, holding at most p micro-batches, as 1F1B's first stage;
    with v programs per rank the idle time is 1/v of that, as interleaving divides 1F1B's."""
    f, i, w = work
    assert pipeline.zero_bubble_idle(p, m, 1, f, i, w) == pytest.approx((p - 1) * (f + i - w))
    assert [pipeline.held("zero-bubble", p, m, s) for s in range(p)] == [min(p, m)] * p
    if m % p == 0 and m >= p:
        assert pipeline.zero_bubble_idle(p, m, 2, f, i, w) == pytest.approx((p - 1) * (f + i - w) / 2)
    # never slower than 1F1B's (p - 1)(F + I + W), by 2 W (p - 1) exactly
    assert pipeline.zero_bubble_idle(p, m, 1, f, i, w) == pytest.approx(pipeline.bubble("1f1b", p) * (f + i + w)
                                                                        - 2 * w * (p - 1))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_zero_bubble_v_against_interleaved_zero_bubble(p, m):
    """ZB-V (Qi et al., section 6: two programs per rank in a V) in torch's order: as idle as the
    interleaved zero-bubble order of two programs per rank where F = I = W, less where the input
    gradient costs more than the weight's (attention's backward is all input part), no less where
    the forward costs most; with 2p micro-batches or more every rank holds p of them, as
    1F1B's first stage (the paper's peak); rank r runs programs r and 2p - 1 - r."""
    def idle(f, i, w, v_shape):
        return pipeline.zero_bubble_idle(p, m, 2, f, i, w, v_shape=v_shape)

    assert idle(1.0, 1.0, 1.0, True) == pytest.approx(idle(1.0, 1.0, 1.0, False))
    assert idle(1.0, 1.3, 0.7, True) < idle(1.0, 1.3, 0.7, False)
    assert idle(2.0, 1.5, 1.5, True) >= idle(2.0, 1.5, 1.5, False)
    assert [pipeline.held("zero-bubble-v", p, m, s, 2) for s in range(p)] == [float(p)] * p
    assert [pipeline.program_rank("zero-bubble-v", j, p) for j in range(2 * p)] == [*range(p), *reversed(range(p))]
    assert [pipeline.program_rank("zero-bubble", j, p) for j in range(2 * p)] == [*range(p)] * 2


def test_zero_bubble_v_prices_the_head_on_the_first_stage():
    """Under ZB-V the first rank runs the first program and the last: its time per micro-batch
    is its layers' plus the embeddings' and the head's, the other rank's its layers' alone."""
    model, inputs = _tiny_llama(4)
    cluster = autoshard.Cluster.preset("dgx-h100", nodes=2)
    if not _torch.RUNS_V_SCHEDULES:   # torch 2.11 cannot run it: the search says so and finds no plan
        with pytest.raises(ConstraintError, match="zero-bubble-v runs from torch 2.13 on"):
            pipeline.plan_pipeline(model, cluster, inputs, stages=2, micro_batches=4, schedules="zero-bubble-v")
        return
    zbv = pipeline.plan_pipeline(model, cluster, inputs, stages=2, micro_batches=4, schedules="zero-bubble-v",
                                 time_limit=60)
    split = pipeline.split_times(zbv.stage_plan, 2)
    assert zbv.schedule == "zero-bubble-v" and zbv.virtual == 2 and zbv.held == [2.0, 2.0]
    assert zbv.stage_times == pytest.approx([zbv.layers[0] * split.layer[0] + split.pre[0] + split.post[0],
                                             zbv.layers[1] * split.layer[0]])


def test_work_split_counts_each_matmul_where_it_runs():
    """L bias-free linear layers (ReLU between) to a summed loss, by hand: forward L products of
    2 b n^2 FLOPs; backward one per layer for its weight (the weight part) and one per layer but
    the first for the gradient carried on through the weight (the input part: the batch takes
    none). And a transformers model: the weight part is its linear weights' gradients, by hand."""
    layers, n, b = 3, 16, 4

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(n, n, bias=False) for _ in range(layers))

        def forward(self, x):
            for layer in self.layers:
                x = torch.relu(layer(x))
            return x.sum()

    total = 3 * layers - 1
    traced = trace(Stack(), (torch.randn(b, n),))
    assert pipeline.work_split(traced) == pytest.approx((layers / total, (layers - 1) / total, layers / total))
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from autoshard.passes.annotate import META_KEY

    model = hf.CausalLM(Qwen2ForCausalLM(hf._config(
        Qwen2Config, vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2)))
    ids = torch.randint(0, 128, (8, 16))
    traced = trace(model, (ids, ids))
    total = sum(n.meta[META_KEY].flops for n in traced.gm.graph.nodes
                if META_KEY in n.meta and n.meta[META_KEY].phase in ("fwd", "bwd"))
    # each linear weight (o, i) takes 2 T o i FLOPs for its gradient, T = 8 x 16 tokens
    linear = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "embed" not in name)
    fwd, inp, wgt = pipeline.work_split(traced)
    assert wgt == pytest.approx(2 * 8 * 16 * linear / total) and fwd + inp + wgt == pytest.approx(1)
    assert inp > wgt   # the input part also carries attention's backward


def test_a_backward_cut_in_two_computes_what_it_did_whole():
    """Zero bubble's two parts of a backward graph (runtime/module.py ``_split_backward``): the
    input part, then the weight part from what it hands on, give the whole graph's gradients
    exactly. The weight part is handed tensors alone: the layer norm's weight and bias gradients
    but not its input gradient, which the stage sends on at once."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from autoshard.runtime.module import _split_backward

    def backward(x, dy, *weights):   # parameters' gradients first, then the input's, as compiled
        x, weights = x.detach().requires_grad_(), [w.detach().requires_grad_() for w in weights]
        h = torch.nn.functional.layer_norm(x, (8,), weights[0], weights[1])
        y = torch.nn.functional.linear(torch.relu(h), weights[2], weights[3])
        return tuple(torch.autograd.grad(y, [*weights, x], dy))

    torch.manual_seed(0)
    args = [torch.randn(4, 8), torch.randn(4, 8), torch.randn(8), torch.randn(8), torch.randn(8, 8), torch.randn(8)]
    whole = make_fx(backward)(*args)
    inputs_part, weights_part = _split_backward(whole, 4)
    handed = inputs_part(*args)
    got = (*weights_part(*handed[1:]), handed[0])
    assert all(torch.equal(a, b) for a, b in zip(got, whole(*args)))
    assert all(isinstance(t, torch.Tensor) for t in handed[1:]) and not any(t is handed[0] for t in handed[1:])
    # one matmul each: the output gradient with the weight (carried on), with the saved input (the weight's)
    mms = [sum(n.target is torch.ops.aten.mm.default for n in g.graph.nodes) for g in (inputs_part, weights_part)]
    assert mms == [1, 1], mms


def test_balance_is_the_best_contiguous_split():
    rng = random.Random(0)
    for _ in range(60):
        layers, stages, least = rng.randint(2, 9), rng.randint(2, 4), rng.choice([1, 1, 2])
        if layers < stages * least:
            continue
        layer, pre, post = rng.uniform(0.5, 2), rng.uniform(0, 4), rng.uniform(0, 4)
        head = rng.choice([stages - 1, stages - 1, 0])   # the last stage, or the first (ZB-V's V)
        time = lambda counts: max(n * layer + (pre if s == 0 else 0) + (post if s == head else 0)  # noqa: E731
                                  for s, n in enumerate(counts))
        best = min(time(c) for c in itertools.product(range(least, layers + 1), repeat=stages) if sum(c) == layers)
        counts = pipeline.balance(layers, stages, layer, pre, post, least, head=head)
        assert sum(counts) == layers and min(counts) >= least
        assert time(counts) == pytest.approx(best)
        # and the most even of the best: no best split has a smaller spread of layers
        spread = min(max(c) - min(c) for c in itertools.product(range(least, layers + 1), repeat=stages)
                     if sum(c) == layers and time(c) <= best * (1 + 1e-9))
        assert max(counts) - min(counts) == spread


def _tiny_llama(layers: int):
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**{**LlamaConfig.tiny().__dict__, "layers": layers}))
    return model, model.example_inputs(8)


def test_held_micro_batches_add_their_saved_activations():
    """A stage holding 3 micro-batches holds 2 more copies of what one saves, in forward and
    every phase of backward: the step is as fast, the peak larger, and the least memory any
    plan needs grows."""
    model, inputs = _tiny_llama(2)
    cluster = autoshard.Cluster.preset("dgx-h100")
    traced = prepare(trace(model, inputs), cluster, inputs, False)[0]
    one = solve(traced, cluster, None, float("inf"), False, 60)[1]
    three = solve(traced, cluster, None, float("inf"), False, 60, held_batches=3.0)[1]
    assert three.objective == pytest.approx(one.objective, rel=2e-3)
    own = sum(three.memory.saved_by_node.values())   # one micro-batch's, under three's plan
    assert own > 0 and three.memory.moment not in ("optimizer step", "end of backward")
    assert 2 * own < three.memory["activations"] <= 3 * own * (1 + 1e-9)

    def least(hold):
        with pytest.raises(InfeasibleError) as err:
            solve(traced, cluster, None, 1.0, False, 60, held_batches=hold)
        return err.value.min_memory

    assert least(3.0) > least(1.0)


def test_a_stage_plans_parts_add_up_to_its_step():
    """Split into one layer, the ops before the layers and after them, per micro-batch and once
    per step, the plan's own step comes back whole, and each op is where it runs."""
    model, inputs = _tiny_llama(3)
    cluster = autoshard.Cluster.preset("dgx-h100")
    options = dict(recompute=True, time_limit=60, roles=None, strict=False)
    _, sp = pipeline._stage_plan(model, pipeline.micro_batch(inputs, 2), cluster, 3, 2, [2.0, 1.0],
                                 cluster.memory_limit, options)
    per_mb, once = pipeline.split_times(sp, 3).of(3, True, True)
    assert 2 * per_mb + once == pytest.approx(sp.step_time, rel=1e-9)
    part = pipeline.parts(sp)
    where = lambda op: {part[n.name] for n in sp.nodes if n.op == op}  # noqa: E731
    assert where("aten.embedding.default") == where("aten.embedding_dense_backward.default") == {"pre"}
    assert where("aten._log_softmax.default") == where("aten._log_softmax_backward_data.default") == {"post"}
    assert where("aten.mm.default") == {"layer", "post"}   # the layers' projections, the head


def test_a_stage_sends_its_hidden_state():
    """What crosses a boundary is the hidden state of a micro-batch, batch x sequence x hidden x 4
    bytes (float32), and nothing else; a stage of S devices sends S pieces of it over the outer
    link and gathers them over its own: the sends are that formula, whatever the plan's placement."""
    model, inputs = _tiny_llama(4)
    cfg = LlamaConfig.tiny()   # what _tiny_llama builds, but for its layer count
    options = dict(recompute=False, time_limit=60, roles=None, strict=False)
    traced, _ = pipeline._stage_plan(model, pipeline.micro_batch(inputs, 2), autoshard.Cluster.local(1), 2, 2,
                                     [1.0, 1.0], float("inf"), options)   # the solve marks the layers
    whole = pipeline.boundary_bytes(traced)
    assert whole == 4 * cfg.seq * cfg.hidden * 4
    cluster = autoshard.Cluster.preset("dgx-h100", nodes=2)
    pp = pipeline.plan_pipeline(model, cluster, inputs, stages=2, micro_batches=2, schedules="1f1b", time_limit=60)
    net, nvlink = cluster.links
    hop = net.latency + whole / 8 / net.effective_bandwidth + 7 / 8 * whole / nvlink.effective_bandwidth \
        + 7 * nvlink.latency   # the ring all-gather over the 8 GPUs of a node
    assert pp.send_time == pytest.approx((2 + 1) * 2 * hop)
    # under bf16 compute the hidden state crosses in bf16: half the bytes
    policy = autoshard.MixedPrecision(torch.bfloat16)
    traced, _ = pipeline._stage_plan(model, pipeline.micro_batch(inputs, 2), autoshard.Cluster.local(1), 2, 2,
                                     [1.0, 1.0], float("inf"), dict(options, mixed_precision=policy))
    assert pipeline.boundary_bytes(traced) == whole / 2


def test_a_transformers_model_whose_layers_the_stages_do_not_divide():
    """3 layers of a transformers Qwen2 over 2 stages: uneven stages, the user's model left whole,
    and the step as the schedule's formula of the parts."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = hf.CausalLM(Qwen2ForCausalLM(hf._config(
        Qwen2Config, vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2)))
    ids = torch.randint(0, 128, (8, 16))
    stack = pipeline.repeated_module(model)[2]
    cluster = autoshard.Cluster.preset("dgx-h100", nodes=2)
    pp = pipeline.plan_pipeline(model, cluster, (ids, ids), stages=2, micro_batches=4, schedules="1f1b",
                                time_limit=60)
    assert pipeline.repeated_module(model)[2] is stack and len(stack) == len(model.model.model.layers) == 3

    assert sorted(pp.layers) == [1, 2] and pp.stage_mesh == (8,) and pp.held == [2.0, 1.0]
    assert pp.peak_memory <= pp.memory_limit
    worst = max(pp.stage_times)
    assert pp.bubble_time == pytest.approx(worst)   # p - 1 = 1 slot
    assert pp.step_time == pytest.approx(4 * worst + pp.bubble_time + max(pp.stage_once) + pp.send_time)
    # the stage with the head (its last) is the slower per layer: it got fewer
    assert pp.layers == [2, 1] and pp.stage_times[1] > pp.stage_times[0] / 2
    # zero bubble, one program per rank (ZB-H1): idle (p - 1)(F + I - W) of the slowest stage's
    # micro-batch split as the model cut to two layers splits its FLOPs; every stage holds p
    zb = pipeline.plan_pipeline(model, cluster, (ids, ids), stages=2, micro_batches=4, schedules="zero-bubble",
                                virtual=1, time_limit=60)
    with pipeline.cut_to(model, 2) as cut:
        f, i, w = pipeline.work_split(trace(cut, pipeline.micro_batch((ids, ids), 4)))
    worst = max(zb.stage_times)
    assert zb.schedule == "zero-bubble" and zb.held == [2.0, 2.0] and zb.virtual == 1
    assert zb.bubble_time == pytest.approx((f + i - w) * worst) and zb.bubble_time < 0.5 * worst
    assert zb.step_time == pytest.approx(4 * worst + zb.bubble_time + max(zb.stage_once) + zb.send_time)
    with pytest.raises(autoshard.errors.ClusterError, match="initialized process group"):
        autoshard.compile(model, cluster, (ids, ids), plan=pp)   # runs on ranks, as without stages
    again = pipeline.PipelinePlan.from_json(pp.to_json())
    assert again.to_json() == pp.to_json() and again.layers == pp.layers and again.stage_plan == pp.stage_plan
    with pytest.raises(autoshard.errors.PlanError, match="not a pipeline plan"):
        pipeline.PipelinePlan.from_json(pp.stage_plan.to_json())


def test_fsdp_tp_pp_is_fsdp_and_tp_inside_each_stage():
    model, inputs = _tiny_llama(4)
    cluster = autoshard.Cluster.preset("dgx-h100", nodes=2)
    pp = plan_baseline(model, cluster, "fsdp_tp_pp+recompute", inputs, time_limit=60)
    assert pp.stages == 2 and pp.stage_mesh == (8,) and pp.layers == [2, 2]
    # tp on the stage's inner dim: the layers' weights are split there, stored and used
    storage = [pl for name, pl in pp.stage_plan.storage.items() if "blocks" in name and "norm" not in name]
    assert storage and all("S" in pl for pl in storage)
    assert all(n.recompute for n in pp.stage_plan.nodes if n.layer is not None and n.op == "aten.mm.default"
               and n.phase == "fwd")
    with pytest.raises(ConstraintError, match="plan it with plan_baseline"):
        compare(model, cluster, inputs, baselines=["fsdp_tp_pp"])


def test_stages_over_each_logical_mesh():
    """``meshes``: the stages may cut the outer dim of another grid of the same devices; the plan
    is the fastest of plan_pipeline on each grid alone, and records the grid it cut."""
    model, inputs = _tiny_llama(4)
    cluster = autoshard.Cluster.preset("dgx-h100", nodes=2)
    options = dict(stages=[2, 4], micro_batches=4, schedules="1f1b", time_limit=60)
    both = pipeline.plan_pipeline(model, cluster, inputs, meshes=[(2, 8), (16,)], **options)
    own = pipeline.plan_pipeline(model, cluster, inputs, stages=2, micro_batches=4, schedules="1f1b",
                                 time_limit=60)
    flat = pipeline.plan_pipeline(model, cluster.with_mesh((16,)), inputs, **options)
    assert own.mesh_shape == (2, 8) and flat.mesh_shape == (16,) and flat.stage_mesh in ((8,), (4,))
    assert both.step_time == pytest.approx(min(own.step_time, flat.step_time))
    assert both.mesh_shape == min([own, flat], key=lambda p: p.step_time).mesh_shape
    # 4 stages do not cut the 2 nodes of the own grid: recorded, not raised; they do cut (16,)
    assert both.stats["candidates"]["(2, 8) pp4"] is None and "stage counts that do" in both.stats["errors"]["(2, 8) pp4"]
    assert both.stats["candidates"]["(16,) pp4 m4 1f1b"] == pytest.approx(flat.stats["candidates"]["pp4 m4 1f1b"])
    again = pipeline.PipelinePlan.from_json(both.to_json())
    assert again.mesh_shape == both.mesh_shape and again.mesh_dim_names == both.mesh_dim_names
    legacy = {k: v for k, v in json.loads(both.to_json()).items() if k not in ("mesh_shape", "mesh_dim_names")}
    assert pipeline.PipelinePlan.from_json(json.dumps(legacy)).mesh_shape is None   # a file from before: its cluster's
    with pytest.raises(ConstraintError, match="roles name the dims of the cluster's own mesh"):
        pipeline.plan_pipeline(model, cluster, inputs, meshes=[(16,)], roles=("fsdp", "tp"))


def test_bad_input_names_what_works():
    model, inputs = _tiny_llama(4)
    cluster = autoshard.Cluster.preset("dgx-h100", nodes=2)
    with pytest.raises(ConstraintError, match=r"does not split into 3 .*\[2, 4, 8\]"):
        pipeline.plan_pipeline(model, cluster, inputs, stages=2, micro_batches=3)
    with pytest.raises(ConstraintError, match=r"stage counts that do: \[2\]"):
        pipeline.plan_pipeline(model, cluster, inputs, stages=4, micro_batches=4)
    with pytest.raises(ConstraintError, match="unknown schedule"):
        pipeline.plan_pipeline(model, cluster, inputs, schedules=("zb",))
    mlp, mlp_inputs = autoshard.zoo.get("mlp", "tiny")   # a ModuleList of Linear layers of other shapes
    with pytest.raises(ConstraintError, match="no repeated layers"):
        pipeline.plan_pipeline(mlp, cluster, mlp_inputs)


# --- the runtime: 4 gloo processes --------------------------------------------------------------
RUNS = {"1f1b-fsdp": ("llama", "1f1b", ("dp", "fsdp"), True),
        "interleaved-free": ("llama", "interleaved", None, False),
        "qwen2-gpipe-free": ("qwen2", "gpipe", None, False),
        "1f1b-free-bf16": ("llama-bf16", "1f1b", None, False),
        "zero-bubble-free": ("llama", "zero-bubble", None, False),
        # torch 2.11 cannot run ZB-V on gloo (autoshard/_torch.py: RUNS_V_SCHEDULES): refused in planning
        **({"zero-bubble-v-fsdp": ("llama", "zero-bubble-v", ("dp", "fsdp"), False)}
           if _torch.RUNS_V_SCHEDULES else {})}


@pytest.fixture(scope="module")
def pipeline_runs(tmp_path_factory):
    import pipeline_cases

    from autoshard.runtime.launch import run_local

    # every rank plans the pipeline, then each stage plans its programs while the other waits: a
    # loaded machine needs more than the default 2 minutes for a collective
    return run_local(pipeline_cases.run_cases, 4, RUNS, str(tmp_path_factory.mktemp("pp")), timeout=1200,
                     pg_timeout=900)


@pytest.mark.world(4)
@pytest.mark.parametrize("case", sorted(RUNS))
def test_a_pipeline_step_matches_the_single_device_step(pipeline_runs, case):
    """2 stages x 2 ranks, 4 micro-batches: loss, gradients and parameters after an SGD step
    within 1e-5 of the model run whole on one device; each rank holds its stages' layers only.

    Under bf16 compute (fp32 master weights) the reference is the whole model under the same
    policy, and the bounds are tests/test_training_loop.py's for accumulated micro-batches: the
    loss (a bf16 value, the mean of 4 micro-batches' here) within 2 units in bf16's last place at
    its size, gradients within 4 bf16 steps (4 x 2^-8) of the largest, and so the SGD step (lr
    0.1) within 0.1 of that; the norm, an fp32 sum, within 2^-10 relative."""
    first, last = {0, 1}, {2, 3}
    for rank, res in enumerate(pipeline_runs):
        r = res[case]
        if case.endswith("bf16"):
            ulp = 2.0 ** (math.floor(math.log2(abs(r["loss_ref"]))) - 7)
            step = 4 * 2.0 ** -8 * r["largest_grad"]
            assert r["loss"] <= 2 * ulp and r["grad"] <= step and r["param"] <= 0.1 * step, (rank, case, r)
            assert r["grad2"] <= step and r["norm"] <= 2.0 ** -10, (rank, case, r)
            assert r["policy"] == "param=torch.bfloat16,reduce=torch.float32" and r["loss_dtype"] == "torch.bfloat16"
            assert "made for mixed_precision param=torch.bfloat16" in r["policy_error"], r
        else:
            assert r["loss"] < 1e-5 and r["grad"] < 1e-5 and r["param"] < 1e-5, (rank, case, r)
            assert r["grad2"] < 1e-5 and r["norm"] < 1e-6, (rank, case, r)   # the second step's, from the new weights
        assert r["is_dtensor"], (rank, case)
        assert "compiled for a global batch of [((8, 16), torch.int64)" in r["wrong_batch"], r["wrong_batch"]
        layers = {int(n.split("layers.")[1].split(".")[0]) if "layers." in n else int(n.split(".")[1])
                  for n in r["names"] if n.startswith("blocks.") or ".layers." in n}
        if case.startswith(("interleaved", "zero-bubble")):   # 4 programs of one layer
            # rank r holds programs r mod 2 and + 2; under ZB-V a V: rank r holds r and 3 - r
            own = ([0, 3] if rank in first else [1, 2]) if "-v-" in case else ([0, 2] if rank in first else [1, 3])
            assert r["stage_programs"] == own and layers == set(own), (rank, r["stage_programs"], r["names"])
            kind = {"interleaved": "ScheduleInterleaved1F1B", "zero-bubble": "ScheduleInterleavedZeroBubble",
                    "zero-bubble-v": "ScheduleZBVZeroBubble"}
            assert r["schedule"] == kind[case.rsplit("-", 1)[0]], r["schedule"]
            # zero bubble runs each backward's weight part apart, and all of them by the step's end
            assert r["split"] == [(case.startswith("zero"), 0)] * 2, r["split"]
            if case.startswith("zero"):   # both parts do matrix products: weights' and the gradient carried on,
                # but for the first program, whose input (the batch) takes no gradient
                assert all((i > 0) == (j > 0) and w > 0 for j, (i, w) in zip(r["stage_programs"], r["split_mms"])), \
                    r["split_mms"]
        else:
            assert r["stage_programs"] == ([0] if rank in first else [1])
            assert r["schedule"] == ("ScheduleGPipe" if "gpipe" in case else "Schedule1F1B")
            assert layers == ({0, 1} if rank in first else {2, 3}), (rank, r["names"])
        # qwen2's plan cut the logical mesh (4,): each stage's parameters live on its "world" dim
        assert r["mesh"] == ((4,) if case.startswith("qwen2") else (2, 2)), r["mesh"]
        assert r["pieces"] == 2   # each rank sends half of what crosses a boundary; its stage gathers
        assert r["stage_dims"] == ([("world",)] if case.startswith("qwen2") else [("d1",)]), r["stage_dims"]
        embed, head = ("embed.weight", "head.weight") if not case.startswith("qwen2") else \
            ("model.model.embed_tokens.weight", "model.lm_head.weight")
        with_head = first if "-v-" in case else last   # the V ends where it started
        assert (embed in r["names"]) == (rank in first) and (head in r["names"]) == (rank in with_head), r["names"]


@pytest.mark.world(4)
def test_checkpoints_move_between_pipeline_and_flat_plans(pipeline_runs):
    """DCP: the pipeline's state loads into a plan without stages, and that one's into a new
    pipeline started from other weights; both end at the trained values exactly."""
    for rank, res in enumerate(pipeline_runs):
        r = res["1f1b-fsdp"]
        assert r["pp_to_flat"] == 0.0 and r["flat_to_pp"] == 0.0, (rank, r)
        assert r["flat_near_reference"] < 1e-5, (rank, r)   # every stage's entries, not one
        assert r["before_load"] > 1e-3, (rank, r)   # the new pipeline did start elsewhere


def test_plan_with_stages_returns_the_faster_of_both():
    """``plan(stages=...)``: whichever of the plan without stages and the best pipeline plan is
    predicted faster, each as planned on its own, the other's step recorded."""
    model, inputs = _tiny_llama(4)
    cluster = autoshard.Cluster.preset("dgx-h100", nodes=2)
    flat = autoshard.plan(model, cluster, inputs, time_limit=60)
    pp = pipeline.plan_pipeline(model, cluster, inputs, stages=2, time_limit=60)
    best = autoshard.plan(model, cluster, inputs, stages=2, time_limit=60)
    winner, loser = sorted([flat, pp], key=lambda p: p.step_time)
    assert type(best) is type(winner) and best.step_time == pytest.approx(winner.step_time)
    assert best.stats["other_step_time"] == pytest.approx(loser.step_time)
    from autoshard.zoo import MLP

    mlp = MLP()   # no stack of identical layers: the plan without stages, with a warning that says why
    with pytest.warns(UserWarning, match="no plan with stages"):
        alone = autoshard.plan(mlp, cluster, mlp.example_inputs(8) if hasattr(mlp, "example_inputs") else
                               (torch.randn(8, 32), torch.randn(8, 16)), stages=2, time_limit=60)
    assert "ConstraintError" in alone.stats["other_error"]["pipeline"]
    with pytest.raises(ConstraintError, match="nn.Module, not a traced model"):
        autoshard.plan(autoshard.trace(model, inputs), cluster, stages=2)
    with pytest.raises(ConstraintError, match="take no grad_accumulation"):
        autoshard.plan(model, cluster, inputs, stages=2, grad_accumulation=2)


def test_a_weight_two_stages_share_is_refused():
    """GPT-2's LM head is its token embedding: on two stages each would train its own copy."""
    from autoshard.runtime.pipeline import _cut
    from autoshard.zoo import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny())
    batch = pipeline.micro_batch(model.example_inputs(8), 4)
    with pytest.raises(ConstraintError, match="are one weight, used by pipeline stages \\[0, 1\\]"):
        _cut(model, [1, 1], batch)
