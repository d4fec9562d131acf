"""CPU flash attention: FLOP formulas, DTensor sharding rules and context parallelism.

``aten._scaled_dot_product_flash_attention_for_cpu`` (and its backward) is what every
``F.scaled_dot_product_attention`` becomes on CPU. torch 2.13 has neither a FLOP formula for it
(flop counting silently gives 0) nor a DTensor rule. Attention is independent per batch element
and per head, so on each mesh dim it may be sharded on dim 0 (batch) or dim 1 (heads) of q, k, v,
the output, the log-sum-exp and all gradients alike; the all-Replicate rule is implied. A mask
(transformers' SDPA path passes one of (batch, 1, q, k)) splits along with the batch or heads
where it has that dim, and is replicated where it broadcasts.

Context parallelism splits the sequence (dim 2) of the queries, the output and the log-sum-exp:
each rank attends its own query rows to every key. In the gathered variants keys and values are
whole (gathered: the resharding the solver prices) and, in backward, their gradients are partial
sums over ranks (reduced: priced alike); the ring variants (below) keep them split. Gathered and
without a causal mask, the split is a plain DTensor rule, registered below (a mask splits along
its query dim). With a causal mask, a rank's rows at global positions ``o + i`` see keys
``j <= o + i``: the kernel run on the local rows needs that offset, which DTensor's rule cannot
pass, so these strategies are autoshard's own (:func:`context_strategies`) and the rewriter runs
the op itself with the offset mask (:func:`_local`). Two gathered causal variants,
priced apart for the ILP to choose:

* contiguous: rank r computes chunk r of the queries, so the last rank of ``cp`` has the most
  work, ``(2 cp - 1) / cp`` times an even share (the strategy's ``imbalance``: the cost model
  prices the slowest rank);
* balanced (``variant="balanced"``): the query-row tensors move inside the op, by one all-to-all
  each, to the layout where rank r holds half-chunks r and 2 cp - 1 - r (equal causal work on
  every rank), and the row results move back; outside the op everything stays contiguous, so
  positions and the model's own masks need nothing. The all-to-alls are priced with the op
  (:func:`exchange_time`).

Each of these gathers the keys and values before the op, a resharding the solver prices in full
(only parameter moves hide behind compute). The ring variants (``variant`` "ring", and "balanced
ring" for a causal op) take keys and values split like the queries instead: each rank attends
its rows to its own key block, then to the block its left neighbour passes it, ``cp`` steps in
all, each pass overlapping the current block's compute; the block outputs merge by their
log-sum-exps. Backward passes the key and value blocks again, with their gradients' running sums
(float32), which end at their owners. A rank holds a few key blocks at a time (the one it
attends to, the copy it sends, the one arriving), not the whole keys, and only the part of the
passes that outlasts a block's compute is exposed. A causal op runs the
ring balanced ("balanced ring"): queries, keys and values move to the balanced layout first, as
above, so every step gives every rank the same work; its blocks of half-chunks are full (keys
before the rows), diagonal (the kernel's own causal mask) or skipped, so no mask tensor is built.
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
_RING_FWD, _RING_BWD = [S(2)] * 5, [S(2)] * 9           # the ring: keys and values split too


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
RING = "ring"           # the variant that passes keys and values around the ring (see the module doc)


def _is(strategy, word: str) -> bool:
    return word in strategy.variant.split()


def context_strategies(node, mesh_shape) -> list[tuple[tuple, tuple, float, str]]:
    """Attention split by sequence on one mesh dim (batch, heads or nothing on the others) that
    only the rewriter runs right, for the strategy pass: (outputs, inputs, imbalance, variant) per
    strategy. A causal op, with keys and values gathered: contiguous chunks (the last rank's
    excess work) and balanced (two half-chunks per rank, moved there and back inside the op),
    where the sequence has 2 cp equal half-chunks. Any self-attention (as many keys as queries)
    whose sequence the mesh dim divides, with keys and values split too: the ring (balanced
    where causal, so it needs the half-chunks). The non-causal gathered split is the
    registered rule above; an op with a mask tensor is left to the rules (a causal one splits
    only by batch and heads)."""
    if _has_mask(node):
        return []
    causal = _node_causal(node)
    n_out, _, q = _LAYOUT[node.target]
    length, keys = node.args[q].meta["val"].shape[2], node.args[q + 1].meta["val"].shape[2]
    gathered, ring = (_SEQ_FWD, _RING_FWD) if node.target is FWD else (_SEQ_BWD, _RING_BWD)
    found, other = [], [[R] * 9, [S(0)] * 9, [S(1)] * 9]
    for cp_dim, cp in enumerate(mesh_shape):
        balances = length % (2 * cp) == 0
        variants = []
        if causal:
            variants += [(gathered, (2 * cp - 1) / cp, "")] + [(gathered, 1.0, BALANCED)] * balances
        # a causal ring runs balanced only: in contiguous chunks a rank would receive key blocks
        # past its rows and use none of them, and the traced program, whose dead code is dropped
        # per rank, would then lose that rank's share of a collective every rank must join
        if keys == length and cp > 1 and (balances if causal else length % cp == 0):
            variants.append((ring, 1.0, f"{BALANCED} {RING}" if causal else RING))
        # the other dims' splits outermost: the order the solver's ties were broken in before the ring
        for choice in itertools.product(*[[None] if d == cp_dim else other for d in range(len(mesh_shape))]):
            for seq, imbalance, variant in variants:
                rules = [seq if c is None else c[:len(seq)] for c in choice]
                columns = [tuple(_concrete(rule[i]) for rule in rules) for i in range(len(seq))]
                found.append((tuple(columns[:n_out]), tuple(columns[n_out:]), imbalance, variant))
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
    over the whole key length (a partial sum over every rank's queries, in any layout). The ring
    variants run in :func:`_ring`."""
    d = sequence_mesh_dim(node, strategy)
    if d is not None and _is(strategy, RING):
        return _ring(node, args, kwargs, strategy, mesh, d)
    if d is None or not _node_causal(node):
        return node.target(*args, **kwargs)
    backward = node.target is BWD
    _, position, q = _LAYOUT[node.target]
    rows, length, rank, cp = args[q].shape[2], args[q + 1].shape[2], mesh.get_local_rank(d), mesh.size(d)
    rowwise, back = _moved(node, strategy)   # one row per query: grad_out, query, out, lse
    if _is(strategy, BALANCED):
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
    if _is(strategy, BALANCED):   # the row results back: out and lse, or grad_query
        out = tuple(move(t, False) if i in back else t for i, t in enumerate(out))
    return tuple(_laid_out_as(t, v) for t, v in zip(out, node.meta["val"]))


