"""The emitted module: a plan's forward and backward graphs behind a normal nn.Module.

Parameters are DTensors in their storage placement, registered under the original model's
names (``state_dict()`` works with torch.distributed.checkpoint). ``forward`` takes this rank's
local inputs (``shard_inputs`` cuts them from the global batch) and returns the outputs in full,
identical on every rank; ``backward`` fills each parameter's ``.grad`` (a DTensor in the
parameter's storage placement), so any torch optimizer and LR scheduler step it, and
``torch.nn.utils.clip_grad_norm_`` over ``parameters()`` sees the global norm.

On a mesh of one device (world size 1) the parameters and their gradients are plain tensors
instead. There the plan is all-replicated (a mesh dim of one offers no other placement) and the
local tensor is the full one, so the DTensor wrapper says nothing, and what it costs is real:
each DTensor op goes through sharding propagation (on this 2-core host a 16-element ``add_``
takes 4.5 us as a DTensor, 1.2 us plain; ``mul_`` by a scalar 14.8 us, 2.4 us), so an optimizer
step over the ~50 parameters of a small GPT (AdamW with ``foreach=False`` issues ~7 ops per
parameter) took the compiled module to 1.06-1.16x of the eager model's step, against 1.02-1.05x
for forward + backward alone; with plain parameters the whole step runs at 0.99-1.00x
(bench/overhead.py). Plain tensors are also what everything else on one device expects:
``torch.nn.utils.clip_grad_norm_`` (the norm is global because it is local), ``state_dict()``
with full tensors that ``torch.save`` and a single-device model load as they are, and
torch.distributed.checkpoint, which saves a plain tensor as one full chunk and loads it into any
other plan's DTensor shards (and a DTensor checkpoint into plain tensors), so checkpoints still
move between one rank and many. The module behaves otherwise alike (``no_sync``,
``grad_accumulation``, ``load_state_dict``, ``autoshard.checkpoint``). With more than one rank,
parameters stay DTensors even where stored replicated (as DDP would store them): in one module
mixing plain and DTensor parameters, ``torch.nn.utils.clip_grad_norm_`` and any ``foreach``
optimizer step (AdamW's default on GPUs) fail ("got mixed torch.Tensor and DTensor").

Gradients: the backward graph that runs on a synchronizing backward reduces each block's
gradients into storage (all-reduce, reduce-scatter) as soon as the block's last one is made, one
flat collective per bucket (passes/bucket.py puts autoshard/collectives.py's calls in it), and
hands them over reduced. Inside :meth:`DistributedModule.no_sync` (or on all but every
``grad_accumulation``-th backward) the plain backward graph runs instead: it leaves each gradient
as its last op made it (possibly an unreduced partial sum), the unreduced gradients are summed
locally and moved once, after the next synchronizing backward (with its own, through the plain
graph, in flat buckets by autoshard/collectives.py), as DDP's ``no_sync`` does.

``load_state_dict`` takes DTensor values in any placement (redistributed to this plan's) or plain
full tensors (each rank keeps its shard), and names every missing, unexpected or misshapen entry
in a :class:`~autoshard.errors.RuntimeMismatchError`; ``autoshard.checkpoint`` builds on it.
"""

from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx as fx
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.nn.modules.module import _IncompatibleKeys
from torch.optim.optimizer import register_optimizer_step_post_hook

from autoshard import _torch
from autoshard.collectives import gather_many, local_shape, to_storage_many
from autoshard.errors import RuntimeMismatchError


# Optimizer steps taken in this process: a foreach or fused step (AdamW's default on GPUs)
# updates DTensor parameters in place without bumping their version counter, nor their local
# tensors', so a kept working copy goes stale at any step (DistributedModule._working_copies).
_optimizer_steps = 0


def _count_step(optimizer, args, kwargs) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


register_optimizer_step_post_hook(_count_step)


