"""autoshard's own sharding rules (passes/rules/) checked by arithmetic alone, without DTensor:
for every rule a rule function returns, the op's inputs are cut as the rule places them (Shard(d):
chunks along d; Partial: random addends that sum to the value; Replicate: whole) on 2 "ranks", the
op runs on each rank's pieces, and the pieces of each output, put together as the rule says (cat
along d, or summed), must equal the op run on the whole inputs."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate

from autoshard import _torch
from autoshard.passes.rules import conv, index, layer_norm, norm_pool, pointwise, scatter
from autoshard.passes.rules import pad as pad_rules

aten = torch.ops.aten
RANKS = 2


def _meta(t: torch.Tensor):
    return _torch.TensorMeta(t.shape, t.stride(), t.dtype)


def _split(value, placement, gen):
    if isinstance(placement, _torch.ShardingPlaceholder):
        return list(value.chunk(RANKS, dim=placement.dim))
    if isinstance(placement, Partial):
        parts = [torch.randn(value.shape, generator=gen, dtype=value.dtype) for _ in range(RANKS - 1)]
        return parts + [value - sum(parts)]
    assert isinstance(placement, Replicate), placement
    return [value] * RANKS


def _join(pieces, placement):
    if isinstance(placement, _torch.ShardingPlaceholder):
        return torch.cat(pieces, dim=placement.dim)
    if isinstance(placement, Partial):
        return sum(pieces)
    assert isinstance(placement, Replicate), placement
    return pieces[0]


def check_rules(op, rule_fn, args: tuple, n_outputs: int) -> int:
    """Every rule ``rule_fn`` gives for ``op(*args)`` reproduces the op; returns how many."""
    whole = op(*args)
    whole = whole if isinstance(whole, (tuple, list)) else (whole,)
    schema = tuple(_meta(a) if isinstance(a, torch.Tensor) else a for a in args)
    rules = rule_fn(op, schema, {})
    assert rules, f"{op}: no rule for these inputs"
    tensor_pos = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    gen = torch.Generator().manual_seed(0)
    for rule in rules:
        outs, ins = rule[:n_outputs], rule[n_outputs:]
        assert len(ins) == len(tensor_pos), (op, rule)
        split = {i: _split(args[i], pl, gen) for i, pl in zip(tensor_pos, ins)}
        per_rank = []
        for r in range(RANKS):
            local = op(*(split[i][r] if i in split else a for i, a in enumerate(args)))
            per_rank.append(local if isinstance(local, (tuple, list)) else (local,))
        for k, pl in enumerate(outs):
            if pl is None:
                continue
            got = _join([p[k] for p in per_rank], pl)
            want = whole[k]
            if want.is_floating_point():
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"{op} rule {rule}, output {k}")
            else:
                assert torch.equal(got, want), f"{op} rule {rule}, output {k}"
    return len(rules)


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_batch_norm_rules_keep_per_channel_statistics():
    x, w, b = _x(4, 6, 5, 5), _x(6, seed=1), _x(6, seed=2)
    n = check_rules(aten._native_batch_norm_legit.no_stats, norm_pool._batch_norm, (x, w, b, True, 0.1, 1e-5), 3)
    assert n == 1
    mean, var = _x(6, seed=3), _x(6, seed=4).abs() + 0.5
    check_rules(aten.native_batch_norm.default, norm_pool._batch_norm, (x, w, b, mean.clone(), var.clone(), True,
                                                                        0.1, 1e-5), 3)


@pytest.mark.parametrize("mask", [[True, True, True], [True, False, False], [False, True, True]])
def test_batch_norm_backward_rules(mask):
    x, w, go = _x(4, 6, 5, 5), _x(6, seed=1), _x(4, 6, 5, 5, seed=2)
    _, save_mean, save_invstd = aten._native_batch_norm_legit.no_stats(x, w, None, True, 0.1, 1e-5)
    args = (go, x, w, None, None, save_mean, save_invstd, True, 1e-5, mask)
    check_rules(aten.native_batch_norm_backward.default, norm_pool._batch_norm_backward, args, 3)


def test_a_batch_rule_for_batch_norm_would_be_caught():
    """The check is not vacuous: splitting batch norm along the batch changes its statistics."""
    x = _x(4, 6, 5, 5)

    def batch_rule(op, schema, kwargs):
        return [[norm_pool.S(0), norm_pool.R, norm_pool.R, norm_pool.S(0)]]

    with pytest.raises(AssertionError):
        check_rules(aten._native_batch_norm_legit.no_stats, batch_rule, (x, None, None, True, 0.1, 1e-5), 3)


@pytest.mark.parametrize("shape", [(4, 6, 8, 8), (6, 8, 8)])
def test_max_pool_rules(shape):
    x = _x(*shape)
    args = (x, [2, 2], [2, 2], [0, 0], [1, 1], False)
    n = check_rules(aten.max_pool2d_with_indices.default, norm_pool._max_pool, args, 2)
    assert n == (2 if len(shape) == 4 else 1)
    out, idx = aten.max_pool2d_with_indices.default(*args)
    go = _x(*out.shape, seed=5)
    bargs = (go, x, [2, 2], [2, 2], [0, 0], [1, 1], False, idx)
    check_rules(aten.max_pool2d_with_indices_backward.default, norm_pool._max_pool_backward, bargs, 1)


def test_norm_pool_registers_only_what_torch_lacks():
    for op in norm_pool.RULES:
        assert _torch.has_sharding_rule(op), f"{op}: no sharding rule after autoshard's rules were imported"
    if torch.__version__ >= "2.13":
        assert norm_pool.ADDED == [], "torch 2.13 and later have these rules; autoshard must not replace them"


def test_convolution_rules():
    x, w, bias = _x(4, 6, 7, 7), _x(8, 6, 3, 3, seed=1), _x(8, seed=2)
    args = (x, w, bias, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    assert check_rules(aten.convolution.default, conv._forward, args, 1) == 3
    out = aten.convolution.default(*args)
    go = _x(*out.shape, seed=3)
    bargs = (go, x, w, [8], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, True])
    assert check_rules(aten.convolution_backward.default, conv._backward, bargs, 3) == 3


def test_elementwise_rules():
    a, b = _x(4, 6) * 10, _x(4, 6, seed=1).abs() + 1
    assert check_rules(aten.floor_divide.default, pointwise._same_dim_rule, (a, b), 1) == 2
    assert check_rules(aten.polar.default, pointwise._same_dim_rule, (b, a), 1) == 2


_ACTIVATION_ARGS = {   # op -> its Python-number arguments after the tensors (gradient first for backward ops)
    "softplus": (2.0, 5.0), "softplus_backward": (2.0, 5.0), "elu": (1.0, 1.0, 1.0),
    "elu_backward": (1.0, 1.0, 1.0, False), "celu": (0.5,), "selu": (), "leaky_relu": (0.1,),
    "leaky_relu_backward": (0.1, False), "hardtanh": (-1.0, 1.0), "hardtanh_backward": (-1.0, 1.0),
    "hardswish": (), "hardswish_backward": (), "hardsigmoid": (), "hardsigmoid_backward": (), "mish": (),
    "mish_backward": (), "softshrink": (0.5,), "softshrink_backward": (0.5,), "hardshrink": (0.5,),
    "hardshrink_backward": (0.5,), "logit_backward": (1e-6,)}


@pytest.mark.parametrize("op", pointwise.ACTIVATIONS, ids=lambda op: op.__name__.split(".")[0])
def test_activation_rules(op):
    name = op.__name__.split(".")[0]
    x, grad = _x(4, 6) * 3, _x(4, 6, seed=1)
    if name == "logit_backward":
        x = torch.sigmoid(x)   # logit's domain
    extra = _ACTIVATION_ARGS[name]
    if name == "elu_backward":   # (grad, alpha, scale, input_scale, is_result, self_or_result)
        args = (grad, *extra, x)
    elif name.endswith("_backward"):
        args = (grad, x, *extra)
    else:
        args = (x, *extra)
    assert check_rules(op, pointwise._same_dim_rule, args, 1) == 2   # split on either dim


def test_activation_rules_registered_where_torch_lacks_one():
    for op in pointwise.ACTIVATIONS:
        assert _torch.has_sharding_rule(op), op
    assert set(pointwise.ADDED) >= {aten.softplus_backward.default, aten.leaky_relu_backward.default,
                                    aten.hardtanh_backward.default}   # no release has these


@pytest.mark.parametrize("where", ["leading", "middle", "apart", "2-D"])
def test_index_rules(where):
    """Gathers by index tensors (passes/rules/index.py): values split beside the indexed dims,
    indices split, partial sums; the indexed dims in front, in the middle, apart (the index dims
    go first) and one 2-D index."""
    x = _x(4, 6, 8)
    i, j = torch.tensor([3, 0, 2, 2]), torch.tensor([5, 1, 0, 4])
    indices = {"leading": [i], "middle": [None, j], "apart": [i, None, j], "2-D": [i.view(2, 2)]}[where]
    given = [t for t in indices if t is not None]

    def op(x, *tensors):
        it = iter(tensors)
        return aten.index.Tensor(x, [None if t is None else next(it) for t in indices])

    def rule(op_, schema, kwargs):
        it = iter(schema[1:])
        return index._index(aten.index.Tensor, (schema[0], [None if t is None else next(it) for t in indices]), {})

    n = check_rules(op, rule, (x, *given), 1)
    indexed = sum(t is not None for t in indices)
    assert n == (3 - indexed) + given[0].ndim + 1   # a rule per free dim, per index dim, the partial


def test_index_rule_registered_only_where_torch_lacks_one():
    assert _torch.has_sharding_rule(aten.index.Tensor)
    if torch.__version__ >= "2.13":
        assert index.ADDED == [], "torch 2.13 and later have this rule; autoshard must not replace it"


def _on_contiguous(op):
    """``op`` on contiguous copies: a rank's shard is contiguous, a chunk of dim 1 is not, and the
    CPU layer-norm backward reads mean and rstd as flat rows."""
    return lambda *args: op(*(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args))


@pytest.mark.parametrize("params", ["weight+bias", "none", "2-D weight"])
def test_layer_norm_rules(params):
    """Layer norm (passes/rules/layer_norm.py), forward and backward under each output mask: rows
    split on each leading dim, the statistics alike, the parameters whole, their gradients partial."""
    x = _x(4, 6, 8)
    shape, weight, bias = {"weight+bias": ([8], _x(8, seed=1), _x(8, seed=2)), "none": ([8], None, None),
                           "2-D weight": ([6, 8], _x(6, 8, seed=1), None)}[params]
    args = (x, shape, weight, bias, 1e-5)
    assert check_rules(aten.native_layer_norm.default, layer_norm._layer_norm, args, 3) == 3 - len(shape)
    out, mean, rstd = aten.native_layer_norm.default(*args)
    go = _x(*out.shape, seed=3)
    for mask in ([True, True, True], [True, False, False], [False, True, True]):
        mask = [mask[0], mask[1] and weight is not None, mask[2] and bias is not None]
        bargs = (go, x, shape, mean, rstd, weight, bias, mask)
        check_rules(_on_contiguous(aten.native_layer_norm_backward.default), layer_norm._layer_norm_backward,
                    bargs, 3)


def _rms_norm_backward(grad_out, x, shape, rstd, weight, mask):
    """``_fused_rms_norm_backward`` by its formula (the op has no CPU kernel): with x̂ = x·rstd and
    g = grad_out·weight, grad_input = rstd·(g − x̂·mean(g·x̂)) over each row, grad_weight the sum
    of grad_out·x̂ over the rows."""
    rows = tuple(range(x.ndim - len(shape), x.ndim))
    x_hat = x * rstd
    g = grad_out if weight is None else grad_out * weight
    grad_input = rstd * (g - x_hat * (g * x_hat).mean(rows, keepdim=True))
    grad_weight = (grad_out * x_hat).sum(tuple(range(x.ndim - len(shape)))) if weight is not None else None
    return grad_input if mask[0] else None, grad_weight if mask[1] else None


@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_rules(with_weight):
    x, weight = _x(4, 6, 8), _x(8, seed=1) if with_weight else None
    args = (x, [8], weight, 1e-5)
    assert check_rules(aten._fused_rms_norm.default, layer_norm._rms_norm, args, 2) == 2
    out, rstd = aten._fused_rms_norm.default(*args)
    grad_out = _x(*out.shape, seed=3)
    bargs = (grad_out, x, [8], rstd, weight, [True, with_weight])
    # the formula is autograd's on the whole tensors
    leaves = [t.clone().requires_grad_() for t in (x, weight) if t is not None]
    torch.nn.functional.rms_norm(leaves[0], [8], leaves[1] if with_weight else None, 1e-5).backward(grad_out)
    for got, want in zip(_rms_norm_backward(*bargs), leaves):
        torch.testing.assert_close(got, want.grad)
    assert check_rules(_rms_norm_backward, layer_norm._rms_norm_backward, bargs, 2) == 2


def test_layer_norm_backward_with_statistics_split_unlike_its_input_would_be_caught():
    """What torch 2.11's rule offers when asked about every input placement (statistics and weight
    taken as they come) is wrong on the ranks' pieces (wrong values, or shapes that do not fit):
    the input whole, mean and rstd split; the input split, the weight split."""
    x, weight = _x(4, 6, 8), _x(8, seed=1)
    out, mean, rstd = aten.native_layer_norm.default(x, [8], weight, None, 1e-5)
    bargs = (_x(*out.shape, seed=3), x, [8], mean, rstd, weight, None, [True, True, False])
    op = _on_contiguous(aten.native_layer_norm_backward.default)
    for taken_as_they_come in ([layer_norm.R, layer_norm.S(0), layer_norm.S(0), layer_norm.R],
                               [layer_norm.S(0), layer_norm.S(0), layer_norm.S(0), layer_norm.S(0)]):
        def rule(op_, schema, kwargs, ins=taken_as_they_come):
            return [[layer_norm.S(0), layer_norm.P, None, layer_norm.S(0), *ins]]

        with pytest.raises((AssertionError, RuntimeError)):
            check_rules(op, rule, bargs, 3)


def test_layer_norm_rules_registered_only_where_torch_has_no_single_dim_rule():
    single_dim = _torch.sharding_propagator().op_single_dim_strategy_funcs
    for op, (rule, _) in layer_norm.RULES.items():
        assert op in single_dim, f"{op}: no single-dim rule after autoshard's rules were imported"
        assert (single_dim[op].func is rule) == (op in layer_norm.ADDED)
    if torch.__version__ >= "2.13":
        assert layer_norm.ADDED == [], "torch 2.13 and later have these rules; autoshard must not replace them"



def _scatter_index(*shape, size, seed=0):
    return torch.randint(0, size, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dim", [1, -1])
def test_scatter_rules(dim):
    """Scatters (passes/rules/scatter.py): the dims beside the scattered one split alike, of a
    number's scatter too; a src larger than the index on a dim does not split there."""
    x, index = _x(4, 6, 5), _scatter_index(4, 3, 5, size=6)
    src = _x(4, 3, 5, seed=1)
    assert check_rules(aten.scatter.src, scatter._scatter, (x, dim if dim > 0 else dim - 1, index, src), 1) == 2
    assert check_rules(aten.scatter.value, scatter._scatter, (x, 1, index, 2.5), 1) == 2
    larger = _x(8, 3, 5, seed=2)   # scatter reads src only where the index reaches
    assert check_rules(aten.scatter.src, scatter._scatter, (x, 1, index, larger), 1) == 1   # dim 2 alone
    meta = [_meta(t) if isinstance(t, torch.Tensor) else t for t in (x, 1, index[:, :, :1], src[:, :, :1])]
    assert [[p.dim for p in rule] for rule in scatter._scatter(aten.scatter.src, meta, {})] == [[0] * 4]