def _moved(node, strategy) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The inputs and outputs a balanced strategy moves between the layouts (their positions):
    the query-row tensors (grad_out, query, out, lse) and row results, and under the ring the
    keys and values and their gradients too."""
    if node.target is FWD:
        return ((0, 1, 2) if _is(strategy, RING) else (0,)), (0, 1)
    return ((0, 1, 2, 3, 4, 5), (0, 1, 2)) if _is(strategy, RING) else ((0, 1, 4, 5), (0,))


def _segments(rank: int, rows: int, cp: int, balanced: bool) -> list[tuple[int, int, int]]:
    """(chunk, first local row, rows) of rank ``rank``'s rows: its chunk of ``cp``, or its two
    half-chunks r and 2 cp - 1 - r of 2 cp."""
    if not balanced:
        return [(rank, 0, rows)]
    h = rows // 2
    return [(rank, 0, h), (2 * cp - 1 - rank, h, h)]


def _pass_on(tensors: list[torch.Tensor], rank: int, cp: int, group: str) -> torch.Tensor:
    """Start sending ``tensors`` (flattened, one message) to the next rank of the ring while
    receiving the previous rank's; :func:`_unpack` once :func:`_torch.wait` returns it."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    sizes = lambda peer: [flat.numel() if j == peer else 0 for j in range(cp)]  # noqa: E731
    return _torch.all_to_all_async(flat, sizes((rank - 1) % cp), sizes((rank + 1) % cp), group)


