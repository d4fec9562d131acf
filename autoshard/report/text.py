"""Reading a plan in the terminal: the row model and the text tables (header, nodes, storage,
memory, coverage gaps) and a diff of two plans.

Everything here is a pure function of a :class:`~autoshard.planning.plan.Plan`; nothing reaches
the network or runs an external program. One row model feeds the text table and the HTML table,
so the two always agree; how each value reads is :mod:`autoshard.report.format`'s.

    text = summary_text(plan, max_rows=20)   # report/summary.py: what plan.summary() returns
    dot = to_dot(plan)                        # report/html.py; parses with pydot / networkx.nx_pydot
    page = to_html(plan)                      # inline SVG graph + memory plot + tables, no <script>
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from autoshard.report.format import (comm_str, export, fmt_bytes, fmt_time, node_label, per_dim, ranges,
                                     recording_console, shard_factor, short_op, shown_comm)

PHASES = {"input": "parameters and inputs", "fwd": "forward", "bwd": "backward", "optim": "optimizer"}


# ---------------------------------------------------------------------- small helpers
def node_cost(node) -> float:
    return node.compute + sum(c["time"] for c in node.comm)


def _cluster(plan):
    from autoshard.cluster import Cluster

    try:
        return Cluster.from_json(plan.cluster)
    except Exception:  # a report must render even if the cluster JSON is odd  # noqa: BLE001
        return None


def cap_of(plan) -> tuple[float | None, str]:
    """The memory cap to compare against: the plan's own limit, else the device's usable memory."""
    if plan.memory_limit is not None and math.isfinite(plan.memory_limit):
        return plan.memory_limit, "cap"
    cluster = _cluster(plan)
    return (cluster.memory_limit, "device usable") if cluster else (None, "")


# ---------------------------------------------------------------------- the row model
@dataclass
class Group:
    phase: str
    title: str
    nodes: list          # NodeDecisions shown, in plan order; for folded layers, the first layer's
    total: int           # nodes in the group, all its layers together
    compute: float       # seconds, all its layers together
    comm: float
    layers: list = field(default_factory=list)   # the layers folded into it; empty outside repeated blocks


def _signature(nodes) -> tuple:
    """What makes two copies of a layer read alike in a table: each node's op, strategy, recompute
    mark and collectives, in order (node names differ from copy to copy and do not count)."""
    return tuple((n.op, n.strategy, n.recompute,
                  tuple((c["kind"], c["mesh_dim"], round(c["bytes"])) for c in n.comm)) for n in nodes)


def layers_title(phase: str, layers: list[int]) -> str:
    base = PHASES.get(phase, phase)
    if not layers:
        return base
    return f"{base}, layer {layers[0]}" if len(layers) == 1 else \
        f"{base}, layers {ranges(layers)} x {len(layers)}"


def _raw_groups(plan, fold: bool) -> list[tuple[str, list[int], list[list]]]:
    """(phase, layers, one node list per layer) in phase order, nodes outside repeated blocks first;
    with ``fold``, the layers that read alike (:func:`_signature`) share one group."""
    phases = list(PHASES) + sorted({n.phase for n in plan.nodes} - set(PHASES))
    out = []
    for ph in phases:
        by_layer: dict = {}
        for n in plan.nodes:
            if n.phase == ph:
                by_layer.setdefault(n.layer, []).append(n)
        if None in by_layer:
            out.append((ph, [], [by_layer.pop(None)]))
        alike: dict = {}
        for layer in sorted(by_layer):
            alike.setdefault(_signature(by_layer[layer]) if fold else layer, []).append(layer)
        out += [(ph, layers, [by_layer[j] for j in layers]) for layers in sorted(alike.values())]
    return out


def node_groups(plan, max_rows: int | None, fold: bool = True) -> tuple[list[Group], int]:
    """Nodes by phase (input, fwd, bwd, ...) and repeated layer, keeping the ``max_rows`` costliest
    rows (None: all); returns the groups and how many nodes no row stands for. With ``fold``, copies
    of a layer that read alike are one group ("forward, layers 0-11 x 12") whose rows are the first
    copy's nodes, each standing for one node per copy and ranked by their cost over all copies."""
    raw = _raw_groups(plan, fold)
    rows = [(gi, n) for gi, (_, _, copies) in enumerate(raw) for n in copies[0]]
    keep = set(range(len(rows)))
    if max_rows is not None:
        weight = lambda k: node_cost(rows[k][1]) * len(raw[rows[k][0]][2])  # noqa: E731
        keep = set(sorted(range(len(rows)), key=lambda k: (-weight(k), k))[:max_rows])
    shown: dict[int, list] = {}
    for k in sorted(keep):
        shown.setdefault(rows[k][0], []).append(rows[k][1])
    groups, covered = [], 0
    for gi, (ph, layers, copies) in enumerate(raw):
        members = [n for copy in copies for n in copy]
        covered += len(shown.get(gi, [])) * len(copies)
        groups.append(Group(ph, layers_title(ph, layers), shown.get(gi, []), len(members),
                            sum(n.compute for n in members), sum(c["time"] for n in members for c in n.comm),
                            layers))
    return groups, len(plan.nodes) - covered


