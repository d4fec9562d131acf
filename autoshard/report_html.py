"""The plan as a graph: Graphviz DOT, an inline-SVG drawing laid out with networkx, the memory
plot and the self-contained HTML report that holds them (no script, no external link).

Text tables and the helpers shared with them live in :mod:`autoshard.report`.
"""

from __future__ import annotations

import html
import math
import re

from autoshard.report import (  # noqa: F401
    _COMM,
    _UNPLANNED,
    comm_str,
    fmt_bytes,
    fmt_time,
    header_lines,
    memory_rows,
    node_groups,
    output_placement,
    per_dim,
    placement_colour,
    shard_factor,
    short_op,
    shown_comm,
)


# ---------------------------------------------------------------------- graph: DOT
def _edge_comm(plan) -> tuple[list[tuple[str, str]], dict, dict]:
    """Edges (deduplicated, endpoints made to exist), the collectives on each edge and those
    that cannot be pinned to one edge (kept on the consumer). A collective dict may name its
    producer under "src"; otherwise it sits on the consumer's only in-edge, if it has one."""
    edges = list(dict.fromkeys(tuple(e) for e in plan.edges))
    ins: dict[str, list[str]] = {}
    for a, b in edges:
        ins.setdefault(b, []).append(a)
    on_edge: dict[tuple[str, str], list[dict]] = {}
    on_node: dict[str, list[dict]] = {}
    known = set(edges)
    for n in plan.nodes:
        for c in shown_comm(plan, n):
            src = c.get("src") or (ins[n.name][0] if len(ins.get(n.name, [])) == 1 else None)
            if src is None:
                on_node.setdefault(n.name, []).append(c)
                continue
            if (src, n.name) not in known:
                known.add((src, n.name))
                edges.append((src, n.name))
            on_edge.setdefault((src, n.name), []).append(c)
    return edges, on_edge, on_node


def _q(s: str) -> str:
    return '"' + str(s).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def to_dot(plan) -> str:
    edges, on_edge, on_node = _edge_comm(plan)
    by_name = {n.name: n for n in plan.nodes}
    title = " / ".join(header_lines(plan)[:2])
    out = ["digraph plan {",
           f"  graph [rankdir=TB, fontname=Helvetica, fontsize=11, labelloc=t, label={_q(title)}];",
           "  node [shape=box, style=filled, fontname=Helvetica, fontsize=9];",
           "  edge [fontname=Helvetica, fontsize=8, color=\"#888888\"];"]
    for n in plan.nodes:
        pl = output_placement(n.strategy)
        label = f"{n.name}\n{short_op(n.op)}\n{pl}" + ("\nrecompute" if n.recompute else "")
        attrs = [f"label={_q(label)}", f"fillcolor={_q(placement_colour(pl))}", f"phase={_q(n.phase)}",
                 f"tooltip={_q(n.strategy)}", f"style={_q('filled,dashed' if n.recompute else 'filled')}"]
        if n.name in on_node:
            attrs += [f"xlabel={_q(chr(10).join(comm_str(plan, c) for c in on_node[n.name]))}", "peripheries=2",
                      f"color={_q(_COMM)}"]
        out.append(f"  {_q(n.name)} [{', '.join(attrs)}];")
    for name in dict.fromkeys(x for e in edges for x in e):
        if name not in by_name:
            out.append(f"  {_q(name)} [label={_q(name)}, fillcolor={_q(_UNPLANNED)}, style=dotted];")
    for a, b in edges:
        comm = on_edge.get((a, b))
        attrs = (f" [label={_q(chr(10).join(comm_str(plan, c) for c in comm))}, color={_q(_COMM)}, "
                 f"fontcolor={_q(_COMM)}, penwidth=2]") if comm else ""
        out.append(f"  {_q(a)} -> {_q(b)}{attrs};")
    out.append("}")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------- graph: layout and SVG
_W, _H, _DX, _DY, _WRAP = 132, 34, 148, 64, 24


