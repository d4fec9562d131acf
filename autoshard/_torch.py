"""The one place autoshard touches private torch APIs (supported: torch 2.11 to 2.15).

A torch upgrade that moves any of these is a change to this file alone; tests/test_torch_adapter.py
checks each name resolves on the installed version. Where releases differ, the code detects the
feature; a branch by version names the version it serves.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import warnings
from typing import Any, Callable

import torch

from autoshard.errors import UnsupportedTorchError

# The oldest and newest torch minor releases autoshard supports (`make test TORCH=...` runs the suite
# on one; docs/design.md, "torch releases", says where it stands on each).
SUPPORTED = ((2, 11), (2, 15))
# Set to 1 to import autoshard on a torch outside SUPPORTED anyway (with a warning), at your own risk.
ANY_TORCH = "AUTOSHARD_ANY_TORCH"


def check_version(version: str) -> None:
    """Raise UnsupportedTorchError unless ``version`` (``torch.__version__``: "2.13.0+cpu",
    "2.15.0a0+git…") is a supported release. Checked at import, before any private name below is
    looked up, so an unsupported torch fails here and not with an AttributeError deep in a pass."""
    found = re.match(r"(\d+)\.(\d+)", version)
    minor = (int(found[1]), int(found[2])) if found else None
    if minor is not None and SUPPORTED[0] <= minor <= SUPPORTED[1]:
        return
    (lo_major, lo), (hi_major, hi) = SUPPORTED
    message = (f"autoshard supports torch {lo_major}.{lo} to {hi_major}.{hi}, but torch {version} is installed; "
               f"install a supported torch (pip install 'torch>={lo_major}.{lo},<{hi_major}.{hi + 1}'), or set "
               f"{ANY_TORCH}=1 to try this one anyway")
    if os.environ.get(ANY_TORCH) == "1":
        warnings.warn(message.split(", or set")[0] + f"; going on because {ANY_TORCH}=1", stacklevel=2)
        return
    raise UnsupportedTorchError(message)


check_version(torch.__version__)
# The installed release as (major, minor), for the few differences no feature test can see (an
# unreadable version, imported under AUTOSHARD_ANY_TORCH, counts as the newest supported).
_found = re.match(r"(\d+)\.(\d+)", torch.__version__)
RELEASE = (int(_found[1]), int(_found[2])) if _found else SUPPORTED[1]

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
    "sharding_propagator", "has_sharding_rule", "single_dim_rule", "op_strategy_rule",
    "planning_mesh", "flop_formula", "register_flop_formula", "is_data_dependent_error",
    "tree_leaves", "tree_map", "tree_map_only", "default_group_options", "is_all_gather",
    "all_gather_key", "merge_all_gathers", "unpriced_strategies", "decompositions",
]


def sharding_propagator():
    """DTensor's registry of per-op sharding rules (strategy functions and single-dim rules)."""
    return DTensor._op_dispatcher.sharding_propagator


def has_sharding_rule(op) -> bool:
    """Whether DTensor's registry holds a sharding rule (of either kind) for an op overload."""
    return single_dim_rule(op) is not None or op_strategy_rule(op) is not None


def single_dim_rule(op):
    """DTensor's single-dim rule for an op overload (its ``.func(op, args, kwargs)`` lists the
    placement tuples on one mesh dim), or None."""
    return sharding_propagator().op_single_dim_strategy_funcs.get(op)


def op_strategy_rule(op):
    """DTensor's op-strategy function for an op overload and its schema info, or None."""
    prop = sharding_propagator()
    func = prop.op_strategy_funcs.get(op)
    return None if func is None else (func, prop.op_to_schema_info.get(op))


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


def default_group_timeout(device_type: str):
    """The default process group's timeout (a timedelta), for groups made with ``new_group``."""
    return default_group_options(device_type)._timeout


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


def decompositions(ops) -> dict:
    """torch's own decompositions of ``ops`` (overload packets or overloads), for tracing."""
    from torch._decomp import get_decompositions

    return get_decompositions(list(ops))