def test_scatter_split_along_the_scattered_dim_would_be_caught():
    x, index, src = _x(4, 6), _scatter_index(4, 6, size=6), _x(4, 6, seed=1)

    def along_dim(op, schema, kwargs):
        return [[scatter.S(1)] * 4]

    with pytest.raises((AssertionError, RuntimeError)):   # wrong values, or an index past the shard
        check_rules(aten.scatter.src, along_dim, (x, 1, index, src), 1)


def test_scatter_rules_registered_only_before_torch_2_13():
    single_dim = _torch.sharding_propagator().op_single_dim_strategy_funcs
    assert (scatter.ADDED != []) == (torch.__version__ < "2.13"), scatter.ADDED
    for op in scatter.ADDED:
        assert single_dim[op].func is scatter.RULES[op]


@pytest.mark.parametrize("pad, value, n", [([0, 0, 1, 2], 0.0, 3), ([0, 0, 1, 2], 1.5, 2), ([0, 0, 0, 0], 1.5, 4),
                                           ([-1, 0], 0.0, 3)])
def test_constant_pad_rules(pad, value, n):
    """Constant padding (passes/rules/pad.py): the dims left alone split, a partial sum stays one
    where only zeros are written; cropping (a negative pad) counts as padding."""
    x = _x(4, 6, 8)
    assert check_rules(aten.constant_pad_nd.default, pad_rules._constant_pad, (x, pad, value), 1) == n


def test_constant_pad_split_along_a_padded_dim_would_be_caught():
    def along_padded(op, schema, kwargs):
        return [[pad_rules.S(1), pad_rules.S(1)]]

    with pytest.raises(AssertionError):
        check_rules(aten.constant_pad_nd.default, along_padded, (_x(4, 6, 8), [0, 0, 1, 2], 0.0), 1)


def test_constant_pad_rule_registered_only_where_torch_has_no_single_dim_rule():
    single_dim = _torch.sharding_propagator().op_single_dim_strategy_funcs
    assert aten.constant_pad_nd.default in single_dim
    assert (single_dim[aten.constant_pad_nd.default].func is pad_rules._constant_pad) == bool(pad_rules.ADDED)
    if torch.__version__ >= "2.13":
        assert pad_rules.ADDED == [], "torch 2.13 and later have this rule; autoshard must not replace it"
