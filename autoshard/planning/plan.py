"""Plan: what the solver chose, what it costs, and how to read it (table, JSON, DOT, HTML, diff).

A plan names nodes of the traced joint graph; its ``fingerprint`` (graph) and ``cluster``
fingerprint tie it to one model, input shapes and cluster, so a plan is never run on another.
Rendering lives in :mod:`autoshard.report.text` (text tables) and :mod:`autoshard.report.html` (DOT, HTML); this
module holds the data, its JSON form and the checks on it.

>>> plan = autoshard.plan(model, Cluster.preset("dgx-h100", nodes=2), inputs)   # doctest: +SKIP
>>> plan.save("plan.json"); Plan.load("plan.json") == plan                     # doctest: +SKIP
True
>>> print(plan.summary(max_rows=10))       # header, top nodes by phase, storage, memory  # doctest: +SKIP
>>> plan.save_html("plan.html")            # graph + tables + memory plot, no network   # doctest: +SKIP
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

from autoshard.errors import PlanError, PlanMismatchError

SCHEMA_VERSION = 1


@dataclass
class NodeDecision:
    name: str
    op: str
    strategy: str                  # "(in placements),...->(out placements)" per mesh dim
    compute: float                 # seconds
    phase: str                     # input | fwd | bwd | optim
    comm: list[dict] = field(default_factory=list)   # collectives before this node: kind, mesh_dim, bytes, time
    recompute: bool = False        # forward activation recomputed in backward instead of saved
    layer: int | None = None       # which copy of a repeated block the node is in (None: not repeated)
    module: str | None = None      # path of the module that made it (planning/modules.py); None: unknown
    memory: float = 0.0            # bytes per device it holds: a parameter across the step (at rest,
                                   # its gradient and optimizer state, a kept working copy), an
                                   # activation from forward to backward (saved, not recomputed)


def read_json(text: str | bytes, what: str):
    """``text`` parsed, or a :class:`PlanError` saying it is no ``what`` file."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as exc:
        raise PlanError(f"not a {what} file: invalid JSON ({exc})") from exc


