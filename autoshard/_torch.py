"""The one place autoshard touches private torch APIs (supported: torch 2.13.x).

A torch upgrade that moves any of these is a change to this file alone; tests/test_torch_adapter.py
checks each name resolves on the installed version.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch._functorch.aot_autograd import aot_export_joint_with_descriptors  # noqa: F401
from torch._functorch._aot_autograd.descriptors import (  # noqa: F401
    BufferAOTInput,
    GradAOTOutput,
    ParamAOTInput,
    PlainAOTInput,
    PlainAOTOutput,
    TangentAOTInput,
)
from torch._functorch.partitioners import default_partition  # noqa: F401
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: F401
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta  # noqa: F401
from torch.distributed.tensor._op_schema import (  # noqa: F401
    OpSchema,
    OpSpec,
    OpStrategy,
    RuntimeSchemaInfo,
    TupleStrategy,
)
from torch.distributed.tensor._ops.single_dim_strategy import (  # noqa: F401
    _expand_single_dim_strategy_to_mesh as expand_single_dim_strategy,
    _ShardingPlaceholder as ShardingPlaceholder,
    register_single_dim_strategy,
)
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard  # noqa: F401
from torch.utils import flop_counter
from torch.utils._pytree import tree_leaves, tree_map, tree_map_only  # noqa: F401

__all__ = [
    "aot_export_joint_with_descriptors", "default_partition", "FakeTensorMode", "DTensorSpec",
    "TensorMeta", "OpSchema", "OpSpec", "OpStrategy", "TupleStrategy", "RuntimeSchemaInfo",
    "ShardingPlaceholder", "StridedShard", "register_single_dim_strategy", "expand_single_dim_strategy",
    "sharding_propagator",
    "planning_mesh", "flop_formula", "register_flop_formula", "is_data_dependent_error",
    "tree_leaves", "tree_map", "tree_map_only", "default_group_options", "is_all_gather",
    "all_gather_key", "merge_all_gathers", "unpriced_strategies",
]


def sharding_propagator():
    """DTensor's registry of per-op sharding rules (strategy functions and single-dim rules)."""
    return DTensor._op_dispatcher.sharding_propagator


@contextlib.contextmanager
def unpriced_strategies():
    """DTensor's strategy functions price each input redistribution of each strategy with DTensor's
    own cost estimate (``_ops.utils.generate_redistribute_costs``), which autoshard never reads
    (costmodel.py prices every move): 2.2 s of a 3.3 s enumeration on an 8-layer Llama. Inside
    this context they are priced 0; the strategies (placements) are unchanged."""
    from torch.distributed.tensor._ops import utils

    priced = utils.redistribute_cost
    utils.redistribute_cost = lambda current, target: 0.0
    try:
        yield
    finally:
        utils.redistribute_cost = priced


def planning_mesh(mesh_shape: tuple[int, ...], mesh_dim_names: tuple[str, ...]) -> DeviceMesh:
    """A DeviceMesh for planning only: no process group, no backend, any world size."""
    ranks = torch.arange(int(torch.tensor(mesh_shape).prod().item())).view(mesh_shape)
    return DeviceMesh("cpu", ranks, mesh_dim_names=mesh_dim_names, _init_backend=False, _rank=0)


def default_group_options(device_type: str):
    """The default process group's backend options (timeout, ...), to give a mesh's sub-groups."""
    import torch.distributed as dist

    return dist.group.WORLD._get_backend(torch.device(device_type)).options


def flop_formula(op) -> Callable[..., int] | None:
    """torch.utils.flop_counter's formula for an op overload (called with shapes), if any."""
    reg = flop_counter.flop_registry
    return reg.get(op) or reg.get(getattr(op, "overloadpacket", None))


def register_flop_formula(ops, fn) -> None:
    """Idempotent: re-importing a rules module must not fail on an existing formula."""
    if all(op in flop_counter.flop_registry for op in ops):
        return
    flop_counter.register_flop_formula(ops)(fn)


sdpa_flop_count = flop_counter.sdpa_flop_count
sdpa_backward_flop_count = flop_counter.sdpa_backward_flop_count


