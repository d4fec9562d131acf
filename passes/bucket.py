"""bucket: the moves of many tensors made as one collective on a flat buffer, as FSDP and DDP make them.

On gloo every collective is a synchronization of the ranks (on NCCL a kernel launch): moving a
small GPT's parameters and gradients one at a time took ~90 gathers and ~50 reductions per FSDP
step, 1.96x torch's FSDP step. Four places bucket:

- :func:`bucket_gathers`, a graph pass: a block's parameter gathers merged into one, issued
  while the previous block computes (FSDP's per-module gather and prefetch).
- :func:`reduce_gradients`, a graph pass: backward reduces each block's gradients into their
  storage placement as soon as the block's last one is made (DDP's and FSDP's bucketed
  reduction), issued there and waited for when the next bucket is issued, so the reduction runs
  while backward goes on and a block's unreduced gradients are freed at once instead of living
  to the end of backward (solver/memory.py counts one block's in flight).
- :func:`gather_many` (runtime): working copies gathered once per step.
- :func:`to_storage_many` (runtime): the same reductions after backward, for what backward hands
  over unreduced (gradients summed over micro-batches, moves the graph does not bucket).

The moves bucketed: a summed partial into Replicate on any mesh dims (all-reduce, DDP) or into a
Shard(k) on one mesh dim that no other splits (reduce-scatter, FSDP); a Shard(k) gathered into
Replicate on one mesh dim (all-gather). Anything else goes alone, through DTensor.

Example (inside a process group; ``bw`` the backward graph of a 2-layer GPT's DDP plan,
``moves`` its gradients [(output index, placements, parameter, block, dtype)] in the order
backward makes them, as autoshard/build.py lists them)::

    >>> buckets = gradient_buckets(moves, None)
    >>> [b.kind for b in buckets]    # the final norm's, each layer's, the embeddings'
    ['all_reduce', 'all_reduce', 'all_reduce', 'all_reduce']
    >>> bw_sync = reduce_gradients(bw, buckets)   # one issue and one wait node per bucket
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from autoshard import _torch
from autoshard.cluster import costmodel
from autoshard.passes.rewrite import ORIGIN, to_storage

GRAD_BUCKET_BYTES = 64 * 2**20   # a flat buffer's cap: bounds the transient copy of the gradients


# --- reductions -------------------------------------------------------------------------------
def bucketable(placements: tuple, param: DTensor):
    """How one flat collective per bucket makes this gradient move from ``placements`` to its
    parameter's (costmodel.bucket_move: ("all_reduce", mesh dims) or ("reduce_scatter", mesh dim,
    k)); None for any other move, or when a rank's piece, before or after, differs in shape from
    another's: a bucket's layout must be the same on all ranks."""
    return costmodel.grad_bucket_move(param.shape, tuple(placements), tuple(param.placements), param.device_mesh.shape)


@dataclass(frozen=True)
class GradBucket:
    """One flat reduction of several gradients (its members, in the bucket's order)."""
    kind: str                    # "all_reduce" | "reduce_scatter"
    groups: tuple                # process-group names of the mesh dims it sums over
    ranks: int                   # the reduce-scatter's group size (1 for an all-reduce)
    split: tuple                 # per member: the tensor dim a reduce-scatter splits (None: all-reduce)
    shapes: tuple                # per member: its local gradient's shape, as backward makes it
    dtypes: tuple                # per member: its dtype (the sum runs in ``wire``)
    wire: torch.dtype
    indices: tuple = ()          # per member: its position among the backward graph's outputs


def _pack(grads, b: GradBucket) -> torch.Tensor:
    """The gradients copied into one flat buffer in the wire dtype. All-reduce: one after
    another; reduce-scatter: rank r's chunks of every gradient, rank after rank, so that rank r
    receives its chunks summed, in order."""
    total = sum(g.numel() for g in grads)
    flat = torch.empty(total, dtype=b.wire, device=grads[0].device)
    per_rank, offsets = total // b.ranks, [0] * b.ranks
    for g, k in zip(grads, b.split):
        for r, chunk in enumerate([g] if k is None else g.chunk(b.ranks, dim=k)):
            start = r * per_rank + offsets[r]
            flat[start:start + chunk.numel()].view(chunk.shape).copy_(chunk)
            offsets[r] += chunk.numel()
    return flat


def _issue(flat: torch.Tensor, b: GradBucket) -> torch.Tensor:
    """Start the bucket's first collective; the result is pending until :func:`_finish`."""
    if b.kind == "all_reduce":
        return _torch.all_reduce_async(flat, b.groups[0])
    return _torch.reduce_scatter_async(flat, b.ranks, b.groups[0])


def _finish(pending: torch.Tensor, b: GradBucket) -> list[torch.Tensor]:
    """Wait for the bucket's collective (an all-reduce then sums over its other mesh dims) and
    cut this rank's result into each member's local gradient, in its own dtype (views of the
    result where the dtype is the wire's)."""
    result = _torch.wait(pending)
    for group in b.groups[1:]:
        result = _torch.wait(_torch.all_reduce_async(result, group))
    out, offset = [], 0
    for shape, k, dtype in zip(b.shapes, b.split, b.dtypes):
        shape = list(shape)
        if k is not None:
            shape[k] //= b.ranks
        n = torch.Size(shape).numel()
        out.append(result[offset:offset + n].view(shape).to(dtype))
        offset += n
    return out


class _IssueBucket(nn.Module):
    """A graph node: pack a bucket's gradients and start its reduction."""

    def __init__(self, bucket: GradBucket):
        super().__init__()
        self.bucket = bucket

    def forward(self, *grads: torch.Tensor) -> torch.Tensor:
        return _issue(_pack(grads, self.bucket), self.bucket)


class _FinishBucket(_IssueBucket):
    """A graph node: wait for a bucket's reduction and hand out each member's reduced gradient."""

    def forward(self, pending: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(_finish(pending, self.bucket))


def gradient_buckets(moves: list[tuple[int, tuple, DTensor, object, torch.dtype]], reduce_dtype: torch.dtype | None,
                     cap: int = GRAD_BUCKET_BYTES) -> list[GradBucket]:
    """``moves`` [(backward output index, its placements, the parameter, its block, the gradient's
    dtype)], in the order backward makes them, as buckets: consecutive moves of one block and the
    same kind, mesh dims and dtype, up to ``cap`` bytes (in the wire dtype: ``reduce_dtype`` or the
    gradient's own)."""
    buckets: list[GradBucket] = []
    open_: dict = {}      # (kind, dims, dtype) -> members [(index, shape, k)] of the bucket filling
    block = object()

    def close(key) -> None:
        members = open_.pop(key)
        (kind, dims), dtype, mesh = key[0], key[1], key[2]
        ranks = 1 if kind == "all_reduce" else mesh.size(dims)
        groups = tuple(mesh.get_group(d).group_name for d in (dims if kind == "all_reduce" else (dims,)))
        buckets.append(GradBucket(kind, groups, ranks, tuple(k for _, _, k in members),
                                  tuple(s for _, s, _ in members), (dtype,) * len(members),
                                  reduce_dtype or dtype, tuple(i for i, _, _ in members)))

    for i, placements, param, blk, dtype in moves:
        shape = costmodel.local_shape(param.shape, placements, param.device_mesh.shape)
        how = bucketable(placements, param)
        if how is None:
            continue
        if blk != block:
            for key in list(open_):
                close(key)
            block = blk
        key = (how[:2], dtype, param.device_mesh)
        n = torch.Size(shape).numel() * (reduce_dtype or dtype).itemsize
        if key in open_ and sum(torch.Size(s).numel() for _, s, _ in open_[key]) * (reduce_dtype or dtype).itemsize \
                + n > cap:
            close(key)
        open_.setdefault(key, []).append((i, tuple(shape), how[2] if how[0] == "reduce_scatter" else None))
    for key in list(open_):
        close(key)
    return buckets


def reduce_gradients(bw: fx.GraphModule, buckets: list[GradBucket]) -> fx.GraphModule:
    """A copy of the backward graph ``bw`` that reduces each bucket's gradients itself: the
    bucket's reduction issued right after its last member is made and waited for when the next
    bucket is issued (the last at the end of backward), so it runs while the next block's
    backward computes, and one bucket's flat copy is in flight at a time (a collective holds its
    input until waited for: deferring every wait to the end held all of them, as FSDP's
    reduce-scatter stream would). The members' outputs become their reduced local gradients, each
    in its parameter's storage placement. ``bw`` is left as it is (the runtime still runs it
    when it accumulates)."""
    graph = fx.Graph()
    copied, _ = graph.graph_copy(bw.graph, {}, return_output_node=True)
    outputs = list(copied)
    out = graph.output(None)
    gm = fx.GraphModule(bw, graph)
    pos = {n: i for i, n in enumerate(graph.nodes)}
    issued = []
    for j, b in enumerate(buckets):
        members = [outputs[i] for i in b.indices]
        gm.add_submodule(f"grad_bucket_{j}", _IssueBucket(b))
        with graph.inserting_after(max(members, key=pos.__getitem__)):
            issued.append(graph.call_module(f"grad_bucket_{j}", tuple(members)))
    order = {n: i for i, n in enumerate(graph.nodes)}
    issued.sort(key=order.__getitem__)
    for k, node in enumerate(issued):
        j = int(node.target.rsplit("_", 1)[1])
        gm.add_submodule(f"grad_bucket_{j}_wait", _FinishBucket(buckets[j]))
        with graph.inserting_before(issued[k + 1] if k + 1 < len(issued) else out):
            done = graph.call_module(f"grad_bucket_{j}_wait", (node,))
            for m, i in enumerate(buckets[j].indices):
                outputs[i] = graph.call_function(operator.getitem, (done, m))
    out.args = (type(copied)(outputs),)
    graph.lint()
    gm.recompile()
    return gm


def to_storage_many(grads: list, moves: list[tuple[int, tuple, DTensor]],
                    reduce_dtype: torch.dtype | None = None) -> list[DTensor]:
    """:func:`to_storage` for ``moves`` = [(index into ``grads``, placements, parameter)], with
    the all-reduces and reduce-scatters of the same mesh dims and dtype made as one collective on
    a flat buffer (up to GRAD_BUCKET_BYTES). Each gradient is dropped from ``grads`` once copied
    into its bucket."""
    out: list = [None] * len(moves)
    buckets = gradient_buckets([(j, placements, param, None, grads[i].dtype)
                                for j, (i, placements, param) in enumerate(moves)], reduce_dtype)
    bucketed = {j for b in buckets for j in b.indices}
    for j, (i, placements, param) in enumerate(moves):   # the others, one by one through DTensor
        if j not in bucketed:
            out[j] = to_storage(grads[i], placements, param, reduce_dtype)
            grads[i] = None
    by_index = {j: (i, param) for j, (i, _, param) in enumerate(moves)}
    for b in buckets:
        members = [grads[by_index[j][0]] for j in b.indices]
        for j in b.indices:
            grads[by_index[j][0]] = None
        flat = _pack(members, b)
        del members
        for j, local in zip(b.indices, _finish(_issue(flat, b), b)):
            param = by_index[j][1]
            out[j] = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                        shape=param.shape, stride=param.stride())
    return out


# --- gathers ----------------------------------------------------------------------------------
def _gather_dims(dt: DTensor, placements) -> tuple[int, int] | None:
    """(mesh dim, tensor dim k) of a Shard(k) -> Replicate gather on one mesh dim of a tensor
    split evenly (costmodel.splits_evenly) and along k by no other mesh dim, or None."""
    mesh, have, want = dt.device_mesh, tuple(dt.placements), tuple(placements)
    moved = [d for d, (a, b) in enumerate(zip(have, want)) if a != b]
    if len(moved) != 1:
        return None
    (d,) = moved
    k = getattr(have[d], "dim", None)
    if type(have[d]) is Shard and isinstance(want[d], Replicate) and have[d] not in have[:d] + have[d + 1:] \
            and costmodel.splits_evenly(dt.shape, have, mesh.shape):
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
    _torch.all_gather_flat(gathered, flat, mesh.get_group(d))
    gathered = gathered.view(p, flat.numel())
    # rank r's piece of every tensor, rank after rank: a tensor is its pieces joined along k
    for (j, k), t, piece in zip(bucket, locals_, gathered.split([t.numel() for t in locals_], dim=1)):
        pieces = piece.reshape(p, *t.shape)
        out[j] = pieces.reshape(p * t.shape[0], *t.shape[1:]) if k == 0 else torch.cat(pieces.unbind(0), dim=k)


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
        origin = (node.meta.get("custom") or {}).get(ORIGIN)
        k = (_torch.all_gather_key(node), block_of.get(origin))
        if k[1] is None:
            # a consumer outside the layers (a parameter's view) goes with its layer's gathers;
            # any other with the gathers of its own consumer only (a norm's weight and bias):
            # merging a model's gathers outside layers (all of them, without layers) would
            # gather those parameters all at once
            joins = current and k[0] == key[0] and not isinstance(key[1], _Alone)
            k = key if joins else (k[0], _Alone(origin))
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
        # each node once, in graph order: members share chain nodes (one transpose read by two
        # copies), and a shared node moved again would land after what reads it
        chains = {n for member in bucket for n in _input_chain(member)}
        for n in sorted(chains, key=pos.__getitem__):
            if pos[n] > pos[issue]:
                issue.prepend(n)   # earlier is safe: its inputs are graph inputs or moved before it
        arrived = _torch.merge_all_gathers_at(gm.graph, bucket, issue, bucket[0])
    gm.graph.lint()
    gm.recompile()
    return gm


@dataclass(frozen=True)
class _Alone:
    """bucket_gathers' key for gathers outside the layers that go alone: those of one consumer
    (its joint-graph name)."""
    consumer: str


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
