"""bucket: the graph passes that move many tensors as one collective, as FSDP and DDP move them.

On gloo every collective is a synchronization of the ranks (on NCCL a kernel launch): moving a
small GPT's parameters and gradients one at a time took ~90 gathers and ~50 reductions per FSDP
step, 1.96x torch's FSDP step. Two graph passes bucket:

- :func:`bucket_gathers`: a block's parameter gathers merged into one, issued while the previous
  block computes (FSDP's per-module gather and prefetch).
- :func:`reduce_gradients`: backward reduces each block's gradients into their storage placement
  as soon as the block's last one is made (DDP's and FSDP's bucketed reduction), issued there and
  waited for when the next bucket is issued, so the reduction runs while backward goes on and a
  block's unreduced gradients are freed at once instead of living to the end of backward
  (solver/memory.py counts one block's in flight).

The inserted nodes call autoshard/collectives.py, which also holds the runtime's own bucketed
moves (after backward, and of the working copies): the runtime imports no compiler pass.

Example (inside a process group; ``bw`` the backward graph of a 2-layer GPT's DDP plan,
``moves`` its gradients [(output index, placements, parameter, block, dtype)] in the order
backward makes them, as autoshard/build.py lists them)::

    >>> buckets = gradient_buckets(moves, None)   # autoshard.collectives
    >>> bw_sync = reduce_gradients(bw, buckets)   # one issue and one wait node per bucket
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import nn

from autoshard import _torch
from autoshard.collectives import GradBucket, finish, issue, pack
from autoshard.passes.rewrite import ORIGIN

aten = torch.ops.aten


# --- reductions -------------------------------------------------------------------------------
class _IssueBucket(nn.Module):
    """A graph node: pack a bucket's gradients and start its reduction."""

    def __init__(self, bucket: GradBucket):
        super().__init__()
        self.bucket = bucket

    def forward(self, *grads: torch.Tensor) -> torch.Tensor:
        return issue(pack(grads, self.bucket), self.bucket)


class _FinishBucket(_IssueBucket):
    """A graph node: wait for a bucket's reduction and hand out each member's reduced gradient."""

    def forward(self, pending: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(finish(pending, self.bucket))


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


# --- gathers ----------------------------------------------------------------------------------
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
        issue_at = bucket[0] if arrived is None else arrived.next
        pos = {n: i for i, n in enumerate(gm.graph.nodes)}
        # each node once, in graph order: members share chain nodes (one transpose read by two
        # copies), and a shared node moved again would land after what reads it
        chains = {n for member in bucket for n in _input_chain(member)}
        for n in sorted(chains, key=pos.__getitem__):
            if pos[n] > pos[issue_at]:
                issue_at.prepend(n)   # earlier is safe: its inputs are graph inputs or moved before it
        arrived = _torch.merge_all_gathers_at(gm.graph, bucket, issue_at, bucket[0])
        _reshape_pieces(arrived)
    gm.graph.lint()
    gm.recompile()
    return gm


# ops through which a merged gather's piece keeps being a view of the flat buffer
_VIEWS = {operator.getitem, aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.slice.Tensor,
          aten.split.Tensor, aten.split_with_sizes.default, aten.permute.default, aten.t.default, aten.transpose.int,
          aten.unsqueeze.default, aten.squeeze.dim, aten.expand.default, aten.alias.default}


def _reshape_pieces(wait: fx.Node) -> None:
    """The views of a merged gather's pieces become reshapes. The merge (inductor's) cuts each
    member out of the flat buffer as a strided view, rows a rank's piece apart: compiled, inductor
    lays it out; run as written, the graph's ``view`` that joined dims of the contiguous tensor
    the member's own gather made fails on it (transformers' Mamba, a (1, 32) storage shard per
    rank viewed as (1, 64)). A reshape is that view where one exists, a copy where not."""
    todo, seen = list(wait.users), set()
    while todo:
        node = todo.pop()
        if node in seen or node.op != "call_function" or node.target not in _VIEWS:
            continue
        seen.add(node)
        if node.target in (aten.view.default, aten._unsafe_view.default):   # both need viewable strides
            node.target = aten.reshape.default
        todo.extend(node.users)


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
