"""Simulated ranks (autoshard/runtime/simulate.py): a plan's emitted module, every rank in this process
under torch's LocalTensorMode, trained like the same model on one device.

FSDP-like and Megatron-like (tensor-parallel) plans on 2 and 4 ranks and a data x tensor plan on
a (2, 2) mesh, each made with the roles :mod:`autoshard.baselines` builds its baselines from, for
the zoo's tiny GPT and transformers' Llama (from a config): three AdamW steps on three batches,
every loss and every parameter after the last step against the single-device run. Also: pieces
handed to the wrong rank are caught; a plan that keeps gathered parameter copies follows AdamW's
foreach step (its default on GPUs); ranks' graphs that differ in more than integers are refused.
No process is started; the file takes about 55 s of CPU (torch 2.13, 2.15).
"""

from __future__ import annotations

import functools
import math
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate

import autoshard
from autoshard import zoo
from autoshard.runtime import simulate
from autoshard.errors import ClusterError, RuntimeMismatchError
from autoshard.planning.roles import allow_for

# fp32, 3 AdamW steps at lr 1e-3. AdamW divides each gradient element by its running scale, so
# an element that is all rounding noise moves by up to lr whichever way the noise goes: parameters
# are held to 10% of one step, and the deviation of all of them together to 0.1% of how far the
# steps moved them. Measured on torch 2.13 and 2.11: losses within 4.8e-7, parameters within
# 1.9e-5, the deviation 5.8e-5 of the update at most (4-way tensor parallel GPT).
LOSS_ATOL = 1e-5
PARAM_ATOL = 1e-4
UPDATE_RTOL = 1e-3
STEPS = 3