@contextlib.contextmanager
def joint_export(model: torch.nn.Module, args: tuple[Any, ...], user_frame: Callable[[], str | None],
                 decompose: dict | None = None):
    """Joint fwd+bwd export with parameter/gradient descriptors (the ExitStack keeps the
    export's contexts alive while the caller reads the graph).

    The model runs as under ``torch.compile``/``torch.export`` (``torch.compiler.is_compiling()``
    is true), so libraries take their traceable paths: transformers' mask helpers, for one, skip
    their checks of mask and position values. Each forward node's ``meta["stack_trace"]`` is the
    model line ``user_frame()`` names at the torch call that made it (AOTAutograd records none).
    ``decompose``: ops traced as what their decompositions call (:func:`decompositions`)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(_compiling())
        stack.enter_context(_SourceLines(user_frame))
        stack.enter_context(grouped_mm_any_float())
        yield aot_export_joint_with_descriptors(stack, model, args, decompositions=decompose)


@contextlib.contextmanager
def grouped_mm_any_float():
    """Inside, fake tensors run ``aten._grouped_mm`` in any floating dtype. torch's meta kernel
    accepts bfloat16 only up to 2.13 (2.15 accepts float32), while its CPU kernel multiplies
    float32 too, so a float32 model with grouped GEMMs could run but not be traced. Fake tensors
    consult a list of op implementations before an op's meta kernel: the one added there gives
    other dtypes the output torch's meta code builds for bfloat16, and leaves bfloat16 to torch.
    On exit it is removed; where it answered, the fake tensors' shared cache of op results is
    emptied too, so that no float32 result made here answers a later call outside."""
    from torch import _meta_registrations as metas
    from torch._subclasses import fake_impls
    from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager

    op = torch.ops.aten._grouped_mm.default
    used = []

    def impl(mode, func, mat_a, mat_b, offs=None, bias=None, out_dtype=None):
        if mat_a.dtype == torch.bfloat16 or offs is None or bias is not None or mat_a.dtype != mat_b.dtype:
            return NotImplemented     # torch's meta kernel: its checks and its errors
        used.append(True)
        with in_kernel_invocation_manager(mode):
            out = metas._create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype)
        return FakeTensor(mode, out, mat_a.device)

    entry = (lambda func: func is op, impl)
    fake_impls.op_implementations_checks.insert(0, entry)
    try:
        yield
    finally:
        fake_impls.op_implementations_checks.remove(entry)
        if used:   # only then can the cache hold a result torch's own kernel would not give
            FakeTensorMode.cache_clear()


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
    collective: the result is ``t``, ready after :func:`wait`). Traced for a compiler, which
    takes functional programs only, it is the out-of-place all-reduce (inductor lowers that back
    to the in-place one on its own buffer)."""
    if torch.compiler.is_compiling():
        return torch.ops._c10d_functional.all_reduce(t, "sum", group_name)
    return torch.ops._c10d_functional.all_reduce_(t, "sum", group_name)


def reduce_scatter_async(t: torch.Tensor, ranks: int, group_name: str) -> torch.Tensor:
    """Start a sum reduce-scatter of ``t`` (flat, rank r's part the r-th 1/ranks) over the named
    process group; the result is ready after :func:`wait`."""
    return torch.ops._c10d_functional.reduce_scatter_tensor(t, "sum", ranks, group_name)


def all_gather_async(t: torch.Tensor, ranks: int, group_name: str) -> torch.Tensor:
    """Start an all-gather of ``t`` over the named process group of ``ranks`` ranks: every rank's
    ``t`` stacked along dim 0, in rank order; ready after :func:`wait`."""
    return torch.ops._c10d_functional.all_gather_into_tensor(t, ranks, group_name)


def all_to_all_async(t: torch.Tensor, output_sizes: list[int], input_sizes: list[int], group_name: str) -> torch.Tensor:
    """Start an all-to-all of ``t``'s rows (dim 0) over the named process group: ``input_sizes[j]``
    rows go to rank j, ``output_sizes[j]`` come from it, in rank order; ready after :func:`wait`."""
    return torch.ops._c10d_functional.all_to_all_single(t, output_sizes, input_sizes, group_name)


def wait(t: torch.Tensor) -> torch.Tensor:
    """The result of a functional collective, once it has arrived."""
    return torch.ops._c10d_functional.wait_tensor(t)


# --- simulated ranks (autoshard/runtime/simulate.py): torch.distributed._local_tensor --------------------
from torch.utils._pytree import tree_flatten, tree_unflatten  # noqa: E402

__all__ += ["simulated_ranks", "local_tensor", "rank_values", "local_int", "on_each_rank", "data_address",
            "tree_flatten", "tree_unflatten", "reset_sharding_caches"]


def simulated_ranks(world_size: int) -> contextlib.AbstractContextManager:
    """torch's ``LocalTensorMode`` over ranks 0..world_size-1: an op on a LocalTensor runs once
    per rank, a collective moves data between the ranks' tensors."""
    from torch.distributed._local_tensor import LocalTensorMode

    return LocalTensorMode(world_size)


