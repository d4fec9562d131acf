"""overlap: the part of a block's parameter and gradient moves its compute does not hide
(formulation.py: Overlap), one formula for the ILP's rows and for pricing a plan:

    E_b >= sum_{hidden e in b} R_e  -  a * sum_{v in b} sum_s c[v,s] x[v,s],   E_b >= 0

The solver minimizes E_b, so at its plan E_b = :func:`exposed`; pricing (autoshard/planning/
pricing.py) evaluates :func:`exposed` at the chosen strategies rather than reading the solver's
E_b back, which carries the solver's tolerances and would move a plan's step time in its last
bits from one backend or scaling to another.
"""

from __future__ import annotations


def hidden(problem, e, q, p, mesh_shape) -> bool:
    """Whether edge ``e``'s move ``q -> p`` counts in its block's E_b instead of in full: a move
    that may hide (:meth:`~autoshard.solver.formulation.Edge.hides`) on a cluster that overlaps at all (a = 0: every move in
    full, with its latency)."""
    return problem.overlap > 0 and e.hides(q, p, mesh_shape, problem.micro_batches)


def hiding_nodes(problem) -> dict[object, list]:
    """Each block's nodes, whose compute may hide the block's moves: all but the storage
    decisions (the optimizer step runs after backward: it hides nothing)."""
    members: dict[object, list] = {}
    for v in problem.nodes:
        if v.op != "storage":
            members.setdefault(problem.block.get(v), []).append(v)
    return members


def hiding_compute(problem, nodes, strategies) -> list[tuple[object, int, float]]:
    """[(v, s, c[v,s])]: the compute, in seconds, of each of ``nodes`` under each of its
    ``strategies(v)`` that may hide the block's moves (free strategies leave no term)."""
    return [(v, s, problem.cost[v][s]) for v in nodes for s in strategies(v) if problem.cost[v][s] > 0]


def exposure_rows(m, problem, x, hidden_terms: dict[object, list], scale: float) -> None:
    """E_b (above) for each block with hidden moves, charged to the objective: ``hidden_terms``,
    block -> the [(var, cost)] of its hidden moves in the model's unit, ``scale`` model units per
    second (the compute's)."""
    members = hiding_nodes(problem)
    for b, terms in hidden_terms.items():
        compute = [(x[v, s], problem.overlap * c * scale)
                   for v, s, c in hiding_compute(problem, members.get(b, []), lambda v: problem.allowed[v])]
        exposed = m.var()
        m.cost[exposed] += 1.0
        m.add([(exposed, 1.0), *((var, -c) for var, c in terms), *compute], lower=0)


def exposed(problem, comm: float, nodes, choice: dict) -> float:
    """E_b at a plan: seconds of the block's hidden moves (``comm``, their sum) that the compute of
    its ``nodes`` (:func:`hiding_nodes`) under ``choice`` (node -> strategy index) leaves exposed."""
    compute = sum(c for _, _, c in hiding_compute(problem, nodes, lambda v: (choice[v],)))
    return max(0.0, comm - problem.overlap * compute)
