"""Pipeline stages, run: a :class:`~autoshard.planning.pipeline.PipelinePlan` as torch.distributed.pipelining
stages, each a compiled module on its stage's devices.

The model is cut into p x v stage programs at the first layer of each stage
(``torch.distributed.pipelining.pipeline``, which traces the model's forward and keeps every
parameter's name). Rank coordinates: the outer dim of N of the plan's mesh (the cluster's, or the
logical grid it was planned on) becomes (p, N/p); stage program j runs
on the ranks of pipeline coordinate j mod p (torch's loop order: interleaved gives each rank v of
them; under ZB-V a V, rank r runs programs r and 2p - 1 - r), on a sub-mesh of N/p x the inner
dims. Each stage program is planned once, by one rank of
its stage (the stages in parallel, the plans then all-gathered), by the ILP on that sub-mesh (its held micro-batches from the schedule, its gradients accumulated over the m
micro-batches) and built as a :class:`~autoshard.runtime.module.DistributedModule`: DTensor
parameters (plain tensors on a stage of one device) under the model's names, gradients reduced
to storage once per step.

Between stages travel pieces: a stage's outputs are whole and alike on every rank of its sub-mesh
(as a compiled module returns them); rank (s, i) sends only the i-th of S flat pieces to rank
(s + 1, i), and the receiving stage gathers them over its own group (:class:`_Hand`). Gradients
come back the same way. Inputs of the model that a later stage reads (the targets, for the loss)
do not travel: every rank has the global batch, and a stage takes the micro-batch it is on.

Every rank calls :meth:`PipelineModule.step` with the global batch; it runs the schedule's
forwards and backwards of all m micro-batches and returns the mean loss, on every rank. Under
the zero-bubble schedule each program's backward runs in two tasks: the input gradients, then,
when the schedule gets to it, the weights' (:meth:`DistributedModule.defer_weights`).
``state_dict()`` holds this rank's stages' entries under the model's names, so
torch.distributed.checkpoint saves a pipeline and loads it into any other plan, pipeline or not.
"""

from __future__ import annotations

import math
import pickle

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.distributed.tensor import DTensor

from autoshard import _torch
from autoshard.cluster import Cluster
from autoshard.errors import (ConstraintError, PlanError, PlanMismatchError, RuntimeMismatchError, TraceError,
                              UnsupportedTorchError)
from autoshard.planning.pipeline import PipelinePlan, held, micro_batch, program_rank, repeated_module, stage_cluster
from autoshard.planning.plan import Plan
from autoshard.precision import MixedPrecision, cast_module
from autoshard.runtime.module import DistributedModule, _register


