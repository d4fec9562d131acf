"""passes/normalize.py: the mean cross-entropy traced as a sum divided by its total weight.

Checked against the model itself: the rewritten joint graph, run on real tensors, gives the
model's loss and gradients; a plan that splits the loss over the batch on 2 simulated ranks gives
the single-device loss when the ranks' halves of the batch hold different numbers of ignored
labels (torch 2.13's average of per-rank means gave 7.9 for 14.4 there; 2.15 has no such plan);
and every torch release plans GPT-2's loss batch-split."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch.distributed.tensor import Shard
from torch import nn

import autoshard
from autoshard.runtime import simulate
from autoshard.passes.normalize import MEAN, NLL_FORWARD
from autoshard.planning.roles import allow_for

aten = torch.ops.aten


class Classifier(nn.Module):
    """Token classification with padded labels, as transformers' models compute their loss."""

    def __init__(self, vocab=32, hidden=16, classes=512):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.head = nn.Linear(hidden, classes)
        nn.init.normal_(self.head.weight, std=2.0)   # confident logits: per-token losses far apart

    def forward(self, tokens, labels):
        logits = self.head(torch.tanh(self.embed(tokens)))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def _batch(model, seed=0, batch=4, seq=32):
    """The first half of the batch is mostly padding, its few labels the ones the model
    predicts (a low loss); the second half's labels are random (a high one)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 32, (batch, seq), generator=g)
    labels = torch.randint(0, 512, (batch, seq), generator=g)
    with torch.no_grad():
        labels[: batch // 2] = model.head(torch.tanh(model.embed(tokens[: batch // 2]))).argmax(-1)
    labels[: batch // 2, 2:] = -100
    return tokens, labels


def _nll(traced, reduction=None):
    return [n for n in traced.gm.graph.nodes if n.target in NLL_FORWARD
            and (reduction is None or n.args[3] == reduction)]


def test_traced_graph_sums_then_divides_and_keeps_the_loss_and_gradients():
    torch.manual_seed(0)
    model = Classifier()
    tokens, labels = _batch(model)
    traced = autoshard.trace(model, (tokens, labels))
    assert _nll(traced) and not _nll(traced, MEAN)
    (loss_node,) = traced.outputs
    assert loss_node.target is aten.div.Tensor
    # the joint graph on real tensors: parameters, inputs, then the loss's tangent
    params = dict(model.named_parameters())
    value = {node: params[name].detach() for name, node in traced.params}
    value.update({traced.inputs[0]: tokens, traced.inputs[1]: labels, traced.tangents[0]: torch.ones(())})
    out = fx.Interpreter(traced.gm).run(*[value[n] for n in traced.gm.graph.find_nodes(op="placeholder")], enable_io_processing=False)
    loss = model(tokens, labels)
    loss.backward()
    torch.testing.assert_close(out[0], loss.detach(), rtol=0, atol=1e-6)
    got = dict(zip(traced.grads, out[1:]))
    for name, p in params.items():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-5, atol=1e-6)


def test_batch_split_loss_with_ignored_labels_is_the_single_device_loss():
    torch.manual_seed(0)
    model = Classifier()
    batches = [_batch(model, seed) for seed in range(2)]
    # per-rank means averaged would differ from the true mean by this much: the check can fail
    full = model(*batches[0]).item()
    halves = [model(t[h], y[h]).item() for t, y in [batches[0]] for h in (slice(0, 2), slice(2, 4))]
    assert abs(sum(halves) / 2 - full) > 0.5, (halves, full)
    traced = autoshard.trace(model, batches[0])
    fsdp = allow_for(traced, ("fsdp",))

    def split_loss(node, strategy) -> bool:   # the loss too is computed on each rank's own rows
        if node.target in NLL_FORWARD:
            return strategy.inputs[0] == (Shard(0),)
        return fsdp(node, strategy)

    plan = autoshard.plan(traced, autoshard.Cluster.local(2), allow=split_loss)
    assert plan.inputs == ["(S(0))"] * 2
    sim = simulate.run_ranks(model, plan, batches)
    ref = simulate.single_device(model, batches)
    assert sim.losses == pytest.approx(ref.losses, abs=1e-5)
    for name, p in ref.params.items():
        torch.testing.assert_close(sim.params[name], p, rtol=0, atol=1e-5)


def test_gpt2_loss_plans_batch_split_on_every_release():
    """GPT-2 124M on 4 A100s: the loss keeps the batch split (without the rewrite, torch 2.14 and
    2.15 gathered the 0.8 GB of log-probabilities on every rank)."""
    from autoshard import zoo

    model, inputs = zoo.get("hf_gpt2", "124m", device="meta")
    plan = autoshard.plan(model, autoshard.Cluster.preset("perlmutter", 1), inputs)
    (nll,) = [n for n in plan.nodes if n.op == str(aten.nll_loss_forward.default)]
    assert "S(0)" in nll.strategy and not nll.comm, nll
