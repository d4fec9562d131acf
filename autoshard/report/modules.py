"""The plan at module level: one box per module (forward and backward folded together), the
copies of a repeated block folded into one block marked x N, with the copies whose decisions
differ drawn apart, and the collectives summed on the edges between modules.

Edges run from the module that computes first in forward to the later one, whichever way the
tensor flows, so backward's edges fold onto forward's and the drawing has no cycle: a gradient
returning to its parameter stays inside the parameter's module, and an edge from one copy of a
block to the next becomes the block's "between copies" note instead of a loop.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

import networkx as nx

from autoshard.report.format import fmt_bytes, fmt_time, parse_strategy, ranges, short_op

ROOT = "(model)"


@dataclass
class Block:
    """Copies ``layers`` of the repeated module ``container`` that made the same decisions."""
    container: str
    layers: list[int]

    @property
    def key(self) -> str:
        return f"{self.container}[{ranges(self.layers)}]"

    @property
    def title(self) -> str:
        return f"{self.container}.{ranges(self.layers)}  x {len(self.layers)}"


@dataclass
class Group:
    """One box: a module, in one block's representative copy or outside every block."""
    key: str
    module: str                      # path within its block ("attn.c_proj"), or full path
    block: Block | None
    nodes: list = field(default_factory=list)       # the representative copy's NodeDecisions
    params: dict[str, str] = field(default_factory=dict)   # parameter (relative name) -> storage
    rank: int = 0                    # plan index of its costliest forward node: orders the drawing
    own: list[str] = field(default_factory=list)    # collectives inside it (parameter gathers)


@dataclass
class Folded:
    graph: nx.DiGraph                # group key -> group key, attribute "comm": aggregated rows
    groups: dict[str, Group]
    blocks: list[Block]
    between: dict[str, list[dict]]   # block key -> collectives on edges from one copy to the next
    folded_away: set[str] = field(default_factory=set)   # nodes of the copies a block's first stands for


def _split(n, containers: list[str]) -> tuple[str, str | None, int | None, str]:
    """(module path, container, copy index, path inside the copy) of a plan node. The copy is
    read from the module path where it has one (``h.3.attn`` is copy 3 of ``h``): the layer
    the planner put a node in can differ at a copy's edge. Plans saved without module names
    group by that layer alone."""
    if n.module is None:
        if n.layer is None:
            return ROOT, None, None, ROOT
        return f"layer.{n.layer}", "layer", n.layer, "(block)"
    m = n.module or ROOT
    for c in containers:
        hit = re.match(rf"^{re.escape(c)}\.(\d+)(?:\.(.*))?$", m)
        if hit:
            return m, c, int(hit.group(1)), hit.group(2) or "(block)"
    return m, None, None, m


def containers_of(plan) -> list[str]:
    """Module paths whose children are numbered copies (``h`` of ``h.0.attn.c_attn.weight``)."""
    found = (re.match(r"(.*?)\.\d+\.", p) for p in plan.storage)
    return sorted(dict.fromkeys(m.group(1) for m in found if m), key=len, reverse=True)


