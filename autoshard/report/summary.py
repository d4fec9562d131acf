"""The terminal summary of a plan: its header, then the plan by module (the HTML's module graph as
a table: repeated layers folded "x N", each module's placement per mesh dim, its parameters at
rest, forward and backward time and its collectives), the ATen nodes, storage and memory."""

from __future__ import annotations

from autoshard.report.format import export, recording_console, shown_comm
from autoshard.report.modules import Folded, aggregate, fold, group_lines, out_placements, storage_badges
from autoshard.report.text import (PY_HINTS, gaps_table, header_lines, memory_table, node_groups, nodes_table,
                                   storage_table)


def modules_table(plan, folded: Folded, max_rows: int | None = None):
    """One row per module, in the order the forward runs them; a folded block's modules under its
    title ("h.0-11 x 12"), standing for each of its copies."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="plan by module (forward and backward; a block x N stands for each of its N copies)",
                  title_justify="left")
    for col in ["module", *(f"{n}({s})" for n, s in zip(plan.mesh_dim_names, plan.mesh_shape)),
                "parameters at rest", "fwd · bwd", "collectives"]:
        table.add_column(col, overflow="fold")
    groups = sorted(folded.groups.values(), key=lambda g: g.rank)
    shown = groups if max_rows is None else groups[:max_rows]
    block = None
    for g in shown:
        if g.block is not block:
            table.add_section()
            block = g.block
            if block is not None:
                table.add_row(f"[bold]{escape(block.title)}[/bold]", *[""] * (len(plan.mesh_shape) + 3))
        out = out_placements(plan, g) or [""] * len(plan.mesh_shape)
        at_rest = ", ".join(f"{leaf} {'/'.join(storage_badges(plan, pl))}" for leaf, pl in g.params.items())
        times, _ = group_lines(plan, g)
        comm = aggregate(plan, [{**c, "phase": n.phase} for n in g.nodes for c in shown_comm(plan, n)])
        table.add_row(escape(("  " if g.block else "") + g.module), *out, escape(at_rest), escape(times),
                      escape("; ".join(comm[:2]) + (f" (+{len(comm) - 2})" if len(comm) > 2 else "")))
    if len(shown) < len(groups):
        table.caption = f"{len(groups) - len(shown)} more modules not shown"
    return table


def summary_text(plan, max_rows: int | None = 40, width: int = 160, hints: dict | None = None) -> str:
    """Header, module table, node table, storage and memory tables. ``max_rows`` None shows every
    node of every layer; otherwise alike layers fold into one group and the costliest rows are kept."""
    from rich.markup import escape

    hints = hints or PY_HINTS
    console = recording_console(width)
    for line in header_lines(plan):
        console.print(escape(line))
    console.print(modules_table(plan, fold(plan), max_rows))
    groups, hidden = node_groups(plan, max_rows, fold=max_rows is not None)
    console.print(nodes_table(plan, groups, max_rows))
    notes = []
    if hidden:
        notes.append(f"{hidden} cheaper nodes not shown ({hints['all']} shows all)")
    if any(len(g.layers) > 1 for g in groups):
        notes.append("in a group of layers 'x N', each row is the first layer's node and stands for its copy in "
                     "every layer; compute and communication on the group's line are for all N")
    noop = sum(len(n.comm) - len(shown_comm(plan, n)) for g in groups for n in g.nodes)
    if noop:
        notes.append(f"{noop} collectives over one-rank mesh dims (no data moves) not shown")
    notes.append("rc: R = recomputed in backward instead of saved")
    console.print(escape("; ".join(notes)))
    console.print(storage_table(plan, max_rows, hints))
    console.print(memory_table(plan))
    if plan.fallbacks:
        console.print(escape("replicated for lack of a rule: " + "; ".join(f"{n} ({r})" for n, r in plan.fallbacks)))
    if plan.gaps:
        console.print(gaps_table(plan))
    return export(console)