def layout(plan) -> tuple[dict[str, tuple[float, float]], list[tuple[str, str]], dict, dict]:
    """Top-left corner of each node box. Rows are layers of the edge graph without its back
    edges: networkx topological generations, then every node pulled down to just above its
    first consumer (so a weight's transpose sits by its matmul, not at the top); each row is
    ordered by where its producers sit, and wide rows wrap. A spring layout (fixed seed) if a
    cycle remains; with no edges, the nodes of each phase fill rows in plan order."""
    import networkx as nx

    edges, on_edge, on_node = _edge_comm(plan)
    order = {n.name: i for i, n in enumerate(plan.nodes)}
    g = nx.DiGraph()
    g.add_nodes_from(order)
    # Edges back up the plan order (a gradient returning to its parameter's storage placement)
    # close cycles; they are drawn but do not shape the layout.
    g.add_edges_from((a, b) for a, b in edges if order.get(a, -1) < order.get(b, len(order)))
    rank = lambda n: order.get(n, len(order))  # noqa: E731
    if edges and nx.is_directed_acyclic_graph(g):
        layer = {n: k for k, gen in enumerate(nx.topological_generations(g)) for n in gen}
        for n in reversed(list(nx.topological_sort(g))):
            succ = [layer[s] for s in g.successors(n)]
            if succ:
                layer[n] = max(layer[n], min(succ) - 1)
        rows: list[list[str]] = [[] for _ in range(max(layer.values()) + 1)]
        for n in sorted(layer, key=rank):
            rows[layer[n]].append(n)
    elif edges:
        spring = nx.spring_layout(g, seed=0)
        side = max(4, math.ceil(math.sqrt(len(spring))))
        return ({n: ((x + 1) / 2 * side * _DX, (y + 1) / 2 * side * _DY) for n, (x, y) in spring.items()},
                edges, on_edge, on_node)
    else:
        rows = [[n.name for n in plan.nodes if n.phase == ph] for ph in dict.fromkeys(n.phase for n in plan.nodes)]
    pos: dict[str, tuple[float, float]] = {}
    y = 0
    for row in rows:
        def where(n):
            xs = [pos[p][0] for p in g.predecessors(n) if p in pos]
            return (sum(xs) / len(xs) if xs else math.inf, rank(n))
        row = sorted(row, key=where)
        for k in range(0, len(row), _WRAP):
            for j, name in enumerate(row[k:k + _WRAP]):
                pos[name] = (j * _DX, y * _DY)
            y += 1
    return pos, edges, on_edge, on_node


