"""Pipeline stages, priced: the model's repeated layers cut into contiguous stages over the outer
mesh dim, each stage planned by the ILP on its own devices, and the schedule's bubble,
point-to-point sends and in-flight activations added on top.

A pipeline of p stages over the outer dim of a (N, ...) mesh gives each stage a (N/p, ...) mesh.
Micro-batches: the global batch B in m equal parts of b = B/m. Per stage s, with n_s layers:

    t_s = n_s * l + [s = 0] * pre + [s = p-1] * post        one micro-batch, forward and backward
    O_s = its share of what runs once per step              gradient reductions, the optimizer

where l is one repeated layer's time, pre that of the ops before the first layer (the
embeddings) and post that of the ops after the last (the head and the loss), all from one
intra-op plan (below). The step is

    T = (m + bubble) * max_s t_s + max_s O_s + sends

    bubble = p - 1            GPipe and 1F1B
           = (p - 1) / v      interleaved 1F1B, v virtual stages (chunks of layers) per rank
    zero bubble: the slowest rank's idle time under torch's interleaved zero-bubble order, its
           micro-batch split into forward, input-gradient and weight-gradient parts as the
           model's FLOPs are (:func:`work_split`, :func:`zero_bubble_idle`): (p - 1)(F + I - W)/v
           where W <= F; ZB-V ("zero-bubble-v", torch's V order, the head on the first rank)
           likewise
    sends  = (m v + p - 1) * 2 * (alpha + a / (S beta) + G(a))
                                                    a micro-batch's activation forward and its
                                                    gradient back, over the outer dim's link
                                                    (its slowest: an upper bound on a grid
                                                    whose stages lie inside a node),
                                                    not hidden: torch's schedules wait on each
                                                    receive before the compute that needs it

(a: the bytes of the hidden state that crosses a stage boundary, whole; S the stage's devices).
Each rank of a stage holds that tensor whole and sends only its 1/S piece to its peer in the
next stage, which gathers the S pieces over its own devices: G(a), an all-gather over the stage
mesh, its faster links (Megatron's scatter-gather; the gradient comes back the same way). The layers are split to minimize max_s t_s (:func:`balance`): a layer count
that the stages do not divide gives uneven stages, the first and last shorter when embeddings
and head cost more.

In-flight micro-batches. Stage s holds the saved activations of every micro-batch whose forward
it ran and whose backward it has not:

    GPipe         m
    1F1B          min(p - s, m)                              the first stage the most
    interleaved   min((v - 1) p + 2 (p - 1 - s) + 1, m v) / v  (torch's warmup, in chunks of 1/v)
    zero bubble   the most chunks forward has run and the weight gradient not, in torch's order,
                  over v: min(p, m) (each counted as one micro-batch's saved activations: the
                  input gradient frees what only it reads, and the weight part's own values, its
                  output gradients among them, stay)

The intra-op plan. For each (p, m, schedule) one ILP solves a copy of the model cut to k
layers, k = max(2, max_s n_s), with its embeddings and head, at micro-batch b, on the stage
mesh, under the memory cap, for m micro-batches per step (gradients accumulated), its saved
activations held H = max_s held_s times and the head's held_{p-1} times (solver/memory.py:
``held_batches``). Its plan bounds every stage's memory: none holds more layers, more
micro-batches in flight, or more than both embeddings and head. Its times split into l, pre and
post by where each op runs (:func:`parts`); recompute is chosen by that ILP as for any plan,
under the stage's cap. Stages share the one solve, as repeated layers do.

``autoshard.compile(..., plan=pipeline_plan)`` runs a plan (autoshard/runtime/pipeline.py), each
stage program planned again on its own. Stages cut the outer dim of the cluster's mesh, or of each
logical mesh ``meshes`` names (:func:`plan_pipeline`). GPipe prices as 1F1B with more memory, so the default search
(``SEARCHED``) leaves it out (``schedules=("gpipe", ...)`` prices it).
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from autoshard import _torch
from autoshard.cluster import Cluster
from autoshard.errors import ConstraintError, CutoffError, InfeasibleError, PlanError, SolverError
from autoshard.planning.meshes import divisors, failure
from autoshard.planning.plan import Plan, read_json

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble", "zero-bubble-v")
ZERO_BUBBLE = ("zero-bubble", "zero-bubble-v")
# the schedules of the default search; GPipe prices as 1F1B with more memory (module docstring)
SEARCHED = ("1f1b", "interleaved", "zero-bubble", "zero-bubble-v")


# --- schedules -----------------------------------------------------------------------------------
def held(schedule: str, stages: int, micro_batches: int, stage: int, virtual: int = 1) -> float:
    """Micro-batches whose saved activations ``stage`` holds at once (module docstring), in units
    of one micro-batch through all of the rank's layers."""
    p, m, s, v = stages, micro_batches, stage, virtual
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(p - s, m))
    if schedule == "interleaved":
        return min((v - 1) * p + 2 * (p - 1 - s) + 1, m * v) / v
    if schedule in ZERO_BUBBLE:   # forward run, weight gradient not yet: what it reads is still held
        live = most = 0
        for kind, _, _ in _torch.zero_bubble_order(p, m, v, schedule == "zero-bubble-v")[s]:
            live += (kind == "F") - (kind == "W")
            most = max(most, live)
        return most / v
    raise ConstraintError(f"unknown schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")