def stage_layers(plan: PipelinePlan) -> list[int]:
    """Layers of each of the p x v stage programs, in model order: rank r's n_r layers in v
    near-even chunks, program j = k p + r' its chunk k, r' = r in torch's loop order, or
    p - 1 - r for odd k under ZB-V (``program_rank``)."""
    p, v = plan.stages, plan.virtual
    chunks = [[n // v + (k < n % v) for k in range(v)] for n in plan.layers]
    return [chunks[program_rank(plan.schedule, j, p)][j // p] for j in range(p * v)]


def _cut(model: nn.Module, counts: list[int], example_inputs, policy: MixedPrecision | None = None):
    """The model's forward cut into len(counts) programs of ``counts`` repeated layers each: torch's
    ``Pipe``, whose ``split_gm`` wires the programs. Under ``policy`` the forward is exported with
    its parameters in ``param_dtype`` (put back after): the export fixes every ``x.dtype`` the
    code reads (a rotary table cast to the activations' dtype), and the programs then run on
    activations of that dtype."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    parent, attr, stack = repeated_module(model)
    prefix = next(name for name, m in model.named_modules() if m is parent)
    names = [name for name, _ in stack.named_children()]
    if sum(counts) != len(names):
        raise ConstraintError(f"the pipeline plan places {sum(counts)} layers; the model has {len(names)}")
    starts = [sum(counts[:j]) for j in range(1, len(counts))]
    spec = {".".join(x for x in (prefix, attr, names[i]) if x): SplitPoint.BEGINNING for i in starts}
    own = {p: p.data for p in model.parameters()}
    try:
        if policy is not None:
            for p, data in own.items():
                if data.is_floating_point():
                    p.data = data.to(policy.param_dtype)
        pipe = pipeline(model, mb_args=tuple(example_inputs), split_spec=spec)
    except Exception as exc:  # noqa: BLE001 - re-raised typed
        raise TraceError(f"torch.distributed.pipelining could not cut {type(model).__name__} into "
                         f"{len(counts)} stages at {sorted(spec)}: {type(exc).__name__}: {exc}") from exc
    finally:
        for p, data in own.items():
            p.data = data
    if pipe.num_stages != len(counts):
        raise TraceError(f"torch.distributed.pipelining cut {type(model).__name__} into {pipe.num_stages} "
                         f"stages, not {len(counts)}: its forward must call the layers in order")
    _untied_across(model, pipe)
    cast = {n for j in range(pipe.num_stages) for n, p in pipe.get_stage_module(j).named_parameters()
            if p not in own} if policy is not None else ()
    if cast:   # a copy made while the parameters were cast would train in param_dtype
        raise TraceError(f"torch.distributed.pipelining's programs hold copies of {sorted(cast)[:3]}, not the model's "
                         "parameters: they would stay in the policy's dtype; plan this model without a policy")
    for j in range(pipe.num_stages):
        # the export's checks of dtype casts: they compute nothing, and would be traced as ops
        for part in pipe.get_stage_module(j).modules():   # the layers' graphs (unflattened), too
            for gm in (part, getattr(part, "graph_module", None)):
                if isinstance(getattr(gm, "graph", None), fx.Graph):
                    for node in gm.graph.find_nodes(op="call_function",
                                                    target=torch.ops.aten._assert_tensor_metadata.default):
                        gm.graph.erase_node(node)
                    if isinstance(gm, fx.GraphModule):
                        gm.recompile()
    return pipe


def _untied_across(model: nn.Module, pipe) -> None:
    """Refuse a weight the model shares between stages (an LM head tied to the embedding, the
    embedding on the first stage and the head on the last): each stage would train its own copy."""
    holder: dict[str, set[int]] = {}
    for j in range(pipe.num_stages):
        for name, _ in pipe.get_stage_module(j).named_parameters(remove_duplicate=False):
            holder.setdefault(name, set()).add(j)
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    for names in groups.values():
        stages = sorted(set().union(*(holder.get(n, set()) for n in names)))
        if len(stages) > 1:
            raise ConstraintError(f"{' and '.join(names)} are one weight, used by pipeline stages {stages}; each stage "
                                  "would train its own copy. Untie them (a separate head), or plan without stages")


def _wiring(split_gm: fx.GraphModule, n: int) -> list[list[tuple[str, object]]]:
    """Per stage program, where each of its inputs comes from: ("root", k), the model's k-th
    input, or ("value", (i, k)), the k-th output of program i (an earlier one)."""
    roots = {node: k for k, node in enumerate(split_gm.graph.find_nodes(op="placeholder"))}
    calls = [node for node in split_gm.graph.nodes if node.op == "call_module"][:n]
    made = {call: (i, 0) for i, call in enumerate(calls)}
    for node in split_gm.graph.nodes:
        if node.op == "call_function" and node.args and node.args[0] in made:
            made[node] = (made[node.args[0]][0], node.args[1])
    wiring = []
    for j, call in enumerate(calls):
        if call.kwargs:
            raise TraceError(f"stage {j} takes keyword arguments ({sorted(call.kwargs)}); pass inputs positionally")
        sources = []
        for arg in call.args:
            if arg in roots:
                sources.append(("root", roots[arg]))
            elif arg in made and arg not in calls[j:]:
                sources.append(("value", made[arg]))
            else:
                raise TraceError(f"stage {j} reads {arg}, which no earlier stage makes")
        wiring.append(sources)
    return wiring


class _Route:
    """What travels between stage programs: each program's own outputs, then the values a later
    program reads from an earlier one, passed on through every program between (torch's
    schedules send from each stage to the next only)."""

    def __init__(self, wiring, own: list[int]):
        self.own = own
        self.passes: list[list[tuple[int, int]]] = [[] for _ in wiring]
        for j, sources in enumerate(wiring):
            for kind, value in sources:
                if kind == "value":
                    for between in range(value[0] + 1, j):
                        if value not in self.passes[between]:
                            self.passes[between].append(value)
        self.wiring = wiring

    def position(self, value: tuple[int, int], stage: int) -> int:
        """Where ``value`` is among ``stage``'s outputs."""
        i, k = value
        return k if i == stage else self.own[stage] + self.passes[stage].index(value)

    def inputs(self, j: int) -> list[tuple[str, int]]:
        """Program j's inputs: ("root", k) or ("recv", position among what program j - 1 sends)."""
        return [(kind, k) if kind == "root" else ("recv", self.position(k, j - 1)) for kind, k in self.wiring[j]]

    def passed(self, j: int) -> list[int]:
        """Positions, among what program j receives, of what it passes on."""
        return [self.position(value, j - 1) for value in self.passes[j]]


def _piece(t: torch.Tensor, index: int, size: int) -> torch.Tensor:
    """The ``index``-th of ``size`` equal pieces of ``t`` flattened (the last padded with zeros)."""
    flat = t.reshape(-1)
    n = -(-flat.numel() // size)
    if n * size != flat.numel():
        flat = torch.cat([flat, flat.new_zeros(n * size - flat.numel())])
    return flat[index * n:(index + 1) * n].clone()


def _whole(piece: torch.Tensor, shape, group) -> torch.Tensor:
    """Every rank's piece of ``group``, in rank order, back to the full tensor of ``shape``."""
    out = piece.new_empty(piece.numel() * dist.get_world_size(group))
    _torch.all_gather_flat(out, piece.contiguous(), group)
    return out[:math.prod(shape)].reshape(shape)


class _Scatter(torch.autograd.Function):
    """What rank i of a stage sends on: the i-th piece of an output every rank of the stage holds
    whole; the pieces' gradients come back and are gathered into the whole one's."""

    @staticmethod
    def forward(ctx, t, hand):
        ctx.shape, ctx.hand = t.shape, hand
        return _piece(t, hand.index, hand.size)

    @staticmethod
    def backward(ctx, grad):
        return _whole(grad, ctx.shape, ctx.hand.group), None


class _Gather(torch.autograd.Function):
    """What rank i of the next stage receives, its piece, gathered over the stage into the whole
    tensor; the whole gradient (alike on every rank of the stage) goes back as its i-th piece."""

    @staticmethod
    def forward(ctx, piece, shape, hand):
        ctx.hand = hand
        return _whole(piece, shape, hand.group)

    @staticmethod
    def backward(ctx, grad):
        return _piece(grad, ctx.hand.index, ctx.hand.size), None, None


class _Hand:
    """How a stage's ranks split what crosses a stage boundary (Megatron's scatter-gather): rank i
    of S sends and receives only the i-th of S pieces over the pipeline's link, and the stage's
    own (faster) group gathers them. ``size`` 1: whole tensors, nothing gathered."""

    def __init__(self, group, index: int, size: int):
        self.group, self.index, self.size = group, index, size

    def send(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.size == 1 else _Scatter.apply(t, self)

    def receive(self, piece: torch.Tensor, shape) -> torch.Tensor:
        return piece if self.size == 1 else _Gather.apply(piece, tuple(shape), self)

    def meta(self, t: torch.Tensor) -> torch.Tensor:
        """What travels for ``t`` (a tensor of its shape and dtype), as torch's stage is told."""
        n = t.numel() if self.size == 1 else -(-t.numel() // self.size)
        return _meta(t if self.size == 1 else torch.empty(n, dtype=t.dtype, device="meta"), True)


class _Stage(nn.Module):
    """One stage program as torch's PipelineStage calls it: the received pieces (or, first, the
    model inputs it reads) in, gathered whole (``hand``); its outputs and what it passes on out,
    each as this rank's piece (the last stage's: the loss, whole). The model inputs a later stage reads come from the micro-batch it
    is on (``feed``); forwards on a stage run in micro-batch order under every schedule here."""

    def __init__(self, body: DistributedModule, sources: list[tuple[str, int]], passed: list[int], first: bool,
                 last: bool, hand: _Hand, shapes: list):
        super().__init__()
        self.body = body
        self.sources = sources
        self.passed = passed
        self.first, self.last = first, last
        self.__dict__["hand"] = hand
        self.shapes = shapes   # the whole shape of each received tensor
        self.__dict__["feed"] = []   # per micro-batch: the model's inputs (set by PipelineModule.step)
        self.calls = 0

    def forward(self, *received):
        chunk = self.__dict__["feed"][self.calls]
        self.calls += 1
        hand = self.__dict__["hand"]
        if self.first:   # the schedule hands stage 0 the model inputs it reads, in order
            args = list(received)
        else:
            args = [chunk[k] if kind == "root" else hand.receive(received[k], self.shapes[k])
                    for kind, k in self.sources]
        out = self.body(*self.body.shard_inputs(*args))
        out = (out,) if isinstance(out, torch.Tensor) else tuple(out)
        if self.last:   # torch's schedule concatenates the losses over micro-batches: one element each
            return out[0].reshape(1)
        # passed on as copies of the pieces: torch's stage may reuse its receive buffers
        out = tuple(hand.send(t) for t in out) + tuple(received[k].clone() for k in self.passed)
        return out[0] if len(out) == 1 else out

    def weights_later(self):
        """torch's ``dw_builder`` under a zero-bubble schedule: called right after a backward that
        computed the input gradients only, it returns what computes that backward's weight
        gradients when the schedule gets to them."""
        body, deferred = self.body, self.body.pop_deferred()
        return lambda: body.weight_backward(deferred)


class PipelineModule(nn.Module):
    """This rank's stage programs of a pipeline plan (module docstring). Parameters are DTensors on
    the stage's sub-mesh under the model's names; ``step(*global_inputs)`` runs one step of the
    schedule and returns the mean loss; an optimizer steps ``parameters()`` as usual."""

    def __init__(self, plan: PipelinePlan, stages: list[_Stage], schedule, pp_group, persistent: set[str],
                 stage_plans: dict[int, Plan], stage_roots: list[int], batch_meta: list, loss_like: torch.Tensor):
        super().__init__()
        self.plan = plan
        self._batch_meta = batch_meta   # (shape, dtype) of each global input, as compiled
        self.__dict__["_loss_like"] = loss_like
        self.stage_plans = stage_plans
        self.__dict__["_stages"] = stages
        self.__dict__["_schedule"] = schedule
        self.__dict__["_pp_group"] = pp_group
        self._roots = stage_roots   # the model inputs stage 0 reads, in its order
        for stage in stages:
            for name, p in stage.body.named_parameters():
                _register(self, name, p, "param")
            for name, b in stage.body.named_buffers():   # the model's own state dict says which it keeps
                _register(self, name, b, "buffer", persistent=name in persistent)

    def step(self, *global_inputs: torch.Tensor) -> torch.Tensor:
        """Forward and backward of the global batch as the plan's micro-batches under its schedule;
        gradients land in ``.grad`` (the mean over micro-batches, as one batch's). Returns the mean
        loss, on every rank."""
        m = self.plan.micro_batches
        got = [(tuple(x.shape), x.dtype) for x in global_inputs if isinstance(x, torch.Tensor)]
        if got != self._batch_meta:   # checked on every rank: a stage must not wait on one that raised
            raise RuntimeMismatchError(f"the pipeline was compiled for a global batch of {self._batch_meta} "
                                       f"(shape, dtype per input), got {got}; compile it for this batch")
        chunks = [tuple(x.tensor_split(m)[i] if isinstance(x, torch.Tensor) else x for x in global_inputs)
                  for i in range(m)]
        for stage in self.__dict__["_stages"]:
            stage.__dict__["feed"] = chunks
            stage.calls = 0
        losses: list[torch.Tensor] = []
        first = tuple(global_inputs[k] for k in self._roots)
        self.__dict__["_schedule"].step(*first, target=torch.zeros(m), losses=losses)
        group = self.__dict__["_pp_group"]
        loss = torch.stack([x.detach() for x in losses]).mean() if losses else self.__dict__["_loss_like"].clone()
        plan = self.plan   # from the rank of the last program
        dist.broadcast(loss, group=group, group_src=program_rank(plan.schedule, plan.stages * plan.virtual - 1,
                                                                 plan.stages))
        return loss

    def forward(self, *args, **kwargs):
        raise RuntimeMismatchError("a pipeline module runs whole steps: call module.step(*global_inputs), "
                                   "which returns the loss and leaves the gradients in .grad")

    def zero_grad(self, set_to_none: bool = True) -> None:
        for stage in self.__dict__["_stages"]:
            stage.body.zero_grad(set_to_none)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over every stage's gradients: the global norm (over
        the pipeline too), every shard scaled alike."""
        params = [p for p in self.parameters() if p.grad is not None]
        like = self.__dict__["_loss_like"]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type) if params else \
            torch.zeros((), device=like.device)
        norm = (norm.full_tensor() if isinstance(norm, DTensor) else norm).float()   # this rank's stages'
        # every rank of a stage's sub-mesh holds its stages' norm: combined over the pipeline only
        if math.isinf(norm_type):
            dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=self.__dict__["_pp_group"])
        else:
            norm = norm ** norm_type
            dist.all_reduce(norm, group=self.__dict__["_pp_group"])
            norm = norm ** (1.0 / norm_type)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    # this rank's state is its stages' entries: a checkpoint of the whole model holds more
    # (autoshard.runtime.checkpoint.load reads only these)
    partial_state = True

    def expected_state(self, optional=None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """This rank's state-dict keys with their global shapes and dtypes."""
        return {k: (tuple(v.shape), v.dtype) for k, v in self.state_dict().items()}


def _mesh(cluster: Cluster, p: int, device_type: str):
    """The whole group's mesh as (pp, N/p, inner...), and its pp dim's name."""
    pp = next(n for n in ("pp", "pp_stage", "pipeline") if n not in cluster.mesh_dim_names)
    shape = (p, cluster.mesh_shape[0] // p, *cluster.mesh_shape[1:])
    names = (pp, *cluster.mesh_dim_names)
    options = _torch.default_group_options(device_type)
    override = None if options is None else dict.fromkeys(range(len(shape)), options)
    mesh = torch.distributed.device_mesh.init_device_mesh(device_type, shape, mesh_dim_names=names,
                                                          backend_override=override)
    return mesh, pp


def _fake_outputs(program: nn.Module, args, device):
    """The program's outputs as fake tensors (shapes and dtypes; nothing real runs: the fake mode
    reads its parameters' metadata only)."""
    with _torch.FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
        fakes = tuple(torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=device)
                      if isinstance(a, torch.Tensor) else a for a in args)
        out = program(*fakes)
    return out if isinstance(out, tuple) else (out,)


def _examples(pipe, wiring, mb: tuple, device, policy=None) -> tuple[list[list], dict]:
    """Each stage program's example inputs: the micro-batch's model inputs and, for values of
    earlier programs, zeros of their shapes (floating ones requiring grad); and every program's
    outputs as fake tensors, by (program, index)."""
    examples, values = [], {}
    for j, sources in enumerate(wiring):
        args = []
        for kind, k in sources:
            if kind == "root":
                args.append(mb[k])
            else:
                t = values[k]
                args.append(torch.zeros(t.shape, dtype=t.dtype, device=device).requires_grad_(t.is_floating_point()))
        examples.append(args)
        # under a policy a program computes in its dtype, and hands that on
        for k, out in enumerate(_fake_outputs(cast_module(pipe.get_stage_module(j), policy), args, device)):
            values[(j, k)] = out
    return examples, values


def _meta(t: torch.Tensor, grad: bool) -> torch.Tensor:
    """What torch's stage is told of a tensor it sends or receives: its shape, dtype, and whether a
    gradient comes back for it (every floating one between stages)."""
    return torch.empty(t.shape, dtype=t.dtype, device="meta").requires_grad_(grad and t.is_floating_point())


def build_pipeline(model: nn.Module, cluster: Cluster, example_inputs, plan: PipelinePlan, device: torch.device,
                   *, time_limit: float = 120.0, strict: bool = False,
                   mixed_precision: MixedPrecision | None = None) -> PipelineModule:
    """This rank's :class:`PipelineModule` running ``plan`` (from
    :func:`~autoshard.planning.pipeline.plan_pipeline`) on ``cluster``; every rank calls it."""
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                              ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)

    from autoshard.build import build
    from autoshard.planning.driver import prepare, solve, trace
    from autoshard.planning.pricing import price
    from autoshard.planning.roles import allow_for

    p, v, m = plan.stages, plan.virtual, plan.micro_batches
    policy = None if mixed_precision is None else mixed_precision.key()
    layout = (p, v, m, plan.schedule, list(plan.layers), plan.mesh_shape and list(plan.mesh_shape),
              plan.mesh_dim_names and list(plan.mesh_dim_names), plan.roles, plan.mixed_precision, policy)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, layout)
    if any(other != layout for other in every):
        raise RuntimeMismatchError(f"the ranks were given different pipeline plans (stages, virtual, micro-batches, "
                                   f"schedule, layers, mesh, roles, policies): {sorted(set(map(str, every)))}; plan once (on "
                                   "one rank) and give every rank that plan and policy")
    if plan.mixed_precision != policy:   # alike on every rank (checked above): every rank raises
        raise PlanMismatchError(f"the pipeline plan was made for mixed_precision {plan.mixed_precision or 'none'}, "
                                f"not {policy or 'none'}: compile with the policy it was planned under, or re-plan")
    if plan.schedule == "zero-bubble-v" and not _torch.RUNS_V_SCHEDULES:   # alike on every rank
        raise UnsupportedTorchError(f"the ZB-V schedule runs under torch 2.13 or later (torch {torch.__version__}'s "
                                    "puts its two middle programs' links through gloo to the same rank); plan with "
                                    "schedules=('zero-bubble', ...), or upgrade torch")
    if plan.mesh_shape is not None and tuple(plan.mesh_shape) != tuple(cluster.mesh_shape) \
            and math.prod(plan.mesh_shape) == cluster.world_size:
        # stages cut a logical mesh of the same devices (plan_pipeline's meshes): run on that grid
        cluster = cluster.with_mesh(tuple(plan.mesh_shape), tuple(plan.mesh_dim_names))
    stage, roles = stage_cluster(cluster, p, plan.roles)
    if tuple(stage.mesh_shape) != tuple(plan.stage_mesh):
        raise RuntimeMismatchError(f"the pipeline plan's stage mesh is {tuple(plan.stage_mesh)}; this cluster's "
                                   f"{p} stages have {tuple(stage.mesh_shape)}: plan it for this cluster")
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    mb = micro_batch(inputs, m)
    counts = stage_layers(plan)
    pipe = _cut(model, counts, mb, mixed_precision)
    wiring = _wiring(pipe.split_gm, len(counts))
    examples, values = _examples(pipe, wiring, mb, device, mixed_precision)
    last = [t for (i, _), t in values.items() if i == len(counts) - 1]
    if len(last) != 1 or last[0].dim() != 0 or not last[0].is_floating_point():
        raise ConstraintError(f"a pipeline's last stage hands the schedule the loss: {type(model).__name__}'s "
                              f"forward must return one scalar loss, not {[tuple(t.shape) for t in last]}")
    route = _Route(wiring, [sum(1 for i, _ in values if i == j) for j in range(len(counts))])
    mesh, pp = _mesh(cluster, p, device.type)
    coordinate = mesh.get_coordinate()[0]
    mine = [j for j in range(p * v) if program_rank(plan.schedule, j, p) == coordinate]

    def hold(j):
        return held(plan.schedule, p, m, program_rank(plan.schedule, j, p), v)

    traces: dict[int, tuple] = {}

    def prepared(j):   # once per program: its plan and its module are built from one trace
        if j not in traces:
            # received activations take gradients, sent back to the stage before
            traced = trace(pipe.get_stage_module(j), examples[j], device=device, input_grads=True,
                           mixed_precision=mixed_precision)
            traces[j] = prepare(traced, stage, examples[j], strict, mixed_precision)
        return traces[j]

    def stage_plan(j):
        traced, fallbacks, gaps = prepared(j)
        allow = allow_for(traced, roles) if roles is not None else None
        # a rank's v programs share its memory
        problem, solution, limit = solve(traced, stage, None, plan.memory_limit / v, True, time_limit, allow=allow,
                                         grad_accumulation=m, held_batches=hold(j), held_head=hold(j))
        return price(traced, stage, problem, solution, fallbacks, gaps, limit)

    # Each program is planned once, by one rank of the stage that runs it (a stage's v programs
    # spread over its ranks), the stages in parallel; every rank then runs the plans it is
    # sent, so the ranks of a stage never disagree on a tie.
    sub = mesh[tuple(stage.mesh_dim_names)]
    place = sum(c * math.prod(sub.mesh.shape[d + 1:]) for d, c in enumerate(sub.get_coordinate()))
    texts: dict[int, str] | Exception = {}
    try:
        texts = {j: stage_plan(j).to_json() for j in mine if (j // p) % sub.size() == place}
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it, not hang
        texts = exc
        try:
            pickle.dumps(exc)
        except Exception:  # noqa: BLE001 - one that cannot travel goes as its text
            texts = PlanError(f"planning stage programs {sorted(j for j in mine)} failed: {type(exc).__name__}: {exc}")
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, texts)
    failed = next((e for e in every if isinstance(e, Exception)), None)
    if failed is not None:
        raise failed
    plans = {j: Plan.from_json(text) for d in every for j, text in d.items()}

    # each stage's own group, for the pieces of what crosses its boundaries (every rank makes every one)
    groups = [dist.new_group(mesh.mesh[c].flatten().tolist(), timeout=_torch.default_group_timeout(device.type))
              for c in range(p)] if sub.size() > 1 else [None] * p
    hand = _Hand(groups[coordinate], place, sub.size())
    stages, pipeline_stages = [], []
    zero_bubble = plan.schedule in ("zero-bubble", "zero-bubble-v")
    for j in mine:
        program = pipe.get_stage_module(j)
        traced, _, _ = prepared(j)
        plans[j].check_matches(traced.fingerprint, stage.to_json(), plans[j].backend)
        body = build(program, traced, plans[j], stage, device, mixed_precision, m, mesh=sub)
        received = examples[0] if j == 0 else [values[(j - 1, k)] for k in range(route.own[j - 1])] + \
            [values[x] for x in route.passes[j - 1]]
        wrapped = _Stage(body, route.inputs(j), route.passed(j), first=j == 0, last=j == p * v - 1, hand=hand,
                         shapes=[tuple(a.shape) for a in received])
        if zero_bubble:
            body.defer_weights()
        stages.append(wrapped)
        sent = [values[(j, k)] for k in range(route.own[j])] + [values[x] for x in route.passes[j]]
        outs = [_meta(sent[0].reshape(1), True)] if j == p * v - 1 else [hand.meta(o) for o in sent]
        pipeline_stages.append(PipelineStage(
            wrapped, j, p * v, device,
            input_args=tuple(_meta(a, False) for a in received) if j == 0 else tuple(hand.meta(a) for a in received),
            output_args=tuple(outs), group=mesh.get_group(pp),
            dw_builder=wrapped.weights_later if zero_bubble else None))

    def loss_fn(output, target):   # the last program's output is the model's loss already
        return output.sum()

    if zero_bubble:
        kind = ScheduleZBVZeroBubble if plan.schedule == "zero-bubble-v" else ScheduleInterleavedZeroBubble
        schedule = kind(pipeline_stages, m, loss_fn=loss_fn)
    elif plan.schedule == "interleaved":
        schedule = ScheduleInterleaved1F1B(pipeline_stages, m, loss_fn=loss_fn)
    else:
        kind = Schedule1F1B if plan.schedule == "1f1b" else ScheduleGPipe
        schedule = kind(pipeline_stages[0], m, loss_fn=loss_fn)
    persistent = set(model.state_dict())
    batch_meta = [(tuple(x.shape), x.dtype) for x in inputs if isinstance(x, torch.Tensor)]
    loss_like = torch.zeros((), dtype=last[0].dtype, device=device)
    return PipelineModule(plan, stages, schedule, mesh.get_group(pp), persistent, {j: plans[j] for j in mine},
                          [k for _, k in wiring[0]], batch_meta, loss_like)
