"""solve: the ILP of formulation.py with OR-Tools (HiGHS through pywraplp), deterministically.

HiGHS is the default backend (on random Alpa-style problems it reached the optimum where CBC and
SCIP left gaps). Times enter the model in microseconds so coefficients stay well scaled; one
thread and a fixed seed make the same problem give the same answer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch.fx as fx
from ortools.linear_solver import pywraplp

from autoshard import costmodel
from autoshard.errors import InfeasibleError, SolverError
from autoshard.solver.formulation import Problem

US = 1e6  # seconds -> microseconds


@dataclass
class Solution:
    choice: dict[fx.Node, int]     # decision node -> strategy index
    objective: float               # seconds
    bound: float                   # seconds (best proven lower bound)
    status: str                    # "optimal" | "feasible"
    solve_time: float
    backend: str
    num_variables: int
    num_constraints: int

    @property
    def gap(self) -> float:
        return 0.0 if self.objective <= 0 else max(0.0, (self.objective - self.bound) / self.objective)


def _edge_cost(problem: Problem, e, x) -> tuple[list, list]:
    """Objective terms of one edge, plus the flow rows' variables to add (flow form)."""
    src = {}
    for s in problem.allowed[e.src]:
        src.setdefault(problem.src_placement(e, s), []).append(s)
    if e.dst is None:
        dst = {e.fixed: None}
    else:
        dst = {}
        for s in problem.allowed[e.dst]:
            dst.setdefault(e.dst_in[s], []).append(s)
    r = {(q, p): costmodel.resharding_time_cached(q, p, e.nbytes) for q in src for p in dst}
    if len(dst) == 1:
        (p,) = dst
        return [(x[e.src, s], r[q, p]) for q, ss in src.items() for s in ss], []
    if len(src) == 1:
        (q,) = src
        return [(x[e.dst, s], r[q, p]) for p, ss in dst.items() for s in ss], []
    return [], [(src, dst, r)]


def solve(problem: Problem, cluster, *, time_limit: float = 60.0, backend: str = "HIGHS") -> Solution:
    start = time.perf_counter()
    costmodel.set_resharding_cluster(cluster)
    solver = pywraplp.Solver.CreateSolver(backend)
    if solver is None:
        raise SolverError(f"OR-Tools backend {backend!r} is not available in this build")
    solver.SuppressOutput()
    solver.SetNumThreads(1)
    solver.SetTimeLimit(int(time_limit * 1000))
    objective = solver.Objective()

    # x[v,s]: node v takes strategy s; exactly one per node.
    x = {}
    for v in problem.nodes:
        allowed = problem.allowed[v]
        for s in allowed:
            x[v, s] = solver.BoolVar("") if len(allowed) > 1 else solver.NumVar(1, 1, "")
            objective.SetCoefficient(x[v, s], problem.cost[v][s] * US)
        if len(allowed) > 1:
            solver.Add(solver.Sum([x[v, s] for s in allowed]) == 1)

    # Edges: resharding cost, linear in x when one side has a single placement, else flow form.
    for e in problem.edges:
        terms, flows = _edge_cost(problem, e, x)
        for var, c in terms:
            objective.SetCoefficient(var, objective.GetCoefficient(var) + c * US)
        for src, dst, r in flows:
            y = {(q, p): solver.NumVar(0, 1, "") for q in src for p in dst}
            for (q, p), var in y.items():
                objective.SetCoefficient(var, r[q, p] * US)
            for q, ss in src.items():
                solver.Add(solver.Sum([y[q, p] for p in dst]) == solver.Sum([x[e.src, s] for s in ss]))
            for p, ss in dst.items():
                solver.Add(solver.Sum([y[q, p] for q in src]) == solver.Sum([x[e.dst, s] for s in ss]))

    objective.SetMinimization()
    status = solver.Solve()
    elapsed = time.perf_counter() - start
    if status == pywraplp.Solver.INFEASIBLE:
        raise InfeasibleError("no sharding satisfies the constraints (pinned placements conflict)")
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        raise SolverError(f"{backend} found no plan within {time_limit:.0f}s (status {status}); raise time_limit")
    choice = {}
    for v in problem.nodes:
        allowed = problem.allowed[v]
        choice[v] = max(allowed, key=lambda s: x[v, s].solution_value())
    return Solution(choice, objective.Value() / US, objective.BestBound() / US,
                    "optimal" if status == pywraplp.Solver.OPTIMAL else "feasible", elapsed, backend,
                    solver.NumVariables(), solver.NumConstraints())