class _LocalPiece(torch.autograd.Function):
    """``p.to_local()`` that hands ``p`` no gradient back: _PlanStep delivers the parameters'
    gradients itself and gives autograd none, which torch 2.11's ``to_local`` made zeros, and
    those reached ``.grad`` inside ``no_sync``."""

    @staticmethod
    def forward(ctx, p):
        ctx.set_materialize_grads(False)
        return p.to_local().view_as(p.to_local())   # a new tensor: the output gets autograd's edge

    @staticmethod
    def backward(ctx, grad):
        return None


class _PlanStep(torch.autograd.Function):
    """Forward graph in forward, backward graph in backward: what AOTAutograd's runtime does,
    without compiling, so the graphs run as written."""

    @staticmethod
    def forward(ctx, module: "DistributedModule", *primals):
        outs = module._run["_fw"](*module._working_copies(primals))
        n = module._num_outputs
        saved = outs[n:]
        tensors = [s for s in saved if isinstance(s, torch.Tensor)]
        ctx.save_for_backward(*tensors)
        ctx.layout = [isinstance(s, torch.Tensor) for s in saved]
        ctx.others = [s for s in saved if not isinstance(s, torch.Tensor)]
        ctx.module = module
        return tuple(outs[:n])

    @staticmethod
    def backward(ctx, *grad_outputs):
        tensors, others = iter(ctx.saved_tensors), iter(ctx.others)
        args = [next(tensors) if is_t else next(others) for is_t in ctx.layout]
        # the graph takes a tangent for each output a gradient can reach, no other
        args += [None if (g := grad_outputs[i]) is None else g.contiguous() for i in ctx.module._tangent_outputs]
        # The backward graph takes its inputs boxed and frees each saved activation after its last
        # use; for that no one else may hold them: autograd's saved copies go now (unless
        # retain_graph), as in AOTAutograd's runtime. Without it every activation lived until the
        # last gradient, on top of them: measured peaks 10-20% above the plan's.
        del tensors
        ctx.maybe_clear_saved_tensors()
        module = ctx.module
        n_params = len(module._param_names)
        nothing = [None] * (1 + n_params + len(module._buffer_names))   # the module, parameters, buffers
        inputs = [None] * len(module._input_meta)
        if module.__dict__["_split"] is not None:
            # zero bubble: the input gradients now; what the weights' need waits for the schedule
            # to call weight_backward (DistributedModule.defer_weights)
            outs = list(module.__dict__["_split"][0](args))
            for i, g in zip(module._input_grads, outs):
                inputs[i] = g
            module.__dict__["_deferred"].append(outs[len(module._input_grads):])
            return (*nothing, *inputs)
        sync = module._syncs_now()
        # the graph that reduces each block's gradients itself, unless there are unreduced sums
        # to move with them (accumulation): those go through _take_grads after the plain graph
        in_graph = sync and module._bw_sync is not None and not module.__dict__["_unreduced"]
        grads = list(module._run["_bw_sync" if in_graph else "_bw"](args))
        # after the parameters', the gradients of the inputs that take one (a pipeline stage's
        # received activations), each of this rank's piece
        for i, g in zip(module._input_grads, grads[n_params:]):
            inputs[i] = g
        del grads[n_params:]
        # drops each parameter's entry once it is delivered
        module._take_grads(grads, sync, module._reduced if in_graph else frozenset())
        # the gradients were delivered to .grad above, in storage placement; autograd's path
        # through to_local() would label an unreduced partial sum as the parameter's placement
        return (*nothing, *inputs)


