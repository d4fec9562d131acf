"""Roles of mesh dims, as an ``allow(node, strategy)`` predicate for :func:`autoshard.plan`: what
a hand-written parallel strategy lets each op, parameter and input take on each dim
(:mod:`autoshard.baselines` builds its baselines from them, :mod:`autoshard.planning.meshes` its pruned
3-D candidates).

Roles of a mesh dim (placements are per mesh dim; "stored" is a parameter's placement at rest,
"consumed" the placement an op computes with, through any views of the parameter):

=========  ===========================  ==================================  =====================
role       parameter stored             parameter consumed                  model inputs
=========  ===========================  ==================================  =====================
dp         Replicate                    Replicate                           Shard(0) (batch)
fsdp       Shard(any dim)               Replicate (all-gathered per use)    Shard(0) (batch)
tp         Shard(any) if >= 2-D, else   Shard(any) if >= 2-D (colwise or    Replicate
           Replicate                    rowwise: the solver picks), else
                                        any
data       Replicate or Shard(any)      Replicate                           Shard(0) (batch)
cp         Shard(any dim)               Replicate (all-gathered per use)    Shard(1) (sequence)
ep         Shard(any dim)               Replicate, but experts Shard(0)     Shard(0) (batch)
free       any                          any                                 any
=========  ===========================  ==================================  =====================

"cp" is context parallelism as torchtitan runs it beside FSDP: the sequence is split, every
attention op splits its queries' sequence on that dim (keys and values gathered), and parameters
are stored sharded over it too and gathered per use, like fsdp's. "ep" is expert parallelism as
torchtitan runs it beside FSDP: every MoE region runs expert-parallel on that dim (each rank
holds its share of the experts, whole, and receives their rows by all-to-all), and every other
parameter is stored and gathered as fsdp's. "data" is dp or fsdp, per
parameter, as the solver likes; "free" leaves a dim to the solver (the
pruned 3-D candidates of :mod:`autoshard.planning.meshes` use ("data", "free", "free")). On dp, fsdp and
data dims an op's outputs are split along the batch (dim 0) or not at all (Replicate, Partial):
data parallelism, no sequence or feature splits; on AxoNN's x and y dims they are not split
along the batch; views are exempt (a transposed activation's batch dim moves).

A parameter that no strategy can place so (a dim that does not divide by the mesh size) falls
back to Replicate on that dim, as FSDP's padding or Megatron's replicated small layers would; on
"tp" dims of a mesh with two of them (AxoNN's x and y), a >= 2-D parameter must be sharded on both
along different tensor dims (a 2-D block). Otherwise activations are free: the solver places them.
A parameter's working placement (what its consumers gather from) obeys its storage rule too, so
FSDP gathers at every use (reshard after forward) rather than keeping a gathered copy.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard

from autoshard.passes.annotate import is_free
from autoshard.passes.rules import attention
from autoshard.passes.graph import META_KEY, tensor_inputs, value_of
from autoshard.passes.regions import ep_dim, ep_member
from autoshard.passes.trace import TracedModel


def _stored_ok(role: str, p, nd: int) -> bool:
    if role in ("free", "data"):
        return role == "free" or isinstance(p, (Replicate, Shard))
    if role == "dp" or (role == "tp" and nd < 2):
        return isinstance(p, Replicate)
    return isinstance(p, Shard)


def _consumed_ok(role: str, p, nd: int) -> bool:
    if role == "free":
        return True
    if role in ("dp", "fsdp", "data", "cp", "ep"):
        return isinstance(p, Replicate)
    return nd < 2 or isinstance(p, Shard)


def _input_ok(role: str, p) -> bool:
    if role == "free":
        return True
    if role == "cp":
        return isinstance(p, Shard) and p.dim == 1
    return isinstance(p, Shard) and p.dim == 0 if role in ("dp", "fsdp", "data", "ep") else isinstance(p, Replicate)


def _batch_ok(role: str, p, grid: bool) -> bool:
    """Data-parallel dims split the batch (dim 0) and nothing else; a tensor grid's dims (AxoNN's
    x, y) leave the batch to the data dims."""
    if not isinstance(p, Shard) or role in ("free", "cp"):
        return True
    if role == "tp":
        return not grid or p.dim in (1, -1) or p.dim >= 2
    return p.dim == 0


def _block_ok(roles, placements, nd: int) -> bool:
    """Two tp dims (AxoNN's x, y) shard a >= 2-D parameter along different tensor dims."""
    tp = [p for r, p in zip(roles, placements) if r == "tp"]
    if len(tp) < 2 or nd < 2:
        return True
    return len({p.dim for p in tp if isinstance(p, Shard)}) == len(tp)


def allow_for(traced: TracedModel, roles: tuple[str, ...]):
    """``allow(node, strategy)`` enforcing ``roles`` (one per mesh dim) on ``traced``."""
    params = {node: node.meta["val"].ndim for _, node in traced.params}
    root = dict.fromkeys(params)
    root.update({p: p for p in params})
    frontier = list(params)
    while frontier:  # views of a parameter take its storage placement; their consumers compute with it
        u = frontier.pop()
        for v in u.users:
            if v.op == "call_function" and is_free(v) and v not in root:
                root[v] = root[u]
                frontier.append(v)
    inputs = set(traced.inputs)
    grid = roles.count("tp") > 1
    strict_possible: dict = {}

    def check(node, s, strict: bool) -> bool:
        relax = lambda ok, p: ok or (not strict and isinstance(p, Replicate))  # noqa: E731
        param = getattr(node, "param", node)  # the solver's storage decision of a parameter names it
        if param in params:
            # storage and working placement alike: the hand strategies keep the parameter as stored
            pl, nd = s.outputs[0], params[param]
            return all(relax(_stored_ok(r, p, nd), p) for r, p in zip(roles, pl)) and \
                (not strict or _block_ok(roles, pl, nd))
        if node in inputs:
            return all(_input_ok(r, p) for r, p in zip(roles, s.outputs[0]))
        if node in root or node.op != "call_function":
            return True
        if attention.is_attention(node) and any(
                r == "cp" and attention.sequence_mesh_dim(node, s) != d for d, r in enumerate(roles)):
            return False
        # expert parallelism on the ep dim, and only there (or on a free dim)
        if ep_member(node) and (any(r == "ep" and ep_dim(s) != d for d, r in enumerate(roles))
                                or (ep_dim(s) is not None and roles[ep_dim(s)] not in ("ep", "free"))):
            return False
        if not is_free(node) and not all(_batch_ok(r, p[d], grid) for d, r in enumerate(roles)
                                         for p in s.outputs if p is not None):
            return False
        # an expert-parallel op reads its experts split by expert on its ep dim
        node_roles = [("free" if r == "ep" and ep_dim(s) == d else r) for d, r in enumerate(roles)]
        for i, arg in enumerate(tensor_inputs(node)):
            src = value_of(arg)[0]
            if src in root and s.inputs[i] is not None:
                nd = params[root[src]]
                if not all(relax(_consumed_ok(r, p, nd), p) for r, p in zip(node_roles, s.inputs[i])):
                    return False
                if strict and not _block_ok(roles, s.inputs[i], nd):
                    return False
        return True

    def allow(node, s) -> bool:
        if node not in strict_possible:
            strict_possible[node] = any(check(node, t, True) for t in node.meta[META_KEY].strategies)
        return check(node, s, strict_possible[node])

    return allow
