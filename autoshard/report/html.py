"""The plan as a graph: Graphviz DOT, an inline-SVG drawing laid out with networkx, the memory
plot and the self-contained HTML report that holds them (no script, no external link).

Text tables live in :mod:`autoshard.report.text`, how a value reads in either in
:mod:`autoshard.report.format`.
"""

from __future__ import annotations

import html
import math
import re

from autoshard.report.format import (COMM_COLOUR, UNPLANNED_COLOUR, comm_str, fmt_bytes, fmt_time, node_label,
                                     output_placement, per_dim, placement_colour, shard_factor, short_op, shown_comm)
from autoshard.report.text import header_lines, memory_rows, node_groups, storage_rows


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


def subset(plan, layer: int | None = None, module: str | None = None):
    """The plan cut down to one copy of a repeated block and/or one module path (and what is
    under it): the ATen-level drill-down of the module view."""
    import dataclasses

    def keep(n):
        return ((layer is None or n.layer == layer)
                and (module is None or (n.module or "") == module or (n.module or "").startswith(module + ".")))

    nodes = [n for n in plan.nodes if keep(n)]
    if not nodes:
        from autoshard.errors import PlanError

        raise PlanError(f"no node of the plan is in layer {layer} / module {module!r}")
    names = {n.name for n in nodes}
    return dataclasses.replace(plan, nodes=nodes, edges=[e for e in plan.edges if e[0] in names and e[1] in names])


def to_dot(plan, *, aten: bool = False, layer: int | None = None, module: str | None = None) -> str:
    """The module graph (layers folded), or with ``aten`` (or a ``layer``/``module`` to drill
    into) the ATen nodes themselves."""
    if not aten and layer is None and module is None:
        from autoshard.report.modules import module_dot

        return module_dot(plan)
    if layer is not None or module is not None:
        plan = subset(plan, layer, module)
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
                      f"color={_q(COMM_COLOUR)}"]
        out.append(f"  {_q(n.name)} [{', '.join(attrs)}];")
    for name in dict.fromkeys(x for e in edges for x in e):
        if name not in by_name:
            out.append(f"  {_q(name)} [label={_q(name)}, fillcolor={_q(UNPLANNED_COLOUR)}, style=dotted];")
    for a, b in edges:
        comm = on_edge.get((a, b))
        attrs = (f" [label={_q(chr(10).join(comm_str(plan, c) for c in comm))}, color={_q(COMM_COLOUR)}, "
                 f"fontcolor={_q(COMM_COLOUR)}, penwidth=2]") if comm else ""
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


