"""passes/trace.py: joint fwd+bwd tracing on fake tensors, parameter/gradient pairing, fingerprint."""

import inspect

import pytest
import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

import autoshard
from autoshard.errors import TraceError
from autoshard.zoo import GPT, GPTConfig, MLP


def _run_joint(traced, values: dict):
    """Run the joint graph on real tensors (positional placeholders), returning its flat outputs."""
    placeholders = traced.gm.graph.find_nodes(op="placeholder")
    outs = fx.Interpreter(traced.gm).run(*[values[n] for n in placeholders], enable_io_processing=False)
    (out_node,) = traced.gm.graph.find_nodes(op="output")
    pos = {n: i for i, n in enumerate(out_node.args[0]) if n is not None}
    return outs, pos


@pytest.fixture(scope="module")
def gpt_traced():
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny())
    inputs = model.example_inputs(2, generator=torch.Generator().manual_seed(1))
    return model, inputs, autoshard.trace(model, inputs)


def test_every_parameter_paired_with_gradient(gpt_traced):
    model, _, traced = gpt_traced
    expected = [name for name, _ in model.named_parameters()]
    assert [name for name, _ in traced.params] == expected
    assert sorted(traced.grads) == sorted(expected)
    named = dict(model.named_parameters())
    for name, node in traced.params:
        assert node.op == "placeholder"
        assert tuple(node.meta["val"].shape) == tuple(named[name].shape)
        grad = traced.grads[name]
        assert isinstance(grad, fx.Node), f"{name} has no gradient node"
        assert tuple(grad.meta["val"].shape) == tuple(named[name].shape)
    assert len(traced.inputs) == 2 and len(traced.tangents) == 1
    assert len(traced.outputs) == 1 and traced.outputs[0].meta["val"].shape == ()


