"""How a plan's values read in a report: byte and time units, op names, strategy strings cut per
mesh dim, placement colours, collectives, runs of layer indices, and the rich console the
terminal tables are printed to and read back from. Shared by the terminal tables (:mod:`.text`,
:mod:`.summary`), the module view (:mod:`.modules`) and the HTML report (:mod:`.html`), so a value
reads the same in each.

Colours are keyed by the output placement string through a hash, so "(S(0),R)" has the same
colour in every plan and every file; all-replicated outputs are grey.
"""

from __future__ import annotations

import hashlib
import re

from autoshard.notation import split_top

_PALETTE = ("#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69", "#fccde5",
            "#bc80bd", "#ccebc5", "#ffed6f", "#66c2a5", "#fc8d62", "#8da0cb", "#e78ac3", "#a6d854",
            "#ffd92f", "#e5c494", "#b3e2cd", "#f4cae4")
_REPLICATED = "#e0e0e0"
UNPLANNED_COLOUR, COMM_COLOUR = "#ffffff", "#d62728"   # a node the plan does not place; a collective


def fmt_bytes(b: float | None) -> str:
    if b is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(b) < 1024 or unit == "TiB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.2f} {unit}"
        b /= 1024
    return ""  # unreachable


def fmt_time(s: float | None) -> str:
    if s is None:
        return "-"
    if abs(s) < 1e-3:
        return f"{s * 1e6:.1f} us"
    return f"{s * 1e3:.3f} ms" if abs(s) < 1 else f"{s:.3f} s"


def short_op(op: str) -> str:
    """"aten.addmm.default" -> "addmm"; "aten.add.Tensor" -> "add.Tensor"."""
    parts = op.split(".")
    if len(parts) >= 2 and parts[0] in ("aten", "prims", "_c10d_functional"):
        return parts[1] if len(parts) == 2 or parts[2] == "default" else f"{parts[1]}.{parts[2]}"
    return op


def _groups(text: str) -> list[str]:
    """Top-level parenthesised groups: "(S(0),R),(R,R)" -> ["S(0),R", "R,R"]."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
            if depth == 1:
                start = i + 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                out.append(text[start:i])
    return out


def parse_strategy(strategy: str, ndim: int) -> tuple[list[list[str]], list[list[str]]] | None:
    """"(S(0),R),(R,R)->(S(0),R)" -> (inputs, outputs), each a list of per-mesh-dim placements;
    None when the string has another form."""
    if "->" not in strategy:
        return None
    lhs, rhs = strategy.split("->", 1)
    ins, outs = [split_top(g) for g in _groups(lhs)], [split_top(g) for g in _groups(rhs)]
    if any(len(p) != ndim for p in ins + outs):
        return None
    return ins, outs


def output_placement(strategy: str) -> str:
    """The first output's placements, "(S(0),R)", or "" when there is none."""
    groups = _groups(strategy.split("->", 1)[1]) if "->" in strategy else []
    return f"({groups[0]})" if groups else ""


def placement_colour(placement: str) -> str:
    if not placement:
        return UNPLANNED_COLOUR
    if all(p == "R" for p in split_top(placement.strip("()"))):
        return _REPLICATED
    return _PALETTE[int(hashlib.sha256(placement.encode()).hexdigest(), 16) % len(_PALETTE)]


def per_dim(plan, strategy: str) -> list[str]:
    """One "ins -> outs" cell per mesh dim, or the raw strategy in the first cell."""
    ndim = len(plan.mesh_shape)
    parsed = parse_strategy(strategy, ndim)
    if parsed is None:
        return [strategy] + [""] * (ndim - 1)
    ins, outs = parsed
    cells = [(_runs([p[d] for p in ins]) + " -> " + _runs([p[d] for p in outs])).strip() for d in range(ndim)]
    # how the op runs them (words after the placements): an MoE op expert-parallel over mesh dim
    # d ("ep1"), on that dim; attention's ("balanced ring") on the mesh dims that split the rows'
    # sequence (dim 2 of attention's row tensors), else the last
    variant = re.search(r"\)((?: [a-z]+\d*)+)$", strategy)
    if variant is None:
        return cells
    ep = re.fullmatch(r" ep(\d+)", variant.group(1))
    if ep is not None:
        return [f"{c} (ep)" if d == int(ep.group(1)) else c for d, c in enumerate(cells)]
    marked = [d for d in range(ndim) if ins and ins[0][d] == "S(2)"]
    return [f"{c} ({variant.group(1).strip()})" if d in (marked or [ndim - 1]) else c for d, c in enumerate(cells)]


def _runs(items: list[str]) -> str:
    """["S(0)", "S(0)", "S(0)", "R"] -> "3×S(0),R": runs of three or more are counted."""
    out, i = [], 0
    while i < len(items):
        j = i
        while j < len(items) and items[j] == items[i]:
            j += 1
        out += [f"{j - i}×{items[i]}"] if j - i >= 3 else items[i:j]
        i = j
    return ",".join(out)


def shown_comm(plan, node) -> list[dict]:
    """Collectives worth showing: those over a mesh dim of one rank move nothing."""
    return [c for c in node.comm if plan.mesh_shape[int(c["mesh_dim"])] > 1 or c["time"] > 0]


def comm_str(plan, c: dict) -> str:
    text = (f"{c['kind']} {plan.mesh_dim_names[int(c['mesh_dim'])]} {fmt_bytes(c['bytes'])} "
            f"{fmt_time(c['time'])}")
    hidden = c.get("exposed", c["time"]) < c["time"] * (1 - 1e-9)  # show only what overlap changed
    return text + (f" (exposed {fmt_time(c['exposed'])})" if hidden else "")


def shard_factor(plan, placements: str) -> int:
    f = 1
    for p, m in zip(split_top(placements.strip("()")), plan.mesh_shape):
        f *= m if p.startswith("S") else 1
    return f


def ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    out, start = [], None
    for i, k in enumerate(indices):
        if start is None:
            start = k
        if i + 1 == len(indices) or indices[i + 1] != k + 1:
            out.append(str(start) if start == k else f"{start}-{k}")
            start = None
    return ",".join(out)


def node_label(plan_or_names, name: str) -> str:
    """A node's name, with the parameter it holds where the plan knows it: "primals_3 (h.0.attn.weight)"."""
    names = plan_or_names if isinstance(plan_or_names, dict) else getattr(plan_or_names, "param_names", {}) or {}
    return f"{name} ({names[name]})" if name in names else name


# ---------------------------------------------------------------------- text (rich)
def recording_console(width: int):
    """A rich console that records what is printed, for :func:`export`, in plain text (no colour codes)."""
    import io

    from rich.console import Console

    return Console(width=width, record=True, file=io.StringIO(), color_system=None, force_terminal=False)


def export(console) -> str:
    """The recorded text without the spaces rich pads a title line with to the full width."""
    return "".join(line.rstrip() + "\n" for line in console.export_text().splitlines())