def _split_backward(bw: fx.GraphModule, n_params: int) -> tuple[fx.GraphModule, fx.GraphModule]:
    """``bw`` (parameters' gradients, then the inputs') cut in two for a zero-bubble schedule:
    the ops the input gradients need, returning those gradients and then every value the rest
    reads (saved activations and tangents included), and the rest, which takes those values and
    returns the parameters' gradients. Both run every op of ``bw`` once, in its order; constants
    are read where used."""
    nodes = list(bw.graph.nodes)
    output = next(n for n in reversed(nodes) if n.op == "output")
    values = list(output.args[0])
    first, stack = set(), [v for v in values[n_params:] if isinstance(v, fx.Node)]
    while stack:
        node = stack.pop()
        if node not in first:
            first.add(node)
            stack.extend(node.all_input_nodes)
    # an op of several outputs (a layer norm's backward: input, weight and bias gradients) hands
    # the weight part the pieces it reads, not the whole tuple with the input gradient in it
    first |= {u for n in list(first) for u in n.users if u.target is operator.getitem}
    placeholders = [n for n in nodes if n.op == "placeholder"]
    rest = [n for n in nodes if n.op not in ("placeholder", "output") and (n not in first or n.op == "get_attr")]
    wanted = [v for v in values[:n_params] if isinstance(v, fx.Node)] + \
        [a for n in rest for a in n.all_input_nodes]
    handed = list(dict.fromkeys(a for a in wanted if (a in first or a.op == "placeholder") and a.op != "get_attr"))

    def graph(inputs, body, outs):
        g, env = fx.Graph(), {}
        for node in inputs:
            env[node] = g.placeholder(node.name)
            env[node].meta = dict(node.meta)
        for node in body:
            env[node] = g.node_copy(node, env.__getitem__)
        g.output(tuple(env[v] if isinstance(v, fx.Node) else v for v in outs))
        return fx.GraphModule(bw, g)

    inputs_part = graph(placeholders, [n for n in nodes if n in first and n.op != "placeholder"],
                        values[n_params:] + handed)
    return inputs_part, graph(handed, rest, values[:n_params])