def test_gradient_nodes_compute_autograd_gradients(gpt_traced):
    """Independent check of the pairing: run the joint graph on the real weights and compare
    each paired gradient output with eager autograd on the user's model."""
    model, inputs, traced = gpt_traced
    named = dict(model.named_parameters())
    values = {node: named[name].detach() for name, node in traced.params}
    values.update(zip(traced.inputs, inputs))
    values.update({t: torch.ones(()) for t in traced.tangents})
    outs, pos = _run_joint(traced, values)

    model.zero_grad()
    loss = model(*inputs)
    loss.backward()
    torch.testing.assert_close(outs[pos[traced.outputs[0]]], loss.detach())
    for name, grad in traced.grads.items():
        torch.testing.assert_close(outs[pos[grad]], named[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    model.zero_grad(set_to_none=True)


def test_user_model_unchanged_by_trace():
    torch.manual_seed(0)
    model = MLP()
    model.eval()
    before = {name: (p, p.detach().clone()) for name, p in model.named_parameters()}
    autoshard.trace(model, (torch.randn(8, 32), torch.randn(8, 16)))
    after = dict(model.named_parameters())
    assert list(after) == list(before)
    for name, (obj, value) in before.items():
        p = after[name]
        assert p is obj, f"{name} was replaced"
        assert type(p) is nn.Parameter and not isinstance(p, FakeTensor) and not isinstance(p.data, FakeTensor)
        assert p.device.type == "cpu" and p.requires_grad
        assert torch.equal(p.detach(), value)
        assert p.grad is None
    assert not model.training, "trace must restore the training flag"
    # the model still runs eagerly on real tensors
    assert torch.isfinite(model(torch.randn(8, 32), torch.randn(8, 16)))


def test_buffers_restored_and_paired():
    class WithBuffer(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("scale", torch.full((4,), 0.5))

        def forward(self, x):
            return (self.lin(x) * self.scale).sum()

    model = WithBuffer()
    buf = model.scale
    traced = autoshard.trace(model, (torch.randn(2, 4),))
    assert [n for n, _ in traced.buffers] == ["scale"]
    assert model.scale is buf and not isinstance(model.scale, FakeTensor)
    assert torch.equal(model.scale, torch.full((4,), 0.5))


def test_tied_weights_pair_like_named_parameters():
    """GPT-2-style tied embedding/head: the trace must name parameters as named_parameters() does
    (one entry per distinct tensor) and the gradient must be the full (summed) gradient."""

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.head = nn.Linear(8, 10, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, idx):
            return self.head(self.emb(idx)).logsumexp(-1).mean()

    torch.manual_seed(0)
    model = Tied()
    idx = torch.randint(0, 10, (4, 3))
    traced = autoshard.trace(model, (idx,))
    assert model.head.weight is model.emb.weight, "tracing untied the user's weights"
    assert [n for n, _ in traced.params] == [n for n, _ in model.named_parameters()]
    named = dict(model.named_parameters())
    values = {node: named[name].detach() for name, node in traced.params}
    values[traced.inputs[0]] = idx
    values.update({t: torch.ones(()) for t in traced.tangents})
    outs, pos = _run_joint(traced, values)
    model(idx).backward()
    torch.testing.assert_close(outs[pos[traced.grads["emb.weight"]]], model.emb.weight.grad)


def test_meta_model_traces_and_stays_on_meta():
    with torch.device("meta"):
        model = GPT(GPTConfig.tiny())
    params = {name: p for name, p in model.named_parameters()}
    idx = torch.zeros(2, 16, dtype=torch.long, device="meta")
    traced = autoshard.trace(model, (idx, idx))
    assert [n for n, _ in traced.params] == list(params)
    assert set(traced.grads) == set(params) and all(g is not None for g in traced.grads.values())
    for name, p in model.named_parameters():
        assert p is params[name]
        assert p.device.type == "meta" and type(p) is nn.Parameter and not isinstance(p, FakeTensor)


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:
            y = y * 2
        return y.sum()


def test_data_dependent_control_flow_raises_trace_error_naming_the_line():
    model = DataDependent()
    weight = model.lin.weight
    with pytest.raises(TraceError) as info:
        autoshard.trace(model, (torch.randn(2, 4),))
    msg = str(info.value)
    src, start = inspect.getsourcelines(DataDependent.forward)
    offset = next(i for i, line in enumerate(src) if "if y.sum() > 0:" in line)
    assert "if y.sum() > 0:" in msg
    assert f"{inspect.getsourcefile(DataDependent)}:{start + offset}" in msg
    assert "DataDependent" in msg
    # a failed trace still restores the model
    assert model.lin.weight is weight and not isinstance(model.lin.weight, FakeTensor)
    assert isinstance(info.value, autoshard.errors.AutoshardError)


_USER_MODEL = """
import torch
from torch import nn


class UserModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.max() > 0:  # the offending line
            y = y * 2
        return y.sum()
"""


@pytest.mark.parametrize("folder", ["autoshard", "passes"])
def test_trace_error_names_line_of_model_in_any_folder(tmp_path, folder):
    """The user's model may live anywhere, e.g. in a checkout or project folder named like one of
    autoshard's own packages; the error must still name the user's line."""
    import importlib.util

    path = tmp_path / folder / "user_model.py"
    path.parent.mkdir()
    path.write_text(_USER_MODEL)
    spec = importlib.util.spec_from_file_location(f"user_model_{folder}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(TraceError) as info:
        autoshard.trace(module.UserModel(), (torch.randn(2, 4),))
    lineno = _USER_MODEL.splitlines().index("        if y.max() > 0:  # the offending line") + 1
    assert "if y.max() > 0:" in str(info.value)
    assert f"{path}:{lineno}" in str(info.value)


def test_fingerprint_same_shapes_equal_batch_differs():
    a, b = GPT(GPTConfig.tiny()), GPT(GPTConfig.tiny())  # different random weights, same shapes
    fa = autoshard.trace(a, a.example_inputs(2)).fingerprint
    fb = autoshard.trace(b, b.example_inputs(2)).fingerprint
    fc = autoshard.trace(a, a.example_inputs(4)).fingerprint
    assert fa and fa == fb
    assert fc != fa


def test_fingerprint_differs_for_other_architecture():
    a = GPT(GPTConfig.tiny())
    b = GPT(GPTConfig(heads=2))
    assert autoshard.trace(a, a.example_inputs(2)).fingerprint != autoshard.trace(b, b.example_inputs(2)).fingerprint


def test_input_meta_records_shapes_and_dtypes():
    model = MLP()
    traced = autoshard.trace(model, (torch.randn(8, 32), torch.randn(8, 16, dtype=torch.float32)))
    assert traced.input_meta == [((8, 32), torch.float32), ((8, 16), torch.float32)]
    assert [tuple(n.meta["val"].shape) for n in traced.inputs] == [(8, 32), (8, 16)]


def test_trace_device_follows_the_model_and_meta_means_cpu():
    from autoshard.passes.trace import trace_device

    x = torch.zeros(2, 4)
    assert trace_device(nn.Linear(4, 4), (x,)) == torch.device("cpu")
    with torch.device("meta"):
        on_meta = nn.Linear(4, 4)
    assert trace_device(on_meta, (torch.zeros(2, 4, device="meta"),)) == torch.device("cpu")
    assert trace_device(on_meta, (x,), device="cpu") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where there is no GPU")
def test_tracing_for_cuda_without_a_gpu_is_a_typed_error():
    import autoshard

    with pytest.raises(TraceError, match="tracing for a CUDA device needs a GPU"):
        autoshard.trace(nn.Linear(4, 4), (torch.zeros(2, 4),), device="cuda")


def test_traced_program_records_its_device():
    import autoshard

    traced = autoshard.trace(nn.Linear(4, 4), (torch.zeros(2, 4),))
    assert traced.device == torch.device("cpu")
    assert all(n.meta["val"].device.type == "cpu" for n in traced.gm.graph.nodes
               if isinstance(n.meta.get("val"), torch.Tensor))
