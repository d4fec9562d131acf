"""Plan: what the solver chose, what it costs, and how to read it (table, JSON).

A plan names nodes of the traced joint graph; its ``fingerprint`` (graph) and ``cluster``
fingerprint tie it to one model, input shapes and cluster, so a plan is never run on another.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field

from torch.distributed.tensor import Partial, Replicate, Shard

from autoshard.errors import PlanError, PlanMismatchError

SCHEMA_VERSION = 1
_PLACEMENT = re.compile(r"^(R|S\((\d+)\)|P)$")


def parse_placements(value, ndim: int) -> tuple:
    """Placements per mesh dim from DTensor placements or strings ("R", "S(0)", "P"); a single
    placement on a 1-D mesh may be given bare."""
    if not isinstance(value, (list, tuple)):
        value = [value]
    if len(value) != ndim:
        raise ValueError(f"{list(value)} gives {len(value)} placements for a {ndim}-D mesh; give one per mesh dim")
    out = []
    for v in value:
        if isinstance(v, (Replicate, Shard, Partial)):
            out.append(v)
            continue
        m = _PLACEMENT.match(str(v).replace(" ", ""))
        if not m:
            raise ValueError(f"unknown placement {v!r}; use Replicate(), Shard(d), Partial() or 'R', 'S(d)', 'P'")
        out.append(Replicate() if v == "R" else Partial() if v == "P" else Shard(int(m.group(2))))
    return tuple(out)


@dataclass
class NodeDecision:
    name: str
    op: str
    strategy: str                  # "(in placements),...->(out placements)" per mesh dim
    compute: float                 # seconds
    phase: str
    comm: list[dict] = field(default_factory=list)   # collectives before this node: kind, mesh_dim, bytes, time


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
    memory: dict[str, float]       # breakdown: params, grads, optimizer, activations
    fallbacks: list[tuple[str, str]]
    solver: dict                   # status, objective, bound, gap, time, backend, sizes
    stats: dict = field(default_factory=dict)

    # ------------------------------------------------------------------ JSON
    def to_json(self) -> str:
        d = asdict(self)
        d["schema"] = SCHEMA_VERSION
        d.pop("stats")             # timings vary run to run; the plan itself must not
        return json.dumps(d, sort_keys=True, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"not a plan file: invalid JSON ({exc})") from exc
        if not isinstance(d, dict) or d.get("schema") != SCHEMA_VERSION:
            raise PlanError(f"unsupported plan schema {d.get('schema') if isinstance(d, dict) else None!r}; "
                            f"this autoshard reads schema {SCHEMA_VERSION}: re-plan the model")
        d.pop("schema")
        try:
            d["nodes"] = [NodeDecision(**n) for n in d["nodes"]]
            d["mesh_shape"], d["mesh_dim_names"] = tuple(d["mesh_shape"]), tuple(d["mesh_dim_names"])
            d["fallbacks"] = [tuple(f) for f in d["fallbacks"]]
            return cls(**d)
        except (KeyError, TypeError) as exc:
            raise PlanError(f"corrupt plan file: {exc}") from exc

    def check_matches(self, fingerprint: str, cluster_json: str) -> None:
        if fingerprint != self.fingerprint:
            raise PlanMismatchError(f"this plan was made for another model or input shapes (graph {self.fingerprint}, "
                                    f"this model's is {fingerprint}); plan this model instead")
        from autoshard.cluster import Cluster

        mine, theirs = Cluster.from_json(self.cluster), Cluster.from_json(cluster_json)
        if mine.mesh_shape != theirs.mesh_shape:
            raise PlanMismatchError(f"this plan is for mesh {mine.mesh_shape}, the cluster given has {theirs.mesh_shape}")

    # ------------------------------------------------------------------ reading
    def strategy_of(self, name: str) -> str:
        return self._by_name()[name].strategy

    def _by_name(self) -> dict[str, NodeDecision]:
        if not hasattr(self, "_index"):
            self._index = {n.name: n for n in self.nodes}
        return self._index

    def summary(self, *, max_rows: int = 40) -> str:
        """A table of the most expensive nodes, with a header of predicted totals (also printed
        by rich when it is a terminal)."""
        from rich.console import Console
        from rich.table import Table

        gib = 2**30
        head = (f"step {self.step_time * 1e3:.2f} ms (compute {self.compute_time * 1e3:.2f}, comm "
                f"{self.comm_time * 1e3:.2f}) | peak {self.peak_memory / gib:.2f} GiB/device | mesh "
                f"{dict(zip(self.mesh_dim_names, self.mesh_shape))} | solver {self.solver['status']} "
                f"gap {self.solver['gap']:.1%}")
        table = Table(title=head, title_justify="left")
        for col in ("node", "op", "placements (in -> out)", "compute us", "comm"):
            table.add_column(col)
        rows = sorted(self.nodes, key=lambda n: -(n.compute + sum(c["time"] for c in n.comm)))[:max_rows]
        for n in rows:
            comm = ", ".join(f"{c['kind']}@{self.mesh_dim_names[c['mesh_dim']]} {c['bytes'] / 2**20:.1f}MiB "
                             f"{c['time'] * 1e6:.0f}us" for c in n.comm)
            table.add_row(n.name, n.op, n.strategy, f"{n.compute * 1e6:.1f}", comm)
        storage = Table(title="parameter storage", title_justify="left")
        storage.add_column("parameter")
        storage.add_column("placements")
        for name, pl in self.storage.items():
            storage.add_row(name, pl)
        console = Console(width=160, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
        console.print(table)
        console.print(storage)
        if self.fallbacks:
            console.print("replicated for lack of a rule: " + "; ".join(f"{n} ({r})" for n, r in self.fallbacks))
        return console.export_text()

    def __repr__(self) -> str:
        return (f"Plan(step_time={self.step_time * 1e3:.3f} ms, peak_memory={self.peak_memory / 2**30:.2f} GiB, "
                f"mesh={self.mesh_shape}, nodes={len(self.nodes)}, fallbacks={len(self.fallbacks)})")