def bubble(schedule: str, stages: int, virtual: int = 1) -> float:
    """Idle micro-batch slots on the critical path: p - 1, or (p - 1)/v interleaved (zero-bubble:
    :func:`zero_bubble_idle`)."""
    return (stages - 1) / virtual if schedule == "interleaved" else float(stages - 1)


def program_rank(schedule: str, program: int, stages: int) -> int:
    """The rank (pipeline coordinate) that runs stage program j: j mod p in torch's loop order;
    under ZB-V a V (rank r runs programs r and 2p - 1 - r, so the first rank has the
    embeddings and the head)."""
    chunk, r = divmod(program, stages)
    return stages - 1 - r if schedule == "zero-bubble-v" and chunk % 2 else r


def zero_bubble_idle(stages: int, micro_batches: int, virtual: int, forward: float, inputs: float,
                     weights: float, v_shape: bool = False) -> float:
    """Idle time of the slowest rank's step under torch's interleaved zero-bubble schedule (or
    ZB-V, ``v_shape``), each rank running its own order of tasks (``_torch.zero_bubble_order``)
    as soon as their inputs exist: the makespan less the rank's m v tasks of each kind. ``forward``, ``inputs``,
    ``weights``: one micro-batch's forward, input-gradient and weight-gradient time through all
    of a rank's layers (a program's is 1/v of it). F(j, i) follows F(j - 1, i); I(j, i) follows
    I(j + 1, i) (the last program: its own F); W(j, i) follows I(j, i)."""
    p, m, v = stages, micro_batches, virtual
    order = _torch.zero_bubble_order(p, m, v, v_shape)
    cost = {"F": forward / v, "I": inputs / v, "W": weights / v}
    last = p * v - 1
    done: dict[tuple[str, int, int], float] = {}
    clock, pos = [0.0] * p, [0] * p
    while any(pos[r] < len(order[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while pos[r] < len(order[r]):
                kind, j, i = order[r][pos[r]]
                deps = {"F": [("F", j - 1, i)] if j > 0 else [],
                        "I": [("F", j, i)] if j == last else [("I", j + 1, i)],
                        "W": [("I", j, i)]}[kind]
                if not all(d in done for d in deps):
                    break
                clock[r] = done[(kind, j, i)] = max([clock[r]] + [done[d] for d in deps]) + cost[kind]
                pos[r] += 1
                moved = True
        if not moved:   # torch's order is a valid schedule: this would be a bug here
            raise PlanError(f"the zero-bubble order of {p} stages, {m} micro-batches deadlocked")
    return max(clock) - m * (forward + inputs + weights)


def work_split(traced) -> tuple[float, float, float]:
    """Shares of the traced step's FLOPs in forward, in the input-gradient part of backward and in
    its weight-gradient part. The input part carries the gradient through the weights: every
    backward op that reads a parameter (or a value made from parameters alone: a transpose, a
    cast), as the matmul of the output gradient with the weight does, and everything such an op
    needs (attention's backward, a norm's). The rest only turns gradients and saved activations
    into a parameter's gradient (the weight's matmul with its saved input, a norm weight's sum)."""
    from autoshard.passes.annotate import META_KEY as COST_KEY

    weights = {node for _, node in traced.params}
    for node in traced.gm.graph.nodes:
        if node.op == "call_function" and node.all_input_nodes and all(a in weights for a in node.all_input_nodes):
            weights.add(node)

    def phase(node):
        cost = node.meta.get(COST_KEY)
        return None if cost is None else cost.phase

    carried: set = set()
    stack = [n for n in traced.gm.graph.nodes if phase(n) == "bwd" and n not in weights
             and any(a in weights for a in n.all_input_nodes)]
    while stack:
        node = stack.pop()
        if node not in carried and phase(node) == "bwd":
            carried.add(node)
            stack.extend(node.all_input_nodes)
    flops = {"fwd": 0.0, "I": 0.0, "W": 0.0}
    for node in traced.gm.graph.nodes:
        if phase(node) in ("fwd", "bwd"):
            part = "fwd" if phase(node) == "fwd" else "I" if node in carried else "W"
            flops[part] += node.meta[COST_KEY].flops
    total = sum(flops.values()) or 1.0
    return flops["fwd"] / total, flops["I"] / total, flops["W"] / total


def balance(layers: int, stages: int, layer: float, pre: float = 0.0, post: float = 0.0,
            least: int = 1, head: int | None = None) -> list[int]:
    """Layers per stage, contiguous and at least ``least`` each, minimizing the slowest stage's
    time n_s * layer + [first] pre + [s = head] post (``head``: the stage with the head, the last
    by default); of the splits that do, the most even one (the earlier stages take the odd
    layers)."""
    if layers < stages * least:
        raise ConstraintError(f"{layers} layers cannot fill {stages} stages of at least {least}")
    extra = [pre if s == 0 else 0.0 for s in range(stages)]
    extra[stages - 1 if head is None else head] += post

    def fits(bound: float) -> list[int] | None:
        room = [max(0, math.floor((bound - e) / layer + 1e-9)) if layer > 0 else layers for e in extra]
        if any(r < least for r in room) or sum(room) < layers:
            return None
        # as even as the rooms allow: every stage up to one level, then the last ones at the
        # level give one back until the count is right (the level is the least that holds them
        # all, so fewer than the stages at it give back)
        level = least
        while sum(min(r, level) for r in room) < layers:
            level += 1
        counts, spare = [min(r, level) for r in room], sum(min(r, level) for r in room) - layers
        for s in reversed(range(stages)):
            if spare and counts[s] == level and level > least:
                counts[s] -= 1
                spare -= 1
        return counts

    bounds = sorted({n * layer + e for e in extra for n in range(least, layers + 1)})
    return next(c for b in bounds if (c := fits(b)) is not None)


# --- the model's repeated layers -----------------------------------------------------------------
def repeated_module(model: nn.Module) -> tuple[nn.Module, str, nn.Module]:
    """(parent, attribute, container) of the model's stack of layers: the ``nn.ModuleList`` or
    ``nn.ModuleDict`` with the most children, all alike (one class, the same parameter shapes;
    at least two)."""
    best = None
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)) and len(child) >= 2 \
                    and len({_signature(c) for c in child.children()}) == 1 \
                    and (best is None or len(child) > len(best[2])):
                best = (parent, name, child)
    if best is None:
        raise ConstraintError(f"{type(model).__name__} has no repeated layers to cut into pipeline stages: "
                              "stages are contiguous runs of a stack of identical blocks (an nn.ModuleList or "
                              "nn.ModuleDict of at least two of one class and the same parameter shapes); plan it without stages")
    return best


def _signature(module: nn.Module) -> tuple:
    return type(module), tuple((name, tuple(p.shape)) for name, p in module.named_parameters())


@contextlib.contextmanager
def cut_to(model: nn.Module, k: int):
    """The model with only the first ``k`` of its repeated layers, while the block runs; the
    model's own stack is put back after, whatever happens."""
    parent, name, stack = repeated_module(model)
    kept = list(stack.items())[:k] if isinstance(stack, nn.ModuleDict) else list(stack)[:k]
    parent._modules[name] = type(stack)(dict(kept) if isinstance(stack, nn.ModuleDict) else kept)
    try:
        yield model
    finally:
        parent._modules[name] = stack


def _as_tuple(example_inputs) -> tuple:
    return tuple(example_inputs) if isinstance(example_inputs, (list, tuple)) else (example_inputs,)


def batch_size(example_inputs) -> int:
    """The batch: dim 0 of every tensor input, one size for all."""
    sizes = {x.shape[0] for x in _as_tuple(example_inputs) if isinstance(x, torch.Tensor) and x.dim() > 0}
    if len(sizes) != 1:
        raise ConstraintError(f"pipeline stages split the batch (dim 0 of every tensor input) into micro-batches; "
                              f"the inputs' leading dims are {sorted(sizes)}, not one batch size")
    return sizes.pop()


def micro_batch(example_inputs, micro_batches: int) -> tuple:
    """The first of ``micro_batches`` equal slices of the batch (dim 0 of every tensor input)."""
    batch = batch_size(example_inputs)
    if batch % micro_batches:
        works = [d for d in divisors(batch) if d > 1]
        raise ConstraintError(f"a batch of {batch} does not split into {micro_batches} equal micro-batches; "
                              f"micro-batch counts that divide it: {works}")
    b = batch // micro_batches
    return tuple(x[:b] if isinstance(x, torch.Tensor) and x.dim() > 0 else x for x in _as_tuple(example_inputs))


# --- the plan ------------------------------------------------------------------------------------
@dataclass
class PipelinePlan:
    """A pipeline over the outer dim of ``mesh_shape`` (a logical mesh of the cluster's devices,
    :meth:`Cluster.with_mesh`; None: the cluster's own): ``stages`` (p) stages of ``layers`` repeated layers each,
    ``virtual`` chunks per rank, ``micro_batches`` (m) per step under ``schedule``; ``stage_plan``
    the intra-op plan every stage runs (the model cut to max(layers) layers, module docstring) on
    ``stage_mesh``. Times in seconds per step, ``peak_memory`` the bound on every stage's bytes
    per device, ``held`` each stage's in-flight micro-batches."""

    stages: int
    virtual: int
    micro_batches: int
    schedule: str
    layers: list[int]
    stage_mesh: tuple
    step_time: float
    bubble_time: float
    send_time: float
    stage_times: list[float]            # per stage: one micro-batch, forward and backward
    stage_once: list[float]             # per stage: what runs once per step (reductions, optimizer)
    held: list[float]
    peak_memory: float
    memory_limit: float
    stage_plan: Plan
    roles: list[str] | None = None      # the hand layout inside each stage (one per mesh dim), if any
    mesh_shape: tuple | None = None     # the (logical) mesh whose outer dim the stages cut; None: the cluster's
    mesh_dim_names: tuple | None = None
    mixed_precision: str | None = None  # the policy's key (MixedPrecision.key()) the stages compute under
    stats: dict = field(default_factory=dict)

    def to_json(self) -> str:
        """Stable JSON: the pipeline's fields and its stage plan's own JSON (timings left out)."""
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("stage_plan", "stats")}
        d.update(kind="pipeline", stage_mesh=list(self.stage_mesh), stage_plan=json.loads(self.stage_plan.to_json()))
        for k in ("mesh_shape", "mesh_dim_names"):
            d[k] = None if d[k] is None else list(d[k])
        return json.dumps(d, sort_keys=True, indent=1)

    @classmethod
    def from_json(cls, text: str | bytes) -> "PipelinePlan":
        """Read :meth:`to_json` text back (a :class:`PlanError` for anything else)."""
        d = read_json(text, "pipeline plan")
        if not isinstance(d, dict) or d.pop("kind", None) != "pipeline":
            raise PlanError("not a pipeline plan file: write one with PipelinePlan.to_json()")
        fields = set(cls.__dataclass_fields__) - {"stats"}
        if ("mesh_shape" in d) != ("mesh_dim_names" in d):
            raise PlanError("pipeline plan file: mesh_shape and mesh_dim_names come together")
        # files from before grids and policies: the cluster's mesh, no policy
        optional = {"mesh_shape", "mesh_dim_names", "mixed_precision"}
        if set(d) - fields or fields - optional - set(d):
            raise PlanError(f"pipeline plan file: fields {sorted((set(d) ^ fields) - optional)} missing or unknown")
        d["stage_plan"] = Plan.from_json(json.dumps(d["stage_plan"]))
        d["stage_mesh"] = tuple(d["stage_mesh"])
        for k in ("mesh_shape", "mesh_dim_names"):
            d[k] = None if d.get(k) is None else tuple(d[k])
        return cls(**d)

    def summary(self) -> str:
        over = f" over mesh {tuple(self.mesh_shape)}" if self.mesh_shape is not None else ""
        over += f" ({self.mixed_precision})" if self.mixed_precision else ""
        return (f"PP {self.stages}{f' x {self.virtual} virtual' if self.virtual > 1 else ''}{over}, {self.schedule}, "
                f"{self.micro_batches} micro-batches, layers {self.layers}, stage mesh {self.stage_mesh}: "
                f"{self.step_time * 1e3:.1f} ms/step (bubble {self.bubble_time * 1e3:.1f} ms, sends "
                f"{self.send_time * 1e3:.1f} ms), peak {self.peak_memory / 2**30:.1f} GiB")