def _unpack(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    return [piece.view(t.shape) for piece, t in zip(flat.split([t.numel() for t in like]), like)]


def _ring(node, args: tuple, kwargs: dict, strategy, mesh, d: int):
    """The ring variants (module doc) on this rank's rows. Step s attends the rows to the key
    block of rank r - s, received during step s - 1; in backward that block's gradient sums (in
    float32) follow one step behind it and end, after the last step, at the block's owner."""
    backward = node.target is BWD
    _, position, q = _LAYOUT[node.target]
    rank, cp, group = mesh.get_local_rank(d), mesh.size(d), mesh.get_group(d).group_name
    causal, balanced = _node_causal(node), _is(strategy, BALANCED)
    ins, back = _moved(node, strategy)
    if balanced:
        args = tuple(_move_halves(a, 2, rank, cp, group, True) if i in ins else a for i, a in enumerate(args))
    rows = args[q].shape[2]
    mine = _segments(rank, rows, cp, balanced)
    options = {**kwargs, "attn_mask": None}

    def blocks(owner):
        """(query rows, key rows, diagonal) of each pair the causal mask leaves any work in."""
        for qc, qs, n in mine:
            for kc, ks, m in _segments(owner, rows, cp, balanced):
                if not causal or kc <= qc:
                    yield slice(qs, qs + n), slice(ks, ks + m), causal and kc == qc

    def run(block_args, diagonal):
        block_args = list(block_args)
        if len(block_args) > position:
            block_args[position] = diagonal
            return node.target(*block_args, **options)
        return node.target(*block_args, **{**options, "is_causal": diagonal})

    rowslice = lambda t, sl: t[:, :, sl]  # noqa: E731
    kv = [args[q + 1], args[q + 2]]
    if not backward:
        acc: dict[int, tuple] = {}   # first row -> (out, lse) of the blocks so far, in float32
        for step in range(cp):
            sending = _pass_on(kv, rank, cp, group) if step < cp - 1 else None
            for qs, ks, diagonal in blocks((rank - step) % cp):
                o, lse = run((rowslice(args[0], qs), rowslice(kv[0], ks), rowslice(kv[1], ks), *args[3:]), diagonal)[:2]
                acc[qs.start] = _merge(acc.get(qs.start), o.float(), lse.float())
            if sending is not None:
                kv = _unpack(_torch.wait(sending), kv)
        parts = [acc[first] for first in sorted(acc)]
        out = (torch.cat([o for o, _ in parts], dim=2).to(args[0].dtype),
               torch.cat([lse for _, lse in parts], dim=2).to(node.meta["val"][1].dtype))
    else:
        go, query, _, _, o, lse = args[:6]
        grad_q = torch.zeros_like(query, dtype=torch.float32)
        travelling = None   # the gradient sums of the key block now held, from the previous rank
        for step in range(cp):
            sending = _pass_on(kv, rank, cp, group) if step < cp - 1 else None
            grad_kv = [torch.zeros_like(t, dtype=torch.float32) for t in kv]
            for qs, ks, diagonal in blocks((rank - step) % cp):
                g = run((rowslice(go, qs), rowslice(query, qs), rowslice(kv[0], ks), rowslice(kv[1], ks),
                         rowslice(o, qs), rowslice(lse, qs), *args[6:]), diagonal)
                grad_q[:, :, qs] += g[0]
                grad_kv[0][:, :, ks] += g[1]
                grad_kv[1][:, :, ks] += g[2]
            if travelling is not None:
                grad_kv = [a + b for a, b in zip(grad_kv, _unpack(_torch.wait(travelling), grad_kv))]
            travelling = _pass_on(grad_kv, rank, cp, group)
            if sending is not None:
                kv = _unpack(_torch.wait(sending), kv)
        grad_k, grad_v = _unpack(_torch.wait(travelling), grad_kv)
        out = (grad_q.to(query.dtype), grad_k.to(args[2].dtype), grad_v.to(args[3].dtype))
    if balanced:
        out = tuple(_move_halves(t, 2, rank, cp, group, False) if i in back else t for i, t in enumerate(out))
    return tuple(_laid_out_as(t, v) for t, v in zip(out, node.meta["val"]))


def _merge(acc, out: torch.Tensor, lse: torch.Tensor):
    """Attention over two key sets from each one's output and log-sum-exp (softmax weights
    rescaled to the union's normalizer)."""
    if acc is None:
        return out, lse
    acc_out, acc_lse = acc
    total = torch.logaddexp(acc_lse, lse)
    return (acc_out * torch.exp(acc_lse - total).unsqueeze(-1) + out * torch.exp(lse - total).unsqueeze(-1),
            total)


def _laid_out_as(t: torch.Tensor, val) -> torch.Tensor:
    """``t`` in the memory order of the traced ``val``: the kernel returns its output transposed
    (so that the model's transpose and view after it need no copy), and the DTensor wrapping a
    local result takes the traced strides as the truth."""
    order = sorted(range(t.ndim), key=lambda i: -val.stride()[i])
    if [t.stride()[i] for i in order] == sorted(t.stride(), reverse=True):
        return t
    return t.permute(order).contiguous().permute([order.index(i) for i in range(t.ndim)])


def exchange_time(cluster, node, strategy, compute: float) -> float:
    """Seconds the op's own communication adds to its ``compute`` seconds under ``strategy``:

    * balanced: the all-to-alls of the tensors it moves between the layouts (:func:`_moved`),
      each a local shard, in line with the op;
    * ring: each of the ``cp`` steps hides what passes during it behind its block's compute
      (``compute`` / cp) and exposes the rest. Forward: steps 0 .. cp-2 pass the next key and
      value block. Backward: step s passes the next key block and the gradient sums of step
      s - 1 (float32); the sums of the last step arrive after it, exposed whole.
    """
    d = sequence_mesh_dim(node, strategy)
    if d is None or not strategy.variant:
        return 0.0
    mesh_shape = cluster.mesh_shape
    time = 0.0
    if _is(strategy, BALANCED):
        time += sum(cluster.collective_time("all_to_all", n, d) for n in _moved_bytes(node, strategy, mesh_shape))
    if _is(strategy, RING):
        cp = mesh_shape[d]
        kv, grads = (_pass_time(cluster, d, n) for n in _ring_blocks(node, strategy, mesh_shape))
        block = compute / cp
        if node.target is FWD:
            time += (cp - 1) * max(0.0, kv - block)
        else:
            time += (max(0.0, kv - block) + (cp - 2) * max(0.0, kv + grads - block) + max(0.0, grads - block)
                     + grads)
    return time


def _pass_time(cluster, d: int, nbytes: float) -> float:
    """One pass of ``nbytes`` to the next rank of mesh dim ``d``: a step of a ring all-gather over
    the dim where it spans one hardware level (its calibrated line, where it has one); where it
    spans several, a ring's step waits on its slowest hop: that link's latency + bytes / bandwidth."""
    levels = cluster.levels[d]
    if len(levels) == 1:
        return cluster.collective_time("all_gather", nbytes * cluster.mesh_shape[d], d) / (cluster.mesh_shape[d] - 1)
    slowest = min((link for _, link in levels), key=lambda l: (l.effective_bandwidth, -l.latency))
    return slowest.latency + nbytes / slowest.effective_bandwidth


def _moved_bytes(node, strategy, mesh_shape) -> list[float]:
    """Local bytes of each tensor a balanced strategy moves between the layouts (:func:`_moved`)."""
    ins, outs = _moved(node, strategy)
    return ([_local_bytes(node.args[i].meta["val"], strategy.inputs[i], mesh_shape) for i in ins]
            + [_local_bytes(node.meta["val"][i], strategy.outputs[i], mesh_shape) for i in outs])


def _ring_blocks(node, strategy, mesh_shape) -> tuple[float, float]:
    """Bytes of one ring pass: the key and value blocks, and their float32 gradient sums."""
    q = _LAYOUT[node.target][2]
    vals = [node.args[i].meta["val"] for i in (q + 1, q + 2)]
    kv = sum(_local_bytes(v, strategy.inputs[q + 1], mesh_shape) for v in vals)
    return kv, kv * 4 / vals[0].element_size()


def _local_bytes(val, placements, mesh_shape) -> float:
    shards = math.prod(m for m, p in zip(mesh_shape, placements) if isinstance(p, Shard))
    return val.numel() * val.element_size() / shards


def held_beyond(node, strategy, mesh_shape) -> float:
    """Bytes the op holds under ``strategy`` beyond its inputs and outputs as the working-set
    formula counts them (solver/memory.py):

    * gathered keys and values, in backward: the keys and values it reads whole (saved split,
      gathered again: the formula leaves saved values out);
    * ring: three key and value blocks (the one attended to, the copy being sent, the one
      arriving); forward, the float32 output being merged and a merge's two float32 terms;
      backward, the float32 query gradient sum and four blocks' gradient sums (this step's, the
      ones arriving, their total, the copy being sent). Counted so even where the float32 sums
      are the op's outputs themselves (an fp32 model): an upper bound there;
    * balanced: the moved copies of the tensors it moves (:func:`_moved`).

    (The CPU kernel's mask under the gathered causal split, local rows x visible keys in the
    query's dtype, is not counted: a kernel that takes the offsets, as a GPU one would, has none.)
    """
    d = sequence_mesh_dim(node, strategy)
    if d is None:
        return 0.0
    backward = node.target is BWD
    local = lambda i, p: _local_bytes(node.args[i].meta["val"], p, mesh_shape)  # noqa: E731
    if _is(strategy, RING):
        kv, grads = _ring_blocks(node, strategy, mesh_shape)
        q = _LAYOUT[node.target][2]
        as_f32 = lambda v, p: _local_bytes(v, p, mesh_shape) * 4 / v.element_size()  # noqa: E731
        held = 3 * kv + (4 * grads + as_f32(node.args[q].meta["val"], strategy.inputs[q]) if backward
                         else 3 * as_f32(node.meta["val"][0], strategy.outputs[0]))
    else:
        held = sum(local(i, strategy.inputs[i]) for i in (2, 3)) if backward else 0.0
    if _is(strategy, BALANCED):
        held += sum(_moved_bytes(node, strategy, mesh_shape))
    return held


# ops the rewriter runs on local shards itself: the causal sequence split needs its offsets
LOCAL = {FWD: _local, BWD: _local}
EXTRA = {FWD: context_strategies, BWD: context_strategies}
# ops whose strategies communicate inside the op, priced with its time (autoshard/cluster/costmodel.py)
INLINE_COMM = {FWD: exchange_time, BWD: exchange_time}
# ops that hold more than their inputs and outputs under some strategies (solver/memory.py)
HELD = {FWD: held_beyond, BWD: held_beyond}