def local_tensor(per_rank: dict[int, torch.Tensor]) -> torch.Tensor:
    """One tensor holding ``per_rank[r]`` on each simulated rank r. Make it outside
    :func:`simulated_ranks`: under the mode the constructor's own ops nest a LocalTensor in each
    rank's value."""
    from torch.distributed._local_tensor import LocalTensor

    return LocalTensor(per_rank)


def rank_values(t: torch.Tensor) -> dict[int, torch.Tensor]:
    """Each simulated rank's value of ``t``, by rank; a plain tensor is its one value."""
    from torch.distributed._local_tensor import LocalTensor

    return dict(sorted(t._local_tensors.items())) if isinstance(t, LocalTensor) else {0: t}


def local_int(values: tuple[int, ...]) -> torch.SymInt:
    """An int that is ``values[r]`` on simulated rank r: an op under :func:`simulated_ranks` takes
    it per rank."""
    from torch.distributed._local_tensor import LocalIntNode

    return torch.SymInt(LocalIntNode(dict(enumerate(values))))


def on_each_rank(fn: Callable) -> Callable:
    """``fn`` run once per simulated rank on that rank's values (its LocalTensors' and
    :func:`local_int`'s), the results joined as LocalTensors; ``fn`` itself outside the mode."""
    from torch.distributed._local_tensor import maybe_run_for_local_tensor

    return maybe_run_for_local_tensor(fn)


def data_address(t: torch.Tensor):
    """Where a tensor's values live (a replaced tensor moves, an updated one does not): its data
    pointer; for a LocalTensor, which has no storage of its own, every simulated rank's."""
    if type(t).__name__ == "LocalTensor":   # (no import of the simulation on a real rank's step)
        return tuple(v.data_ptr() for v in rank_values(t).values())
    return t.data_ptr()


def reset_sharding_caches() -> None:
    """Forget what DTensor keeps from one trace to the next in a process, so that each simulated
    rank traces as in a process of its own: cached sharding propagations (their output specs hold
    the mesh they were first made on, and meshes of one shape compare equal, so the next rank's
    trace would cut its pieces at the first rank's coordinate) and, from torch 2.13, the one-device
    mesh of decomposition-based rules (made, and left in the graph as a dead constant, by the
    first trace that needs it)."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    decomposed = getattr(sharding_propagator(), "decomp_strategy", None)
    getattr(decomposed, "_fake_meshes", {}).clear()


# --- flat collectives and merged gathers on torch 2.11 ------------------------------------------
import torch.distributed as dist  # noqa: E402

__all__ += ["all_gather_flat", "reduce_scatter_flat", "merge_all_gathers_at"]


def all_gather_flat(out: torch.Tensor, t: torch.Tensor, group=None) -> None:
    """Every rank's ``t`` into ``out``, rank after rank. torch 2.13 names it ``all_gather_single``
    (its ``all_gather_into_tensor`` warns on every call that it is deprecated); 2.11 has only
    ``all_gather_into_tensor``."""
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, t, group=group)


def reduce_scatter_flat(out: torch.Tensor, t: torch.Tensor, group=None) -> None:
    """The sum over ranks of ``t``, rank r keeping the r-th piece in ``out``: as
    :func:`all_gather_flat`, ``reduce_scatter_single`` from torch 2.13, ``reduce_scatter_tensor``
    on 2.11."""
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, t, group=group)


def merge_all_gathers_at(graph, nodes, insert_before, wait_before):
    """:func:`merge_all_gathers`, issued right before ``insert_before`` and waited for right
    before ``wait_before`` on every supported torch. torch 2.11's ``merge_all_gather_bucket``
    takes ``insert_before`` but does not pass it on: it issues after the bucket's last gather, and
    the waits, moved to ``wait_before``, then read the merged gather before it is made. So the
    gathers (which the merge erases) are moved, in order, to right before the issue point first:
    after the last of them is then that point on every release. Both points are taken past the
    bucket's own gathers, which only the merge's nodes replace."""
    bucket = set(nodes)

    def past_bucket(node):
        while node in bucket:
            node = node.next
        return node

    insert_before, wait_before = past_bucket(insert_before), past_bucket(wait_before)
    for node in nodes:
        insert_before.prepend(node)
    return merge_all_gathers(graph, nodes, insert_before, wait_before)


# --- compiled programs (autoshard.compile(backend="inductor")) ------------------------------------
__all__ += ["inductor"]


def inductor(gm: torch.fx.GraphModule) -> Callable:
    """``gm`` compiled by inductor on its first call (C++ on CPU, Triton on GPU), as one program
    (``fullgraph``: a part that cannot compile is an error, not a silent fallback) for the shapes it
    was traced at; torch's own caches keep the compiled code across processes. torch.compile does
    not run under a dispatch mode (a FLOP counter, a memory tracker): there ``gm`` runs as it is,
    with a warning. ``.compiled_calls`` on the result counts the calls that ran compiled.

    Dynamo empties the caller's argument list only after the compiled program returns (so its
    code reads; not measured), so a boxed ``gm`` (one that empties its list to free each input at
    its last use) likely keeps its inputs, the saved activations, to the end of the backward it
    computes (docs/design.md, "Backends")."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    _functional_gathers(gm)
    compiled = torch.compile(gm, backend="inductor", fullgraph=True, dynamic=False)

    def run(*args):
        if _get_current_dispatch_mode() is not None:
            warnings.warn("autoshard: a TorchDispatchMode is active, under which torch.compile does not run: "
                          "this call runs the program uncompiled", stacklevel=2)
            return gm(*args)
        run.compiled_calls += 1
        return compiled(*args)

    run.compiled_calls = 0
    return run