def graph_svg(plan, svg_id: str = "plan-graph") -> str:
    pos, edges, on_edge, on_node = layout(plan)
    by_name = {n.name: n for n in plan.nodes}
    long = any(not 0 <= pos[b][1] - pos[a][1] <= 2 * _DY for a, b in edges)
    width = max((x for x, _ in pos.values()), default=0) + _W + 20 + (600 if long else 0)
    height = max((y for _, y in pos.values()), default=0) + _H + 34
    e = html.escape
    out = [f'<svg id="{svg_id}" class="graph" width="{width:.0f}" height="{height:.0f}" '
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
                       f'<path d="{d}" fill="none" stroke="{COMM_COLOUR}" stroke-width="2" stroke-opacity="0.8"{dash} '
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
        stroke = COMM_COLOUR if name in on_node else "#555"
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


def _axis_unit(top: float) -> tuple[float, str]:
    """One unit for the whole axis, the largest binary unit ``top`` reaches."""
    k = max(0, min(4, int(math.log(max(top, 1.0), 1024))))
    return 1024.0 ** k, ("B", "KiB", "MiB", "GiB", "TiB")[k]


def _ticks(top: float) -> list[float]:
    """0 and round steps (1, 2 or 5 x 10^k in the unit of ``top``) up to just above ``top``."""
    unit, _ = _axis_unit(top)
    raw = top / unit / 5
    step = min((m * 10**e for e in range(-3, 6) for m in (1, 2, 5) if m * 10**e >= raw), default=raw) * unit
    return [step * k for k in range(math.ceil(top / step - 1e-9) + 1)]


def _number(x: float) -> str:
    return f"{x:.3f}".rstrip("0").rstrip(".")


def _runs_of(keys: list) -> list[tuple[object, int, int]]:
    """[a, a, b, b, b] -> [(a, 0, 1), (b, 2, 4)]: each run of equal keys, first and last index."""
    out = []
    for i, k in enumerate(keys):
        if out and out[-1][0] == k:
            out[-1] = (k, out[-1][1], i)
        else:
            out.append((k, i, i))
    return out


def _point_phases(plan, points) -> tuple[list[str], list]:
    """Each timeline point's phase (its node's; the optimizer step and a derived line's start
    named apart) and layer."""
    by_name = {n.name: n for n in plan.nodes}
    phases = [by_name[n].phase if n in by_name else "optim" if n == "optimizer step" else "input" for n, _ in points]
    return phases, [by_name[n].layer if n in by_name else None for n, _ in points]


def peak_span(plan, points) -> tuple[int, int]:
    """The timeline points of the plan's peak moment (``plan.peak_moment``, solver/memory.py's
    phase names); the highest point when the moment is unknown."""
    phases, layers = _point_phases(plan, points)
    moment = plan.peak_moment or ""
    bwd = [i for i, ph in enumerate(phases) if ph == "bwd"]
    layered = [i for i in bwd if layers[i] is not None]
    found = re.match(r"backward of layer (\d+)", moment)
    if moment == "forward":
        pick = [i for i, ph in enumerate(phases) if ph == "fwd"]
    elif found:
        pick = [i for i in layered if layers[i] == int(found.group(1))]
    elif moment == "backward, before the layers" and layered:
        pick = [i for i in bwd if i < layered[0]]
    elif moment == "backward, after the layers" and layered:
        pick = [i for i in bwd if i > layered[-1]]
    elif moment in ("backward", "end of backward") and bwd:
        pick = bwd if moment == "backward" else bwd[-1:]
    elif moment == "optimizer step":
        pick = [i for i, ph in enumerate(phases) if ph == "optim"]
    else:
        pick = []
    if not pick:
        top = max(range(len(points)), key=lambda i: points[i][1]) if points else 0
        return top, top
    return min(pick), max(pick)


_PHASE_WORDS = {"fwd": "forward", "bwd": "backward", "optim": "optimizer", "input": ""}


def _x_axis(plan, points, xs, y0: float) -> list[str]:
    """Phase bands and names under the plot, and a tick at the start of each layer (labelled
    where there is room), so a reader can tell where a layer is."""
    phases, layers = _point_phases(plan, points)
    out = []
    for ph, i, j in _runs_of(phases):
        x1, x2 = xs(i), xs(j)
        if ph == "bwd":
            out.append(f'<rect class="phase-band" x="{x1:.1f}" y="{y0 - 1:.0f}" width="{max(x2 - x1, 1):.1f}" '
                       f'height="4" fill="#d6e4f0"/>')
        if i > 0:
            out.append(f'<line x1="{x1:.1f}" y1="{y0:.0f}" x2="{x1:.1f}" y2="{y0 + 30:.0f}" stroke="#999"/>')
        if _PHASE_WORDS.get(ph, ph):
            anchor = "start" if ph == "optim" else "middle"
            x = x1 + 3 if ph == "optim" else (x1 + x2) / 2
            out.append(f'<text class="phase" x="{x:.1f}" y="{y0 + 30:.0f}" text-anchor="{anchor}">'
                       f'{_PHASE_WORDS.get(ph, ph)}</text>')
    last = -math.inf
    for (ph, layer), i, _ in _runs_of(list(zip(phases, layers))):
        if layer is None:
            continue
        x = xs(i)
        out.append(f'<line class="layer-tick" x1="{x:.1f}" y1="{y0:.0f}" x2="{x:.1f}" y2="{y0 + 5:.0f}" '
                   'stroke="#555"/>')
        if x - last >= 26:   # a label "L31" is ~18 px wide at 9 px
            out.append(f'<text class="layer" x="{x:.1f}" y="{y0 + 15:.0f}" text-anchor="middle">L{layer}</text>')
            last = x
    return out


def _label_y(line_y: float, avoid: list[tuple[float, float]]) -> float:
    """A baseline for a label of 11 px text just above the line at ``line_y``, else just below it,
    else a line further off: the first that keeps 2 px from every span in ``avoid`` (another line,
    or another label's box)."""
    for y in (line_y - 6, line_y + 16, line_y - 22, line_y + 32):
        top, bottom = _box(y)
        if all(hi < top - 2 or lo > bottom + 2 for lo, hi in avoid):
            return y
    return line_y - 6


def _box(y: float) -> tuple[float, float]:
    return y - 11, y + 3


def _peak_and_cap(plan, points, xs, ys, left: float, right_x: float, top_y: float, cap, on_scale: bool) -> list[str]:
    """The plan's peak (the header's figure) drawn over its moment's span, and the cap line; each
    label keeps clear of the other line and label."""
    e = html.escape
    i, j = peak_span(plan, points)
    peak = plan.peak_memory
    yp = ys(peak)
    yc = ys(cap) if cap and on_scale else None
    out = [f'<line class="peak" x1="{xs(i) - 3:.1f}" y1="{yp:.1f}" x2="{xs(j) + 3:.1f}" y2="{yp:.1f}" '
           f'stroke="#08306b" stroke-width="3"><title>the plan\'s peak, {e(plan.peak_moment or "its highest point")}'
           f'</title></line>']
    text = f"peak {fmt_bytes(peak)}" + (f" ({plan.peak_moment})" if plan.peak_moment else "")   # as the header says
    peak_y = _label_y(yp, [] if yc is None else [(yc, yc)])
    x = max(left + 2, min(xs(i), right_x - 6.5 * len(text)))
    out.append(f'<text class="peak-label" x="{x:.1f}" y="{peak_y:.1f}" fill="#08306b">{e(text)}</text>')
    if cap and not on_scale:
        out.append(f'<text class="cap" x="{right_x - 4}" y="{top_y - 8:.0f}" text-anchor="end" '
                   f'fill="{COMM_COLOUR}">cap {fmt_bytes(cap)} (above this scale; the peak uses {peak / cap:.1%})</text>')
    elif cap:
        cap_y = _label_y(yc, [(yp, yp), _box(peak_y)])
        out.append(f'<line class="cap" x1="{left}" y1="{yc:.1f}" x2="{right_x}" y2="{yc:.1f}" stroke="{COMM_COLOUR}" '
                   f'stroke-width="1.5" stroke-dasharray="6 4"/><text class="cap-label" x="{right_x - 4}" '
                   f'y="{cap_y:.1f}" text-anchor="end" fill="{COMM_COLOUR}">cap {fmt_bytes(cap)}</text>')
    return out


def memory_legend(plan, derived: bool, curve_top: float) -> str:
    """What the plot shows and what moves the curve, as HTML under it."""
    rc = any(n.recompute for n in plan.nodes)
    items = [
        "<b>Curve</b>: predicted bytes held on one device after each node, in execution order "
        + ("(derived from the plan's totals: activations grow evenly over forward and shrink over backward)"
           if derived else "(the solver's prediction)") + ".",
        "<b>Forward</b>: it rises as each layer saves activations for backward; spikes are an op's temporary "
        "working set (freed when the op ends).",
        "<b>Backward</b>: it falls as each layer's saved activations are freed after their last use, and rises "
        "as gradients are made" + (", and where recomputed activations come back (dashed nodes in the graph are "
                                   "recomputed)" if rc else "") + "; spikes are working sets again.",
        "<b>Optimizer</b>: parameters, gradients and optimizer state, plus the step's temporaries.",
        "<b>Peak</b> (dark bar, the header's figure): the largest moment of the step as the solver bounds it "
        "— a phase's live values, its largest working set" + (" and its recomputed values" if rc else "")
        + " counted at once — so it can sit above the curve.",
    ]
    if plan.peak_memory > curve_top * (1 + 1e-6):
        items.append(f"Here the peak is {fmt_bytes(plan.peak_memory - curve_top)} above the curve's top "
                     f"({fmt_bytes(curve_top)}).")
    return '<ul class="legend">' + "".join(f"<li>{t}</li>" for t in items) + "</ul>"


def memory_svg(plan) -> str:
    points, derived = memory_timeline(plan)
    cap = plan.memory_limit if plan.memory_limit is not None and math.isfinite(plan.memory_limit) else None
    w, h, left, right, top, bottom = 960, 340, 70, 64, 24, 52   # the right margin holds "optimizer"
    pw, ph = w - left - right, h - top - bottom
    high = max([b for _, b in points] + [plan.peak_memory, 1.0])
    on_scale = cap is not None and cap <= 3 * high   # a far-off cap would flatten the curve
    ticks = _ticks(max(high, cap if on_scale else 0.0) * 1.08)
    ymax = ticks[-1]
    unit, uname = _axis_unit(ymax)
    xs = lambda i: left + pw * i / max(1, len(points) - 1)  # noqa: E731
    ys = lambda b: top + ph * (1 - b / ymax)  # noqa: E731
    out = [f'<svg id="memory-plot" class="plot" width="{w}" height="{h}" viewBox="0 0 {w} {h}" role="img" '
           f'aria-label="predicted memory per device over the step">',
           f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="#fafafa" stroke="#ccc"/>',
           f'<text class="unit" x="{left - 8}" y="{top - 8}" text-anchor="end">{uname}</text>']
    for t in ticks:
        y = ys(t)
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" stroke="#eee"/>'
                   f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" class="tick ytick">'
                   f'{_number(t / unit)}</text>')
    out += _x_axis(plan, points, xs, top + ph)
    path = []
    for i, (_, b) in enumerate(points):
        path.append(f"{xs(i):.1f},{ys(b):.1f}")
        if i + 1 < len(points):
            path.append(f"{xs(i + 1):.1f},{ys(b):.1f}")
    out.append(f'<polyline class="memory" points="{" ".join(path)}" fill="none" stroke="#1f77b4" stroke-width="2"/>')
    out += _peak_and_cap(plan, points, xs, ys, left, left + pw, top, cap, on_scale)
    out.append("</svg>")
    return "\n".join(out)