def is_data_dependent_error(exc: BaseException) -> bool:
    """Errors fake-tensor tracing raises when Python control flow depends on tensor data."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    kinds = (DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode)
    return isinstance(exc, kinds) or "data-dependent" in str(exc).lower()


@contextlib.contextmanager
def joint_export(model: torch.nn.Module, args: tuple[Any, ...], user_frame: Callable[[], str | None]):
    """Joint fwd+bwd export with parameter/gradient descriptors (the ExitStack keeps the
    export's contexts alive while the caller reads the graph).

    The model runs as under ``torch.compile``/``torch.export`` (``torch.compiler.is_compiling()``
    is true), so libraries take their traceable paths: transformers' mask helpers, for one, skip
    their checks of mask and position values. Each forward node's ``meta["stack_trace"]`` is the
    model line ``user_frame()`` names at the torch call that made it (AOTAutograd records none)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(_compiling())
        stack.enter_context(_SourceLines(user_frame))
        yield aot_export_joint_with_descriptors(stack, model, args)


@contextlib.contextmanager
def _compiling():
    """``torch.compiler.is_compiling()`` true inside: torch 2.13 has a session context for it,
    torch 2.11 only the module flag it reads."""
    import torch.compiler as compiler

    if hasattr(compiler, "_compile_session_context"):
        with compiler._compile_session_context():
            yield
        return
    before = compiler._is_compiling_flag
    compiler._is_compiling_flag = True
    try:
        yield
    finally:
        compiler._is_compiling_flag = before


class _SourceLines(torch.overrides.TorchFunctionMode):
    """Names the model line of every torch call in the graph nodes it makes: AOTAutograd keeps
    fx's current node meta (``preserve_node_meta``) while tracing, and copies its stack trace."""

    def __init__(self, user_frame: Callable[[], str | None]):
        super().__init__()
        self.user_frame = user_frame

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from torch.fx import traceback as fx_traceback

        where = self.user_frame()
        if where is None or not fx_traceback.has_preserved_node_meta():
            return func(*args, **(kwargs or {}))
        meta = fx_traceback.get_current_meta()
        before = meta.get("stack_trace")
        fx_traceback.set_stack_trace([where])
        try:
            return func(*args, **(kwargs or {}))
        finally:
            fx_traceback.set_stack_trace([before] if before else [])


def tensor_version(t: torch.Tensor) -> int:
    """The in-place update counter autograd keeps on every tensor (bumped by ``add_``, ``copy_``)."""
    return t._version


def is_all_gather(node) -> bool:
    """A functional ``all_gather_into_tensor`` node of a traced graph."""
    from torch._inductor.fx_passes.bucketing import is_all_gather_into_tensor

    return is_all_gather_into_tensor(node)


def all_gather_key(node):
    """What all-gathers must share to be merged into one: process group and dtype."""
    from torch._inductor.fx_passes.bucketing import _ag_group_key

    return _ag_group_key(node)


def merge_all_gathers(graph, nodes, insert_before, wait_before):
    """Inductor's bucketing: independent all-gathers of graph inputs (same group and dtype)
    become one all-gather of a flat buffer, issued before ``insert_before`` and waited for before
    ``wait_before``, whose pieces replace the originals' waits. Returns the merged wait node."""
    from torch._inductor.fx_passes.bucketing import is_wait_tensor, merge_all_gather_bucket

    new_nodes, _ = merge_all_gather_bucket(graph, nodes, "default", insert_before=insert_before,
                                           wait_insertion_point=wait_before)
    return next(n for n in new_nodes if is_wait_tensor(n))


def all_reduce_async(t: torch.Tensor, group_name: str) -> torch.Tensor:
    """Start a sum all-reduce of ``t`` in place over the named process group (a functional
    collective: the result is ``t``, ready after :func:`wait`)."""
    return torch.ops._c10d_functional.all_reduce_(t, "sum", group_name)


def reduce_scatter_async(t: torch.Tensor, ranks: int, group_name: str) -> torch.Tensor:
    """Start a sum reduce-scatter of ``t`` (flat, rank r's part the r-th 1/ranks) over the named
    process group; the result is ready after :func:`wait`."""
    return torch.ops._c10d_functional.reduce_scatter_tensor(t, "sum", ranks, group_name)


def wait(t: torch.Tensor) -> torch.Tensor:
    """The result of a functional collective, once it has arrived."""
    return torch.ops._c10d_functional.wait_tensor(t)
