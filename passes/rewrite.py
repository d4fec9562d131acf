"""rewrite: the joint graph and a plan -> one rank's local graphs, forward and backward.

Every tensor of the joint graph is run as a DTensor in the placement the plan chose: before each
op its inputs are redistributed to the placements the op's strategy needs, then DTensor runs the
op on local shards (shape arguments made local by DTensor's own rules). Tracing that with
``make_fx`` records only local ops and the functional collectives the redistributions issue; the
result is a local joint graph (``primals`` = local parameter shards and inputs, ``tangents``)
whose outputs are the loss, replicated, and each gradient as its last op left it (possibly a
pending partial sum). torch's partitioner then splits it into forward and backward.

The gradient's last move, into its parameter's storage placement (the plan's "grad" edge: DDP's
all-reduce, FSDP's reduce-scatter), is not in the graph: the runtime makes it with
:func:`to_storage`, after summing the unreduced gradients of several micro-batches when it
accumulates (the move is linear: reduce(sum g_k) = sum reduce(g_k)). With a ``reduce_dtype``,
every reduction of a partial sum on the way to a parameter's gradient runs in that dtype.

Example (inside a process group; ``choice``: node -> chosen Strategy)::

    >>> joint, n_out, grad_placements = local_joint(traced, choice, mesh, local_primals)
    >>> fw, bw = split(joint, n_out, recompute=frozenset({"gelu"}))
    >>> sorted({str(n.target) for n in bw.graph.nodes if "c10d" in str(n.target)})[:1]
    ['_c10d_functional.all_reduce.default']
"""

from __future__ import annotations

import operator
import warnings

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.checkpoint import CheckpointPolicy

from autoshard import _torch
from autoshard.passes.annotate import feeds_only_grads, phases
from autoshard.passes.strategies import META_KEY, Strategy, tensor_inputs

ORIGIN = "autoshard.node"   # meta["custom"] key: the joint-graph node a local node implements
PHASE = "autoshard.phase"   # meta["custom"] key: "fwd" or "bwd"


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def _keep_layout(out: DTensor) -> DTensor:
    """A collective hands back its local result contiguous, but the traced graph may rely on the
    producer's memory order (CPU flash attention returns a transposed view, and a later ``view``
    needs it): lay the local shard out in the order of the DTensor's own strides."""
    if out.ndim < 2:
        return out
    order = lambda strides: sorted(range(out.ndim), key=lambda d: (-strides[d], d))  # noqa: E731
    want, local = order(out.stride()), out.to_local()
    if want == order(local.stride()):
        return out
    back = sorted(range(out.ndim), key=lambda d: want[d])
    return DTensor.from_local(local.permute(want).contiguous().permute(back), out.device_mesh, out.placements,
                              run_check=False, shape=out.shape, stride=out.stride())


def _to_placements(dt: DTensor, placements, reduce_dtype: torch.dtype | None = None) -> DTensor:
    placements = tuple(placements)
    if tuple(dt.placements) == placements:
        return dt
    if reduce_dtype is not None and dt.dtype != reduce_dtype and any(
            isinstance(p, Partial) and p != q for p, q in zip(dt.placements, placements)):
        # the pending sum is taken in reduce_dtype (bf16 partials summed in fp32, or fp32 ones
        # sent as bf16); the cast of a partial sum is applied to each addend, so it stays partial
        return _to_placements(dt.to(reduce_dtype), placements).to(dt.dtype)
    mesh = dt.device_mesh
    # DTensor will not redistribute *to* Partial; do Replicate -> Partial here: the value stays on
    # mesh coordinate 0 of that dim and is zero elsewhere, so the pending sum is exact.
    to_partial = [d for d, p in enumerate(placements) if isinstance(p, Partial) and dt.placements[d] != p]
    if not to_partial:
        return _keep_layout(dt.redistribute(mesh, placements))
    staged = tuple(Replicate() if d in to_partial else p for d, p in enumerate(placements))
    if tuple(dt.placements) != staged:
        dt = dt.redistribute(mesh, staged)
    local = dt.to_local()
    if any(mesh.get_local_rank(d) != 0 for d in to_partial):
        local = torch.zeros_like(local)
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=dt.shape, stride=dt.stride())


