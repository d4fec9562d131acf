"""collectives: the moves of tensors between placements that run at step time, many of them made as
one collective on a flat buffer, as FSDP and DDP make them.

On gloo every collective is a synchronization of the ranks (on NCCL a kernel launch): moving a
small GPT's parameters and gradients one at a time took ~90 gathers and ~50 reductions per FSDP
step, 1.96x torch's FSDP step. The emitted program moves them here:

- :func:`gradient_buckets`, :func:`pack`, :func:`issue`, :func:`finish`: gradients reduced into
  their storage placement by one all-reduce or reduce-scatter of a flat buffer per bucket, inside
  backward (passes/bucket.py: reduce_gradients puts these calls in the backward graph).
- :func:`to_storage_many`: the same reductions after backward, for what backward hands over
  unreduced (gradients summed over micro-batches, moves the graph does not bucket).
- :func:`gather_many`: working copies gathered once per step.

The moves bucketed: a summed partial into Replicate on any mesh dims (all-reduce, DDP) or into a
Shard(k) on one mesh dim that no other splits (reduce-scatter, FSDP); a Shard(k) gathered into
Replicate on one mesh dim (all-gather). Anything else goes alone, through DTensor
(:func:`to_placements`). Which moves those are (:func:`grad_bucket_move`, :func:`splits_evenly`)
is decided here, next to the code that packs the buffers, and the cost model prices a bucketed
move by the same rule, so the plan never counts on a bucket the program does not make.

This module sits below the compiler passes and the runtime: both use it, and it reads neither.

Example (inside a process group; ``moves`` a DDP plan's gradients [(index, placements,
parameter, block, dtype)] in the order backward makes them)::

    >>> buckets = gradient_buckets(moves, None)
    >>> [b.kind for b in buckets]    # the final norm's, each layer's, the embeddings'
    ['all_reduce', 'all_reduce', 'all_reduce', 'all_reduce']
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from autoshard import _torch

GRAD_BUCKET_BYTES = 64 * 2**20   # a flat buffer's cap: bounds the transient copy of the gradients


# --- placement arithmetic ---------------------------------------------------------------------
def local_shape(shape, placements, mesh_shape) -> tuple[int, ...]:
    """The shape of one rank's shard (even sharding: every sharded dim divides)."""
    out = list(shape)
    for p, m in zip(placements, mesh_shape):
        if isinstance(p, Shard):
            out[p.dim] //= m
    return tuple(out)


def splits_evenly(shape, placements, mesh_shape) -> bool:
    """Whether every rank's piece of a tensor of ``shape`` at ``placements`` has the same shape:
    each sharded dim divides by the product of the mesh dims that split it."""
    split: dict[int, int] = {}
    for p, m in zip(placements, mesh_shape):
        if isinstance(p, Shard):
            split[p.dim] = split.get(p.dim, 1) * m
    return all(shape[k] % n == 0 for k, n in split.items())


def bucket_move(src, dst):
    """How a gradient's move to storage goes in one flat collective with others (DDP's and FSDP's
    buckets): ("all_reduce", mesh dims) when it sums partials on those dims into Replicate,
    ("reduce_scatter", mesh dim, k) when it sums a partial on one mesh dim into a Shard(k) that no
    other mesh dim splits; None for any other move (or none)."""
    moved = [d for d, (a, b) in enumerate(zip(src, dst)) if a != b]
    if not moved or not all(isinstance(src[d], Partial) and src[d].reduce_op == "sum" for d in moved):
        return None
    if all(isinstance(dst[d], Replicate) for d in moved):
        return "all_reduce", tuple(moved)
    if len(moved) != 1:
        return None
    (d,) = moved
    if type(dst[d]) is Shard and dst[d] not in dst[:d] + dst[d + 1:]:
        return "reduce_scatter", d, dst[d].dim
    return None


def grad_bucket_move(shape, src, dst, mesh_shape):
    """:func:`bucket_move` of a gradient of ``shape``, or None when its pieces, before or after,
    differ in shape across ranks: a flat bucket's layout must be the same on every rank, so such
    a gradient moves on its own."""
    how = bucket_move(src, dst)
    if how is None or not (splits_evenly(shape, src, mesh_shape) and splits_evenly(shape, dst, mesh_shape)):
        return None
    return how


# --- one tensor, through DTensor --------------------------------------------------------------
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