@dataclass
class Plan:
    fingerprint: str
    cluster: str                   # cluster JSON
    mesh_shape: tuple
    mesh_dim_names: tuple
    nodes: list[NodeDecision]
    storage: dict[str, str]        # parameter name -> placements at rest
    inputs: list[str]              # placements of each input
    step_time: float
    compute_time: float
    comm_time: float
    peak_memory: float
    memory: dict[str, float]       # the peak moment's bytes by part: params, grads, optimizer, activations, ...
    fallbacks: list[tuple[str, str]]
    solver: dict                   # status, objective, bound, gap, time, backend, sizes
    stats: dict = field(default_factory=dict, compare=False)   # timings: not saved, not compared
    edges: list[tuple[str, str]] = field(default_factory=list)  # (producer, consumer) node names
    memory_limit: float | None = None                          # bytes per device the plan was held to
    # (node name, predicted live bytes per device after that node), forward then backward
    memory_timeline: list[tuple[str, float]] = field(default_factory=list)
    mfu: float | None = None                                   # model FLOPs / (step time * peak), 0..1
    breakdown: dict = field(default_factory=dict)              # seconds: compute, exposed comm, recompute
    grad_accumulation: int = 1     # micro-batches per optimizer step the plan was priced for
    # nodes whose every strategy replicates an input that could arrive sharded (passes/coverage.py):
    # {"node", "op", "input", "reason", "source"}
    gaps: list[dict] = field(default_factory=list)
    # the moment of the step the peak is at (solver/memory.py): "forward", a backward phase's,
    # "end of backward" or "optimizer step"
    peak_moment: str = ""
    saved_for_backward: float = 0.0   # bytes per device forward saves for backward (all live when it ends)
    # placeholder node name -> the parameter it holds ("primals_3" -> "h.0.attn.c_attn.weight"), so a
    # report can name it; empty in plans saved before it was recorded
    param_names: dict[str, str] = field(default_factory=dict)
    # what runs the ops, which the compute times were priced for (cluster/costmodel.py): a plan
    # runs only under it
    backend: str = "eager"

    # ------------------------------------------------------------------ JSON
    def to_json(self) -> str:
        d = asdict(self)
        d["schema"] = SCHEMA_VERSION
        d.pop("stats")             # timings vary run to run; the plan itself must not
        return json.dumps(d, sort_keys=True, indent=1)

    @classmethod
    def from_json(cls, text: str | bytes) -> "Plan":
        """Read :meth:`to_json` text back; anything else raises :class:`PlanError` saying what is wrong."""
        d = read_json(text, "plan")
        if not isinstance(d, dict) or "schema" not in d:
            raise PlanError("not a plan file: JSON without the 'schema' field every saved plan has "
                            "(write one with plan.save(path) or 'autoshard plan ... --out FILE.json')")
        if d["schema"] != SCHEMA_VERSION:
            raise PlanError(f"unsupported plan schema {d['schema']!r}; "
                            f"this autoshard reads schema {SCHEMA_VERSION}: re-plan the model")
        d.pop("schema")
        try:
            _check_doc(d)
            d["nodes"] = [NodeDecision(**n) for n in d["nodes"]]
            d["mesh_shape"], d["mesh_dim_names"] = tuple(d["mesh_shape"]), tuple(d["mesh_dim_names"])
            d["fallbacks"] = [tuple(f) for f in d["fallbacks"]]
            d["edges"] = [tuple(e) for e in d.get("edges", [])]
            d["memory_timeline"] = [tuple(t) for t in d.get("memory_timeline", [])]
            return cls(**d)
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"corrupt plan file: {exc}") from exc

    def save(self, path) -> None:
        """Write :meth:`to_json` to ``path``."""
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path) -> "Plan":
        """Read a plan saved by :meth:`save`; a missing, unreadable or corrupt file raises PlanError."""
        try:
            text = Path(path).read_bytes()
        except OSError as exc:
            raise PlanError(f"cannot read plan file {path}: {exc.strerror or exc}") from exc
        try:
            return cls.from_json(text)
        except PlanError as exc:
            raise PlanError(f"{path}: {exc}") from exc

    @property
    def cluster_fingerprint(self) -> str:
        from autoshard.cluster import Cluster

        return Cluster.from_json(self.cluster).fingerprint()

    def check_matches(self, fingerprint: str, cluster_json: str, backend: str = "eager") -> None:
        self.check_backend(backend)
        if fingerprint != self.fingerprint:
            raise PlanMismatchError(f"this plan was made for another model or input shapes (graph {self.fingerprint}, "
                                    f"this model's is {fingerprint}), or traced for another device or torch "
                                    f"release (CPU and CUDA attention are different ops); plan this model, on "
                                    f"the device and torch it runs with")
        from autoshard.cluster import Cluster

        mine, theirs = Cluster.from_json(self.cluster), Cluster.from_json(cluster_json)
        if mine.mesh_shape != theirs.mesh_shape:
            raise PlanMismatchError(f"this plan is for mesh {mine.mesh_shape}, the cluster given has {theirs.mesh_shape}")

    def expert_parallel(self) -> dict[str, tuple[int, float | None]]:
        """Node -> (mesh dim, capacity) of each op the plan runs expert-parallel: its strategy's
        variant ``ep<d>`` or ``ep<d>@<c>`` (capacity None: the dropless buffer)."""
        from autoshard.passes.regions import parse_ep

        eps = {n.name: parse_ep(n.strategy.rsplit(" ", 1)[-1]) for n in self.nodes}
        return {name: ep for name, ep in eps.items() if ep is not None}

    @property
    def moe_capacity(self) -> float | None:
        """The receive buffer its expert-parallel strategies hold, in a rank's own rows; None
        where they hold every rank's rows, or where none runs."""
        return max({c for _, c in self.expert_parallel().values()} - {None}, default=None)

    def check_backend(self, backend: str) -> None:
        if backend != self.backend:
            raise PlanMismatchError(f"this plan was priced for the {self.backend!r} backend, not {backend!r} (fused "
                                    f"kernels change each op's time, and so the best plan): compile it with "
                                    f"backend={self.backend!r}, or re-plan with backend={backend!r}")

    # ------------------------------------------------------------------ reading
    def strategy_of(self, name: str) -> str:
        return self._by_name()[name].strategy

    def _by_name(self) -> dict[str, NodeDecision]:
        if not hasattr(self, "_index"):
            self._index = {n.name: n for n in self.nodes}
        return self._index

    def summary(self, max_rows: int | None = 40, *, expand: bool = False, width: int = 160) -> str:
        """Plain-text tables (rich layout, no colour codes): a header of predicted totals (step
        time, MFU, peak memory vs cap, solver status and gap), the ``max_rows`` most expensive
        nodes grouped by phase (``expand=True``: every node), parameter storage and memory."""
        from autoshard import report

        return report.summary_text(self, max_rows=None if expand else max_rows, width=width)

    def to_dot(self, *, aten: bool = False, layer: int | None = None, module: str | None = None) -> str:
        """Graphviz DOT of the module graph: repeated layers folded into one block, collectives
        summed on the edges between modules, a badge per mesh dim. ``aten=True`` draws the ATen
        nodes instead (coloured by output placement, collectives on the edges into their
        consumer, recomputed nodes dashed); ``layer``/``module`` draw only that part of them."""
        from autoshard.report import html as report_html

        return report_html.to_dot(self, aten=aten, layer=layer, module=module)

    def to_html(self, *, max_rows: int | None = 200) -> str:
        from autoshard.report import html as report_html

        return report_html.to_html(self, max_rows=max_rows)

    def save_html(self, path, *, max_rows: int | None = 200) -> None:
        """One self-contained HTML file (no network, no scripts): the graph as inline SVG, the
        summary tables and a plot of predicted per-device memory over the step."""
        Path(path).write_text(self.to_html(max_rows=max_rows), encoding="utf-8")

    def diff(self, other: "Plan") -> "PlanDiff":
        """What differs from ``other``: node strategies and recompute marks, parameter storage,
        and the predicted time and memory (``other`` minus ``self``)."""
        mine, theirs = {n.name: n for n in self.nodes}, {n.name: n for n in other.nodes}
        changed = [NodeChange(n.name, n.op, n.strategy, theirs[n.name].strategy, n.recompute, theirs[n.name].recompute,
                              _cost(n), _cost(theirs[n.name]), n.phase, n.layer,
                              self.param_names.get(n.name) or other.param_names.get(n.name),
                              n.memory, theirs[n.name].memory, n.module or theirs[n.name].module)
                   for n in self.nodes if n.name in theirs
                   and (n.strategy, n.recompute) != (theirs[n.name].strategy, theirs[n.name].recompute)]
        keys = list(self.storage) + [k for k in other.storage if k not in self.storage]
        storage = {k: (self.storage.get(k), other.storage.get(k)) for k in keys
                   if self.storage.get(k) != other.storage.get(k)}
        held_a, held_b = _held_by_param(self), _held_by_param(other)
        mem_keys = list(self.memory) + [k for k in other.memory if k not in self.memory]
        return PlanDiff(
            same_graph=self.fingerprint == other.fingerprint, same_cluster=self.cluster == other.cluster,
            nodes=changed, only_in_a=[n.name for n in self.nodes if n.name not in theirs],
            only_in_b=[n.name for n in other.nodes if n.name not in mine], storage=storage,
            storage_memory={k: (held_a.get(k, 0.0), held_b.get(k, 0.0)) for k in storage},
            step_time=(self.step_time, other.step_time), compute_time=(self.compute_time, other.compute_time),
            comm_time=(self.comm_time, other.comm_time), peak_memory=(self.peak_memory, other.peak_memory),
            memory={k: (self.memory.get(k, 0.0), other.memory.get(k, 0.0)) for k in mem_keys})

    def __repr__(self) -> str:
        backend = "" if self.backend == "eager" else f", backend={self.backend!r}"
        return (f"Plan(step_time={self.step_time * 1e3:.3f} ms, peak_memory={self.peak_memory / 2**30:.2f} GiB, "
                f"mesh={self.mesh_shape}, nodes={len(self.nodes)}, fallbacks={len(self.fallbacks)}{backend})")


