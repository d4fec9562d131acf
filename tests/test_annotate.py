"""passes/annotate.py: FLOPs, bytes and phase of every node, checked against hand formulas."""

import math
import operator

import pytest
import torch

import autoshard
from autoshard.passes.annotate import META_KEY
from autoshard.zoo import GPT, GPTConfig, MLP

aten = torch.ops.aten
DIMS = (32, 64, 64, 16)
BATCH = 8
FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
FLASH_BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


@pytest.fixture(scope="module")
def mlp():
    model = MLP(DIMS)
    return autoshard.trace(model, (torch.randn(BATCH, DIMS[0]), torch.randn(BATCH, DIMS[-1])))


@pytest.fixture(scope="module")
def gpt():
    model = GPT(GPTConfig.tiny())
    return autoshard.trace(model, model.example_inputs(2))


def _calls(traced, *targets):
    return [n for n in traced.gm.graph.nodes if n.op == "call_function" and n.target in targets]


def _shape(node):
    return tuple(node.meta["val"].shape)


def test_mm_addmm_flops_are_2mkn(mlp):
    nodes = _calls(mlp, aten.mm.default, aten.addmm.default)
    assert nodes
    for n in nodes:
        a, b = (n.args[0], n.args[1]) if n.target == aten.mm.default else (n.args[1], n.args[2])
        (m, k), (k2, nn_) = _shape(a), _shape(b)
        assert k == k2
        assert n.meta[META_KEY].flops == 2 * m * k * nn_, n.name


def test_mlp_matmul_flops_multiset_by_hand(mlp):
    """Forward: one B x d_in x d_out product per layer; backward: a weight gradient per layer and an
    input gradient for every layer but the first (the user's input needs no gradient)."""
    layer = [2 * BATCH * a * b for a, b in zip(DIMS[:-1], DIMS[1:])]
    expected_fwd = sorted(layer)
    expected_bwd = sorted(layer + layer[1:])
    fwd = sorted(n.meta[META_KEY].flops for n in _calls(mlp, aten.mm.default, aten.addmm.default)
                 if n.meta[META_KEY].phase == "fwd")
    bwd = sorted(n.meta[META_KEY].flops for n in _calls(mlp, aten.mm.default, aten.addmm.default)
                 if n.meta[META_KEY].phase == "bwd")
    assert fwd == expected_fwd
    assert bwd == expected_bwd


def test_mm_bytes_are_inputs_plus_output(mlp):
    for n in _calls(mlp, aten.mm.default):
        (m, k), (_, nn_) = _shape(n.args[0]), _shape(n.args[1])
        assert n.meta[META_KEY].bytes == 4 * (m * k + k * nn_ + m * nn_)
        assert n.meta[META_KEY].out_bytes == 4 * m * nn_
    for n in _calls(mlp, aten.addmm.default):
        (m, k), (_, nn_) = _shape(n.args[1]), _shape(n.args[2])
        assert n.meta[META_KEY].bytes == 4 * (nn_ + m * k + k * nn_ + m * nn_)


def test_out_bytes_match_values(gpt):
    for n in gpt.gm.graph.nodes:
        if n.op not in ("placeholder", "call_function"):
            continue
        val = n.meta["val"]
        vals = val if isinstance(val, (tuple, list)) else (val,)
        want = sum(v.numel() * v.element_size() for v in vals if isinstance(v, torch.Tensor))
        assert n.meta[META_KEY].out_bytes == want, n.name


def test_cpu_flash_attention_forward_flops(gpt):
    """torch's sdpa_flop_count convention: two batched matmuls (QK^T and PV), 2*B*H*S*S*D each."""
    c = GPTConfig.tiny()
    b, h, s, d = 2, c.heads, c.seq, c.hidden // c.heads
    nodes = _calls(gpt, FLASH)
    assert len(nodes) == c.layers
    for n in nodes:
        assert _shape(n.args[0]) == (b, h, s, d)
        cost = n.meta[META_KEY]
        assert cost.flops > 0
        assert cost.flops == 4 * b * h * s * s * d
        assert cost.phase == "fwd"