def graph_svg(plan) -> str:
    pos, edges, on_edge, on_node = layout(plan)
    by_name = {n.name: n for n in plan.nodes}
    long = any(not 0 <= pos[b][1] - pos[a][1] <= 2 * _DY for a, b in edges)
    width = max((x for x, _ in pos.values()), default=0) + _W + 20 + (600 if long else 0)
    height = max((y for _, y in pos.values()), default=0) + _H + 34
    e = html.escape
    out = [f'<svg id="plan-graph" class="graph" width="{width:.0f}" height="{height:.0f}" '
           f'viewBox="-10 -24 {width:.0f} {height:.0f}" role="img" aria-label="plan graph">',
           '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="6" markerHeight="6" '
           'orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" fill="#888"/></marker></defs>']
    for a, b in edges:
        (x1, y1), (x2, y2) = pos[a], pos[b]
        x1, y1, x2, y2 = x1 + _W / 2, y1 + _H, x2 + _W / 2, y2
        # Long and backward edges bow out to the right, by their length, so they do not run
        # along a column of boxes; back edges (to a parameter's storage) are dashed.
        bow = 0.0 if 0 <= y2 - y1 <= 2 * _DY else min(600.0, 40 + abs(y2 - y1) / 10)
        d = (f"M {x1:.0f} {y1:.0f} L {x2:.0f} {y2:.0f}" if not bow else
             f"M {x1:.0f} {y1:.0f} C {x1 + bow:.0f} {y1 + 40:.0f}, {x2 + bow:.0f} {y2 - 40:.0f}, {x2:.0f} {y2:.0f}")
        dash = ' stroke-dasharray="5 4"' if y2 < y1 else ""
        comm = on_edge.get((a, b))
        if comm:
            label = "; ".join(comm_str(plan, c) for c in comm)
            out.append(f'<g class="comm"><title>{e(a)} -> {e(b)}: {e(label)}</title>'
                       f'<path d="{d}" fill="none" stroke="{_COMM}" stroke-width="2" stroke-opacity="0.8"{dash} '
                       f'marker-end="url(#arrow)"/><text x="{x2 + 6:.0f}" y="{y2 - 4:.0f}" class="elabel">'
                       f'{e(", ".join(dict.fromkeys(c["kind"] for c in comm)))}</text></g>')
        else:
            out.append(f'<path d="{d}" fill="none" stroke="#aaa" stroke-opacity="0.7"{dash} marker-end="url(#arrow)"/>')
    for name, (x, y) in pos.items():
        n = by_name.get(name)
        pl = output_placement(n.strategy) if n else ""
        tip = (f"{name} ({n.op}, {n.phase})\n{n.strategy}\ncompute {fmt_time(n.compute)}"
               + "".join(f"\n{comm_str(plan, c)}" for c in shown_comm(plan, n))) if n else f"{name} (not planned)"
        dash = ' stroke-dasharray="4 3"' if n and n.recompute else ""
        stroke = _COMM if name in on_node else "#555"
        short = name if len(name) <= 20 else name[:19] + "…"
        out.append(f'<g class="node"><title>{e(tip)}</title><rect x="{x:.0f}" y="{y:.0f}" width="{_W}" '
                   f'height="{_H}" rx="4" fill="{placement_colour(pl)}" stroke="{stroke}"{dash}/>'
                   f'<text x="{x + 4:.0f}" y="{y + 13:.0f}" class="nname">{e(short)}</text>'
                   f'<text x="{x + 4:.0f}" y="{y + 27:.0f}" class="nop">{e((short_op(n.op) if n else "")[:14])} '
                   f'{e(pl)}{" ↻" if n and n.recompute else ""}</text></g>')
    out.append("</svg>")
    return "\n".join(out)


# ---------------------------------------------------------------------- memory over the step
def memory_timeline(plan) -> tuple[list[tuple[str, float]], bool]:
    """The plan's own timeline, or (flagged derived=True) one made from its totals: everything
    but activations is resident all step; activations grow evenly over the forward nodes that
    compute and are released evenly over the backward ones, so the top equals peak_memory."""
    if plan.memory_timeline:
        return [(str(n), float(b)) for n, b in plan.memory_timeline], False
    act = min(plan.peak_memory, plan.memory.get("ilp_activations", plan.memory.get("activations", 0.0)))
    static = plan.peak_memory - act
    fwd = [n.name for n in plan.nodes if n.phase == "fwd" and n.compute > 0]
    bwd = [n.name for n in plan.nodes if n.phase == "bwd" and n.compute > 0]
    line = [("start", static)]
    line += [(name, static + act * (i + 1) / len(fwd)) for i, name in enumerate(fwd)]
    line += [(name, static + act * (1 - (i + 1) / len(bwd))) for i, name in enumerate(bwd)]
    return line, True


def _ticks(top: float) -> list[float]:
    """0 and round steps (1, 2 or 5 x 10^k in the unit of ``top``) up to just above ``top``."""
    unit = 1024 ** max(0, min(4, int(math.log(max(top, 1.0), 1024))))
    raw = top / unit / 5
    step = min((m * 10**e for e in range(-3, 6) for m in (1, 2, 5) if m * 10**e >= raw), default=raw) * unit
    return [step * k for k in range(math.ceil(top / step - 1e-9) + 1)]


def _tick_label(b: float) -> str:
    text = fmt_bytes(b)
    return re.sub(r"\.?0+ ", " ", text) if "." in text else text