def header_lines(plan) -> list[str]:
    mesh = " x ".join(f"{n}={s}" for n, s in zip(plan.mesh_dim_names, plan.mesh_shape))
    cluster = _cluster(plan)
    device = f"{cluster.device.name}, {cluster.world_size} devices" if cluster else "unknown cluster"
    b = plan.breakdown
    parts = ([f"compute {fmt_time(b.get('compute', plan.compute_time))}",
              f"comm {fmt_time(b.get('comm', plan.comm_time))} "
              f"({fmt_time(b.get('exposed_comm', b.get('comm', plan.comm_time)))} exposed, the rest hidden "
              f"behind compute)"]
             + ([f"recompute {fmt_time(b['recompute'])}"] if "recompute" in b else [])
             + ([f"optimizer {fmt_time(b['optimizer'])}"] if b.get("optimizer") else []))
    cap, cap_name = cap_of(plan)
    mem = f"peak memory {fmt_bytes(plan.peak_memory)}/device"
    if cap:
        over = "  OVER THE CAP" if plan.peak_memory > cap else ""
        mem += f" of {fmt_bytes(cap)} {cap_name} ({plan.peak_memory / cap:.1%}){over}"
    s = plan.solver
    gap = s.get("gap")
    gap_s = f"gap {gap:.2%}" if isinstance(gap, (int, float)) and math.isfinite(gap) else f"gap {gap}"
    mfu = f"MFU {plan.mfu * 100:.3g}%" if plan.mfu is not None else "MFU n/a"
    recompute = sum(n.recompute for n in plan.nodes)
    compiled = "" if getattr(plan, "backend", "eager") == "eager" else f"; ops run by {plan.backend}"
    return [f"plan for mesh {mesh} ({device}); graph {plan.fingerprint}{compiled}",
            f"step {fmt_time(plan.step_time)} predicted ({', '.join(parts)}) | {mfu}",
            f"{mem} | solver {s.get('status')} ({s.get('backend', '?')}), {gap_s}"
            + (f" | {recompute} nodes recomputed" if recompute else "")]


# ---------------------------------------------------------------------- text (rich)
# How a reader asks for every row: a Python caller and the command line are told differently.
PY_HINTS = {"all": "summary(expand=True)", "diff_more": "PlanDiff.nodes has them all"}
CLI_HINTS = {"all": "--all", "diff_more": "--max-rows N shows more"}


