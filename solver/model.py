"""model: a MIP as plain arrays, and its hand-over to a solver backend.

pywraplp's expression objects cost ~10 us a term (3.5 s of an 8-layer Llama's 6 s solve), so the
ILP is built as arrays of bounds, costs and rows, and handed to HiGHS as MathOpt's proto or to the
other backends through pywraplp in one pass (solver/solve.py).
"""

from __future__ import annotations

import math

from ortools.linear_solver import pywraplp
from ortools.math_opt import model_pb2

from autoshard.errors import SolverError

INF = math.inf
# The units of the model's coefficients: times in microseconds and bytes in MiB keep both near
# one scale (to_mathopt scales each row further)
US = 1e6  # seconds -> microseconds
MB = 2**20  # bytes -> MiB


class Model:
    """A MIP as arrays: variables are indices, a row is ``lower <= sum_i a_i v_i <= upper`` with
    its terms given as [(variable, coefficient)] (repeats add up), and the objective (minimized)
    is one cost per variable."""

    def __init__(self):
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.integer: list[bool] = []
        self.cost: list[float] = []
        self.rows: list[tuple[float, float, dict[int, float]]] = []

    def var(self, lower: float = 0.0, upper: float = INF, integer: bool = False) -> int:
        self.lower.append(lower)
        self.upper.append(upper)
        self.integer.append(integer)
        self.cost.append(0.0)
        return len(self.cost) - 1

    def binary(self) -> int:
        return self.var(0.0, 1.0, True)

    def add(self, terms, lower: float = -INF, upper: float = INF) -> None:
        coef: dict[int, float] = {}
        for v, a in terms:
            coef[v] = coef.get(v, 0.0) + a
        self.rows.append((lower, upper, coef))

    def to_mathopt(self, objective_scale: float = 1.0) -> model_pb2.ModelProto:
        """MathOpt's proto (ids are indices), each row divided by :func:`_row_scale` and the
        objective multiplied by ``objective_scale``. The rows mix megabytes and microseconds
        (coefficients 8e-6 to 3e7 on a 32-layer Llama, which HiGHS warns of); scaled so, that
        model solved in 27 s instead of 34 s to the same optimum, and in 21-29 s instead of
        32-67 s over four seeds (variable values are unchanged)."""
        m = model_pb2.ModelProto()
        m.variables.ids.extend(range(len(self.cost)))
        m.variables.lower_bounds.extend(self.lower)
        m.variables.upper_bounds.extend(self.upper)
        m.variables.integers.extend(self.integer)
        coef = [(i, c) for i, c in enumerate(self.cost) if c]
        m.objective.linear_coefficients.ids.extend([i for i, _ in coef])
        m.objective.linear_coefficients.values.extend([c * objective_scale for _, c in coef])
        scale = [_row_scale(coef.values()) for _, _, coef in self.rows]
        m.linear_constraints.ids.extend(range(len(self.rows)))
        m.linear_constraints.lower_bounds.extend([lo * f for (lo, _, _), f in zip(self.rows, scale)])
        m.linear_constraints.upper_bounds.extend([up * f for (_, up, _), f in zip(self.rows, scale)])
        row_ids, col_ids, vals = [], [], []
        for k, ((_, _, coef), f) in enumerate(zip(self.rows, scale)):
            entries = sorted(coef.items())   # MathOpt wants row-major order
            row_ids.extend([k] * len(entries))
            col_ids.extend([j for j, _ in entries])
            vals.extend([a * f for _, a in entries])
        matrix = m.linear_constraint_matrix
        matrix.row_ids.extend(row_ids)
        matrix.column_ids.extend(col_ids)
        matrix.coefficients.extend(vals)
        return m

    def to_pywraplp(self, backend: str) -> tuple[pywraplp.Solver, list]:
        solver = pywraplp.Solver.CreateSolver(backend)
        if solver is None:
            raise SolverError(f"OR-Tools backend {backend!r} is not available in this build")
        xs = [solver.IntVar(lo, up, "") if integer else solver.NumVar(lo, up, "")
              for lo, up, integer in zip(self.lower, self.upper, self.integer)]
        for lo, up, coef in self.rows:
            row = solver.Constraint(lo, up)
            for i, a in coef.items():
                row.SetCoefficient(xs[i], a)
        objective = solver.Objective()
        for i, c in enumerate(self.cost):
            if c:
                objective.SetCoefficient(xs[i], c)
        objective.SetMinimization()
        return solver, xs


def _row_scale(coefficients, smallest: float = 1e-8) -> float:
    """The power of two that brings a row's largest |coefficient| into [1, 2), exact in floating
    point, but none that takes its smallest below ``smallest`` (HiGHS drops |a| <= 1e-9)."""
    mags = [abs(a) for a in coefficients if a]
    if not mags:
        return 1.0
    f = 2.0 ** -math.floor(math.log2(max(mags)))
    return max(f, min(2.0 ** math.ceil(math.log2(smallest / min(mags))), 1.0))
