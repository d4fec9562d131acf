"""The placement notation, written and read in one place.

A placement on one mesh dim is ``R`` (replicated), ``S(d)`` (sharded on tensor dim ``d``), ``P``
(a pending sum) or ``P(op)`` (a pending ``op``: ``max``, ``min``, ``avg``, ``product``, ...). A
tensor's placements on an N-D mesh are written ``(S(0),R)``, one per mesh dim; a strategy is its
inputs' and its outputs' placements, ``(S(0),R),(R,S(1))->(S(0),S(1))``, ``-`` standing for an
input or output that is not a tensor.

>>> from torch.distributed.tensor import Partial, Replicate, Shard
>>> placements_str((Shard(0), Partial("max")))
'(S(0),P(max))'
>>> parse_placements("(S(0),P(max))", 2) == (Shard(0), Partial("max"))
True
"""

from __future__ import annotations

import re

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

_ONE = re.compile(r"^(R|S\((\d+)\)|P(?:\((\w+)\))?)$")


def placement_str(p: Placement) -> str:
    """One mesh dim's placement: "R", "S(d)", "P" or "P(op)"; another kind (a strided shard)
    by its repr, which :func:`parse_placement` does not read."""
    if isinstance(p, Replicate):
        return "R"
    if type(p) is Shard:
        return f"S({p.dim})"
    if isinstance(p, Partial):
        return "P" if p.reduce_op == "sum" else f"P({p.reduce_op})"
    return repr(p)


def placements_str(ps) -> str:
    """A tensor's placements, one per mesh dim: "(S(0),R)"; "-" for None (not a tensor)."""
    return "-" if ps is None else "(" + ",".join(placement_str(p) for p in ps) + ")"


def parse_placement(text) -> Placement:
    """The inverse of :func:`placement_str`; a DTensor placement is returned as it is."""
    if isinstance(text, (Replicate, Shard, Partial)):
        return text
    m = _ONE.match(str(text).replace(" ", ""))
    if not m:
        raise ValueError(f"unknown placement {text!r}; use Replicate(), Shard(d), Partial() or 'R', 'S(d)', 'P', "
                         "'P(op)'")
    if m.group(1) == "R":
        return Replicate()
    if m.group(2) is not None:
        return Shard(int(m.group(2)))
    return Partial(m.group(3) or "sum")


def split_top(text: str) -> list[str]:
    """Split at the commas outside parentheses: "S(0),R" -> ["S(0)", "R"]."""
    return [p for p in re.split(r",(?![^(]*\))", text) if p]


def parse_placements(value, ndim: int) -> tuple[Placement, ...]:
    """Placements per mesh dim from DTensor placements or strings ("R", "S(0)", "P"); a single
    placement on a 1-D mesh may be given bare, and the "(S(0),R)" form is read back."""
    if isinstance(value, str) and value.startswith("(") and value.endswith(")"):
        value = split_top(value[1:-1])
    if not isinstance(value, (list, tuple)):
        value = [value]
    if len(value) != ndim:
        raise ValueError(f"{list(value)} gives {len(value)} placements for a {ndim}-D mesh; give one per mesh dim")
    return tuple(parse_placement(v) for v in value)