def nodes_table(plan, groups: list[Group], max_rows: int | None):
    """The ATen nodes, one section per group of :func:`node_groups`."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"nodes by phase and layer ({'all' if max_rows is None else f'top {max_rows} by cost'})",
                  title_justify="left")
    for col in ["node", "op"] + [f"{n}({s}) in -> out" for n, s in zip(plan.mesh_dim_names, plan.mesh_shape)] \
            + ["rc", "compute", "communication"]:
        table.add_column(col, no_wrap=col == "rc", max_width={"node": 44, "op": 18}.get(col),
                         overflow="ellipsis" if col == "op" else "fold")
    for g in groups:
        table.add_section()
        count = f"{g.total // len(g.layers)} nodes each" if len(g.layers) > 1 else f"{g.total} nodes"
        table.add_row(f"[bold]{escape(g.title)}[/bold]", count, *[""] * len(plan.mesh_shape), "",
                      fmt_time(g.compute), f"total {fmt_time(g.comm)}")
        for n in g.nodes:
            table.add_row(escape(node_label(plan, n.name)), escape(short_op(n.op)),
                          *map(escape, per_dim(plan, n.strategy)),
                          "R" if n.recompute else "", fmt_time(n.compute),
                          escape("\n".join(comm_str(plan, c) for c in shown_comm(plan, n))))
    return table


def natural_key(name: str) -> tuple:
    """"blocks.2.w" before "blocks.10.w": digit runs compare as numbers (a saved plan's storage
    comes back in text order)."""
    return tuple((0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", name) if t)


def storage_rows(plan) -> list[tuple[str, str, int]]:
    """(parameter, placements, copies) in model order (else natural order), a repeated layer's parameters folded: names
    that differ only in their first index and are stored alike print once, as "h.[0-11].mlp.weight"
    with 12 copies; a layer stored otherwise is its own row."""
    groups: dict[tuple[str, str], list[int]] = {}
    alone: list[tuple[str, str]] = []
    for name in sorted(plan.storage, key=natural_key):
        pl = plan.storage[name]
        m = re.search(r"(?:^|\.)(\d+)(?=\.)", name)
        if m is None:
            alone.append((name, pl))
            continue
        key = name[:m.start(1)] + "*" + name[m.end(1):]
        groups.setdefault((key, pl), []).append(int(m.group(1)))
    rank = _model_order(plan)
    where = lambda first: (rank.get(first, len(rank)), natural_key(first))  # noqa: E731
    rows = [(where(name), (name, pl, 1)) for name, pl in alone]
    for (key, pl), layers in groups.items():
        name = key.replace("*", str(layers[0]) if len(layers) == 1 else f"[{ranges(layers)}]", 1)
        rows.append((where(key.replace("*", str(layers[0]), 1)), (name, pl, len(layers))))
    return [row for _, row in sorted(rows)]


def _model_order(plan) -> dict[str, int]:
    """Parameter name -> its place in the model (the order its placeholders come in the graph), where the
    plan records which placeholder holds which parameter; an older plan has no record and sorts naturally."""
    names = getattr(plan, "param_names", None) or {}
    nodes = [n.name for n in getattr(plan, "nodes", [])]
    return {names[n]: i for i, n in enumerate(k for k in nodes if k in names)}


def storage_table(plan, max_rows: int | None = None, hints: dict | None = None):
    """The parameter storage, repeated layers folded (:func:`storage_rows`); ``max_rows`` rows at most."""
    from rich.markup import escape
    from rich.table import Table

    rows = storage_rows(plan)
    shown = rows if max_rows is None else rows[:max_rows]
    t = Table(title=f"parameter storage ({len(plan.storage)} parameters)", title_justify="left",
              caption=None if len(shown) == len(rows) else
              f"{len(rows) - len(shown)} more rows not shown ({(hints or PY_HINTS)['all']} shows all)",
              caption_justify="left")
    for col in ("parameter", "placements", "per device", "layers"):
        t.add_column(col)
    for name, pl, copies in shown:
        f = shard_factor(plan, pl)
        t.add_row(escape(name), escape(pl), "full copy" if f == 1 else f"1/{f}", f"x{copies}" if copies > 1 else "")
    return t


def memory_rows(plan) -> list[tuple[str, str, str]]:
    """The peak moment's parts that hold bytes (an empty part, such as "recomputed" in a plan that
    recomputes nothing, says nothing), the peak, and the cap."""
    rows = [(k, fmt_bytes(v), f"{v / plan.peak_memory:.1%}" if plan.peak_memory else "-")
            for k, v in plan.memory.items() if v]
    rows.append(("peak", fmt_bytes(plan.peak_memory), "100.0%"))
    cap, cap_name = cap_of(plan)
    if cap:
        rows.append((cap_name, fmt_bytes(cap), f"{plan.peak_memory / cap:.1%} used"))
    return rows


def memory_table(plan):
    from rich.table import Table

    t = Table(title="memory per device", title_justify="left")
    for col in ("component", "bytes", "share"):
        t.add_column(col)
    for row in memory_rows(plan):
        t.add_row(*row)
    return t


@dataclass
class DiffRow:
    change: object       # NodeChange of the first layer the row stands for
    layers: list         # the layers whose node changed alike; empty outside repeated blocks
    impact: float        # seconds the step changes by through these nodes, all copies (b - a)
    memory: float = 0.0  # bytes per device they hold, all copies (b - a; NodeDecision.memory)


DIFF_ORDERS = ("time", "memory")


def diff_rows(d, by: str = "time") -> list[DiffRow]:
    """The changed nodes, alike changes in different layers folded into one row, ranked by how
    much they move the step time (``by="time"``) or the bytes they hold (``by="memory"``),
    largest first, the other as the next key; then a recompute flip first, computing nodes before
    placeholders, then graph order."""
    if by not in DIFF_ORDERS:
        raise ValueError(f"by must be one of {DIFF_ORDERS}, not {by!r}")
    rows: dict[tuple, DiffRow] = {}
    seen: dict[tuple, int] = {}
    for c in d.nodes:
        alike = (c.phase, c.op, c.a, c.b, c.recompute_a, c.recompute_b, round(c.time_a, 12), round(c.time_b, 12),
                 c.memory_a, c.memory_b)
        # the k-th such change in one layer pairs with the k-th in each other layer
        k = seen[(c.layer, alike)] = seen.get((c.layer, alike), -1) + 1
        row = rows.setdefault((c.name,) if c.layer is None else (alike, k), DiffRow(c, [], 0.0))
        row.layers += [] if c.layer is None else [c.layer]
        row.impact += c.time_b - c.time_a
        row.memory += c.memory_b - c.memory_a
    order = {id(r): i for i, r in enumerate(rows.values())}
    flips = lambda r: r.change.recompute_a != r.change.recompute_b  # noqa: E731  a recompute flip moves memory
    first = (lambda r: (-abs(r.impact), -abs(r.memory))) if by == "time" else (lambda r: (-abs(r.memory), -abs(r.impact)))
    return sorted(rows.values(), key=lambda r: (*first(r), not flips(r), r.change.phase == "input", order[id(r)]))


def diff_text(d, max_rows: int = 100, width: int = 160, hints: dict | None = None, by: str = "time") -> str:
    from rich.markup import escape

    def delta(pair, fmt):
        a, b = pair
        rel = f", {(b - a) / a:+.1%}" if a else ""
        return f"{fmt(a)} -> {fmt(b)} ({'+' if b >= a else '-'}{fmt(abs(b - a))}{rel})"

    console = recording_console(width)
    console.print(f"plan diff (a -> b): same graph: {'yes' if d.same_graph else 'NO'}, "
                  f"same cluster: {'yes' if d.same_cluster else 'NO'}")
    for label, pair, fmt in (("step time", d.step_time, fmt_time), ("compute", d.compute_time, fmt_time),
                             ("communication", d.comm_time, fmt_time), ("peak memory", d.peak_memory, fmt_bytes)):
        console.print(f"  {label}: {delta(pair, fmt)}")
    # the memory parts that moved, largest move first
    for k, pair in sorted(d.memory.items(), key=lambda kv: -abs(kv[1][1] - kv[1][0])):
        if pair[0] != pair[1]:
            console.print(f"  memory {k}: {delta(pair, fmt_bytes)}")
    if d.identical:
        console.print("the plans make the same decisions")
        return export(console)
    rows = diff_rows(d, by)
    if rows:
        console.print(_diff_table(d, rows[:max_rows], len(rows), by))
    if len(rows) > max_rows:
        more = len(rows) - max_rows
        console.print(f"... and {more} more row{'s' if more > 1 else ''} ({(hints or PY_HINTS)['diff_more']})")
    if d.storage:
        console.print(_storage_diff_table(d, max_rows, hints))
    for label, names in (("only in a", d.only_in_a), ("only in b", d.only_in_b)):
        if names:
            more = " ..." if len(names) > 20 else ""
            console.print(escape(f"{len(names)} nodes {label}: {', '.join(names[:20])}{more}"))
    return export(console)


def _signed(x: float, fmt) -> str:
    return ("+" if x >= 0 else "-") + fmt(abs(x))


def _diff_table(d, rows: list[DiffRow], total: int, by: str = "time"):
    from rich.markup import escape
    from rich.table import Table

    ranked = "the step time" if by == "time" else "the bytes held"
    t = Table(title=f"{len(d.nodes)} nodes decided differently ({total} rows, alike layers folded), "
                    f"largest change to {ranked} first", title_justify="left")
    for col in ("node", "module", "layers", "op", "a", "b", "recompute a -> b", "time a -> b (per node)",
                "step change", "memory change"):
        t.add_column(col, overflow="fold")
    for r in rows:
        c = r.change
        rc = f"{c.recompute_a} -> {c.recompute_b}" if c.recompute_a != c.recompute_b else ""
        layers = "" if not r.layers else (str(r.layers[0]) if len(r.layers) == 1 else
                                           f"{ranges(sorted(r.layers))} x {len(r.layers)}")
        name = f"{c.name} ({c.param})" if c.param else c.name
        t.add_row(escape(name), escape(_folded_module(c.module, r.layers)), layers, escape(short_op(c.op)),
                  escape(c.a), escape(c.b), rc, f"{fmt_time(c.time_a)} -> {fmt_time(c.time_b)}",
                  _signed(r.impact, fmt_time),
                  _signed(r.memory, fmt_bytes) if r.memory else "")
    return t


def _folded_module(module: str | None, layers: list) -> str:
    """A folded row's module path with its layer index standing for all of them ("h.[0-11].attn")."""
    if not module or len(layers) < 2:
        return module or ""
    return re.sub(rf"(^|\.){layers[0]}(?=\.|$)", rf"\g<1>[{ranges(sorted(layers))}]", module, count=1)