def memory_svg(plan) -> str:
    points, derived = memory_timeline(plan)
    cap = plan.memory_limit if plan.memory_limit is not None and math.isfinite(plan.memory_limit) else None
    phase = {n.name: n.phase for n in plan.nodes}
    w, h, left, right, top, bottom = 880, 320, 80, 20, 24, 44
    pw, ph = w - left - right, h - top - bottom
    high = max([b for _, b in points] + [1.0])
    on_scale = cap is not None and cap <= 3 * high   # a far-off cap would flatten the curve
    ticks = _ticks(max(high, cap if on_scale else 0.0) * 1.05)
    ymax = ticks[-1]
    xs = lambda i: left + pw * i / max(1, len(points) - 1)  # noqa: E731
    ys = lambda b: top + ph * (1 - b / ymax)  # noqa: E731
    e = html.escape
    out = [f'<svg id="memory-plot" class="plot" width="{w}" height="{h}" viewBox="0 0 {w} {h}" role="img" '
           f'aria-label="predicted memory per device over the step">',
           f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="#fafafa" stroke="#ccc"/>']
    for t in ticks:
        y = ys(t)
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" stroke="#eee"/>'
                   f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" class="tick">{_tick_label(t)}</text>')
    bwd_at = next((i for i, (n, _) in enumerate(points) if phase.get(n) == "bwd"), None)
    if bwd_at is not None:
        x = xs(bwd_at)
        out.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{top + ph}" stroke="#999" stroke-dasharray="2 3"/>'
                   f'<text x="{x - 6:.1f}" y="{top + ph + 15}" text-anchor="end" class="tick">forward</text>'
                   f'<text x="{x + 6:.1f}" y="{top + ph + 15}" class="tick">backward</text>')
    path = []
    for i, (_, b) in enumerate(points):
        path.append(f"{xs(i):.1f},{ys(b):.1f}")
        if i + 1 < len(points):
            path.append(f"{xs(i + 1):.1f},{ys(b):.1f}")
    out.append(f'<polyline class="memory" points="{" ".join(path)}" fill="none" stroke="#1f77b4" stroke-width="2"/>')
    if points:
        i, (name, peak) = max(enumerate(points), key=lambda t: (t[1][1], -t[0]))
        out.append(f'<circle cx="{xs(i):.1f}" cy="{ys(peak):.1f}" r="4" fill="#1f77b4"><title>peak '
                   f'{fmt_bytes(peak)} after {e(name)}</title></circle>'
                   f'<text x="{xs(i) + 6:.1f}" y="{ys(peak) - 6:.1f}" class="tick">peak {fmt_bytes(peak)}</text>')
    if cap and not on_scale:
        out.append(f'<text class="cap" x="{left + pw - 4}" y="{top - 8}" text-anchor="end" fill="{_COMM}" '
                   f'font-size="11">cap {fmt_bytes(cap)} (above this scale; peak uses {high / cap:.1%})</text>')
    elif cap:
        out.append(f'<line class="cap" x1="{left}" y1="{ys(cap):.1f}" x2="{left + pw}" y2="{ys(cap):.1f}" '
                   f'stroke="{_COMM}" stroke-width="1.5" stroke-dasharray="6 4"/>'
                   f'<text x="{left + pw - 4}" y="{ys(cap) - 5:.1f}" text-anchor="end" class="tick" '
                   f'fill="{_COMM}">cap {fmt_bytes(cap)}</text>')
    note = "derived from the plan's totals (approximate)" if derived else "solver's prediction"
    out.append(f'<text x="{left + pw / 2:.0f}" y="{h - 6}" text-anchor="middle" class="tick">nodes in execution '
               f'order, forward then backward; {note}</text></svg>')
    return "\n".join(out)


# ---------------------------------------------------------------------- HTML
_CSS = """body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.3em}h2{font-size:1.1em;margin-top:1.5em}
table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ddd;padding:2px 6px;text-align:left;
vertical-align:top}th{background:#f0f0f0}tr.group td{background:#f7f7f7;font-weight:bold}
.scroll{overflow:auto;max-height:80vh;border:1px solid #ddd}.nname{font:bold 10px monospace}
.nop{font:9px monospace}.elabel{font:9px sans-serif;fill:#d62728}.tick{font:11px sans-serif}
.swatch{display:inline-block;width:1em;height:1em;border:1px solid #888;vertical-align:middle;margin:0 .3em 0 1em}
pre{font-size:12px}"""


