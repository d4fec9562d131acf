"""rewrite: the joint graph and a plan -> one rank's local graphs, forward and backward.

Every tensor of the joint graph is run as a DTensor in the placement the plan chose: before each
op its inputs are redistributed to the placements the op's strategy needs, then DTensor runs the
op on local shards (shape arguments made local by DTensor's own rules); the sorts, gathers,
scatters and grouped GEMMs of a token-local MoE region (passes/regions.py) run on each rank's own
tokens instead, as on a smaller batch, where no DTensor rule could. Tracing that with
``make_fx`` records only local ops and the functional collectives the redistributions issue; the
result is a local joint graph (``primals`` = local parameter shards and inputs, ``tangents``)
whose outputs are the loss, replicated, and each gradient as its last op left it (possibly a
pending partial sum). torch's partitioner then splits it into forward and backward.

The gradient's last move, into its parameter's storage placement (the plan's "grad" edge: DDP's
all-reduce, FSDP's reduce-scatter), is not in this graph: passes/bucket.py adds it, bucketed per
block, to a copy of the backward graph, which the runtime runs when it synchronizes; when it
accumulates, the runtime sums the unreduced gradients of several micro-batches and moves the sum
after the last (the move is linear: reduce(sum g_k) = sum reduce(g_k)), the moves bucketing
leaves alone with autoshard/collectives.py's ``to_storage``, which redistributes as the graph does
(``to_placements``). With a ``reduce_dtype``, every reduction of a partial sum on the way to a
parameter's gradient runs in that dtype.

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
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch.distributed.tensor import DTensor, Replicate
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.checkpoint import CheckpointPolicy

from autoshard import _torch
from autoshard.collectives import local_shape, to_placements
from autoshard.errors import NoShardingRuleError
from autoshard.passes.annotate import feeds_only_grads, phases
from autoshard.passes.graph import META_KEY, Strategy, tensor_inputs
from autoshard.passes.regions import META_KEY as REGION_KEY, ep_dim, runs_locally
from autoshard.passes import rules

ORIGIN = "autoshard.node"   # meta["custom"] key: the joint-graph node a local node implements
PHASE = "autoshard.phase"   # meta["custom"] key: "fwd" or "bwd"


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def _mesh_device(mesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


_SIZED = {torch.ops.aten.new_zeros.default: 1, torch.ops.aten.new_empty.default: 1}  # op -> its size argument


def _run_local(node: fx.Node, env: dict, strategy: Strategy, mesh, reduce_dtype=None):
    """A token-local region's op (passes/regions.py) on this rank's own tokens, or an op of
    ``rules.LOCAL`` (a convolution, attention) on its local shards: inputs moved to the planned placements and taken
    local, the op run as on a smaller batch or fewer channels (sizes and groups made local) or on
    its own query rows (a causal offset), and
    the outputs wrapped as the planned placements of the whole tensors."""
    inputs = iter(strategy.inputs)
    arg = lambda a: env[a] if a.op == "get_attr" else to_placements(env[a], next(inputs), reduce_dtype).to_local()  # noqa: E731
    args = _torch.tree_map_only(fx.Node, arg, node.args)
    kwargs = _torch.tree_map_only(fx.Node, arg, node.kwargs)
    vals = node.meta["val"] if isinstance(node.meta["val"], (tuple, list)) else (node.meta["val"],)
    local = [local_shape(v.shape, p, tuple(mesh.shape)) if p is not None else None
             for v, p in zip(vals, strategy.outputs)]
    if node.target is torch.ops.aten.arange.default:
        args = (local[0][0],)
        kwargs = {**kwargs, "device": _mesh_device(mesh)}
    elif node.target in _SIZED:
        i = _SIZED[node.target]
        args = (*args[:i], list(local[0]), *args[i + 1:])
    if ep_dim(strategy) is not None:
        seed = node.meta[REGION_KEY].seed
        ids = next(v for n, v in env.items() if n.name == seed)[0].to_local()   # the region's sorted expert ids
        out = rules.experts.run(node, args, kwargs, strategy, mesh, ids)
    elif node.target in rules.LOCAL:
        out = rules.LOCAL[node.target](node, args, kwargs, strategy, mesh)
    else:
        out = node.target(*args, **kwargs)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    wrapped = tuple(t if p is None else DTensor.from_local(t, mesh, p, run_check=False, shape=v.shape, stride=v.stride())
                    for t, p, v in zip(outs, strategy.outputs, vals))
    return wrapped if isinstance(out, (tuple, list)) else wrapped[0]


def _run_node(node: fx.Node, env: dict, strategy: Strategy, mesh, reduce_dtype=None):
    # an op planned replicated for lack of a rule: DTensor would refuse it too, so each rank runs
    # it on its whole inputs
    no_rule = node.meta[META_KEY].fallback is not None
    if no_rule and torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()):
        raise NoShardingRuleError(f"{node.name} ({node.target}) draws random numbers and has no sharding rule: "
                                  f"run whole on every rank, the ranks would draw apart. Register a rule "
                                  f"with torch.distributed.tensor's register_sharding.")
    if runs_locally(node, strategy) or node.target in rules.LOCAL or no_rule:
        return _run_local(node, env, strategy, mesh, reduce_dtype)
    inputs = iter(strategy.inputs)

    def arg(a):
        if not isinstance(a, fx.Node):
            return a
        if a.op == "get_attr":   # a constant of the graph: every rank holds it whole
            return env[a]
        return to_placements(env[a], next(inputs), reduce_dtype)

    args = _torch.tree_map_only(fx.Node, arg, node.args)
    kwargs = _torch.tree_map_only(fx.Node, arg, node.kwargs)
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
            t = to_placements(t, want)
        fixed.append(t)
    return tuple(fixed) if isinstance(out, (tuple, list)) else fixed[0]


def local_joint(traced, choice: dict[fx.Node, Strategy], mesh, local_primals: list[torch.Tensor],
                reduce_dtype: torch.dtype | None = None) -> tuple[fx.GraphModule, int, list]:
    """The rank-local joint graph (see module doc). ``local_primals``: local params, buffers, inputs
    in placeholder order (example tensors, for tracing). Returns (graph, number of forward
    outputs, placements of each gradient output: one per parameter, None where it has no
    gradient); autoshard.collectives.to_storage finishes each gradient. The gradients of the
    inputs that have one (``traced.input_grads``) follow the parameters', each this rank's piece
    in its input's placement."""
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
        for node in gm.graph.find_nodes(op="get_attr"):
            env[node] = getattr(gm, node.target)
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
                    env[node] = to_placements(cast, choice[node].outputs[0])
                else:
                    env[node] = _run_node(node, env, choice[node], mesh,
                                          reduce_dtype if node in to_grads else None)
                # Outputs become replicated right where they are made: the partitioner reads
                # phases from graph order, so nothing of the forward may follow the backward.
                for i, o in enumerate(traced.outputs):
                    if o is node:
                        outs[i] = to_placements(env[o], rep).to_local()
        grads = []
        grad_placements.clear()
        for name, _ in traced.params:
            g = traced.grads.get(name)
            grads.append(None if g is None else env[g].to_local())
            grad_placements.append(None if g is None else tuple(env[g].placements))
        # an input's gradient leaves as the gradient of this rank's piece of it: in the input's
        # placement (the caller's autograd takes it on to the full input)
        with fx_traceback.annotate({PHASE: "bwd"}):
            moved = [to_placements(env[g], storage[node]).to_local()
                     for node, g in zip(traced.inputs, traced.input_grads) if g is not None]
        return outs + grads + moved

    n_tangents = len(traced.tangents)
    example_tangents = [torch.ones_like(_local_out_example(traced, traced.tangent_outputs[i]))
                        for i in range(n_tangents)]
    phase = phases(gm)
    with torch.no_grad(), fx_traceback.preserve_node_meta(), _torch.grouped_mm_any_float():
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
