"""CPU flash attention: FLOP formulas, DTensor sharding rules and context parallelism.

``aten._scaled_dot_product_flash_attention_for_cpu`` (and its backward) is what every
``F.scaled_dot_product_attention`` becomes on CPU. torch 2.13 has neither a FLOP formula for it
(flop counting silently gives 0) nor a DTensor rule. Attention is independent per batch element
and per head, so on each mesh dim it may be sharded on dim 0 (batch) or dim 1 (heads) of q, k, v,
the output, the log-sum-exp and all gradients alike; the all-Replicate rule is implied. A mask
(transformers' SDPA path passes one of (batch, 1, q, k)) splits along with the batch or heads
where it has that dim, and is replicated where it broadcasts.

Context parallelism splits the sequence (dim 2) of the queries, the output and the log-sum-exp:
each rank attends its own query rows to every key, so keys and values are whole (gathered: the
resharding the solver prices) and, in backward, their gradients are partial sums over ranks
(reduced: priced alike). Without a causal mask that is a plain DTensor rule, registered below
(a mask splits along its query dim). With one, a rank's rows at global positions ``o + i`` see
keys ``j <= o + i``: the kernel run on the local rows needs that offset, which DTensor's rule
cannot pass, so these strategies are autoshard's own (:func:`context_strategies`) and the
rewriter runs the op itself with the offset mask (:func:`_local`). Two variants, priced apart
for the ILP to choose:

* contiguous: rank r computes chunk r of the queries, so the last rank of ``cp`` has the most
  work, ``(2 cp - 1) / cp`` times an even share (the strategy's ``imbalance``: the cost model
  prices the slowest rank);
* balanced (``variant="balanced"``): the query-row tensors move inside the op, by one all-to-all
  each, to the layout where rank r holds half-chunks r and 2 cp - 1 - r (equal causal work on
  every rank), and the row results move back; outside the op everything stays contiguous, so
  positions and the model's own masks need nothing. The all-to-alls are priced with the op
  (:func:`exchange_time`).
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard

from autoshard import _torch

aten = torch.ops.aten
FWD = aten._scaled_dot_product_flash_attention_for_cpu.default
BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _fwd_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return _torch.sdpa_flop_count(query, key, value)


def _bwd_flops(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return _torch.sdpa_backward_flop_count(grad_out, query, key, value)


_torch.register_flop_formula([FWD.overloadpacket], _fwd_flops)
_torch.register_flop_formula([BWD.overloadpacket], _bwd_flops)

S = _torch.ShardingPlaceholder
R, P = Replicate(), Partial()


def _mask(args_schema, kwargs_schema, position: int):
    """The attention mask's TensorMeta (positional at ``position`` or keyword), or None."""
    if len(args_schema) > position and isinstance(args_schema[position], _torch.TensorMeta):
        return args_schema[position]
    mask = kwargs_schema.get("attn_mask")
    return mask if isinstance(mask, _torch.TensorMeta) else None


def _with_mask(rules, mask, query):
    """A mask broadcasts over (batch, heads, q, k): it follows a batch, head or query split where
    it has that dim in full, and stays whole where it is broadcast (size 1). ``rules``: (query dim
    split, single-dim rule) pairs."""
    if mask is None:
        return [rule for _, rule in rules]
    out = []
    for d, rule in rules:
        lead = len(mask.shape) - 4 + d   # the mask's dim aligned with query's dim d, if any
        if lead < 0 or mask.shape[lead] == 1:
            out.append(rule + [Replicate()])
        elif mask.shape[lead] == query.shape[d]:
            out.append(rule + [S(lead)])
    return out


def _causal(args_schema, kwargs_schema, position: int) -> bool:
    if len(args_schema) > position:
        return bool(args_schema[position])
    return bool(kwargs_schema.get("is_causal", False))


# placements of a sequence split, on one mesh dim, in rule order
_SEQ_FWD = [S(2), S(2), S(2), R, R]                    # out, lse <- q, k, v
_SEQ_BWD = [S(2), P, P, S(2), S(2), R, R, S(2), S(2)]  # gq, gk, gv <- go, q, k, v, out, lse