# ---------------------------------------------------------------------- HTML
_CSS = """body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.3em}h2{font-size:1.1em;margin-top:1.5em}
table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ddd;padding:2px 6px;text-align:left;
vertical-align:top}th{background:#f0f0f0}tr.group td{background:#f7f7f7;font-weight:bold}
.scroll{overflow:auto;max-height:80vh;border:1px solid #ddd}.nname{font:bold 10px monospace}
.nop{font:9px monospace}.elabel{font:9px sans-serif;fill:#d62728}.tick,.phase,.unit,.layer,.peak-label,
.cap-label,.cap{font:11px sans-serif}.layer{font-size:9px;fill:#555}.legend{font-size:12px;max-width:960px}
.swatch{display:inline-block;width:1em;height:1em;border:1px solid #888;vertical-align:middle;margin:0 .3em 0 1em}
pre{font-size:12px}.mname{font:bold 12px monospace}.mop{font:10px monospace}.mcomm{font:10px sans-serif;
fill:#d62728}.btitle{font:bold 13px sans-serif;fill:#4a6fa5}.badge{font:10px monospace}.ecomm{font:10px sans-serif;
fill:#b2182b}span.badge{border:1px solid #999;border-radius:3px;padding:0 4px;margin:0 2px}.ldim{margin-right:1.5em}
#module-graph{max-width:100%;height:auto}"""


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
    groups, _ = node_groups(plan, max_rows, fold=max_rows is not None)
    for g in groups:
        rows.append([g.title, f"{g.total} nodes"] + [""] * len(plan.mesh_shape)
                    + ["", fmt_time(g.compute), f"total {fmt_time(g.comm)}"])
        cls.append("group")
        for n in g.nodes:
            rows.append([node_label(plan, n.name), short_op(n.op), *per_dim(plan, n.strategy),
                         "yes" if n.recompute else "",
                         fmt_time(n.compute), "\n".join(comm_str(plan, c) for c in shown_comm(plan, n))])
            cls.append("")
    return _html_table(head, rows, cls)