def fold(plan) -> Folded:
    """Group the plan's nodes by module and fold identical copies of repeated blocks."""
    containers = containers_of(plan)
    where = {n.name: _split(n, containers) for n in plan.nodes}
    copies: dict[tuple[str, int], list] = {}
    for n in plan.nodes:
        _, c, k, _ = where[n.name]
        if c is not None:
            copies.setdefault((c, k), []).append(n)
    blocks = _blocks(plan, copies, where)
    block_of = {(b.container, k): b for b in blocks for k in b.layers}
    groups: dict[str, Group] = {}
    key_of: dict[str, str] = {}
    folded_away: set[str] = set()
    members: dict[str, list[int]] = {}
    index = {n.name: i for i, n in enumerate(plan.nodes)}
    for n in plan.nodes:
        m, c, k, rel = where[n.name]
        b = block_of.get((c, k))
        key = f"{b.key}/{rel}" if b else m
        key_of[n.name] = key
        g = groups.setdefault(key, Group(key, rel if b else m, b))
        members.setdefault(key, []).append(index[n.name])
        if b is None or k == b.layers[0]:
            g.nodes.append(n)
        else:
            folded_away.add(n.name)
    for key, g in groups.items():
        # where its costliest forward op runs, not its first: the loss's label shift runs at the
        # very start, its log_softmax at the end
        fwd = [n for n in g.nodes if n.phase == "fwd"]
        g.rank = index[max(fwd, key=lambda n: (n.compute, -index[n.name])).name] if fwd else min(members[key])
    for name, placements in plan.storage.items():
        mod, _, leaf = name.rpartition(".")
        hit = next((g for g in groups.values() if _full(g) == (mod or ROOT)), None)
        if hit is not None:
            hit.params[leaf] = placements
    graph, between = _edges(plan, groups, key_of, where)
    for g in groups.values():
        g.own = aggregate(plan, [{**c, "phase": n.phase} for n in g.nodes for c in n.comm
                                 if key_of.get(c.get("src"), g.key) == g.key])
    return Folded(graph, groups, blocks, between, folded_away)


def _full(g: Group) -> str:
    if g.block is None:
        return g.module
    rel = "" if g.module == "(block)" else "." + g.module
    return f"{g.block.container}.{g.block.layers[0]}{rel}"


def _blocks(plan, copies: dict, where: dict) -> list[Block]:
    """Copies of one container with the same decisions (and parameter storage) form a block.
    A copy's decisions are those of the planner's copy of the same index (``layer``), which it
    made equal across copies. Two copies fold when one's decisions are all among the other's:
    the planner also puts in the first copies nodes built once for all (a rotary table, a
    mask), which are no difference of plan; a decision that differs is missing from both."""
    by_layer: dict[int, list] = {}
    for n in plan.nodes:
        if n.layer is not None:
            by_layer.setdefault(n.layer, []).append(n)
    blocks: list[tuple[Block, tuple, Counter]] = []
    for (c, k) in sorted(copies):
        prefix = f"{c}.{k}."
        storage = tuple(sorted((p[len(prefix):], v) for p, v in plan.storage.items() if p.startswith(prefix)))
        decided = Counter((n.op, n.strategy, n.recompute) for n in by_layer[k]) if k in by_layer else \
            Counter((where[n.name][3], n.op, n.strategy, n.recompute) for n in copies[(c, k)])
        for b, st, sig in blocks:
            if b.container == c and st == storage and (not decided - sig or not sig - decided):
                b.layers.append(k)
                break
        else:
            blocks.append((Block(c, [k]), storage, decided))
    return sorted((b for b, _, _ in blocks), key=lambda b: (b.container, b.layers[0]))


def _edges(plan, groups, key_of, where) -> tuple[nx.DiGraph, dict[str, list[dict]]]:
    g = nx.DiGraph()
    g.add_nodes_from(groups)
    between: dict[str, list[dict]] = {}
    by_name = {n.name: n for n in plan.nodes}
    pairs = dict.fromkeys(tuple(e) for e in plan.edges)   # in the plan's order: a set's would vary by hash seed
    comm: dict[tuple[str, str], list[dict]] = {}
    for n in plan.nodes:
        for c in n.comm:
            src = c.get("src")
            if src in key_of:
                pairs.setdefault((src, n.name))
                comm.setdefault((src, n.name), []).append(c)
    for a, b in pairs:
        if a not in key_of or b not in key_of:
            continue
        ga, gb = groups[key_of[a]], groups[key_of[b]]
        cs = [{**c, "phase": by_name[b].phase} for c in comm.get((a, b), [])]
        if ga is gb:
            continue                 # inside one module: see _own
        if ga.block is not None and ga.block is gb.block and where[a][2] != where[b][2]:
            between.setdefault(ga.block.key, []).extend(cs)   # copy k -> copy k+1
            continue
        inner = ga.block is not None and ga.block is gb.block
        if inner and where[b][2] != ga.block.layers[0]:
            cs = []                                           # counted once, in the representative copy
        u, v = (ga.key, gb.key) if ga.rank <= gb.rank else (gb.key, ga.key)
        if not g.has_edge(u, v):
            g.add_edge(u, v, comm=[])
        g.edges[u, v]["comm"].extend(cs)
    for u, v, d in g.edges(data=True):
        d["rows"] = aggregate(plan, d.pop("comm"))
    return g, {k: aggregate(plan, cs) for k, cs in between.items()}