def _storage_diff_table(d, max_rows: int, hints: dict | None):
    """Parameters stored differently, alike layers folded, the largest change to the bytes they
    hold (at rest, with gradient and optimizer state: NodeDecision.memory) first, then in order as
    in the storage table."""
    from types import SimpleNamespace

    from rich.markup import escape
    from rich.table import Table

    held = getattr(d, "storage_memory", {})
    # the bytes go into what folds alike layers, so a folded row's members hold the same
    pairs = {k: f"{a} -> {b} | {held.get(k, (0.0, 0.0))[0]!r} {held.get(k, (0.0, 0.0))[1]!r}"
             for k, (a, b) in d.storage.items()}
    rows = []
    for name, change, copies in storage_rows(SimpleNamespace(storage=pairs)):
        placements, nbytes = change.split(" | ")
        ma, mb = (float(x) for x in nbytes.split())
        rows.append((name, placements, copies, (mb - ma) * copies))
    rows.sort(key=lambda row: -abs(row[3]))   # stable: model order among equals
    more = len(rows) - max_rows
    s = Table(title=f"{len(d.storage)} parameters stored differently, largest change to the bytes held first",
              title_justify="left",
              caption=f"{more} more rows not shown ({(hints or PY_HINTS)['diff_more']})" if more > 0 else None,
              caption_justify="left")
    for col in ("parameter", "a", "b", "layers", "memory change"):
        s.add_column(col, overflow="fold")
    for name, change, copies, delta in rows[:max_rows]:
        a, b = change.split(" -> ", 1)
        s.add_row(escape(name), escape(a), escape(b), f"x{copies}" if copies > 1 else "",
                  _signed(delta, fmt_bytes) if delta else "")
    return s


def gaps_table(plan):
    """The nodes whose strategies replicate an input that could stay sharded (passes/coverage.py)."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"Coverage gaps: {len(plan.gaps)} node(s) gather an input their rule will not take sharded",
                  title_justify="left")
    for col in ("node", "op", "input", "model line"):
        table.add_column(col)
    for g in plan.gaps:
        table.add_row(escape(g["node"]), escape(g["op"]), escape(g["input"]), escape(g["source"] or "-"))
    return table
