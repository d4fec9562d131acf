"""trace: model + example inputs -> joint forward+backward ATen graph on fake tensors.

The graph's placeholders are the parameters (paired with their gradient outputs), the user's
inputs, and one tangent per forward output; ``node.meta["desc"]`` (torch's descriptors) says which
is which. Nothing real is allocated: parameters and inputs are swapped for fake tensors for the
duration of the trace, so a 70B model built on the ``meta`` device traces in this process, and the
user's module is restored unchanged afterwards.

Example::

    >>> t = trace(GPT(GPTConfig.tiny()), (idx, targets))
    >>> [p for p, _ in t.params][:2], t.gm.graph.find_nodes(op="placeholder")[-1].name
    (['wte.weight', 'wpe.weight'], 'tangents_1')
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import traceback
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import nn

from autoshard import _torch
from autoshard.errors import TraceError
from autoshard.passes.normalize import sum_then_divide_mean_losses


@dataclass
class TracedModel:
    """A joint graph plus the pairing torch's descriptors give it."""

    gm: fx.GraphModule
    params: list[tuple[str, fx.Node]]          # (fully qualified name, placeholder)
    buffers: list[tuple[str, fx.Node]]
    inputs: list[fx.Node]                      # user inputs, in call order
    tangents: list[fx.Node]
    outputs: list[fx.Node | None]              # forward outputs, in order
    grads: dict[str, fx.Node | None]           # parameter name -> gradient node
    # per input, its gradient node: None unless the example input requires grad (a pipeline
    # stage's received activations, autoshard/runtime/pipeline.py)
    input_grads: list[fx.Node | None] = field(default_factory=list)
    # per tangent, the forward output it is the gradient of (outputs no gradient reaches have none)
    tangent_outputs: list[int] = field(default_factory=list)
    input_meta: list[tuple[tuple[int, ...], torch.dtype]] = field(default_factory=list)
    fingerprint: str = ""
    trace_time: float = 0.0                    # seconds spent tracing and annotating
    device: torch.device = torch.device("cpu")  # where the traced program runs (its ops are that device's)
    # mesh shape -> its strategies (passes.strategies.find_strategies): planned again, not re-enumerated
    strategy_memo: dict = field(default_factory=dict, repr=False, compare=False)


def _fake_like(fake_mode, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    with fake_mode:
        out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
    return out


def trace_device(model: nn.Module, example_inputs: tuple, device=None) -> torch.device:
    """Where the traced program runs, which decides some of its ops (CPU and CUDA attention are
    different kernels): ``device`` if given, else the first parameter's or input's that is not on
    ``meta``, else the CPU. Tracing on CUDA needs a GPU (autograd's engine asks it for a context)."""
    if device is None:
        tensors = [*model.parameters(), *model.buffers(), *(a for a in example_inputs if isinstance(a, torch.Tensor))]
        device = next((t.device for t in tensors if t.device.type != "meta"), "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TraceError("tracing for a CUDA device needs a GPU in this process (autograd asks the device for a "
                         "context, even on fake tensors); trace where the GPU is, or for device='cpu' (a plan "
                         "traced for the CPU runs on CPU processes: attention is another kernel on a GPU)")
    return device


@contextlib.contextmanager
def _fake_parameters(model: nn.Module, fake_mode, device: torch.device):
    """Swap every parameter and buffer for a fake one (no memory), restoring them on exit.

    A module on ``meta`` cannot be traced jointly as-is; a real one must not be read or copied
    just to plan it. Tied weights stay tied: one fake per distinct tensor.
    """
    saved: list[tuple[nn.Module, str, str, torch.Tensor]] = []
    fakes: dict[int, torch.Tensor] = {}
    try:
        for mod in model.modules():
            for kind in ("_parameters", "_buffers"):
                for name, t in list(getattr(mod, kind).items()):
                    if t is None:
                        continue
                    if id(t) not in fakes:
                        f = _fake_like(fake_mode, t, device)
                        fakes[id(t)] = nn.Parameter(f, requires_grad=t.requires_grad) if kind == "_parameters" else f
                    saved.append((mod, kind, name, t))
                    getattr(mod, kind)[name] = fakes[id(t)]
        yield
    finally:
        for mod, kind, name, t in saved:
            getattr(mod, kind)[name] = t


aten = torch.ops.aten
# Elementwise losses traced as torch's decompositions of them: no release's DTensor has a rule for
# the fused ops (forward or backward), so a plan gathered the prediction and the target on every
# rank and computed the loss there; their decompositions are pointwise ops and a sum or mean,
# which split with the batch. The backward's 1/numel comes from the traced global shape. The
# log-sigmoid pair (binary_cross_entropy_with_logits' decomposition calls it) likewise.
ELEMENTWISE_LOSSES = _torch.decompositions([
    aten.mse_loss, aten.mse_loss_backward, aten.smooth_l1_loss, aten.smooth_l1_loss_backward,
    aten.huber_loss, aten.huber_loss_backward, aten.binary_cross_entropy, aten.binary_cross_entropy_backward,
    aten.binary_cross_entropy_with_logits, aten.soft_margin_loss, aten.soft_margin_loss_backward,
    aten.log_sigmoid_forward, aten.log_sigmoid_backward])

_LIBRARY_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, contextlib))
_OWN_FILES = frozenset({__file__, _torch.__file__})