def aggregate(plan, comms: list[dict]) -> list[str]:
    """One line per (phase, kind, mesh dim): count, bytes and time summed, largest time first."""
    acc: dict[tuple, list[float]] = {}
    for c in comms:
        if c.get("time", 0) <= 0:
            continue
        k = (c.get("phase", ""), c["kind"], int(c["mesh_dim"]))
        row = acc.setdefault(k, [0, 0.0, 0.0])
        row[0] += 1
        row[1] += c["bytes"]
        row[2] += c["time"]
    out = []
    for (ph, kind, d), (count, nbytes, t) in sorted(acc.items(), key=lambda kv: -kv[1][2]):
        times = f"{count}x " if count > 1 else ""
        out.append(f"{ph} {times}{kind} {plan.mesh_dim_names[d]} {fmt_bytes(nbytes)} {fmt_time(t)}".strip())
    return out


def out_placements(plan, g: Group) -> list[str]:
    """Per mesh dim, the output placement of the group's costliest forward node (its matmul)."""
    fwd = [n for n in g.nodes if n.phase == "fwd"] or g.nodes
    if not fwd:
        return []
    main = max(fwd, key=lambda n: n.compute)
    parsed = parse_strategy(main.strategy, len(plan.mesh_shape))
    return parsed[1][0] if parsed and parsed[1] else []


def group_lines(plan, g: Group) -> tuple[str, str]:
    """Op counts and time per phase; the main op and how many nodes are recomputed."""
    parts = []
    for ph in ("fwd", "bwd"):
        ns = [n for n in g.nodes if n.phase == ph]
        if ns:
            parts.append(f"{ph} {len(ns)}: {fmt_time(sum(n.compute for n in ns))}")
    fwd = [n for n in g.nodes if n.phase == "fwd"] or g.nodes
    main = short_op(max(fwd, key=lambda n: n.compute).op)[:22] if fwd else ""
    rc = sum(n.recompute for n in g.nodes)
    return " · ".join(parts), main + (f" · {rc} recomputed" if rc else "")


# ---------------------------------------------------------------------- placement badges
_SHARD = ["#9ecae1", "#a1d99b", "#bcbddc", "#fdd0a2", "#c7e9c0", "#dadaeb"]


def badge_colour(p: str) -> str:
    """One colour per placement kind on a dim: grey replicated, orange partial, a hue per shard dim."""
    if p == "R":
        return "#e0e0e0"
    if p.startswith("P"):
        return "#f4a582"
    hit = re.match(r"S\((\d+)\)", p)
    return _SHARD[int(hit.group(1)) % len(_SHARD)] if hit else "#ffffff"


def legend_entries(plan, folded: Folded) -> list[tuple[str, list[str]]]:
    """Per mesh dim ("dp (4)"), the placements the drawing uses on it."""
    seen: list[dict[str, None]] = [dict() for _ in plan.mesh_shape]
    for g in folded.groups.values():
        for d, p in enumerate(out_placements(plan, g)):
            seen[d][p] = None
        for v in g.params.values():
            parsed = parse_strategy(f"->{v}", len(plan.mesh_shape))
            for d, p in enumerate(parsed[1][0] if parsed else []):
                seen[d][p] = None
    return [(f"{n} ({s})", sorted(ps)) for n, s, ps in zip(plan.mesh_dim_names, plan.mesh_shape, seen)]