def _legend(plan) -> str:
    points, derived = memory_timeline(plan)
    return memory_legend(plan, derived, max((b for _, b in points), default=0.0))


def _drill_down(plan, folded) -> str:
    """The ATen graph of one copy of the first repeated block (or of the whole plan when it has
    no block and is small enough to draw), folded away until opened."""
    if folded.blocks:
        b = folded.blocks[0]
        part, what = subset(plan, layer=b.layers[0]), f"{b.container}.{b.layers[0]}"
    elif len(plan.nodes) <= 600:
        part, what = plan, "the whole plan"
    else:
        return ""
    return (f"<details><summary>ATen graph of {html.escape(what)} ({len(part.nodes)} nodes)</summary>"
            "<p>Nodes coloured by output placement; red edges carry collectives; dashed boxes are recomputed. "
            "<code>plan.to_dot(layer=K)</code> or <code>module=PATH</code> draws any other part.</p>"
            f'<div class="scroll">{graph_svg(part, "aten-graph")}</div></details>')


def _all_nodes(plan, folded) -> str:
    """Every node, but of each folded block only its first copy: the others make the same
    decisions, and listing all 80 copies of a 70B model would make the page tens of MB."""
    import dataclasses

    kept = [n for n in plan.nodes if n.name not in folded.folded_away]
    note = (f" ({len(folded.folded_away)} nodes of folded copies left out: they repeat the first copy's "
            "decisions; the plan's JSON lists them)") if folded.folded_away else ""
    return (f"<details><summary>all {len(kept)} nodes{html.escape(note)}</summary>"
            f"{_nodes_html(dataclasses.replace(plan, nodes=kept), None)}</details>")