def _library(filename: str) -> bool:
    """Whether a frame's file is torch's, contextlib's or autoshard's tracing code, not the model's."""
    return filename.startswith(_LIBRARY_DIRS) or filename in _OWN_FILES or os.path.basename(filename) == "contextlib.py"


def _model_line() -> str | None:
    """The innermost frame of the running stack outside torch and autoshard, as a traceback
    line (``File "...", line N, in f``), or None."""
    f = sys._getframe(1)
    while f is not None and _library(f.f_code.co_filename):
        f = f.f_back
    if f is None:
        return None
    return f'File "{f.f_code.co_filename}", line {f.f_lineno}, in {f.f_code.co_name}'


def _backward_sources(gm: fx.GraphModule) -> None:
    """A backward node's model line is its forward op's: autograd numbers both alike (seq_nr)."""
    forward: dict[int, str] = {}
    for node in gm.graph.nodes:
        seq, where = node.meta.get("seq_nr"), node.meta.get("stack_trace")
        if seq is None:
            continue
        if node.meta.get("autograd_backward"):
            if seq in forward and not where:
                node.meta["stack_trace"] = forward[seq]
        elif where:
            forward.setdefault(seq, where)


def _user_frame(exc: BaseException) -> str:
    """The innermost traceback frame outside torch and autoshard: the line of the model that failed."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not _library(f.filename)]
    if not frames:
        return "(no frame outside torch)"
    f = frames[-1]
    return f'{f.filename}:{f.lineno} in {f.name}: "{(f.line or "").strip()}"'


# What to do when the failing line is inside transformers rather than in the user's model: the
# library's own value checks, which the user cannot rewrite but can route around by configuration.
_TRANSFORMERS_HINTS = (
    ("masking_utils", "transformers' attention-mask helpers inspect mask or position values; build the "
                      "model with attn_implementation=\"autoshard_sdpa\" (registered by importing "
                      "autoshard.zoo.hf), which builds no mask and runs causal or bidirectional SDPA, "
                      "and pass no attention_mask"),
    ("expert", "the Mixture-of-Experts layer loops over the experts the data selects; build it with "
                "experts_implementation=\"batched_mm\" (float32) or \"grouped_mm\" (bfloat16)"),
)


def _hint(where: str) -> str:
    if f"{os.sep}transformers{os.sep}" not in where:
        return ("Rewrite it with torch.where / torch.cond, or move the decision out of forward().")
    for key, text in _TRANSFORMERS_HINTS:
        if key in where.lower():
            return f"That line is in transformers: {text}."
    return ("That line is in transformers: look for a config option that avoids it (attention, "
            "experts or cache implementation), or report it.")


def trace(model: nn.Module, example_inputs: tuple, device=None, input_grads: bool = False) -> TracedModel:
    """Trace ``model(*example_inputs)`` (which must return a scalar loss, or tensors) jointly, on
    fake tensors on ``device`` (:func:`trace_device`). ``input_grads``: the floating inputs that
    require grad get their gradients too (a pipeline stage's received activations)."""
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    device = trace_device(model, example_inputs, device)
    fake_mode = _torch.FakeTensorMode(allow_non_fake_inputs=False)
    args = tuple(_fake_like(fake_mode, a, device).requires_grad_(input_grads and a.requires_grad and a.is_floating_point())
                 if isinstance(a, torch.Tensor) else a for a in example_inputs)
    was_training = model.training
    try:
        with _fake_parameters(model, fake_mode, device), \
                _torch.joint_export(model, args, _model_line, ELEMENTWISE_LOSSES) as jd:
            gm = jd.graph_module
    except Exception as exc:  # noqa: BLE001 - re-raised typed, with the user's line
        where = _user_frame(exc)
        if _torch.is_data_dependent_error(exc):
            raise TraceError(
                f"{type(model).__name__} has Python control flow that depends on tensor values, "
                f"which cannot be traced at {where}. {_hint(where)}"
            ) from exc
        hint = f". {_hint(where)}" if f"{os.sep}transformers{os.sep}" in where else ""
        raise TraceError(f"could not trace {type(model).__name__} at {where}: "
                         f"{type(exc).__name__}: {exc}{hint}") from exc
    finally:
        model.train(was_training)
    _backward_sources(gm)
    sum_then_divide_mean_losses(gm)
    traced = _pair(gm, example_inputs)
    _tie(traced, model)
    traced.fingerprint = _fingerprint(traced.gm)
    traced.device = device
    return traced


def _tie(traced: TracedModel, model: nn.Module) -> None:
    """Merge parameters the model shares under several names (GPT-2's embedding and LM head).

    The export lists a tied weight once per name, each with its own gradient; the model holds
    one tensor, whose gradient is their sum. Keep the first name (``named_parameters()``'s)."""
    first: dict[int, str] = {}
    alias: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        alias[name] = first.setdefault(id(p), name)
    nodes = dict(traced.params)
    graph = traced.gm.graph
    (out,) = graph.find_nodes(op="output")
    for name, primary in alias.items():
        if name == primary or name not in nodes:
            continue
        nodes[name].replace_all_uses_with(nodes[primary])
        g_dup, g_main = traced.grads.pop(name, None), traced.grads.get(primary)
        if g_dup is not None and g_main is not None:
            with graph.inserting_before(out):
                total = graph.call_function(torch.ops.aten.add.Tensor, (g_main, g_dup))
            total.meta["val"] = g_main.meta["val"]
            traced.grads[primary] = total
        elif g_dup is not None:
            traced.grads[primary] = g_dup
        graph.erase_node(nodes[name])
        traced.params = [(n, node) for n, node in traced.params if n != name]
    # The output node keeps listing every gradient in its own order; autoshard reads the pairing
    # from TracedModel.grads, so rewrite the output to exactly that.
    out.args = ([*traced.outputs, *[g for g in traced.grads.values() if g is not None],
                 *[g for g in traced.input_grads if g is not None]],)
    out.meta.pop("desc", None)
    graph.eliminate_dead_code()
    traced.gm.recompile()


def _pair(gm: fx.GraphModule, example_inputs) -> TracedModel:
    params, buffers, inputs, tangents = [], [], [], []
    for node in gm.graph.find_nodes(op="placeholder"):
        desc = node.meta.get("desc")
        if isinstance(desc, _torch.ParamAOTInput):
            params.append((desc.target, node))
        elif isinstance(desc, _torch.BufferAOTInput):
            buffers.append((desc.target, node))
        elif isinstance(desc, _torch.PlainAOTInput):
            inputs.append(node)
        elif isinstance(desc, _torch.TangentAOTInput):
            tangents.append(node)
        else:
            raise TraceError(f"unexpected graph input {node.name} ({desc!r})")
    (out_node,) = gm.graph.find_nodes(op="output")
    outputs, grads, input_grads = [], {}, [None] * len(inputs)
    position = {node.meta["desc"].idx: i for i, node in enumerate(inputs)}
    for val, desc in zip(out_node.args[0], out_node.meta.get("desc", [])):
        if val is None and desc is None:  # gradient slot of an input that needs none
            continue
        if isinstance(desc, _torch.GradAOTOutput) and isinstance(desc.grad_of, _torch.PlainAOTInput):
            input_grads[position[desc.grad_of.idx]] = val
        elif isinstance(desc, _torch.GradAOTOutput):
            grads[desc.grad_of.target] = val
        elif isinstance(desc, _torch.PlainAOTOutput):
            outputs.append(val)
        elif getattr(getattr(desc, "mutated_input", None), "target", None) is not None:
            raise TraceError(f"forward() updates {desc.mutated_input.target} in place; autoshard traces a "
                             f"training step whose only state change is the optimizer's. BatchNorm's running "
                             f"statistics are such an update: build it with track_running_stats=False "
                             f"(batch statistics, as training uses), or keep the buffer out of forward()")
        else:
            raise TraceError(f"unexpected graph output {val} ({desc!r}); autoshard traces models whose "
                             f"forward returns tensors and does not mutate its inputs")
    meta = [(tuple(a.shape), a.dtype) for a in example_inputs if isinstance(a, torch.Tensor)]
    tangent_outputs = [t.meta["desc"].output.idx for t in tangents]
    return TracedModel(gm, params, buffers, inputs, tangents, outputs, grads, input_grads, tangent_outputs, meta,
                       _fingerprint(gm))


def _fingerprint(gm: fx.GraphModule) -> str:
    """Hash of ops, shapes and dtypes: the same model and input shapes give the same value."""
    h = hashlib.sha256()
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else ""
        dtype = str(val.dtype) if isinstance(val, torch.Tensor) else ""
        desc = str(n.meta.get("desc", "")) if n.op == "placeholder" else ""
        h.update(f"{n.op}|{n.target}|{shape}|{dtype}|{desc};".encode())
    return h.hexdigest()[:16]