def storage_badges(plan, placements: str) -> list[str]:
    parsed = parse_strategy(f"->{placements}", len(plan.mesh_shape))
    return parsed[1][0] if parsed else [placements]


# ---------------------------------------------------------------------- DOT
def _q(s: str) -> str:
    return '"' + str(s).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _h(s: str) -> str:
    return str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def _dot_label(plan, g: Group) -> str:
    dims = plan.mesh_dim_names
    cells = "".join(f'<TD BGCOLOR="{badge_colour(p)}">{_h(n)}:{_h(p)}</TD>'
                    for n, p in zip(dims, out_placements(plan, g)))
    rows = [f'<TR><TD COLSPAN="{max(1, len(dims))}"><B>{_h(g.module)}</B></TD></TR>']
    if cells:
        rows.append(f"<TR>{cells}</TR>")
    for leaf, v in list(g.params.items())[:4]:
        ps = storage_badges(plan, v)
        at_rest = " ".join(f"{n}:{p}" for n, p in zip(dims, ps))
        rows.append(f'<TR><TD COLSPAN="{max(1, len(dims))}">{_h(leaf)} {_h(at_rest)}</TD></TR>')
    ops, main = group_lines(plan, g)
    rows.append(f'<TR><TD COLSPAN="{max(1, len(dims))}"><FONT POINT-SIZE="8">{_h(main)} · {_h(ops)}</FONT></TD></TR>')
    return '<<TABLE BORDER="0" CELLBORDER="1" CELLSPACING="0">' + "".join(rows) + "</TABLE>>"


def module_dot(plan, folded: Folded | None = None) -> str:
    """The folded module graph as DOT: a cluster per block, edges labelled with their collectives."""
    f = folded or fold(plan)
    from autoshard.report.text import header_lines

    out = ["digraph plan {",
           f"  graph [rankdir=TB, fontname=Helvetica, fontsize=11, labelloc=t, "
           f"label={_q(' / '.join(header_lines(plan)[:2]))}, nodesep=0.3, ranksep=0.5];",
           "  node [shape=plain, fontname=Helvetica, fontsize=9];",
           "  edge [fontname=Helvetica, fontsize=8, color=\"#888888\"];"]
    for b in f.blocks:
        note = "\\n".join(["between copies:"] + f.between.get(b.key, [])) if f.between.get(b.key) else ""
        out.append(f"  subgraph {_q('cluster_' + b.key)} {{ label={_q(b.title + (chr(10) + note if note else ''))}; "
                   f"style=rounded; color=\"#555555\";")
        out += [f"    {_q(k)} [label={_dot_label(plan, g)}];" for k, g in f.groups.items() if g.block is b]
        out.append("  }")
    out += [f"  {_q(k)} [label={_dot_label(plan, g)}];" for k, g in f.groups.items() if g.block is None]
    for u, v, d in f.graph.edges(data=True):
        rows = d["rows"]
        attrs = (f" [label={_q(chr(10).join(rows))}, color=\"#d62728\", fontcolor=\"#d62728\", penwidth=2]"
                 if rows else "")
        out.append(f"  {_q(u)} -> {_q(v)}{attrs};")
    out.append("}")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------- SVG
_BW, _BH, _GX, _GY, _PER_ROW = 240, 86, 18, 46, 5


