"""Which module made each node of the joint graph, named by its path (``blocks.3.attn.c_proj``).

The trace does not keep ``nn_module_stack``, so names are inferred from the parameters, whose
FQNs the trace does keep: a node that reads a parameter (through views and casts) belongs to
that parameter's module; any other forward node to the deepest module common to the nearest
parameter readers before and after it (attention's softmax between ``c_attn`` and ``c_proj``
lands in ``attn``, a residual add in its block). A node in copy ``k`` of a repeated block whose
name stops above the block (``blocks``) is put in ``blocks.k``. Backward nodes take the module
of the forward op they differentiate (the autograd ``seq_nr`` both carry).
"""

from __future__ import annotations

import re

from torch import fx

from autoshard.passes.annotate import META_KEY as COST_KEY

INPUTS, OUTPUT = "(inputs)", "(loss)"
# ops that only reshape or pick from their input: they stay with the module that produced it
# (a matmul's input view belongs to the norm before it, not to the block around both)
_VIEWS = {"getitem", "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "detach",
          "alias", "clone", "split", "unsqueeze", "squeeze", "slice", "select", "_to_copy", "contiguous"}


def _is_view(n: fx.Node) -> bool:
    name = getattr(n.target, "__name__", str(n.target)).split(".")[0]
    return n.op == "call_function" and name in _VIEWS


def _common(paths) -> str:
    parts = [p.split(".") if p else [] for p in paths]
    out = []
    for level in zip(*parts):
        if any(x != level[0] for x in level):
            break
        out.append(level[0])
    return ".".join(out)


def _nearest(order: list[fx.Node], direct: dict, step) -> dict[fx.Node, set[str]]:
    """The modules of the parameter readers nearest to each node along ``step`` (its inputs or
    users), by hop count; a reader is its own nearest."""
    best: dict[fx.Node, tuple[int, set[str]]] = {}
    for n in order:
        if n in direct:
            best[n] = (0, {direct[n]})
            continue
        near = [best[m] for m in step(n) if m in best]
        if near:
            d = min(x[0] for x in near)
            best[n] = (d + 1, set().union(*(s for k, s in near if k == d)))
    return {n: s for n, (_, s) in best.items()}


def module_names(traced, layer_of: dict[fx.Node, int] | None = None) -> dict[str, str]:
    """Node name -> module path ("" for the root); parameters map to their own FQN's module."""
    layer_of = layer_of or {}
    phase = {n: n.meta[COST_KEY].phase if COST_KEY in n.meta else "input" for n in traced.gm.graph.nodes}
    carry = {node: name.rpartition(".")[0] for name, node in traced.params}
    fwd = [n for n in traced.gm.graph.nodes if phase[n] == "fwd"]
    direct: dict[fx.Node, str] = {}
    for n in fwd:   # a view chain of one parameter carries it; an op reading parameters is their module's
        ins = [a for a in n.all_input_nodes]
        owned = [carry[a] for a in ins if a in carry]
        if owned and len(ins) == 1:
            carry[n] = owned[0]
        if owned:
            direct[n] = _common(owned)
    fwd_set = set(fwd)
    up = _nearest(fwd, direct, lambda n: [a for a in n.all_input_nodes if a in fwd_set])
    down = _nearest(fwd[::-1], direct, lambda n: [u for u in n.users if u in fwd_set])
    out_node = next(n for n in traced.gm.graph.nodes if n.op == "output")
    tail = _feeds_output(fwd, down, out_node)
    containers = _containers([name for name, _ in traced.params])
    names: dict[str, str] = {node.name: name.rpartition(".")[0] for name, node in traced.params}
    by_seq: dict[str, str] = {}
    for n in fwd:
        m = _common(up.get(n, set()) | down.get(n, set())) if n in up or n in down else ""
        if _is_view(n) and len(up.get(n, ())) == 1:
            m = next(iter(up[n]))
        if n in tail:
            m = OUTPUT         # after the last parameter: the loss and what feeds the outputs
        names[n.name] = _in_copy(m, up.get(n, set()), containers, None)
        by_seq.setdefault(n.meta.get("seq_nr"), names[n.name])
    for n in traced.gm.graph.nodes:
        if n.name in names:
            continue
        if phase[n] == "input":
            names[n.name] = INPUTS
            continue
        m = by_seq.get(n.meta.get("seq_nr")) if n.meta.get("seq_nr") is not None else None
        ins = [names[a.name] for a in n.all_input_nodes if names.get(a.name, INPUTS) != INPUTS]
        if ins and (m is None or str(n.target) == "aten.add.Tensor"):
            m = _common(ins)   # autograd's own nodes (gradient sums): where the summed gradients are
        names[n.name] = _in_copy(m or "", set(ins), containers, layer_of.get(n))
    return names


def _feeds_output(fwd: list[fx.Node], down: dict, out_node: fx.Node) -> set[fx.Node]:
    """Forward nodes past the last parameter reader that lead to the graph's output (the loss),
    not those past it that only backward reads (saved activations keep their module)."""
    tail: set[fx.Node] = set()
    for n in reversed(fwd):
        if n not in down and any(u is out_node or u in tail for u in n.users):
            tail.add(n)
    return tail


def _containers(params: list[str]) -> list[str]:
    """Module paths whose children are numbered (``blocks`` of ``blocks.0.attn.c_attn.weight``)."""
    found = dict.fromkeys(m.group(1) for p in params for m in [re.match(r"(.*?)\.\d+\.", p)] if m)
    return list(found)


def _in_copy(m: str, near: set[str], containers: list[str], layer: int | None) -> str:
    """``m`` moved down into copy ``k`` of a repeated block when it stops at or above the block
    (a residual add is common to ``h.3.mlp`` and ``h.4.ln_1``): the copy its nearest parameter
    readers before it are all in, else the planner's layer for backward-only nodes. Nodes that
    feed several copies alike (rotary tables, masks) stay above the block."""
    for c in containers:
        if m in ("", c) or c.startswith(m + "."):
            copies = {hit.group(0) for p in near for hit in [re.match(rf"{re.escape(c)}\.\d+", p)] if hit}
            if len(copies) == 1:
                return copies.pop()
            if not near and layer is not None:
                return f"{c}.{layer}"
    return m