@_torch.register_single_dim_strategy(FWD)
def _fwd_rule(op, args_schema, kwargs_schema):
    # [out, logsumexp, query, key, value, (attn_mask)]
    rules = [(d, [S(d)] * 5) for d in (0, 1)]
    if not _causal(args_schema, kwargs_schema, 4):
        rules.append((2, list(_SEQ_FWD)))
    return _with_mask(rules, _mask(args_schema, kwargs_schema, 5), args_schema[0])


@_torch.register_single_dim_strategy(BWD)
def _bwd_rule(op, args_schema, kwargs_schema):
    # [grad_q, grad_k, grad_v, grad_out, query, key, value, out, logsumexp, (attn_mask)]
    rules = [(d, [S(d)] * 9) for d in (0, 1)]
    if not _causal(args_schema, kwargs_schema, 7):
        rules.append((2, list(_SEQ_BWD)))
    return _with_mask(rules, _mask(args_schema, kwargs_schema, 8), args_schema[1])


# op -> (number of outputs, position of is_causal, index of the query among tensor inputs)
_LAYOUT = {FWD: (2, 4, 0), BWD: (3, 7, 1)}


def is_attention(node) -> bool:
    return node.op == "call_function" and node.target in _LAYOUT


def _node_causal(node) -> bool:
    _, position, _ = _LAYOUT[node.target]
    return bool(node.args[position]) if len(node.args) > position else bool(node.kwargs.get("is_causal", False))


def _has_mask(node) -> bool:
    return node.kwargs.get("attn_mask") is not None


BALANCED = "balanced"   # the strategy variant that balances a causal split (see the module doc)


def context_strategies(node, mesh_shape) -> list[tuple[tuple, tuple, float, str]]:
    """Causal attention split by sequence on one mesh dim (batch, heads or nothing on the others),
    for the strategy pass: (outputs, inputs, imbalance, variant) per strategy, each split both as
    contiguous chunks (the last rank's excess work) and balanced (two half-chunks per rank, moved
    there and back inside the op), where the sequence has 2 cp equal half-chunks. The non-causal
    split is the registered rule above; a causal op with a mask tensor is left to it (batch and
    heads)."""
    if not _node_causal(node) or _has_mask(node):
        return []
    n_out, _, q = _LAYOUT[node.target]
    length = node.args[q].meta["val"].shape[2]
    seq = _SEQ_FWD if node.target is FWD else _SEQ_BWD
    width = len(seq)
    other = [[R] * width, [S(0)] * width, [S(1)] * width]
    found = []
    for cp_dim, cp in enumerate(mesh_shape):
        per_dim = [[seq] if d == cp_dim else other for d in range(len(mesh_shape))]
        for rules in itertools.product(*per_dim):
            columns = [tuple(_concrete(rule[i]) for rule in rules) for i in range(width)]
            outs, ins = tuple(columns[:n_out]), tuple(columns[n_out:])
            found.append((outs, ins, (2 * cp - 1) / cp, ""))
            if length % (2 * cp) == 0:
                found.append((outs, ins, 1.0, BALANCED))
    return found


def _concrete(p):
    return Shard(p.dim) if isinstance(p, S) else p


def no_sequence_split(node, strategies, k: int, mesh_shape=()) -> str:
    """For the coverage report of input ``k``, which every one of ``strategies`` keeps whole: why
    the attention op has no sequence split, and the lengths that would have one; "" where that
    is not why (the input is no query, or a sequence split exists)."""
    q = _LAYOUT[node.target][2]
    if k != q or any(sequence_mesh_dim(node, s) is not None for s in strategies):
        return ""
    length = node.args[q].meta["val"].shape[2]
    if _node_causal(node) and _has_mask(node):
        return "a causal attention that also takes a mask tensor has no sequence split (pass one or the other)"
    sizes = sorted({m for m in mesh_shape if m > 1})
    works = ", ".join(f"{-(-length // m) * m} over a mesh dim of {m} ({-(-length // (2 * m)) * 2 * m} balanced "
                      f"if causal)" for m in sizes)
    return (f"its queries' sequence ({length}) splits only over a mesh dim whose size divides it; pad the "
            f"sequence" + (f": the next lengths that split are {works}" if works else ""))


def sequence_mesh_dim(node, strategy) -> int | None:
    """The mesh dim on which ``strategy`` splits the queries' sequence, if any."""
    _, _, q = _LAYOUT[node.target]
    placements = strategy.inputs[q]
    for d, p in enumerate(placements or ()):
        if isinstance(p, Shard) and p.dim == 2:
            return d
    return None