def _mesh_device(mesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _run_node(node: fx.Node, env: dict, strategy: Strategy, mesh, reduce_dtype=None):
    inputs = iter(strategy.inputs)

    def arg(a):
        if not isinstance(a, fx.Node):
            return a
        return _to_placements(env[a], next(inputs), reduce_dtype)

    args = _torch.tree_map_only(fx.Node, arg, node.args) if tensor_inputs(node) else node.args
    kwargs = _torch.tree_map_only(fx.Node, arg, node.kwargs) if tensor_inputs(node) else node.kwargs
    if not tensor_inputs(node):  # factory: every rank builds the whole (replicated) tensor
        if "device" in kwargs:  # traced on CPU fakes; build on the mesh's device
            kwargs = {**kwargs, "device": _mesh_device(mesh)}
        out = node.target(*args, **kwargs)
        wrap = lambda t: DTensor.from_local(t, mesh, strategy.outputs[0], run_check=False)  # noqa: E731
        return tuple(wrap(t) for t in out) if isinstance(out, (tuple, list)) else wrap(out)
    try:
        out = node.target(*args, **kwargs)
    except (RuntimeError, ValueError):
        if node.target not in _VIEWS:
            raise
        # Local kernels may lay a shard out differently from the global trace (e.g. the CPU
        # attention output) so that its view is impossible; the graph is functional, so a copy is
        # as good as a view here. Only then: a copy per view (every q, k, v split) costs ~1% of a step.
        out = node.target(args[0].contiguous(), *args[1:], **kwargs)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    fixed = []
    for t, want in zip(outs, strategy.outputs):
        if isinstance(t, DTensor) and want is not None and tuple(t.placements) != want:
            # DTensor picked another output placement than planned for these inputs; honour the plan
            warnings.warn(f"autoshard: {node.name}: DTensor produced {t.placements}, plan says {want}")
            t = _to_placements(t, want)
        fixed.append(t)
    return tuple(fixed) if isinstance(out, (tuple, list)) else fixed[0]


def local_joint(traced, choice: dict[fx.Node, Strategy], mesh, local_primals: list[torch.Tensor],
                reduce_dtype: torch.dtype | None = None) -> tuple[fx.GraphModule, int, list]:
    """The rank-local joint graph (see module doc). ``local_primals``: local params, buffers, inputs
    in placeholder order (example tensors, for tracing). Returns (graph, number of forward
    outputs, placements of each gradient output: one per parameter, None where it has no
    gradient); :func:`to_storage` finishes each gradient."""
    gm = traced.gm
    placeholders = gm.graph.find_nodes(op="placeholder")
    primal_nodes = [n for n in placeholders if n not in traced.tangents]
    storage = {node: choice[node].outputs[0] for node in primal_nodes}
    param_of_grad = {}
    params = dict(traced.params)
    for name, g in traced.grads.items():
        if g is not None:
            param_of_grad.setdefault(g, []).append(params[name])
    (out_node,) = gm.graph.find_nodes(op="output")
    rep = tuple([Replicate()] * mesh.ndim)
    to_grads = feeds_only_grads(gm, traced) if reduce_dtype is not None else set()
    narrowing = _parameter_casts(traced)
    grad_placements: list = []

    def joint(primals, tangents):
        env: dict[fx.Node, object] = {}
        for node, t in zip(primal_nodes, primals):
            val = node.meta["val"]
            env[node] = DTensor.from_local(t, mesh, storage[node], run_check=False, shape=val.shape, stride=val.stride())
        outs = [None] * len(traced.outputs)
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            if phase[node] == "bwd" and traced.tangents[0] not in env:
                # wrapped only now, so nothing reading a tangent lands among forward nodes
                with fx_traceback.annotate({PHASE: "bwd"}):
                    for tnode, t in zip(traced.tangents, tangents):
                        env[tnode] = DTensor.from_local(t, mesh, rep, run_check=False)
            ns = node.meta[META_KEY]
            with fx_traceback.annotate({ORIGIN: node.name, PHASE: phase[node]}):
                if ns.alias_of is not None:
                    env[node] = operator.getitem(env[node.args[0]], node.args[1])
                elif node in narrowing:
                    # cast in the parameter's own placement, then move: the cast commutes with
                    # any gather exactly, so gathers move bf16 whatever placement the plan casts in
                    cast = node.target(env[node.args[0]], *node.args[1:], **node.kwargs)
                    env[node] = _to_placements(cast, choice[node].outputs[0])
                else:
                    env[node] = _run_node(node, env, choice[node], mesh,
                                          reduce_dtype if node in to_grads else None)
                # Outputs become replicated right where they are made: the partitioner reads
                # phases from graph order, so nothing of the forward may follow the backward.
                for i, o in enumerate(traced.outputs):
                    if o is node:
                        outs[i] = _to_placements(env[o], rep).to_local()
        grads = []
        grad_placements.clear()
        for name, _ in traced.params:
            g = traced.grads.get(name)
            grads.append(None if g is None else env[g].to_local())
            grad_placements.append(None if g is None else tuple(env[g].placements))
        return outs + grads

    n_tangents = len(traced.tangents)
    example_tangents = [torch.ones_like(_local_out_example(traced, i)) for i in range(n_tangents)]
    phase = phases(gm)
    with torch.no_grad(), fx_traceback.preserve_node_meta():
        local = make_fx(joint, tracing_mode="fake")(list(local_primals), example_tangents)
    return local, len(traced.outputs), list(grad_placements)


_CASTS = (torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default)


def _parameter_casts(traced) -> set[fx.Node]:
    """Casts of a parameter to a narrower dtype (the mixed-precision policy's, autoshard/precision.py)."""
    found = set()
    for _, p in traced.params:
        for user in p.users:
            val = user.meta.get("val")
            if (user.target in _CASTS and user.args[0] is p and isinstance(val, torch.Tensor)
                    and val.dtype.itemsize < p.meta["val"].dtype.itemsize):
                found.add(user)
    return found


def to_storage(local_grad: torch.Tensor, placements, param: DTensor,
               reduce_dtype: torch.dtype | None = None) -> DTensor:
    """A gradient output of the local graph (this rank's piece, in ``placements``) moved to its
    parameter's storage placement, as a DTensor like ``param``: DDP's all-reduce, FSDP's
    reduce-scatter, or nothing where the placements agree. Through DTensor: the one-dim moves
    go bucketed on local tensors (:func:`to_storage_many`), which costs ~1 ms less per call on gloo."""
    dt = DTensor.from_local(local_grad, param.device_mesh, placements, run_check=False,
                            shape=param.shape, stride=param.stride())
    return _to_placements(dt, param.placements, reduce_dtype)


def _gather_dims(dt: DTensor, placements) -> tuple[int, int] | None:
    """(mesh dim, tensor dim k) of a Shard(k) -> Replicate gather on one mesh dim of a tensor
    split evenly there and along k by no other mesh dim, or None."""
    mesh, have, want = dt.device_mesh, tuple(dt.placements), tuple(placements)
    moved = [d for d, (a, b) in enumerate(zip(have, want)) if a != b]
    if len(moved) != 1:
        return None
    (d,) = moved
    k = getattr(have[d], "dim", None)
    if type(have[d]) is Shard and isinstance(want[d], Replicate) and have[d] not in have[:d] + have[d + 1:] \
            and 0 <= k < dt.ndim and dt.to_local().shape[k] * mesh.size(d) == dt.shape[k]:
        return d, k
    return None


def gather_many(items: list[tuple[DTensor, tuple]]) -> list[torch.Tensor]:
    """The local tensors of ``dt.redistribute(mesh, placements)`` for each (dt, placements), with
    the one-dim gathers of one mesh dim and dtype (FSDP's and ZeRO's working copies, gathered
    once a step) made as one all-gather of a flat buffer per bucket (GRAD_BUCKET_BYTES), as FSDP
    does per module: one collective per parameter is one synchronization of the ranks each."""
    out: list = [None] * len(items)
    groups: dict = {}
    for j, (dt, placements) in enumerate(items):
        how = _gather_dims(dt, placements)
        if how is None:
            out[j] = dt.redistribute(dt.device_mesh, placements).to_local()
        else:
            groups.setdefault((how[0], dt.dtype), []).append((j, how[1]))
    for (d, dtype), members in groups.items():
        bucket, size = [], 0
        for j, k in members:
            n = items[j][0].to_local().numel() * dtype.itemsize
            if bucket and size + n > GRAD_BUCKET_BYTES:
                _gather_bucket(items, bucket, d, out)
                bucket, size = [], 0
            bucket.append((j, k))
            size += n
        _gather_bucket(items, bucket, d, out)
    return out


def _gather_bucket(items: list, bucket: list[tuple[int, int]], d: int, out: list) -> None:
    mesh = items[bucket[0][0]][0].device_mesh
    p = mesh.size(d)
    locals_ = [items[j][0].to_local() for j, _ in bucket]
    flat = torch.cat([t.reshape(-1) for t in locals_])
    gathered = flat.new_empty(p * flat.numel())
    dist.all_gather_into_tensor(gathered, flat, group=mesh.get_group(d))
    gathered = gathered.view(p, flat.numel())
    # rank r's piece of every tensor, rank after rank: a tensor is its pieces joined along k
    for (j, k), t, piece in zip(bucket, locals_, gathered.split([t.numel() for t in locals_], dim=1)):
        pieces = piece.reshape(p, *t.shape)
        out[j] = pieces.reshape(p * t.shape[0], *t.shape[1:]) if k == 0 else torch.cat(pieces.unbind(0), dim=k)


GRAD_BUCKET_BYTES = 64 * 2**20   # a flat buffer's cap: bounds the transient copy of the gradients


def _bucketable(local: torch.Tensor, placements: tuple, param: DTensor):
    """How one flat collective per bucket makes this gradient move: ("all_reduce", mesh dims)
    for summed partials on any mesh dims to Replicate (one all-reduce per dim, DDP's), or
    ("reduce_scatter", mesh dim, k) for a summed partial on one mesh dim to an even Shard(k) that
    no other mesh dim splits (FSDP's); None for any other move (to_storage makes it alone)."""
    want = tuple(param.placements)
    moved = [d for d, (a, b) in enumerate(zip(placements, want)) if a != b]
    if not moved or not all(isinstance(placements[d], Partial) and placements[d].reduce_op == "sum" for d in moved):
        return None
    if all(isinstance(want[d], Replicate) for d in moved):
        return "all_reduce", tuple(moved)
    if len(moved) != 1:
        return None
    (d,) = moved
    dst = want[d]
    k = getattr(dst, "dim", None)
    if type(dst) is Shard and dst not in want[:d] + want[d + 1:] and 0 <= k < local.ndim \
            and local.shape[k] % param.device_mesh.size(d) == 0:
        return "reduce_scatter", d, k
    return None


def to_storage_many(grads: list, moves: list[tuple[int, tuple, DTensor]],
                    reduce_dtype: torch.dtype | None = None) -> list[DTensor]:
    """:func:`to_storage` for ``moves`` = [(index into ``grads``, placements, parameter)], with
    the all-reduces and reduce-scatters of the same mesh dims and dtype made as one collective on
    a flat buffer (up to GRAD_BUCKET_BYTES), as DDP and FSDP bucket theirs: on gloo every
    collective is a synchronization of the ranks, and one per parameter cost a small GPT's FSDP
    step ~50 of them. Each gradient is dropped from ``grads`` once copied into its bucket; the
    measured peak still holds every one next to the buckets (something else keeps the backward
    graph's outputs alive: not found yet), which is what solver/memory.py's ``delivered`` counts."""
    out: list = [None] * len(moves)
    groups: dict = {}
    for j, (i, placements, param) in enumerate(moves):
        how = _bucketable(grads[i], tuple(placements), param)
        if how is None:
            out[j] = to_storage(grads[i], placements, param, reduce_dtype)
            grads[i] = None
            continue
        k = how[2] if how[0] == "reduce_scatter" else None
        groups.setdefault((how[:2], grads[i].dtype), []).append((j, i, k, param))
    for ((kind, dims), dtype), members in groups.items():
        wire = reduce_dtype or dtype   # the sum runs in reduce_dtype, as to_storage's does
        bucket, size = [], 0
        for m in members:
            n = grads[m[1]].numel() * wire.itemsize
            if bucket and size + n > GRAD_BUCKET_BYTES:
                _reduce_bucket(grads, bucket, kind, dims, wire, out)
                bucket, size = [], 0
            bucket.append(m)
            size += n
        _reduce_bucket(grads, bucket, kind, dims, wire, out)
    return out


def _reduce_bucket(grads: list, bucket: list, kind: str, dims, wire: torch.dtype, out: list) -> None:
    mesh = bucket[0][3].device_mesh
    all_reduce = kind == "all_reduce"
    p = 1 if all_reduce else mesh.size(dims)
    shapes, dtypes = [], []
    total = sum(grads[i].numel() for _, i, _, _ in bucket)
    flat = torch.empty(total, dtype=wire)
    # all-reduce: the gradients one after another; reduce-scatter: rank r's chunks of every
    # gradient, rank after rank, so that rank r receives its chunks summed, in order
    per_rank = total // p
    offsets = [0] * p
    for _, i, k, _ in bucket:
        g = grads[i]
        dtypes.append(g.dtype)
        chunks = [g] if all_reduce else g.chunk(p, dim=k)
        for r, chunk in enumerate(chunks):
            start = r * per_rank + offsets[r]
            flat[start:start + chunk.numel()].view(chunk.shape).copy_(chunk)
            offsets[r] += chunk.numel()
        shapes.append(chunks[0].shape)
        grads[i] = None
    if all_reduce:
        for d in dims:
            dist.all_reduce(flat, group=mesh.get_group(d))
        result = flat
    else:
        result = flat.new_empty(per_rank)
        dist.reduce_scatter_tensor(result, flat, group=mesh.get_group(dims))
        del flat
    offset = 0
    for (j, _, _, param), shape, dtype in zip(bucket, shapes, dtypes):
        n = shape.numel()
        local = result[offset:offset + n].view(shape).to(dtype)
        offset += n
        out[j] = DTensor.from_local(local, mesh, param.placements, run_check=False, shape=param.shape,
                                    stride=param.stride())


def _local_out_example(traced, i: int) -> torch.Tensor:
    val = traced.outputs[i].meta["val"]
    return torch.zeros(val.shape, dtype=val.dtype)


def split(local: fx.GraphModule, num_fwd_outputs: int, recompute: frozenset[str] = frozenset()
          ) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Forward/backward split by torch's partitioner: it saves the forward values backward reads,
    except those of ``recompute`` (names of joint-graph nodes), which backward computes again.

    Every local node carries its joint-graph node (``meta["custom"]``, from the trace above);
    the partitioner learns the phase from ``partitioner_tag`` and what to recompute from torch's
    activation-checkpointing tags."""
    for node in local.graph.nodes:
        custom = node.meta.get("custom") or {}
        if node.op != "call_function" or PHASE not in custom:
            continue
        node.meta["partitioner_tag"] = "is_forward" if custom[PHASE] == "fwd" else "is_backward"
        seeded = torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())
        # (seeded ops, e.g. the `empty` buffers collectives write into, are saved, never replayed)
        if custom[PHASE] == "fwd" and custom.get(ORIGIN) in recompute and not seeded:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            node.meta["ac_graph_id"] = 0
    placeholders = local.graph.find_nodes(op="placeholder")
    example = [n.meta.get("val") for n in placeholders]
    fw, bw = _torch.default_partition(local, example, num_fwd_outputs=num_fwd_outputs)
    return _drop_dead(fw), _drop_dead(bw)


def bucket_gathers(gm: fx.GraphModule, block_of: dict[str, object]) -> fx.GraphModule:
    """One all-gather per block (a repeated layer's copy, ``block_of``: joint-graph node name ->
    block) and process group for what the graph gathers from its inputs (a parameter's storage
    shard gathered per use, FSDP's reshard-after-forward; a saved shard gathered in backward),
    as FSDP gathers a module's parameters at once: on gloo every collective is a synchronization
    of the ranks, and gathering per parameter cost a small GPT's FSDP step ~90 of them (1.96x
    torch's FSDP step; one per block: 1.14x). Like FSDP's prefetch, a block's gather is issued
    when the previous block's has arrived, so it moves while that block computes, and waited
    for where its first member was (what each member gathers, a view or a copy of an input, is
    computed before). A block's gathered copies live from then until the last use of any of
    them: two blocks' parameters at once, as FSDP holds them. Gathers of computed values stay
    where they are: they wait on compute."""
    buckets, current, key = [], [], None
    for node in gm.graph.nodes:
        if not (_torch.is_all_gather(node) and len(node.users) == 1 and _input_chain(node) is not None):
            continue
        k = (_torch.all_gather_key(node), block_of.get((node.meta.get("custom") or {}).get(ORIGIN)))
        if k[1] is None and current and k[0] == key[0]:
            k = key   # a consumer outside the layers (a parameter's view) goes with its neighbours
        if k != key and current:
            buckets.append(current)
            current = []
        key = k
        current.append(node)
    buckets = [b for b in [*buckets, current] if b]
    if not any(len(b) > 1 for b in buckets):
        return gm
    arrived = None   # the previous bucket's wait
    for bucket in buckets:
        issue = bucket[0] if arrived is None else arrived.next
        pos = {n: i for i, n in enumerate(gm.graph.nodes)}
        for member in bucket:
            for n in sorted(_input_chain(member), key=pos.__getitem__):
                if pos[n] > pos[issue]:
                    issue.prepend(n)   # earlier is safe: its inputs are graph inputs or moved before it
        arrived = _torch.merge_all_gathers(gm.graph, bucket, issue, bucket[0])
    gm.graph.lint()
    gm.recompile()
    return gm


def _input_chain(gather: fx.Node) -> list[fx.Node] | None:
    """The nodes that compute what ``gather`` moves from graph inputs alone (a view, copy or cast
    of a parameter shard); None when it depends on anything else (computed values, collectives)."""
    chain, todo, seen = [], [gather.args[0]], set()
    while todo:
        n = todo.pop()
        if not isinstance(n, fx.Node) or n in seen or n.op == "placeholder":
            continue
        seen.add(n)
        if n.op != "call_function" or "c10d" in str(n.target) or len(chain) >= _CHAIN:
            return None
        chain.append(n)
        todo.extend(n.all_input_nodes)
    return chain


_CHAIN = 8   # longer than a parameter's view, transpose and cast: not a parameter being readied


def _drop_dead(gm: fx.GraphModule) -> fx.GraphModule:
    """Erase ops nothing reads that dead-code elimination keeps for being seeded: the partitioner
    copies CPU flash attention (it takes a dropout seed) into the backward with no reader, and it
    ran there again each step (4 attention forwards, ~2% of a GPT step). Collectives and
    mutating ops stay, as the partitioner keeps them."""
    dropped = False
    for node in reversed(list(gm.graph.nodes)):
        target = node.target
        if (node.op == "call_function" and not node.users and not node.is_impure(impure_random=False)
                and getattr(target, "namespace", None) != "_c10d_functional"):
            gm.graph.erase_node(node)
            dropped = True
    if dropped:
        gm.recompile()
    return gm