def test_cpu_flash_attention_backward_flops(gpt):
    """torch's sdpa_backward_flop_count: recompute QK^T, then dO V^T, P^T dO, dS K and Q^T dS:
    five batched matmuls of 2*B*H*S*S*D each."""
    c = GPTConfig.tiny()
    b, h, s, d = 2, c.heads, c.seq, c.hidden // c.heads
    nodes = _calls(gpt, FLASH_BWD)
    assert len(nodes) == c.layers
    for n in nodes:
        cost = n.meta[META_KEY]
        assert cost.flops > 0
        assert cost.flops == 10 * b * h * s * s * d
        assert cost.phase == "bwd"


def test_gpt_matmul_flops_total_by_hand(gpt):
    """All mm/addmm FLOPs of the tiny GPT against the 6 * tokens * (matmul params) rule, minus the
    input-gradient matmul the first layer does not need (none here: every Linear's input requires
    grad because the embeddings do)."""
    c = GPTConfig.tiny()
    tokens = 2 * c.seq
    per_block = c.hidden * 3 * c.hidden + c.hidden * c.hidden + 2 * c.hidden * 4 * c.hidden
    matmul_params = c.layers * per_block + c.hidden * c.vocab
    total = sum(n.meta[META_KEY].flops for n in _calls(gpt, aten.mm.default, aten.addmm.default))
    assert total == 6 * tokens * matmul_params


@pytest.mark.parametrize("target", [aten.view.default, operator.getitem, aten.t.default,
                                    aten.transpose.int, aten.detach.default, aten.split.Tensor])
def test_views_and_getitem_cost_nothing(gpt, target):
    nodes = _calls(gpt, target)
    assert nodes, f"no {target} in the tiny GPT"
    for n in nodes:
        assert n.meta[META_KEY].bytes == 0, n.name
        assert n.meta[META_KEY].flops == 0, n.name


def test_unsafe_view_costs_nothing(gpt):
    """aten._unsafe_view is a view (no copy; it only hides the alias from autograd), so like every
    view it moves no data."""
    nodes = _calls(gpt, aten._unsafe_view.default)
    assert nodes
    for n in nodes:
        assert n.meta[META_KEY].bytes == 0, f"{n.name} charged {n.meta[META_KEY].bytes} bytes"


def test_compute_ops_have_bytes(gpt):
    for n in _calls(gpt, aten.mm.default, aten.addmm.default, aten.native_layer_norm.default, aten.gelu.default):
        assert n.meta[META_KEY].bytes > 0


def _tangent_dependents(traced):
    tangents = [n for n in traced.gm.graph.find_nodes(op="placeholder") if n in set(traced.tangents)]
    seen, stack = set(), list(tangents)
    while stack:
        n = stack.pop()
        for u in n.users:
            if u.op == "call_function" and u not in seen:
                seen.add(u)
                stack.append(u)
    return seen


@pytest.mark.parametrize("which", ["mlp", "gpt"])
def test_phases(which, request):
    traced = request.getfixturevalue(which)
    # Phases are positional, as torch's partitioner reads them: forward is everything before the
    # first node that reads a tangent; every tangent-dependent node is backward.
    bwd = _tangent_dependents(traced)
    assert bwd
    order = list(traced.gm.graph.nodes)
    first_bwd = min(order.index(n) for n in bwd)
    for i, n in enumerate(order):
        if n.op == "placeholder":
            assert n.meta[META_KEY].phase == "input"
        elif n.op == "call_function":
            assert n.meta[META_KEY].phase == ("bwd" if i >= first_bwd else "fwd"), n.name
            assert n not in bwd or n.meta[META_KEY].phase == "bwd", n.name
    # the loss is forward, every gradient is backward
    assert traced.outputs[0].meta[META_KEY].phase == "fwd"
    for name, g in traced.grads.items():
        assert g.meta[META_KEY].phase == "bwd", name


def test_dtype_is_compute_dtype():
    model = MLP((8, 16, 4)).to(torch.bfloat16)
    traced = autoshard.trace(model, (torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(4, 4, dtype=torch.bfloat16)))
    mms = _calls(traced, aten.mm.default, aten.addmm.default)
    assert mms and all(n.meta[META_KEY].dtype == torch.bfloat16 for n in mms)
    for n in _calls(traced, aten.addmm.default):
        (m, k), (_, nn_) = _shape(n.args[1]), _shape(n.args[2])
        assert n.meta[META_KEY].bytes == 2 * (nn_ + m * k + k * nn_ + m * nn_)
    assert math.isfinite(sum(n.meta[META_KEY].flops for n in mms))