def _boxed(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` called with one list, which it empties, so that a value is freed at its last use
    in the graph rather than when the caller lets go of it."""
    gm.graph.set_codegen(fx.graph._BoxedCodeGen())
    gm.recompile()
    return gm


def _register(root: nn.Module, fqn: str, value, kind: str, persistent: bool = True) -> None:
    *path, leaf = fqn.split(".")
    mod = root
    for part in path:
        if not hasattr(mod, part) or not isinstance(getattr(mod, part), nn.Module):
            mod.add_module(part, nn.Module())
        mod = getattr(mod, part)
    if kind == "param":
        mod.register_parameter(leaf, value)
    else:
        mod.register_buffer(leaf, value, persistent=persistent)


class DistributedModule(nn.Module):
    def __init__(self, plan, mesh, fw: fx.GraphModule, bw: fx.GraphModule, num_outputs: int,
                 params: dict[str, DTensor], buffers: dict[str, torch.Tensor], input_placements: list,
                 input_meta: list, aliases: dict[str, str] | None = None, grad_placements: list | None = None,
                 reduce_dtype: torch.dtype | None = None, grad_accumulation: int = 1, mixed_precision=None,
                 working: dict | None = None, bw_sync: fx.GraphModule | None = None, reduced=(),
                 backend: str = "eager", input_grads=(), tangent_outputs=None, non_persistent=None):
        super().__init__()
        self.plan = plan
        self.mesh = mesh
        self.backend = backend
        # The graphs are code, not state: kept out of the submodules so that their constants do
        # not show up in state_dict(), parameters() or a checkpoint.
        self.__dict__["_fw"], self.__dict__["_bw"] = fw, _boxed(bw)
        # bw with each block's gradient reductions in it (passes/bucket.py); ``reduced``: the
        # gradients it hands over reduced, in their parameter's storage placement
        self.__dict__["_bw_sync"] = None if bw_sync is None or mesh.size() == 1 else _boxed(bw_sync)
        # what runs each graph: the graph itself, or its compiled program (made on the first call)
        run = _torch.inductor if backend == "inductor" else (lambda gm: gm)
        self.__dict__["_run"] = {k: None if self.__dict__[k] is None else run(self.__dict__[k])
                                 for k in ("_fw", "_bw", "_bw_sync")}
        self._reduced = frozenset(reduced)
        self._num_outputs = num_outputs
        self._param_names = list(params)
        self._buffer_names = list(buffers)
        # one device: plain parameters, each the full tensor (the module docstring says why)
        self._plain = mesh.size() == 1
        for name, p in params.items():
            _register(self, name, nn.Parameter(p.to_local().detach() if self._plain else p), "param")
        for name, b in buffers.items():   # a buffer the model keeps out of its state dict stays out
            _register(self, name, b, "buffer", persistent=name not in (non_persistent or ()))
        self._aliases: dict[str, str] = {}
        self.tie(aliases or {})
        self._input_placements = input_placements
        self._input_meta = input_meta  # global (shape, dtype) per input
        self._input_grads = tuple(input_grads)  # the inputs backward hands a gradient, in order
        self._tangent_outputs = tuple(range(num_outputs) if tangent_outputs is None else tangent_outputs)
        # parameters whose plan computes with a gathered copy (working placement != storage);
        # on one device every placement holds the full tensor: the parameter is its working copy
        self._working = {} if self._plain else {self._param_names.index(n): pl for n, pl in (working or {}).items()}
        self.__dict__["_working_cache"] = {}  # index -> ((storage address, version), local working copy)
        # placements of each gradient as the backward graph leaves it (None: no gradient)
        rep = tuple([Replicate()] * mesh.ndim)
        self._grad_placements = list(grad_placements) if grad_placements is not None else [rep] * len(params)
        self._reduce_dtype = reduce_dtype
        self.mixed_precision = mixed_precision
        if not (isinstance(grad_accumulation, int) and grad_accumulation >= 1):
            raise ValueError(f"grad_accumulation must be a positive int, not {grad_accumulation!r}")
        self.grad_accumulation = grad_accumulation
        self._backwards = 0          # backward passes since the last gradient move to storage
        self._skip_sync = False
        self.__dict__["_unreduced"] = {}  # name -> local unreduced gradient (not module state)
        self.__dict__["_split"] = None    # (input part, weight part) of bw: defer_weights
        self.__dict__["_deferred"] = []   # per backward run so, what its weight part reads

    def defer_weights(self) -> None:
        """From now on a backward computes the inputs' gradients only, and keeps what the
        parameters' need (saved activations, the output gradients' descendants) until
        ``weight_backward(pop_deferred())``: the input / weight split of zero-bubble pipeline
        schedules (Qi et al., 2024), which run a weight part in another part's idle time."""
        if self.backend != "eager":
            raise RuntimeMismatchError(f"deferred weight gradients run the backward graph split in two, eagerly; "
                                       f"this module was built for backend={self.backend!r}")
        self.__dict__["_split"] = tuple(_boxed(g) for g in _split_backward(self.__dict__["_bw"],
                                                                            len(self._param_names)))

    def pop_deferred(self) -> list:
        """What the latest backward's weight part reads (``defer_weights``)."""
        return self.__dict__["_deferred"].pop()

    def weight_backward(self, deferred: list) -> None:
        """The parameters' gradients of a backward that deferred them, into ``.grad`` (reduced to
        storage on every ``grad_accumulation``-th, as a whole backward's are)."""
        grads = list(self.__dict__["_split"][1](deferred))
        self._take_grads(grads, self._syncs_now())

    def _working_copies(self, primals):
        """The graph's parameter inputs: storage shards, or for a parameter the plan gathers once per
        step (ZeRO-1/2, FSDP without resharding after forward) its working copy, kept until the
        stored values change (a load bumps their version; optimizer steps are counted). The stale
        ones are gathered together (collectives.gather_many: one collective per bucket)."""
        if not self._working:
            return primals
        primals, cache = list(primals), self.__dict__["_working_cache"]
        stale = []
        for i, placements in self._working.items():
            p = self.get_parameter(self._param_names[i])
            # the DTensor's counter: an in-place update of a DTensor (optimizer step, load) does
            # not bump the version of its local tensor, the one to_local() hands out
            version = (_torch.data_address(primals[i]), _torch.tensor_version(p), _optimizer_steps)
            hit = cache.get(i)
            if hit is None or hit[0] != version:
                stale.append((i, p, placements, version))
        if stale:
            with torch.no_grad():
                low = getattr(self.mixed_precision, "param_dtype", None)
                # The graph casts a copy to the compute dtype first thing; a value that went
                # fp32 -> bf16 -> fp32 casts to the same bf16, so the gather may move bf16, exactly.
                cast = [low is not None and p.is_floating_point() and low.itemsize < p.dtype.itemsize
                        for _, p, _, _ in stale]
                copies = gather_many([(p.to(low) if c else p, pl) for (_, p, pl, _), c in zip(stale, cast)])
                for (i, p, _, version), c, copy in zip(stale, cast, copies):
                    cache[i] = (version, copy.to(p.dtype) if c else copy)
        for i in self._working:
            primals[i] = cache[i][1]
        return primals

    # --- gradients ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside keep their gradients unreduced on each rank (no gradient
        collective); the first backward outside moves their sum with its own to storage, once.
        As ``DistributedDataParallel.no_sync``: the micro-batches of one optimizer step but the
        last run inside it."""
        old, self._skip_sync = self._skip_sync, True
        try:
            yield
        finally:
            self._skip_sync = old

    def _syncs_now(self) -> bool:
        self._backwards += 1
        if self._skip_sync:
            return False
        return self._backwards % self.grad_accumulation == 0

    def _take_grads(self, grads: list, sync: bool, reduced: frozenset = frozenset()) -> None:
        """The backward graph's outputs (a parameter's gradient at its index, this rank's piece,
        in the graph's placement, or in storage placement for the indices in ``reduced``)
        delivered to ``.grad`` in storage placement; each entry is dropped from ``grads`` once it
        is handed on."""
        unreduced = self.__dict__["_unreduced"]
        moves = []   # (index, placements, parameter): what to_storage_many moves, bucketed
        for i, (name, pl) in enumerate(zip(self._param_names, self._grad_placements)):
            g = grads[i]
            if g is None:
                continue
            if i in reduced:   # backward reduced it (passes/bucket.py): this rank's stored piece
                self._add_grad(self.get_parameter(name), g)
                grads[i] = None
                continue
            if name in unreduced:  # the buffer is a past backward's output, no one else's
                g = grads[i] = unreduced.pop(name).add_(g)
            if not sync:
                unreduced[name] = g
                grads[i] = None
                continue
            p = self.get_parameter(name)
            if self._plain:
                self._take_plain_grad(p, g)
                grads[i] = None
                continue
            if p.grad is not None and tuple(pl) == tuple(p.placements) == tuple(p.grad.placements):
                # already where it is stored (DDP on one rank, a replicated parameter's pieces):
                # no DTensor to wrap and unwrap per parameter, as AccumulateGrad would not
                p.grad.to_local().add_(g)
                grads[i] = None
                continue
            moves.append((i, pl, p))
        g = None   # (the last one is in moves: to_storage_many drops it)
        for (_, _, p), moved in zip(moves, to_storage_many(grads, moves, self._reduce_dtype)):
            self._add_grad(p, moved.to_local())
        if sync:
            self._backwards = 0

    def _add_grad(self, p: nn.Parameter, local: torch.Tensor) -> None:
        """This rank's piece of a gradient in ``p``'s storage placement into ``p.grad``: into the
        existing gradient in place, on the local shards, as AccumulateGrad does (a DTensor add
        allocates a new gradient and propagates shardings, per parameter), else as a DTensor."""
        if p.grad is not None and tuple(p.grad.placements) == tuple(p.placements):
            p.grad.to_local().add_(local)
            return
        moved = DTensor.from_local(local, self.mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
        p.grad = moved if p.grad is None else p.grad + moved

    def _take_plain_grad(self, p: nn.Parameter, g: torch.Tensor) -> None:
        """One device: the plan replicates everything (a mesh dim of one offers no other
        placement), so the gradient is already its stored value; kept as it is, or added in
        place into an existing one, as AccumulateGrad does."""
        if p.grad is None:
            p.grad = g
        else:
            p.grad.add_(g)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Also drops gradients accumulated unreduced (inside ``no_sync``) and not yet moved, and
        weight parts deferred and not run (a step that stopped midway)."""
        super().zero_grad(set_to_none)
        self.__dict__["_unreduced"].clear()
        self.__dict__["_deferred"].clear()
        self._backwards = 0

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over this module's parameters: the norm of all
        gradients across all shards (a replicated DTensor; a plain tensor on one device),
        every shard scaled alike."""
        return torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm, norm_type,
                                              error_if_nonfinite=error_if_nonfinite, foreach=foreach)

    def tie(self, aliases: dict[str, str]) -> None:
        """Register tied weights (``{"head.weight": "wte.weight"}``: GPT-2's LM head is its
        token embedding) as the same Parameter under both names, so ``named_parameters()`` lists
        it once and ``state_dict()`` has both keys, as the single-device model's does."""
        for alias, primary in aliases.items():
            if alias != primary and primary in self._param_names and alias not in self._aliases:
                self._aliases[alias] = primary
                _register(self, alias, self.get_parameter(primary), "param")

    def shard_inputs(self, *global_inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's local piece of each global input, as the plan places it (no communication)."""
        if len(global_inputs) != len(self._input_meta):
            raise RuntimeMismatchError(f"expected {len(self._input_meta)} inputs, got {len(global_inputs)}")
        if self._plain:  # one device: the local input is the global one
            return tuple(global_inputs)
        rep = [Replicate()] * self.mesh.ndim
        return tuple(DTensor.from_local(t, self.mesh, rep, run_check=False).redistribute(self.mesh, pl).to_local()
                     for t, pl in zip(global_inputs, self._input_placements))

    def forward(self, *local_inputs: torch.Tensor):
        if len(local_inputs) != len(self._input_meta):
            raise RuntimeMismatchError(f"the compiled module takes {len(self._input_meta)} inputs, got {len(local_inputs)}")
        for i, (t, (shape, dtype), pl) in enumerate(zip(local_inputs, self._input_meta, self._input_placements)):
            want = local_shape(shape, pl, self.mesh.shape)
            if tuple(t.shape) != want or t.dtype != dtype:
                raise RuntimeMismatchError(
                    f"input {i}: expected the local shard of shape {list(want)} and dtype {dtype} on each rank "
                    f"(global {list(shape)} placed {pl}), got {list(t.shape)} {t.dtype}; use "
                    f"module.shard_inputs(*global_inputs) to cut the global batch")
        params = [self.get_parameter(n) for n in self._param_names]
        if not self._plain:
            params = [_LocalPiece.apply(p) for p in params]
        buffers = [self.get_buffer(n) for n in self._buffer_names]
        outs = _PlanStep.apply(self, *params, *buffers, *local_inputs)
        return outs[0] if len(outs) == 1 else outs

    # --- state dict --------------------------------------------------------------------------
    def expected_state(self, optional=None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Every state-dict key with its global shape and dtype (what a checkpoint must hold).
        Given the keys a source holds (``optional``), a tied alias it lacks is left out: its
        primary carries the same tensor (checkpoints saved before the tie was known load)."""
        return {k: (tuple(v.shape), v.dtype) for k, v in self.state_dict().items() if isinstance(v, torch.Tensor)
                and (optional is None or k not in self._aliases or k in optional)}

    def check_state_dict(self, state_dict, *, strict: bool = True, source: str = "the state dict") -> None:
        """Raise RuntimeMismatchError naming every global shape that differs from this module's
        and, with ``strict``, every key missing from ``state_dict`` or in it but not here."""
        found = {k: (tuple(v.shape), v.dtype) for k, v in state_dict.items() if isinstance(v, torch.Tensor)
                 and k not in self.non_persistent()}
        check_against(self.expected_state(optional=found), found, strict=strict, source=source)

    def non_persistent(self) -> set[str]:
        """Buffers the model keeps out of its state dict (rotary frequencies): a state dict or
        checkpoint that has them anyway (saved before they were left out) loads, and they stay."""
        return non_persistent(self)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load DTensors in any placement (redistributed to this plan's storage) or plain full
        tensors (every rank passes the same; each keeps its shard, no communication). On one
        device (plain parameters) a DTensor value is loaded in full."""
        self.check_state_dict(state_dict, strict=strict)
        skip = self.non_persistent()
        state_dict = {k: v for k, v in state_dict.items() if k not in skip}
        own = self.state_dict()
        converted = {}
        for key in own:  # module order, so every rank runs the same redistributions
            if key not in state_dict:
                continue
            value = state_dict[key]
            if isinstance(own[key], DTensor):
                converted[key] = _to_placements(value, self.mesh, own[key].placements)
            else:
                converted[key] = value.full_tensor() if isinstance(value, DTensor) else value
        super().load_state_dict(converted, strict=False, assign=assign)
        missing = [k for k in own if k not in state_dict and k not in self._aliases]
        return _IncompatibleKeys(missing, [k for k in state_dict if k not in own])


def non_persistent(module: nn.Module) -> set[str]:
    """The names of ``module``'s buffers that its state dict leaves out."""
    return {name for name, _ in module.named_buffers()} - set(module.state_dict())


def _to_placements(value: torch.Tensor, mesh, placements) -> DTensor:
    """``value`` as a DTensor on ``mesh`` in ``placements``: a DTensor is redistributed (gathered
    first when it lives on another mesh); a plain tensor is the full value, cut locally."""
    if isinstance(value, DTensor):
        if value.device_mesh == mesh:
            return value.redistribute(mesh, placements) if tuple(value.placements) != tuple(placements) else value
        value = value.full_tensor()
    value = value.detach().to(mesh.device_type)
    rep = [Replicate()] * mesh.ndim
    return DTensor.from_local(value, mesh, rep, run_check=False).redistribute(mesh, placements)


def _fmt(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def check_against(expected: dict, found: dict, *, strict: bool = True, source: str = "the state dict",
                  limit: int = 8) -> None:
    """Compare ``{key: (shape, dtype)}`` maps; raise one RuntimeMismatchError naming both sides.
    Without ``strict`` only the shapes of the keys both hold must agree."""
    missing = [k for k in expected if k not in found] if strict else []
    unexpected = [k for k in found if k not in expected] if strict else []
    shapes = [k for k in expected if k in found and tuple(found[k][0]) != tuple(expected[k][0])]
    if not (missing or unexpected or shapes):
        return

    def some(keys):
        more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
        return ", ".join(keys[:limit]) + more

    lines = [f"{source} does not match this compiled module ({len(expected)} entries expected, "
             f"{len(found)} found):"]
    if missing:
        lines.append(f"  missing from {source} ({len(missing)}): " + some(missing))
    if unexpected:
        lines.append(f"  in {source} but not in the module ({len(unexpected)}): " + some(unexpected))
    for k in shapes[:limit]:
        lines.append(f"  {k}: the module expects global shape {_fmt(expected[k][0])}, "
                     f"{source} has {_fmt(found[k][0])}")
    if len(shapes) > limit:
        lines.append(f"  ... and {len(shapes) - limit} more shape mismatches")
    lines.append("Was it saved for another model or configuration? Names and global shapes must match "
                 "(placements, plan and world size may differ).")
    raise RuntimeMismatchError("\n".join(lines))