def _causal_mask(offset: int, rows: int, like: torch.Tensor) -> torch.Tensor:
    """The additive mask letting query row ``i`` (at global position ``offset + i``) see keys
    ``j <= offset + i``, over the ``offset + rows`` keys up to the last row's own. It is a
    (rows, keys) tensor in the query's dtype: the CPU kernel takes no offset."""
    positions = torch.arange(rows, device=like.device) + offset
    visible = torch.arange(offset + rows, device=like.device)[None, :] <= positions[:, None]
    return torch.zeros(visible.shape, dtype=like.dtype, device=like.device).masked_fill(~visible, float("-inf"))


def _contiguous_owner(g: int, cp: int) -> tuple[int, int]:
    return g // 2, g % 2


def _balanced_owner(g: int, cp: int) -> tuple[int, int]:
    return (g, 0) if g < cp else (2 * cp - 1 - g, 1)


def _move_halves(x: torch.Tensor, dim: int, rank: int, cp: int, group: str, to_balanced: bool) -> torch.Tensor:
    """``x``'s two local half-chunks along ``dim`` moved between the contiguous layout (rank r:
    half-chunks 2r, 2r+1) and the balanced one (rank r: r, 2 cp - 1 - r), by one all-to-all over
    ``group``: each rank sends each half-chunk to its one new owner."""
    src, dst = (_contiguous_owner, _balanced_owner) if to_balanced else (_balanced_owner, _contiguous_owner)
    halves = x.movedim(dim, 0).chunk(2)
    h = halves[0].shape[0]
    mine = sorted((g for g in range(2 * cp) if src(g, cp)[0] == rank), key=lambda g: (dst(g, cp)[0], g))
    theirs = sorted((g for g in range(2 * cp) if dst(g, cp)[0] == rank), key=lambda g: (src(g, cp)[0], g))
    send = torch.cat([halves[src(g, cp)[1]] for g in mine])
    sizes_in = [h * sum(dst(g, cp)[0] == j for g in mine) for j in range(cp)]
    sizes_out = [h * sum(src(g, cp)[0] == j for g in theirs) for j in range(cp)]
    got = _torch.wait(_torch.all_to_all_async(send, sizes_out, sizes_in, group)).split(h)
    slots = sorted(zip(theirs, got), key=lambda t: dst(t[0], cp)[1])
    return torch.cat([piece for _, piece in slots]).movedim(0, dim)


def _local(node, args: tuple, kwargs: dict, strategy, mesh):
    """Run the op on local shards. Under a causal sequence split each block of the rank's query
    rows (contiguous: its chunk; balanced: its two half-chunks, moved there first) runs against
    the keys up to its last row's position only, with a mask of the rows' own positions: so the
    CPU kernel, which skips no masked block, does the causal work the split is priced at. The
    row results are joined (and moved back); the key and value gradients of the blocks are summed
    over the whole key length (a partial sum over every rank's queries, in any layout)."""
    d = sequence_mesh_dim(node, strategy)
    if d is None or not _node_causal(node):
        return node.target(*args, **kwargs)
    backward = node.target is BWD
    _, position, q = _LAYOUT[node.target]
    rows, length, rank, cp = args[q].shape[2], args[q + 1].shape[2], mesh.get_local_rank(d), mesh.size(d)
    rowwise = (0, 1, 4, 5) if backward else (0,)   # one row per query: grad_out, query, out, lse
    if strategy.variant == BALANCED:
        group = mesh.get_group(d).group_name
        move = lambda t, there: _move_halves(t, 2, rank, cp, group, there)  # noqa: E731
        args = tuple(move(a, True) if i in rowwise else a for i, a in enumerate(args))
        h = rows // 2
        blocks = [(0, h, rank * h), (h, h, (2 * cp - 1 - rank) * h)]   # (first local row, rows, position)
    else:
        blocks = [(0, rows, rank * rows)]
    results = []
    for first, n, offset in blocks:
        block = list(args)
        for i in rowwise:
            block[i] = args[i].narrow(2, first, n)
        for i in (q + 1, q + 2):   # key, value: up to the block's last position
            block[i] = args[i].narrow(2, 0, offset + n)
        options = {**kwargs, "attn_mask": _causal_mask(offset, n, args[q])}
        if len(block) > position:
            block[position] = False
        else:
            options["is_causal"] = False
        results.append(node.target(*block, **options))
    if backward:
        whole = lambda g: F.pad(g, (0, 0, 0, length - g.shape[2]))  # noqa: E731
        out = (torch.cat([r[0] for r in results], dim=2),
               sum(whole(r[1]) for r in results), sum(whole(r[2]) for r in results))
    else:
        out = tuple(torch.cat([r[i] for r in results], dim=2) for i in range(2))
    if strategy.variant == BALANCED:   # the row results back: out and lse, or grad_query
        out = tuple(move(t, False) if i in ((0,) if backward else (0, 1)) else t for i, t in enumerate(out))
    return tuple(_laid_out_as(t, v) for t, v in zip(out, node.meta["val"]))