def to_placements(dt: DTensor, placements, reduce_dtype: torch.dtype | None = None) -> DTensor:
    """``dt`` moved to ``placements``, Partial included (which DTensor will not redistribute to),
    with any pending sum taken in ``reduce_dtype``. The rewrite pass traces the local graphs
    through it too, so a gradient moved here after backward goes as the graph would have moved it."""
    placements = tuple(placements)
    if tuple(dt.placements) == placements:
        return dt
    if reduce_dtype is not None and dt.dtype != reduce_dtype and any(
            isinstance(p, Partial) and p != q for p, q in zip(dt.placements, placements)):
        # the pending sum is taken in reduce_dtype (bf16 partials summed in fp32, or fp32 ones
        # sent as bf16); the cast of a partial sum is applied to each addend, so it stays partial
        return to_placements(dt.to(reduce_dtype), placements).to(dt.dtype)
    mesh = dt.device_mesh
    # DTensor will not redistribute *to* Partial; do Replicate -> Partial here: the value stays on
    # mesh coordinate 0 of that dim and is zero elsewhere, so the pending sum is exact.
    to_partial = [d for d, p in enumerate(placements) if isinstance(p, Partial) and dt.placements[d] != p]
    if not to_partial:
        return _keep_layout(dt.redistribute(mesh, placements))
    staged = tuple(Replicate() if d in to_partial else p for d, p in enumerate(placements))
    if tuple(dt.placements) != staged:
        dt = dt.redistribute(mesh, staged)
    # a product with 1 there and 0 elsewhere, not zeros on some ranks only: every rank runs the
    # same ops, its rank in integer arguments alone (what simulated ranks run: autoshard/runtime/simulate.py)
    local = dt.to_local() * int(all(mesh.get_local_rank(d) == 0 for d in to_partial))
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=dt.shape, stride=dt.stride())


def to_storage(local_grad: torch.Tensor, placements, param: DTensor,
               reduce_dtype: torch.dtype | None = None) -> DTensor:
    """A gradient output of the local graph (this rank's piece, in ``placements``) moved to its
    parameter's storage placement, as a DTensor like ``param``: DDP's all-reduce, FSDP's
    reduce-scatter, or nothing where the placements agree. Through DTensor: the one-dim moves
    go bucketed on local tensors (:func:`to_storage_many`), which costs ~1 ms less per call on gloo."""
    dt = DTensor.from_local(local_grad, param.device_mesh, placements, run_check=False,
                            shape=param.shape, stride=param.stride())
    return to_placements(dt, param.placements, reduce_dtype)


# --- reductions -------------------------------------------------------------------------------
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


def pack(grads, b: GradBucket) -> torch.Tensor:
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


def issue(flat: torch.Tensor, b: GradBucket) -> torch.Tensor:
    """Start the bucket's first collective; the result is pending until :func:`finish`."""
    if b.kind == "all_reduce":
        return _torch.all_reduce_async(flat, b.groups[0])
    return _torch.reduce_scatter_async(flat, b.ranks, b.groups[0])


def finish(pending: torch.Tensor, b: GradBucket) -> list[torch.Tensor]:
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


def bucketable(placements: tuple, param: DTensor):
    """How one flat collective per bucket makes this gradient move from ``placements`` to its
    parameter's (:func:`bucket_move`: ("all_reduce", mesh dims) or ("reduce_scatter", mesh dim,
    k)); None for any other move, or when a rank's piece, before or after, differs in shape from
    another's: a bucket's layout must be the same on all ranks."""
    return grad_bucket_move(param.shape, tuple(placements), tuple(param.placements), param.device_mesh.shape)


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
        shape = local_shape(param.shape, placements, param.device_mesh.shape)
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
        flat = pack(members, b)
        del members
        for j, local in zip(b.indices, finish(issue(flat, b), b)):
            param = by_index[j][1]
            out[j] = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                        shape=param.shape, stride=param.stride())
    return out


# --- gathers ----------------------------------------------------------------------------------
def _gather_dims(dt: DTensor, placements) -> tuple[int, int] | None:
    """(mesh dim, tensor dim k) of a Shard(k) -> Replicate gather on one mesh dim of a tensor
    split evenly (:func:`splits_evenly`) and along k by no other mesh dim, or None."""
    mesh, have, want = dt.device_mesh, tuple(dt.placements), tuple(placements)
    moved = [d for d, (a, b) in enumerate(zip(have, want)) if a != b]
    if len(moved) != 1:
        return None
    (d,) = moved
    k = getattr(have[d], "dim", None)
    if type(have[d]) is Shard and isinstance(want[d], Replicate) and have[d] not in have[:d] + have[d + 1:] \
            and splits_evenly(dt.shape, have, mesh.shape):
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