def _html_table(head: list[str], rows: list[list[str]], row_class: list[str] | None = None) -> str:
    e = html.escape
    out = ["<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in head) + "</tr>"]
    for i, r in enumerate(rows):
        cls = f' class="{row_class[i]}"' if row_class and row_class[i] else ""
        out.append(f"<tr{cls}>" + "".join(f"<td>{e(c).replace(chr(10), '<br>')}</td>" for c in r) + "</tr>")
    return "\n".join(out + ["</table>"])


def _nodes_html(plan, max_rows: int | None) -> str:
    head = ["node", "op"] + [f"{n}({s}) in -> out" for n, s in zip(plan.mesh_dim_names, plan.mesh_shape)] \
        + ["recompute", "compute", "communication"]
    rows, cls = [], []
    groups, _ = node_groups(plan, max_rows)
    for g in groups:
        rows.append([g.title, f"{g.total} nodes"] + [""] * len(plan.mesh_shape)
                    + ["", fmt_time(g.compute), f"total {fmt_time(g.comm)}"])
        cls.append("group")
        for n in g.nodes:
            rows.append([n.name, short_op(n.op), *per_dim(plan, n.strategy), "yes" if n.recompute else "",
                         fmt_time(n.compute), "\n".join(comm_str(plan, c) for c in shown_comm(plan, n))])
            cls.append("")
    return _html_table(head, rows, cls)


def to_html(plan, max_rows: int | None = 200) -> str:
    e = html.escape
    legend = sorted({output_placement(n.strategy) for n in plan.nodes} - {""})
    swatches = "".join(f'<span class="swatch" style="background:{placement_colour(p)}"></span>{e(p)}' for p in legend)
    _, hidden = node_groups(plan, max_rows)
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>autoshard plan {e(plan.fingerprint)}</title><style>{_CSS}</style></head><body>",
        "<h1>autoshard plan</h1>", "<p>" + "<br>".join(e(line) for line in header_lines(plan)) + "</p>",
        "<h2>Predicted memory per device</h2>", memory_svg(plan),
        _html_table(["component", "bytes", "share"], [list(r) for r in memory_rows(plan)]),
        "<h2>Graph</h2>", f"<p>Nodes coloured by output placement:{swatches}. Red edges carry collectives "
        "(hover for kind, mesh dim, bytes, time); dashed boxes are recomputed; a red border marks collectives "
        "that could not be placed on one edge.</p>",
        f'<div class="scroll">{graph_svg(plan)}</div>',
        "<h2>Nodes</h2>", _nodes_html(plan, max_rows),
        f"<p>{hidden} cheaper nodes not listed above.</p>" if hidden else "",
        f"<details><summary>all {len(plan.nodes)} nodes</summary>{_nodes_html(plan, None)}</details>" if hidden else "",
        "<h2>Parameter storage</h2>",
        _html_table(["parameter", "placements", "per device"],
                    [[k, v, "full copy" if shard_factor(plan, v) == 1 else f"1/{shard_factor(plan, v)}"]
                     for k, v in plan.storage.items()]),
    ]
    if plan.fallbacks:
        parts += ["<h2>Replicated for lack of a rule</h2>",
                  _html_table(["node", "reason"], [list(f) for f in plan.fallbacks])]
    if plan.gaps:
        parts += ["<h2>Coverage gaps</h2>",
                  "<p>Every strategy of these nodes replicates an input that could arrive sharded: the plan "
                  "gathers it on every rank.</p>",
                  _html_table(["node", "op", "input", "reason", "model line"],
                              [[g["node"], g["op"], g["input"], g["reason"], g["source"]] for g in plan.gaps])]
    parts += ["<h2>Solver</h2>", _html_table(["key", "value"], [[k, str(v)] for k, v in plan.solver.items()]),
              "</body></html>"]
    return "\n".join(p for p in parts if p) + "\n"