def _rows(f: Folded) -> list[list[str]]:
    """Topological generations in forward order, split where a block starts or ends (so a
    block's frame holds only its own boxes) and wrapped at a width that fits a laptop screen."""
    rank = lambda k: f.groups[k].rank  # noqa: E731
    rows = []
    for gen in nx.topological_generations(f.graph):
        gen = sorted(gen, key=rank)
        for blk in dict.fromkeys(f.groups[k].block.key if f.groups[k].block else "" for k in gen):
            part = [k for k in gen if (f.groups[k].block.key if f.groups[k].block else "") == blk]
            rows += [part[i:i + _PER_ROW] for i in range(0, len(part), _PER_ROW)]
    return sorted(rows, key=lambda r: min(rank(k) for k in r))


def _box(plan, g: Group, x: float, y: float) -> str:
    from html import escape as e

    dims = plan.mesh_dim_names
    out = [f'<g class="module"><title>{e(_full(g))}: {len(g.nodes)} ATen nodes'
           + "".join(f"\n{e(r)}" for r in g.own) + "</title>"
           f'<rect x="{x}" y="{y}" width="{_BW}" height="{_BH}" rx="5" fill="#fff" stroke="#555"/>'
           f'<text x="{x + 6}" y="{y + 14}" class="mname">{e(g.module[:34])}</text>']
    bx = x + 6
    for n, p in zip(dims, out_placements(plan, g)):
        w = 7 * len(f"{n}:{p}") + 6
        out.append(f'<rect class="badge" x="{bx}" y="{y + 20}" width="{w}" height="14" rx="3" '
                   f'fill="{badge_colour(p)}"/>'
                   f'<text x="{bx + 3}" y="{y + 31}" class="badge">{e(n)}:{e(p)}</text>')
        bx += w + 4
    ops, main = group_lines(plan, g)
    params = ", ".join(f"{k} " + "/".join(storage_badges(plan, v)) for k, v in list(g.params.items())[:3])
    out.append(f'<text x="{x + 6}" y="{y + 47}" class="mop">{e(params[:38])}</text>'
               f'<text x="{x + 6}" y="{y + 59}" class="mop">{e(main[:38])}</text>'
               f'<text x="{x + 6}" y="{y + 71}" class="mop">{e(ops[:38])}</text>')
    if g.own:
        out.append(f'<text x="{x + 6}" y="{y + 82}" class="mcomm">{e(g.own[0][:40])}'
                   f'{" +" + str(len(g.own) - 1) if len(g.own) > 1 else ""}</text>')
    out.append("</g>")
    return "".join(out)