def _laid_out_as(t: torch.Tensor, val) -> torch.Tensor:
    """``t`` in the memory order of the traced ``val``: the kernel returns its output transposed
    (so that the model's transpose and view after it need no copy), and the DTensor wrapping a
    local result takes the traced strides as the truth."""
    order = sorted(range(t.ndim), key=lambda i: -val.stride()[i])
    if [t.stride()[i] for i in order] == sorted(t.stride(), reverse=True):
        return t
    return t.permute(order).contiguous().permute([order.index(i) for i in range(t.ndim)])


def exchange_time(cluster, node, strategy) -> float:
    """Seconds of the balanced variant's all-to-alls inside the op (0 for any other strategy):
    each moves one query-row tensor's local shard (forward: the query in, the output and
    log-sum-exp back; backward: the output gradient, query, output and log-sum-exp in, the query
    gradient back), in line with the op."""
    if strategy.variant != BALANCED:
        return 0.0
    d = sequence_mesh_dim(node, strategy)
    shards = math.prod(m for m, p in zip(cluster.mesh_shape, strategy.inputs[_LAYOUT[node.target][2]])
                       if not isinstance(p, Replicate))
    vals = [a.meta["val"] for a in node.args[:6] if hasattr(a, "meta")]
    out_vals = node.meta["val"]
    moved = [vals[0]] if node.target is FWD else [vals[i] for i in (0, 1, 4, 5)]
    moved += list(out_vals[:2]) if node.target is FWD else [out_vals[0]]
    return sum(cluster.collective_time("all_to_all", v.numel() * v.element_size() / shards, d) for v in moved)


def _local_bytes(val, placements, mesh_shape) -> float:
    shards = math.prod(m for m, p in zip(mesh_shape, placements) if isinstance(p, Shard))
    return val.numel() * val.element_size() / shards


def held_beyond(node, strategy, mesh_shape) -> float:
    """Bytes the op holds under ``strategy`` beyond its inputs and outputs as the working-set
    formula counts them (solver/memory.py): in backward, the keys and values a sequence split
    reads whole (saved split, gathered again: the formula leaves saved values out); under the
    balanced variant, the moved copies of the query-row tensors and of the row results. (The CPU
    kernel's mask, local rows x visible keys in the query's dtype, is not counted: a kernel that
    takes the offsets, as a GPU one would, has none.)"""
    d = sequence_mesh_dim(node, strategy)
    if d is None:
        return 0.0
    backward = node.target is BWD
    held = sum(_local_bytes(node.args[i].meta["val"], strategy.inputs[i], mesh_shape) for i in (2, 3)) if backward else 0.0
    if strategy.variant == BALANCED:
        q = _LAYOUT[node.target][2]
        rows = [node.args[i].meta["val"] for i in ((0, 1, 4, 5) if backward else (0,))]
        rows += [node.meta["val"][0]] if backward else list(node.meta["val"][:2])
        held += sum(_local_bytes(v, strategy.inputs[q], mesh_shape) for v in rows)
    return held


# ops the rewriter runs on local shards itself: the causal sequence split needs its offsets
LOCAL = {FWD: _local, BWD: _local}
EXTRA = {FWD: context_strategies, BWD: context_strategies}
# ops whose strategies communicate inside the op, priced with its time (autoshard/cluster/costmodel.py)
INLINE_COMM = {FWD: exchange_time, BWD: exchange_time}
# ops that hold more than their inputs and outputs under some strategies (solver/memory.py)
HELD = {FWD: held_beyond, BWD: held_beyond}