def stage_cluster(cluster: Cluster, stages: int, roles: tuple[str, ...] | None = None):
    """The devices of one stage, and ``roles`` on them: the outer mesh dim divided by
    ``stages``, the other dims whole, dims of one device dropped (they split nothing)."""
    outer = cluster.mesh_shape[0]
    if outer % stages:
        raise ConstraintError(f"{stages} stages do not divide the outer mesh dim ({outer} of mesh "
                              f"{tuple(cluster.mesh_shape)}); stage counts that do: {divisors(outer)[1:]}")
    if roles is not None and len(roles) != cluster.ndim:
        raise ConstraintError(f"roles {roles} name {len(roles)} dims; give one per dim of the cluster's mesh "
                              f"{tuple(cluster.mesh_shape)}")
    shape = (outer // stages, *cluster.mesh_shape[1:])
    # the outer dim's hardware levels keep their inner ones whole: a stage takes whole nodes of it
    levels, left = [], outer // stages
    for ranks, link in cluster.levels[0]:
        take = math.gcd(ranks, left)
        levels.append((take, link))
        left //= take
    if left != 1:
        raise ConstraintError(f"{stages} stages do not cut the outer mesh dim along its hardware levels "
                              f"{[r for r, _ in cluster.levels[0]]}; use a stage count that does")
    levels = [tuple(lv for lv in levels if lv[0] > 1) or ((1, cluster.links[0]),), *cluster.levels[1:]]
    kept = [d for d, size in enumerate(shape) if size > 1] or [cluster.ndim - 1]
    stage = Cluster(tuple(shape[d] for d in kept), tuple(cluster.mesh_dim_names[d] for d in kept), cluster.device,
                    tuple(cluster.links[d] for d in kept), ranks_per_node=min(cluster.ranks_per_node, math.prod(shape)),
                    levels=[levels[d] for d in kept], calibration=cluster.calibration)
    return stage, None if roles is None else tuple(roles[d] for d in kept)


@dataclass(frozen=True)
class StageTimes:
    """One intra-op plan's step split by where each op runs: ``layer`` (one repeated layer),
    ``pre`` (the ops before the layers: embeddings) and ``post`` (after them: head and loss),
    each as (per micro-batch, once per step) seconds."""

    layer: tuple[float, float]
    pre: tuple[float, float]
    post: tuple[float, float]

    def of(self, layers: int, first: bool, last: bool) -> tuple[float, float]:
        """A stage's (per micro-batch, once per step) seconds."""
        parts = [(self.layer, layers), (self.pre, int(first)), (self.post, int(last))]
        return sum(t[0] * n for t, n in parts), sum(t[1] * n for t, n in parts)


def parts(plan: Plan) -> dict[str, str]:
    """Each node's part of a stage: "layer" (in a repeated layer), "pre" (forward before the first
    layer, backward after the last: the embeddings) or "post" (the rest: the head, the loss and
    their backward); a parameter or input goes with its first consumer."""
    index = {n.name: i for i, n in enumerate(plan.nodes)}
    first_use: dict[str, int] = {}
    for src, dst in plan.edges:
        if dst in index:
            first_use[src] = min(first_use.get(src, index[dst]), index[dst])
    layered = [i for i, n in enumerate(plan.nodes) if n.layer is not None]
    first_fwd = min((i for i in layered if plan.nodes[i].phase == "fwd"), default=-1)
    last_bwd = max((i for i in layered if plan.nodes[i].phase == "bwd"), default=len(plan.nodes))
    out = {}
    for i, n in enumerate(plan.nodes):
        if n.layer is not None:
            out[n.name] = "layer"
        elif n.phase == "bwd":
            out[n.name] = "pre" if i > last_bwd else "post"
        elif n.phase == "fwd":
            out[n.name] = "pre" if i < first_fwd else "post"
        else:   # a parameter, a batch input
            out[n.name] = "pre" if first_use.get(n.name, i) < first_fwd else "post"
    return out


def split_times(plan: Plan, copies: int) -> StageTimes:
    """``plan``'s step split by part (:func:`parts`, :class:`StageTimes`). Compute, with recompute twice, and exposed collectives are
    counted per micro-batch (``plan.grad_accumulation`` of them per step) but for those run once
    per step (gradient reductions); recompute's resharding is spread over the per-micro-batch
    parts and the optimizer over the once-per-step parts, each by compute."""
    m = plan.grad_accumulation
    if len({n.layer for n in plan.nodes if n.layer is not None}) != copies:
        raise ConstraintError(f"the stage's plan does not show its {copies} repeated layers as {copies} copies of "
                              "one block (passes/coarsen.py found another period): it cannot be cut into stages")
    part_of = parts(plan)
    mb = {"layer": 0.0, "pre": 0.0, "post": 0.0}
    once = dict(mb)
    work = dict(mb)
    for n in plan.nodes:
        part = part_of[n.name]
        mb[part] += n.compute * (2 if n.recompute else 1) / m
        work[part] += n.compute
        for c in n.comm:
            if c.get("calls", m) == 1:
                once[part] += c["exposed"]
            else:
                mb[part] += c["exposed"] / m
    total = sum(work.values()) or 1.0
    for part in mb:
        mb[part] += plan.breakdown.get("recompute_comm", 0.0) / m * work[part] / total
        once[part] += plan.breakdown.get("optimizer", 0.0) * work[part] / total
    return StageTimes((mb["layer"] / copies, once["layer"] / copies), (mb["pre"], once["pre"]),
                      (mb["post"], once["post"]))


def boundary_bytes(traced) -> float:
    """Bytes of what the first repeated layer hands the second in forward (the hidden state), per
    micro-batch, whole: what crosses a stage boundary each way. Only forward values computed from
    the batch count: one made from parameters or buffers alone (a cast of the rotary table) is the
    receiver's to make, or was handed on before the layers."""
    from autoshard.passes.annotate import META_KEY as COST_KEY, tensor_bytes
    from autoshard.passes.coarsen import LAYER_KEY

    from_batch = set(traced.inputs)
    total = 0.0
    for node in traced.gm.graph.nodes:
        if any(a in from_batch for a in node.all_input_nodes):
            from_batch.add(node)
        layer = node.meta.get(LAYER_KEY)
        if layer is None or layer[1] != 0 or node not in from_batch or not isinstance(node.meta.get("val"), torch.Tensor) \
                or node.meta[COST_KEY].phase != "fwd":
            continue
        if any((u.meta.get(LAYER_KEY) or (None, None))[1] == 1 for u in node.users):
            total += tensor_bytes(node.meta["val"])
    if total == 0:
        raise ConstraintError("no tensor crosses from the stage's first layer to its second: its layers "
                              "hand nothing on, so they cannot be cut into stages")
    return total


def plan_pipeline(model, cluster: Cluster, example_inputs, *, stages=None, micro_batches=None,
                  schedules=SEARCHED, virtual: int = 2, memory_limit: float | None = None,
                  recompute=True, time_limit: float = 120.0, roles: tuple[str, ...] | None = None,
                  strict: bool = False, meshes=None, mixed_precision=None) -> PipelinePlan:
    """The fastest pipeline plan over ``stages`` (an int, a list, or None: every divisor of the
    outer mesh dim from 2 up, at most the layer count), ``micro_batches`` (an int, a list, or
    None: p and 4p where they divide the batch) and ``schedules`` (module docstring); interleaved
    uses ``virtual`` chunks per rank. ``roles``: a hand layout inside each stage
    (:mod:`autoshard.planning.roles`, one per dim of the cluster's mesh; a dim a stage has one
    device of drops its role), else the free plan.

    ``meshes`` (as for :func:`autoshard.plan`: "auto", "auto-2d" or a list of shapes): also cut
    the outer dim of each of those logical meshes into stages, so the grid that carries the
    stages is chosen too (a pruned 3-D grid keeps its data-parallel outer dim inside each stage);
    ``plan.mesh_shape`` records the one chosen. Default: the cluster's own mesh.
    ``mixed_precision`` (a :class:`~autoshard.MixedPrecision`): every stage computes under it, and
    what crosses a boundary is in its ``param_dtype``; the plan runs only under that policy.

    ``plan.stats["candidates"]`` lists every candidate's step time (None: no plan;
    ``stats["errors"]`` says why; ``stats["stopped"]``: those whose solve stopped at
    ``time_limit``, priced at the plan it had then). Raises InfeasibleError when no candidate fits,
    SolverError when none has a plan and some were not solved within ``time_limit``, and
    ConstraintError when none can be cut at all (micro-batch counts that do not divide the batch,
    too few layers), naming each candidate's reason."""
    from autoshard.planning.meshes import DATA_NAMES, grids

    start = time.perf_counter()
    _, _, stack = repeated_module(model)
    n_layers = len(stack)
    limit = float(cluster.memory_limit if memory_limit is None else memory_limit)
    batch = batch_size(example_inputs)
    schedules = [schedules] if isinstance(schedules, str) else list(schedules)
    for name in schedules:
        held(name, 1, 1, 0)   # an unknown name is refused before anything is solved
    if meshes is not None and roles is not None:
        raise ConstraintError("roles name the dims of the cluster's own mesh: give them with meshes=None, or drop "
                              "them to plan each logical mesh's stages freely")
    own = (tuple(cluster.mesh_shape), tuple(cluster.mesh_dim_names))
    best, tried, why, solves, stopped = None, {}, {}, {}, []
    for shape, names in ([own] if meshes is None else grids(cluster, meshes)):
        grid = cluster if (shape, names) == own else cluster.with_mesh(shape, names)
        grid_roles = ("data", "free", "free") if meshes is not None and names == DATA_NAMES else roles
        prefix = "" if meshes is None else f"{shape} "
        p_list = ([stages] if isinstance(stages, int) else list(stages) if stages is not None
                  else [d for d in divisors(shape[0]) if 2 <= d <= n_layers])
        for p in p_list:
            try:
                stage, stage_roles = stage_cluster(grid, p, grid_roles)
            except ConstraintError as exc:
                if meshes is None:   # the one mesh: its error names the stage counts that work
                    raise
                tried[f"{prefix}pp{p}"], why[f"{prefix}pp{p}"] = None, str(exc)
                continue
            m_list = ([micro_batches] if isinstance(micro_batches, int) else list(micro_batches)
                      if micro_batches is not None else [m for m in (p, 4 * p) if batch % m == 0])
            if not m_list:
                tried[f"{prefix}pp{p}"] = None
                why[f"{prefix}pp{p}"] = f"neither {p} nor {4 * p} micro-batches divide the batch of {batch}"
            for m in m_list:
                inputs = micro_batch(example_inputs, m)
                for schedule in schedules:
                    v = {"interleaved": virtual, "zero-bubble": virtual, "zero-bubble-v": 2}.get(schedule, 1)
                    key = f"{prefix}pp{p} m{m} {schedule}{f' v{v}' if v > 1 else ''}"
                    if v > 1 and (m % p or n_layers < p * v):
                        tried[key], why[key] = None, f"{schedule} needs m divisible by p and at least {p * v} layers"
                        continue
                    if schedule == "zero-bubble-v" and not _torch.RUNS_V_SCHEDULES:
                        tried[key], why[key] = None, f"zero-bubble-v runs from torch 2.13 on, not {torch.__version__}"
                        continue
                    if schedule == "zero-bubble" and m % max(1, m // p):   # torch's rounds of micro-batches
                        tried[key], why[key] = None, f"zero-bubble needs m a multiple of its {m // p} rounds (m // p)"
                        continue
                    try:
                        candidate = _price(model, inputs, grid, stage, p, m, schedule, v, n_layers, limit,
                                           dict(recompute=recompute, time_limit=time_limit, roles=stage_roles,
                                                strict=strict, mixed_precision=mixed_precision), solves)
                    except (InfeasibleError, SolverError, CutoffError) as exc:
                        tried[key], why[key] = None, f"{failure(exc)}: {exc}"
                        continue
                    except ConstraintError as exc:   # this candidate cannot be cut so: the others may
                        tried[key], why[key] = None, str(exc)
                        continue
                    candidate.roles = None if grid_roles is None else list(grid_roles)
                    candidate.mesh_shape, candidate.mesh_dim_names = shape, names
                    candidate.mixed_precision = None if mixed_precision is None else mixed_precision.key()
                    tried[key] = candidate.step_time
                    if candidate.stage_plan.solver["status"] != "optimal":   # stopped by time_limit (warned)
                        stopped.append(key)
                    if best is None or candidate.step_time < best.step_time:
                        best = candidate
    if best is None:
        tried_all = ", ".join(f"{k} ({why.get(k)})" for k in tried)
        if any(w.startswith(("time_limit", "solver_error")) for w in why.values()):
            raise SolverError(f"no pipeline plan found: some candidates were not solved within time_limit="
                              f"{time_limit:g}s or failed in the solver; tried {tried_all}")
        if all(not w.startswith("infeasible") for w in why.values()):
            raise ConstraintError(f"no pipeline candidate can be cut; tried {tried_all}" if tried else
                                  f"no stage count to try: give stages (from 2 up to the model's {n_layers} layers) "
                                  f"that divide the outer mesh dim")
        raise InfeasibleError(f"no pipeline plan fits {limit / 2**30:.2f} GiB per device; tried {tried_all}")
    best.stats.update(candidates=tried, errors=why, stopped=stopped, solves=len(solves),
                      total_s=time.perf_counter() - start)
    return best


def _stage_plan(model, inputs, stage: Cluster, k: int, m: int, hold: list[float], limit: float, options: dict,
                head: int = -1):
    """The intra-op plan of the model cut to ``k`` layers, at one micro-batch, on the stage's
    devices, for ``m`` micro-batches per step with ``hold[s]`` of them in flight on stage s: the
    most for the layers and embeddings, stage ``head``'s for the head (the last stage's by default)."""
    from autoshard.planning.driver import prepare, solve, trace
    from autoshard.planning.pricing import price
    from autoshard.planning.roles import allow_for

    policy = options.get("mixed_precision")
    with cut_to(model, k) as cut:
        traced = trace(cut, inputs, mixed_precision=policy)
    traced, fallbacks, gaps = prepare(traced, stage, inputs, options["strict"], policy)
    allow = allow_for(traced, options["roles"]) if options["roles"] is not None else None
    problem, solution, limit = solve(traced, stage, None, limit, options["recompute"], options["time_limit"],
                                     allow=allow, grad_accumulation=m, held_batches=max(hold), held_head=hold[head])
    return traced, price(traced, stage, problem, solution, fallbacks, gaps, limit)


def _price(model, inputs, cluster: Cluster, stage: Cluster, p, m, schedule, v, n_layers, limit, options,
           solves: dict) -> PipelinePlan:
    hold = [held(schedule, p, m, s, v) for s in range(p)]
    head = program_rank(schedule, p * v - 1, p)   # the stage with the head and loss
    k = max(2, math.ceil(n_layers / p))   # two copies at least: one layer alone shows no period
    while True:   # solve for k layers; again with more if balancing gave a stage more
        key = (stage.to_json(), options["roles"], m, max(hold), hold[head], k)   # grids can share a stage
        if key not in solves:
            solves[key] = _stage_plan(model, inputs, stage, k, m, hold, limit, options, head)
        traced, sp = solves[key]
        split = split_times(sp, k)
        counts = balance(n_layers, p, split.layer[0], split.pre[0], split.post[0], least=v, head=head)
        if max(counts) <= k:
            break
        k = max(counts)
    times, once = zip(*(split.of(n, s == 0, s == head) for s, n in enumerate(counts)))
    link = cluster.links[0]   # consecutive stages differ in the outer mesh dim
    whole, size = boundary_bytes(traced), math.prod(stage.mesh_shape)
    # each rank sends its 1/S piece over the link; the receiving stage gathers them (module docstring)
    send = link.latency + whole / size / link.effective_bandwidth + \
        stage.collective_time("all_gather", whole, list(range(stage.ndim)))
    sends = (m * v + p - 1) * 2 * send
    if schedule in ZERO_BUBBLE:   # the slowest stage's micro-batch, split as its FLOPs are
        fwd, inp, wgt = work_split(traced)
        idle = zero_bubble_idle(p, m, v, fwd * max(times), inp * max(times), wgt * max(times),
                                schedule == "zero-bubble-v")
    else:
        idle = bubble(schedule, p, v) * max(times)
    return PipelinePlan(stages=p, virtual=v, micro_batches=m, schedule=schedule, layers=counts,
                        stage_mesh=tuple(stage.mesh_shape), step_time=m * max(times) + idle + max(once) + sends,
                        bubble_time=idle, send_time=sends, stage_times=list(times), stage_once=list(once), held=hold,
                        peak_memory=sp.peak_memory, memory_limit=limit, stage_plan=sp)