def _functional_gathers(gm: torch.fx.GraphModule) -> None:
    """A merged all-gather (:func:`merge_all_gathers`) writes into a buffer made for the bucket
    (``all_gather_into_tensor_out``, its input a slice of that buffer), which inductor cannot
    functionalize on torch 2.11: each becomes the functional all-gather of the same input where
    nothing reads the buffer, or a view of it, after the gather (the same values in a new
    tensor: one more bucket-sized buffer than eager holds)."""
    out_op = getattr(torch.ops._c10d_functional, "all_gather_into_tensor_out", None)
    if out_op is None:
        return
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    changed = False
    for node in list(gm.graph.find_nodes(op="call_function", target=out_op.default)):
        buf = node.kwargs.get("out")
        if buf is None or any(position[u] > position[node] for u in _views_of(buf) if u is not node):
            continue
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(torch.ops._c10d_functional.all_gather_into_tensor.default, node.args)
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        changed = True
    if changed:
        gm.recompile()


def _views_of(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes that read ``node``'s storage: its readers, and theirs through every view."""
    out, todo = [], list(node.users)
    while todo:
        user = todo.pop()
        out.append(user)
        schema = getattr(user.target, "_schema", None)
        if schema is not None and any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
            todo.extend(user.users)
    return out


# torch 2.11's schedules open each stage's links with a send to every neighbour stage's rank, and
# a V-shaped schedule's two middle programs are on one rank: gloo cannot send to its own rank
# ("Pair is not connected"). 2.13 opens them without that send.
RUNS_V_SCHEDULES = RELEASE >= (2, 13)


@functools.lru_cache(maxsize=64)   # asked once per stage and once more per candidate priced
def zero_bubble_order(stages: int, micro_batches: int, virtual: int, v_shape: bool = False
                      ) -> dict[int, tuple[tuple[str, int, int], ...]]:
    """The per-rank order of tasks of torch's ``ScheduleInterleavedZeroBubble`` (``v_shape``:
    ``ScheduleZBVZeroBubble``, two programs per rank) for ``stages`` ranks of ``virtual`` programs
    each and ``micro_batches``: per rank, ("F" | "I" | "W", program, micro-batch) in the order the
    rank runs them (forward, input gradient, weight gradient). The schedules compute every rank's
    order in their constructor from these numbers alone; built here without stages (private:
    their attributes and ``_calculate_single_rank_operations``)."""
    from torch.distributed.pipelining.schedules import (ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble,
                                                        _ComputationType)

    s = object.__new__(ScheduleZBVZeroBubble if v_shape else ScheduleInterleavedZeroBubble)
    s.pp_group_size, s.n_local_stages, s._n_microbatches = stages, virtual, micro_batches
    s.num_stages = stages * virtual
    s.number_of_rounds = max(1, micro_batches // stages)
    s.microbatches_per_round = micro_batches // s.number_of_rounds
    kind = {_ComputationType.FORWARD: "F", _ComputationType.BACKWARD_INPUT: "I",
            _ComputationType.BACKWARD_WEIGHT: "W"}
    return {r: tuple((kind[a.computation_type], a.stage_index, a.microbatch_index)
                     for a in s._calculate_single_rank_operations(r) if a is not None) for r in range(stages)}