def module_svg(plan, folded: Folded | None = None) -> str:
    from html import escape as e

    f = folded or fold(plan)
    rows = _rows(f)
    pos, y, pad = {}, 0.0, 28.0
    prev_blk = None
    for row in rows:
        blk = f.groups[row[0]].block
        if blk is not prev_blk:
            y += pad if blk is not None or prev_blk is not None else 0
        for i, k in enumerate(row):
            pos[k] = (20 + i * (_BW + _GX) + (16 if blk else 0), y)
        y += _BH + _GY
        prev_blk = blk
    width = 40 + _PER_ROW * (_BW + _GX) + 32
    height = y + 20
    out = [f'<svg id="module-graph" class="graph" width="{width}" height="{height:.0f}" viewBox="0 0 {width} '
           f'{height:.0f}" role="img" aria-label="module graph">',
           '<defs><marker id="marrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="6" markerHeight="6" '
           'orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" fill="#888"/></marker></defs>']
    for b in f.blocks:
        members = [pos[k] for k, g in f.groups.items() if g.block is b and k in pos]
        if not members:
            continue
        top, bot = min(p[1] for p in members), max(p[1] for p in members)
        note = "; ".join(f.between.get(b.key, []))
        out.append(f'<g class="block"><rect x="10" y="{top - 24:.0f}" width="{width - 20}" '
                   f'height="{bot - top + _BH + 34:.0f}" rx="8" fill="#f3f6fb" stroke="#4a6fa5" stroke-width="1.5"/>'
                   f'<text x="20" y="{top - 8:.0f}" class="btitle">{e(b.title)}</text>'
                   f'<text x="{width - 20}" y="{top - 8:.0f}" text-anchor="end" class="mcomm">'
                   f'{e(("between copies: " + note)[:110]) if note else ""}</text></g>')
    labels = []
    # block titles, as (centre x, y, width, height) in the labels' frame, for labels to avoid
    placed = [(20 + 3.5 * len(b.title), min(pos[k][1] for k, g in f.groups.items() if g.block is b) - 12,
               7 * len(b.title) + 8, 18) for b in f.blocks if any(g.block is b for g in f.groups.values())]
    for u, v, d in f.graph.edges(data=True):
        (x1, y1), (x2, y2) = pos[u], pos[v]
        x1, y1, x2, y2 = x1 + _BW / 2, y1 + _BH, x2 + _BW / 2, y2
        bow = 0 if y2 - y1 <= _GY + 40 else 60 + min(200, (y2 - y1) / 20)
        path = (f"M {x1:.0f} {y1:.0f} L {x2:.0f} {y2:.0f}" if not bow else
                f"M {x1:.0f} {y1:.0f} C {x1 + bow:.0f} {y1 + 60:.0f}, {x2 + bow:.0f} {y2 - 60:.0f}, {x2:.0f} {y2:.0f}")
        rows_ = d["rows"]
        colour = "#d62728" if rows_ else "#aaa"
        out.append(f'<path d="{path}" fill="none" stroke="{colour}" stroke-width="{2 if rows_ else 1}" '
                   f'stroke-opacity="{0.9 if rows_ else 0.5}" marker-end="url(#marrow)"/>')
        if rows_:
            shown = rows_[:2] + ([f"+{len(rows_) - 2} more"] if len(rows_) > 2 else [])
            w, h = max(len(r) for r in shown) * 6 + 8, 12 * len(shown) + 4
            # in the gap just above the arrow's head, so each label reads as its target's input
            # and covers no box; moved sideways off the labels already placed there
            ly = y2 + 4 - h
            for k in range(40):
                lx = x2 + 0.2 * (x1 - x2) + (w / 4 + 4) * ((k + 1) // 2) * (1 if k % 2 else -1)
                lx = min(max(lx, w / 2 + 2), width - w / 2 - 2)
                if not any(abs(lx - ox) < (w + ow) / 2 + 2 and abs(ly - oy) < (h + oh) / 2
                           for ox, oy, ow, oh in placed):
                    break
            placed.append((lx, ly, w, h))
            labels.append(f'<g class="elabel"><title>{e(chr(10).join(rows_))}</title><rect x="{lx - w / 2:.0f}" '
                          f'y="{ly - 8:.0f}" width="{w}" height="{h}" fill="#fff" '
                          f'stroke="#d62728" rx="3"/>' + "".join(
                              f'<text x="{lx - w / 2 + 4:.0f}" y="{ly + 3 + 12 * i:.0f}" class="ecomm">{e(r)}</text>'
                              for i, r in enumerate(shown)) + "</g>")
    out += [_box(plan, f.groups[k], *pos[k]) for k in pos]
    out += labels
    out.append("</svg>")
    return "\n".join(out)


def legend_html(plan, folded: Folded) -> str:
    from html import escape as e

    parts = []
    for dim, ps in legend_entries(plan, folded):
        badges = "".join(f'<span class="badge" style="background:{badge_colour(p)}">{e(p)}</span>' for p in ps)
        parts.append(f"<span class=\"ldim\">{e(dim)}: {badges}</span>")
    return ("<p>Each box is a module, forward and backward together; a framed block is one copy standing for "
            "the N identical ones named in its title, and copies whose decisions differ get their own frame. "
            "Badges give each mesh dim's placement of the module's main output (R replicated, S(k) sharded on "
            "tensor dim k, P partial sum), then parameters at rest. Red edges carry collectives (phase, kind, "
            "mesh dim, bytes, time; hover for all).</p><p>" + " ".join(parts) + "</p>")