def _held_by_param(plan: Plan) -> dict[str, float]:
    return {plan.param_names[n.name]: n.memory for n in plan.nodes if n.name in plan.param_names}


def _cost(n: NodeDecision) -> float:
    """A node's share of the step: its compute (twice if recomputed) and its collectives."""
    return n.compute * (2 if n.recompute else 1) + sum(c["time"] for c in n.comm)


@dataclass
class NodeChange:
    name: str
    op: str
    a: str                  # strategy in the first plan
    b: str                  # strategy in the second
    recompute_a: bool = False
    recompute_b: bool = False
    time_a: float = 0.0     # seconds the node costs in the first plan: compute, collectives, recompute
    time_b: float = 0.0
    phase: str = ""
    layer: int | None = None
    param: str | None = None   # the parameter a placeholder holds, where the plan knows it
    memory_a: float = 0.0   # bytes per device the node holds in the first plan (NodeDecision.memory)
    memory_b: float = 0.0
    module: str | None = None   # the module that made it (NodeDecision.module)


@dataclass
class PlanDiff:
    """``a.diff(b)``: pairs are (a, b); deltas are b - a."""

    same_graph: bool
    same_cluster: bool
    nodes: list[NodeChange]                     # nodes in both whose strategy or recompute differ
    only_in_a: list[str]
    only_in_b: list[str]
    storage: dict[str, tuple]                   # parameter -> (a placements, b placements), differing only
    step_time: tuple[float, float]
    compute_time: tuple[float, float]
    comm_time: tuple[float, float]
    peak_memory: tuple[float, float]
    memory: dict[str, tuple[float, float]]
    storage_memory: dict[str, tuple[float, float]] = field(default_factory=dict)  # parameter -> bytes held (a, b)

    @property
    def identical(self) -> bool:
        return not (self.nodes or self.only_in_a or self.only_in_b or self.storage) and self.same_graph \
            and self.same_cluster and self.step_time[0] == self.step_time[1] \
            and self.peak_memory[0] == self.peak_memory[1]

    @property
    def step_time_delta(self) -> float:
        return self.step_time[1] - self.step_time[0]

    @property
    def peak_memory_delta(self) -> float:
        return self.peak_memory[1] - self.peak_memory[0]

    def __str__(self) -> str:
        from autoshard import report

        return report.diff_text(self)