def to_html(plan, max_rows: int | None = 200) -> str:
    from autoshard.report.modules import fold, legend_html, module_svg

    e = html.escape
    folded = fold(plan)
    _, hidden = node_groups(plan, max_rows)
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>autoshard plan {e(plan.fingerprint)}</title><style>{_CSS}</style></head><body>",
        "<h1>autoshard plan</h1>", "<p>" + "<br>".join(e(line) for line in header_lines(plan)) + "</p>",
        "<h2>Predicted memory per device</h2>", memory_svg(plan), _legend(plan),
        _html_table(["component", "bytes", "share"], [list(r) for r in memory_rows(plan)]),
        "<h2>Graph</h2>", legend_html(plan, folded), f'<div class="scroll">{module_svg(plan, folded)}</div>',
        _drill_down(plan, folded),
        "<h2>Nodes</h2>", _nodes_html(plan, max_rows),
        f"<p>{hidden} cheaper nodes not listed above.</p>" if hidden else "",
        _all_nodes(plan, folded),
        "<h2>Parameter storage</h2>",
        _html_table(["parameter", "placements", "per device", "layers"],
                    [[k, v, "full copy" if shard_factor(plan, v) == 1 else f"1/{shard_factor(plan, v)}",
                      f"x{copies}" if copies > 1 else ""] for k, v, copies in storage_rows(plan)]),
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