KINDS = {  # name: (mesh shape for a world size, roles of its dims)
    "fsdp": (lambda w: (w,), ("fsdp",)),
    "megatron": (lambda w: (w,), ("tp",)),
    "data_x_tensor": (lambda w: (2, w // 2), ("dp", "tp")),
}
# every kind on every world size its mesh allows, the zoo's GPT or transformers' Llama
CASES = [("hf_llama3", "fsdp", 2), ("gpt", "fsdp", 4), ("gpt", "megatron", 2), ("hf_llama3", "megatron", 2),
         ("gpt", "megatron", 4), ("gpt", "data_x_tensor", 4)]


@pytest.fixture(scope="module")
def setups():
    """name -> (model, batches, traced model, single-device run): one of each per model."""
    cache = {}

    def get(name: str):
        if name not in cache:
            model, _ = zoo.get(name, "tiny")
            batches = [zoo.get(name, "tiny", seed=s)[1] for s in range(STEPS)]  # the same weights, other batches
            traced = autoshard.trace(model, batches[0])
            cache[name] = (model, batches, traced, simulate.single_device(model, batches))
        return cache[name]

    return get


def _plan(traced, kind: str, world: int) -> autoshard.Plan:
    shape, roles = KINDS[kind]
    return autoshard.plan(traced, autoshard.Cluster.local(world, shape(world)), allow=allow_for(traced, roles))


@pytest.mark.parametrize("name,kind,world", CASES, ids=[f"{n}-{k}-{w}" for n, k, w in CASES])
def test_simulated_ranks_train_like_one_device(setups, name, kind, world):
    model, batches, traced, ref = setups(name)
    plan = _plan(traced, kind, world)
    # the plan is of the kind it is named for: its inputs split along the batch on data dims only
    split = {"fsdp": ["(S(0))"] * 2, "megatron": ["(R)"] * 2, "data_x_tensor": ["(S(0),R)"] * 2}[kind]
    assert plan.inputs == split and math.prod(plan.mesh_shape) == world, (plan.inputs, plan.mesh_shape)
    assert any("S(" in s for s in plan.storage.values()), "the plan shards no parameter"
    sim = simulate.run_ranks(model, plan, batches)
    assert len(sim.losses) == STEPS and sim.params.keys() == ref.params.keys()
    loss_err = max(abs(a - b) for a, b in zip(sim.losses, ref.losses))
    param_err = max((sim.params[k] - ref.params[k]).abs().max().item() for k in ref.params)
    start = dict(model.named_parameters())   # (run_ranks and single_device train copies)
    off = math.sqrt(sum((sim.params[k] - ref.params[k]).square().sum().item() for k in ref.params))
    moved = math.sqrt(sum((ref.params[k] - start[k]).square().sum().item() for k in ref.params))
    assert loss_err < LOSS_ATOL, (sim.losses, ref.losses)
    assert param_err < PARAM_ATOL and off < UPDATE_RTOL * moved, (param_err, off / moved)
    # the steps moved every parameter by about lr: a run that did nothing would fail
    assert min((ref.params[k] - start[k]).abs().max().item() for k in ref.params) > 10 * PARAM_ATOL


def test_pieces_on_the_wrong_rank_are_caught(setups, monkeypatch):
    """Each rank handed the next rank's pieces of every parameter (a placement read at the wrong
    mesh coordinate): the first loss already differs from the single device's by well over the
    bound above, and the parameters after the step by far more. (How far the loss moves depends
    on which dims the plan shards: a tiny GPT at initialization scores nearly uniformly, and
    with the embeddings split along their features the swap permutes the residual stream
    consistently; measured 3e-4.)"""
    model, batches, traced, ref = setups("gpt")
    plan = _plan(traced, "fsdp", 2)
    local_tensor = simulate._torch.local_tensor

    def rotated(per_rank):
        return local_tensor({r: per_rank[(r + 1) % len(per_rank)] for r in per_rank})

    monkeypatch.setattr(simulate._torch, "local_tensor", rotated)
    sim = simulate.run_ranks(model, plan, batches[:1])
    assert abs(sim.losses[0] - ref.losses[0]) > 10 * LOSS_ATOL, (sim.losses, ref.losses)
    first = simulate.single_device(model, batches[:1])
    assert max((sim.params[k] - first.params[k]).abs().max().item() for k in first.params) > 100 * PARAM_ATOL


def test_kept_working_copies_follow_foreach_steps(setups, monkeypatch):
    """A ZeRO-2-like plan (every parameter stored sharded, gathered once a step and the copy
    kept) under AdamW's foreach step, its default on GPUs. That step updates DTensor parameters
    in place without bumping their version counters; a copy kept by version alone computed the
    second step with the first step's weights (its loss 4.8622 against 4.8632)."""
    model, batches, traced, _ = setups("gpt")
    names = {node.name: name for name, node in traced.params}
    gathered = lambda node, s: (node.op != "placeholder" or node.name not in names  # noqa: E731
                                or tuple(s.outputs[0]) == (Replicate(),))
    plan = autoshard.plan(traced, autoshard.Cluster.local(2), constraints={"inputs": [["S(0)"]] * 2, "*": ["S(0)"]},
                          allow=gathered)
    assert all(plan.strategy_of(node) == "->(R)" and plan.storage[name] == "(S(0))" for node, name in names.items())
    monkeypatch.setattr(torch.optim, "AdamW", functools.partial(torch.optim.AdamW, foreach=True))
    sim, ref = simulate.run_ranks(model, plan, batches[:2]), simulate.single_device(model, batches[:2])
    assert max(abs(a - b) for a, b in zip(sim.losses, ref.losses)) < LOSS_ATOL, (sim.losses, ref.losses)


def test_graphs_that_differ_beyond_integers_are_refused():
    """Rank graphs merge where they differ in integers only (one value per rank); a different op
    is named in the error."""
    def graph(op, k: int) -> fx.GraphModule:
        g = fx.Graph()
        x = g.placeholder("x")
        g.output(g.call_function(op, (x, k)))
        return fx.GraphModule({}, g)

    ranks = [graph(torch.ops.aten.mul.Tensor, r) for r in range(2)]
    simulate._per_rank_constants("forward", ranks)
    assert [n.target for n in ranks[0].graph.nodes].count(simulate._torch.local_int) == 1
    x = simulate._torch.local_tensor({0: torch.ones(2), 1: torch.ones(2)})
    with simulate._torch.simulated_ranks(2):
        out = ranks[0](x)   # rank 0's graph, run for both: x * 0 on rank 0, x * 1 on rank 1
    assert [v.tolist() for v in simulate._torch.rank_values(out).values()] == [[0.0, 0.0], [1.0, 1.0]]
    with pytest.raises(RuntimeMismatchError, match="rank 1's forward graph differs from rank 0's at .*mul"):
        simulate._per_rank_constants("forward", [graph(torch.ops.aten.mul.Tensor, 1),
                                                 graph(torch.ops.aten.add.Tensor, 1)])


def test_inside_a_process_group_is_refused(setups):
    model, batches, traced, _ = setups("gpt")
    plan = _plan(traced, "fsdp", 2)
    dist.init_process_group("fake", rank=0, world_size=2)
    try:
        with pytest.raises(ClusterError, match="outside"):
            simulate.run_ranks(model, plan, batches)
    finally:
        dist.destroy_process_group()
    with pytest.raises(RuntimeMismatchError, match="at least one"):
        simulate.run_ranks(model, plan, [])


class _Regression(torch.nn.Module):
    def __init__(self, loss, body=None):
        super().__init__()
        self.lin, self.loss = body or torch.nn.Linear(16, 8), loss

    def forward(self, x, y):
        return self.loss(self.lin(x), y)


def _split_and_trains_like_one_device(model, batches) -> autoshard.Plan:
    """Strict planning with the batch split (a fallback warns, and fails here) leaves no op
    replicated for want of a rule, and 2 simulated ranks then train like one device."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        plan = autoshard.plan(model, autoshard.Cluster.local(2), batches[0], strict=True,
                              constraints={"inputs": [["S(0)"], ["S(0)"]]})
    assert not plan.fallbacks and plan.inputs == ["(S(0))", "(S(0))"]
    sim, ref = simulate.run_ranks(model, plan, batches), simulate.single_device(model, batches)
    assert max(abs(a - b) for a, b in zip(sim.losses, ref.losses)) < LOSS_ATOL, (sim.losses, ref.losses)
    assert max((sim.params[k] - ref.params[k]).abs().max().item() for k in ref.params) < PARAM_ATOL
    return plan


_LOSSES = {"mse": F.mse_loss, "smooth_l1": F.smooth_l1_loss, "huber": F.huber_loss,
           "bce_logits": F.binary_cross_entropy_with_logits, "soft_margin": F.soft_margin_loss,
           "bce": lambda x, y: F.binary_cross_entropy(torch.sigmoid(x), torch.sigmoid(y)),
           "mse_sum": lambda x, y: F.mse_loss(x, y, reduction="sum")}


@pytest.mark.parametrize("name", list(_LOSSES))
def test_elementwise_losses_split_the_batch_and_train_like_one_device(name):
    """torch's elementwise losses, whose fused ops have no DTensor rule on any release, trace as
    their decompositions."""
    torch.manual_seed(0)
    batches = [(torch.randn(8, 16), torch.randn(8, 8)) for _ in range(2)]
    plan = _split_and_trains_like_one_device(_Regression(_LOSSES[name]), batches)
    assert not any(n.op.startswith(("aten.mse_loss", "aten.smooth_l1", "aten.huber", "aten.binary_cross",
                                    "aten.soft_margin")) for n in plan.nodes)


_ACTIVATIONS = {"leaky_relu": torch.nn.LeakyReLU(0.1), "relu6": torch.nn.ReLU6(), "softplus": torch.nn.Softplus(),
                "elu": torch.nn.ELU(), "mish": torch.nn.Mish(), "hardswish": torch.nn.Hardswish(),
                "hardsigmoid": torch.nn.Hardsigmoid(), "selu": torch.nn.SELU(), "celu": torch.nn.CELU(0.5),
                "softshrink": torch.nn.Softshrink(), "hardshrink": torch.nn.Hardshrink(0.1)}


@pytest.mark.parametrize("name", list(_ACTIVATIONS))
def test_activations_split_the_batch_and_train_like_one_device(name):
    """Activations whose backward (or, on torch 2.11, forward) op DTensor has no rule for."""
    torch.manual_seed(0)
    body = torch.nn.Sequential(torch.nn.Linear(16, 32), _ACTIVATIONS[name], torch.nn.Linear(32, 8))
    batches = [(torch.randn(8, 16), torch.randn(8, 8)) for _ in range(2)]
    _split_and_trains_like_one_device(_Regression(F.mse_loss, body), batches)


def test_transformers_mamba_plans_without_fallbacks_and_trains_like_one_device():
    """transformers' Mamba (its PyTorch path: softplus of the step size, whose backward no
    DTensor release has a rule for; a merged gather's piece viewed across a rank's rows)."""
    from transformers import MambaConfig, MambaForCausalLM

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = MambaForCausalLM(MambaConfig(vocab_size=128, hidden_size=32, state_size=8,
                                                      num_hidden_layers=2, expand=2, conv_kernel=4))

        def forward(self, ids, labels):
            return self.model(input_ids=ids, labels=labels).loss

    torch.manual_seed(0)
    batches = [(ids, ids) for ids in torch.randint(0, 128, (2, 4, 16))]
    plan = _split_and_trains_like_one_device(LM(), batches)
    assert any(n.op == "aten.softplus_backward.default" for n in plan.nodes)


class _Renormed(nn.Module):
    """A weight renormed per row (``torch.renorm``: no DTensor rule on any supported release)
    between two sharded matmuls."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 8))
        self.v = nn.Parameter(torch.randn(8, 4))

    def forward(self, x, y):
        return ((torch.tanh(x @ torch.renorm(self.w, 2, 0, 1.0)) @ self.v - y) ** 2).mean()


def test_an_op_without_a_rule_runs_whole_on_every_rank():
    """An op planned replicated for lack of a rule (reported as a fallback) runs on each rank's
    whole inputs: DTensor refuses to dispatch an op without a rule even on replicated tensors, so
    compile failed before. The ops around it still split (the sharding cluster splits all it can)."""
    from zoo_cases import sharding_cluster

    torch.manual_seed(0)
    model = _Renormed()
    batches = [(torch.randn(8, 16), torch.randn(8, 4)) for _ in range(STEPS)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = autoshard.plan(model, sharding_cluster((2,)), batches[0])
    assert [name for name, _ in plan.fallbacks] == ["renorm"], plan.fallbacks
    assert any("renorm planned replicated" in str(w.message) for w in caught)
    assert "(S(0))" in plan.inputs, plan.inputs
    sim, ref = simulate.run_ranks(model, plan, batches), simulate.single_device(model, batches)
    assert max(abs(a - b) for a, b in zip(sim.losses, ref.losses)) < LOSS_ATOL, (sim.losses, ref.losses)
    assert max((sim.params[k] - ref.params[k]).abs().max().item() for k in ref.params) < PARAM_ATOL