# ---------------------------------------------------------------------- validation of a plan file
_NUM = (int, float)


def _need(ok: bool, where: str, what: str) -> None:
    if not ok:
        raise ValueError(f"{where} {what}")


def _is_num(v, allow_none: bool = False) -> bool:
    return (v is None and allow_none) or (isinstance(v, _NUM) and not isinstance(v, bool))


def _check_doc(d: dict) -> None:
    """Shape checks with a path to the bad entry, so a hand-edited or truncated file says where."""
    known = {f.name for f in fields(Plan)}
    required = {f.name for f in fields(Plan) if f.default is MISSING and f.default_factory is MISSING}
    unknown, missing = sorted(set(d) - known), sorted(required - set(d))
    _need(not unknown, "unknown field(s)", f"{unknown}: written by another autoshard version?")
    _need(not missing, "missing field(s)", f"{missing}")
    for key in ("fingerprint", "cluster"):
        _need(isinstance(d[key], str), key, "must be a string")
    for key in ("mesh_shape", "mesh_dim_names", "inputs", "fallbacks"):
        _need(isinstance(d[key], list), key, "must be a list")
    _need(len(d["mesh_shape"]) == len(d["mesh_dim_names"]) and all(isinstance(m, int) for m in d["mesh_shape"]),
          "mesh_shape", "must be ints, one per mesh_dim_names entry")
    for key in ("step_time", "compute_time", "comm_time", "peak_memory"):
        _need(_is_num(d[key]), key, "must be a number")
    for key in ("memory", "storage", "solver") + (("breakdown",) if "breakdown" in d else ()):
        _need(isinstance(d[key], dict), key, "must be an object")
    _need(all(_is_num(v) for v in d["memory"].values()), "memory", "values must be numbers")
    _need(all(isinstance(v, str) for v in d["storage"].values()), "storage", "values must be placement strings")
    _need(isinstance(d["nodes"], list), "nodes", "must be a list")
    ndim = len(d["mesh_shape"])
    for i, n in enumerate(d["nodes"]):
        where = f"nodes[{i}]"
        _need(isinstance(n, dict), where, "must be an object")
        for key in ("name", "op", "strategy", "phase"):
            _need(isinstance(n.get(key), str), where, f"needs a string {key!r}")
        _need(_is_num(n.get("compute")), where, "needs a number 'compute'")
        _need(isinstance(n.get("comm", []), list), where, "'comm' must be a list")
        _need(isinstance(n.get("recompute", False), bool), where, "'recompute' must be true or false")
        _need(n.get("layer") is None or isinstance(n.get("layer"), int), where, "'layer' must be an int or null")
        _need(n.get("module") is None or isinstance(n.get("module"), str), where, "'module' must be a string or null")
        _need(_is_num(n.get("memory", 0.0)), where, "'memory' must be a number")
        for j, c in enumerate(n.get("comm", [])):
            _need(isinstance(c, dict) and isinstance(c.get("kind"), str) and all(
                _is_num(c.get(k)) for k in ("mesh_dim", "bytes", "time")), f"{where}.comm[{j}]",
                "needs kind, mesh_dim, bytes and time")
            _need(0 <= c["mesh_dim"] < ndim, f"{where}.comm[{j}]", f"has mesh_dim {c['mesh_dim']} on a {ndim}-D mesh")
    _need(all(isinstance(f, list) and len(f) == 2 for f in d["fallbacks"]), "fallbacks", "must be [node, reason] pairs")
    _need(isinstance(d.get("gaps", []), list) and all(
        isinstance(g, dict) and all(isinstance(g.get(k), str) for k in ("node", "op", "input", "reason", "source"))
        for g in d.get("gaps", [])), "gaps", "must be objects with node, op, input, reason and source strings")
    _need(isinstance(d.get("edges", []), list) and all(
        isinstance(e, list) and len(e) == 2 and all(isinstance(x, str) for x in e) for e in d.get("edges", [])),
        "edges", "must be [producer, consumer] name pairs")
    _need(isinstance(d.get("memory_timeline", []), list) and all(
        isinstance(t, list) and len(t) == 2 and isinstance(t[0], str) and _is_num(t[1])
        for t in d.get("memory_timeline", [])), "memory_timeline", "must be [node name, bytes] pairs")
    for key in ("memory_limit", "mfu"):
        _need(_is_num(d.get(key), allow_none=True), key, "must be a number or null")
    _need(isinstance(d.get("peak_moment", ""), str), "peak_moment", "must be a string")
    names = d.get("param_names", {})
    _need(isinstance(names, dict) and all(isinstance(v, str) for v in names.values()), "param_names",
          "must map node names to parameter names")
    _need(_is_num(d.get("saved_for_backward", 0.0)), "saved_for_backward", "must be a number")
    if d.get("memory_limit") is not None:
        _need(d["memory_limit"] > 0 and not math.isnan(d["memory_limit"]), "memory_limit", "must be positive")
