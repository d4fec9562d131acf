"""solve: the ILP of formulation.py with OR-Tools, deterministically.

HiGHS is the default backend (on random Alpa-style problems it reached the optimum where CBC and
SCIP left gaps). The model is built as plain arrays (:class:`Model`: pywraplp's expression objects
cost ~10 us a term, 3.5 s of an 8-layer Llama's 6 s solve) and HiGHS runs under MathOpt on its
proto: pywraplp's HiGHS bridge (OR-Tools 9.15) drops the best plan found when the time limit stops
the search (status 99; or-tools issues 5016 and 5372), and ignores the gap and thread options.
Other backends (SCIP, CBC, ...) solve the same model through pywraplp. Times enter the model in
microseconds so coefficients stay well scaled; one thread and a fixed seed make the same problem
give the same answer. The memory rows are solver/memory_rows.py's, the overlap rows
solver/overlap.py's.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch.fx as fx
from ortools.linear_solver import pywraplp
from ortools.math_opt import model_parameters_pb2, model_pb2, result_pb2
from ortools.math_opt.core.python import solver as mathopt_core
from ortools.math_opt.python import mathopt
from ortools.math_opt.python.callback import CallbackRegistration
from ortools.math_opt.python.init_arguments import StreamableSolverInitArguments

from autoshard.cluster import costmodel
from autoshard.errors import CutoffError, InfeasibleError, SolverError
from autoshard.solver.formulation import Problem, slices_to
from autoshard.solver.memory import Breakdown, MemoryModel, predicted_memory
from autoshard.solver.memory_rows import MemoryRows, memory_rows
from autoshard.solver.model import MB, US, Model
from autoshard.solver.overlap import exposure_rows, hidden

# Microseconds per MiB of peak in the step-time objective: storage placements often tie in time
# (a weight sharded on either dim moves the same bytes) but not in memory (ResNet-50's golden plan
# held 5% more after such a tie flipped). 40 us on a 40 GB peak; taken off the reported objective.
PEAK_TIE_BREAK = 1e-3


@dataclass
class Solution:
    choice: dict[fx.Node, int]     # decision node -> strategy index
    recompute: set                 # forward nodes recomputed in backward
    memory: dict                   # the peak moment's predicted per-device bytes by part (memory.Breakdown)
    objective: float               # seconds
    bound: float                   # seconds (best proven lower bound)
    status: str                    # "optimal" | "feasible"
    solve_time: float
    backend: str
    num_variables: int
    num_constraints: int
    shared_nodes: tuple = ()       # (nodes, decision classes) when repeated layers were shared
    timeline: list = field(default_factory=list)   # (node, predicted live bytes) over the step

    @property
    def gap(self) -> float:
        return 0.0 if self.objective <= 0 else max(0.0, (self.objective - self.bound) / self.objective)


def _edge_cost(problem: Problem, e, x, price) -> tuple[list, list]:
    """Objective terms of one edge as [(x var, seconds, (source, destination placement))], or the
    flow form's (source groups, destination groups, cost matrix) to build, a group being
    (placements, the strategies that give or take them)."""
    src: dict = {}
    for s in problem.allowed[e.src]:
        src.setdefault(problem.src_placement(e, s), []).append(s)
    if e.dst is None:
        dst = {e.fixed: None}
    else:
        dst = {}
        for s in problem.allowed[e.dst]:
            dst.setdefault(e.dst_in[s], []).append(s)
    qs, ps = [(q, price.intern(q), ss) for q, ss in src.items()], [(p, price.intern(p), ss) for p, ss in dst.items()]
    r = [[price(e, q, p, qi, pi) for p, pi, _ in ps] for q, qi, _ in qs]
    if e.dst is e.src:  # a block's output feeding the same class in the next block: one choice
        row = {q: i for i, (q, _, _) in enumerate(qs)}
        col = {p: j for j, (p, _, _) in enumerate(ps)}
        pairs = [(s, problem.src_placement(e, s), e.dst_in[s]) for s in problem.allowed[e.src]]
        return [(x[e.src, s], r[row[q]][col[p]], (q, p)) for s, q, p in pairs], []
    if len(ps) == 1:
        (p, _, _), = ps
        return [(x[e.src, s], r[i][0], (q, p)) for i, (q, _, ss) in enumerate(qs) for s in ss], []
    if len(qs) == 1:
        (q, _, _), = qs
        return [(x[e.dst, s], r[0][j], (q, p)) for j, (p, _, ss) in enumerate(ps) for s in ss], []
    return [], [(qs, ps, r)]


class _Prices:
    """An edge's resharding time for a pair of placements, cached by their interned ids (with
    the bytes moved and whether bucketed): Placement hashes in Python, and keyed by the
    placements themselves, pricing an 8 x 8 mesh's edges hashed two million of them (a third of
    the model's build)."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.ids: dict = {}
        self.cache: dict = {}

    def intern(self, placements) -> int:
        return self.ids.setdefault(placements, len(self.ids))

    def __call__(self, e, q, p, qi: int, pi: int) -> float:
        nbytes, bucketed = e.moved_bytes(q, p), e.in_bucket(q, p, self.cluster.mesh_shape)
        key = (qi, pi, nbytes, bucketed)
        t = self.cache.get(key)
        if t is None:
            t = self.cache[key] = costmodel.resharding_time(self.cluster, q, p, nbytes, bucketed)
        return e.weight * t


def solve(problem: Problem, cluster, memory: MemoryModel | None = None, *, time_limit: float = 60.0,
          backend: str = "HIGHS", minimize: str = "time", mip_gap: float | None = None,
          cutoff: float | None = None) -> Solution:
    """``minimize="memory"`` finds the smallest feasible peak instead (for infeasibility reports).
    ``cutoff`` (seconds): raise CutoffError as soon as no plan can cost less (HiGHS prunes by it
    from the root on, so a problem that cannot win stops after a few bounds).
    The solve stops once the plan is proven within ``mip_gap`` (relative) of the optimum: by default
    0.1% of step time, far inside the cost model's own error (bench/fidelity.py), where proving the
    last 0.09% took a quarter of the solve on a 32-layer Llama; 0.01% of the peak for "memory", whose
    figure the infeasibility report quotes as the smallest cap that fits.

    The rows go in in this order (a plan depends on it: HiGHS's path follows the model's order):
    strategy choice, aligned edges, token-local ties, resharding, overlap exposure, memory."""
    if mip_gap is None:
        mip_gap = 1e-3 if minimize == "time" else 1e-4
    start = time.perf_counter()
    m = Model()
    x = _strategy_rows(m, problem)
    _aligned_rows(m, problem, x)
    _token_local_rows(m, problem, x)
    moves = _resharding_rows(m, problem, cluster, x)
    exposure_rows(m, problem, x, moves.hidden, US)
    mem = memory_rows(m, problem, memory, x, moves.held, moves.terms) if memory is not None else None
    limit = _objective(m, mem, minimize, cutoff, backend)
    status, value, found, bound = _run(m, problem, x, backend, time_limit, mip_gap, limit)
    elapsed = time.perf_counter() - start
    if minimize == "time" and mem is not None and value is not None:   # report the step alone
        tie = PEAK_TIE_BREAK * value(mem.peak)
        found, bound = found - tie, bound - tie
    _raise_unless_solved(status, found, limit, cutoff, backend, time_limit)
    choice = {v: max(problem.allowed[v], key=lambda s: value(x[v, s])) for v in problem.nodes}
    recompute, breakdown = set(), Breakdown({}, "")
    if mem is not None:
        recompute = {v for v, var in mem.r.items() if value(var) > 0.5}
        breakdown = predicted_memory(memory, choice, recompute)
    scale = US if minimize == "time" else 1 / MB
    return Solution(choice, recompute, breakdown, found / scale, bound / scale, status, elapsed, backend,
                    len(m.cost), len(m.rows))


def _strategy_rows(m: Model, problem: Problem) -> dict:
    # x[v,s]: node v takes strategy s; exactly one per node (sum_s x[v,s] = 1), each charged its
    # compute c[v,s]
    x = {}
    for v in problem.nodes:
        allowed = problem.allowed[v]
        for s in allowed:
            x[v, s] = m.binary() if len(allowed) > 1 else m.var(1.0, 1.0)
            m.cost[x[v, s]] += problem.cost[v][s] * US
        if len(allowed) > 1:
            m.add([(x[v, s], 1.0) for s in allowed], lower=1, upper=1)
    return x


def _aligned_rows(m: Model, problem: Problem, x: dict) -> None:
    # Aligned edges: sum_{s: in_e(s) = p} x[v,s] = sum_{s: out_e(s) = p} x[u,s] for every placement p;
    # a follower's may also slice: sum_{s: in_e(s) = p} x[v,s] <= sum_{s: out_e(s) slices to p} x[u,s]
    for e in problem.edges:
        if not e.aligned:
            continue
        if e.dst is e.src:  # one class on both ends: its own strategy must line up
            for s in problem.allowed[e.src]:
                q, p = problem.src_placement(e, s), e.dst_in[s]
                if not (slices_to(q, p) if e.slices else q == p):
                    m.add([(x[e.src, s], 1.0)], lower=0, upper=0)
            continue
        src_by, dst_by = {}, {}
        for s in problem.allowed[e.src]:
            src_by.setdefault(problem.src_placement(e, s), []).append((x[e.src, s], -1.0))
        for s in problem.allowed[e.dst]:
            dst_by.setdefault(e.dst_in[s], []).append((x[e.dst, s], 1.0))
        for p in dict.fromkeys([*src_by, *dst_by]):
            if e.slices:
                if p in dst_by:
                    m.add(dst_by[p] + [t for q, ts in src_by.items() if slices_to(q, p) for t in ts], upper=0)
            else:
                m.add(dst_by.get(p, []) + src_by.get(p, []), lower=0, upper=0)


def _token_local_rows(m: Model, problem: Problem, x: dict) -> None:
    # Token-local regions: on each mesh dim, every member splits tokens there or none does
    #   sum_{s in T_d(v)} x[v,s] = sum_{s in T_d(h)} x[h,s]
    for tie in problem.ties:
        (h, hs), *rest = tie
        for v, vs in rest:
            m.add([*((x[v, s], 1.0) for s in vs), *((x[h, s], -1.0) for s in hs)], lower=0, upper=0)


@dataclass
class _Moves:
    """The resharding block's terms, for the rows that read them after it."""

    hidden: dict = field(default_factory=dict)   # block -> [(var, microseconds)] of the moves it may hide
    # a parameter's working copy, kept when its working placement is not its storage: [(var, bytes)]
    held: list = field(default_factory=list)
    terms: dict = field(default_factory=dict)    # edge -> [(var, microseconds, (source, destination placement))]


def _resharding_rows(m: Model, problem: Problem, cluster, x: dict) -> _Moves:
    # Edges: resharding cost, linear in x when one side has a single placement, else flow form
    #   sum_p y[e,q,p] = sum_{s: out_e(s) = q} x[u,s],  sum_q y[e,q,p] = sum_{s: in_e(s) = p} x[v,s]
    # A move that may hide behind its block's compute goes to the block's E_b instead (overlap.py).
    price = _Prices(cluster)
    moves = _Moves()
    for e in problem.edges:
        if e.aligned:
            continue
        terms, flows = _edge_cost(problem, e, x, price)
        terms += _flow_terms(m, e, x, flows)
        for var, c, (q, p) in terms:
            if hidden(problem, e, q, p, cluster.mesh_shape):
                moves.hidden.setdefault(e.block, []).append((var, c * US))
            else:
                m.cost[var] += c * US
            moves.terms.setdefault(e, []).append((var, c * US, (q, p)))
            if e.kind == "gather" and q != p:  # the working copy, kept for the step
                moves.held.append((var, e.weight * costmodel.local_bytes(e.kept, p, cluster.mesh_shape)))
    return moves


def _flow_terms(m: Model, e, x: dict, flows: list) -> list:
    """y[e,q,p] with its two rows per placement, for each of :func:`_edge_cost`'s flow groups:
    its objective terms as [(y var, seconds, (q, p))]."""
    terms = []
    for qs, ps, r in flows:
        y = [[m.var(0.0, 1.0) for _ in ps] for _ in qs]
        terms += [(y[i][j], r[i][j], (q, p)) for i, (q, _, _) in enumerate(qs) for j, (p, _, _) in enumerate(ps)]
        for i, (_, _, ss) in enumerate(qs):
            m.add([*((var, 1.0) for var in y[i]), *((x[e.src, s], -1.0) for s in ss)], lower=0, upper=0)
        for j, (_, _, ss) in enumerate(ps):
            m.add([*((row[j], 1.0) for row in y), *((x[e.dst, s], -1.0) for s in ss)], lower=0, upper=0)
    return terms


def _objective(m: Model, mem: MemoryRows | None, minimize: str, cutoff: float | None, backend: str) -> float | None:
    """The objective for ``minimize``, and the cutoff in model units (None without one): a row
    for backends other than HiGHS, which takes it as its objective bound."""
    if minimize == "memory":
        m.cost = [0.0] * len(m.cost)
        m.cost[mem.peak] = 1.0
    elif mem is not None:   # of equally fast plans, the one with the least memory
        m.cost[mem.peak] = PEAK_TIE_BREAK
    limit = None if cutoff is None or minimize != "time" else cutoff * US
    if limit is not None and backend != "HIGHS":   # the others take it as a row: objective <= cutoff
        m.add([(i, c) for i, c in enumerate(m.cost) if c], upper=limit)
    return limit


def _run(m: Model, problem: Problem, x: dict, backend: str, time_limit: float, mip_gap: float,
         limit: float | None):
    """(status, variable -> value, objective, best bound) from ``backend``."""
    log = bool(os.environ.get("AUTOSHARD_SOLVER_LOG"))  # solver progress, for diagnosing slow solves
    if backend == "HIGHS":
        groups = [[x[v, s] for s in problem.allowed[v]] for v in problem.nodes if len(problem.allowed[v]) > 1]
        return _run_highs(m, time_limit, mip_gap, log, limit, groups)
    return _run_pywraplp(m, backend, time_limit, mip_gap, log)


def _raise_unless_solved(status: str, found: float | None, limit: float | None, cutoff: float | None,
                         backend: str, time_limit: float) -> None:
    # HiGHS prunes its search by the bound but keeps a plan it finds at the root or in presolve
    if limit is not None and (status == "infeasible" or (status == "optimal" and found >= limit)):
        raise CutoffError(f"no plan predicts a step under {cutoff:.6g} s (or none fits)")
    if limit is not None and status == "feasible" and found >= limit:   # stopped before proving either
        raise SolverError(f"{backend} found no plan under the cutoff within {time_limit:.0f}s; raise time_limit")
    if status == "infeasible":
        raise InfeasibleError("no plan satisfies the constraints and the memory limit")
    if status not in ("optimal", "feasible"):
        raise SolverError(f"{backend} found no plan within {time_limit:.0f}s ({status}); raise time_limit")


def _run_pywraplp(m: Model, backend: str, time_limit: float, mip_gap: float, log: bool):
    """(status, variable -> value, objective, best bound) from pywraplp's own solve."""
    solver, xs = m.to_pywraplp(backend)
    solver.EnableOutput() if log else solver.SuppressOutput()
    solver.SetNumThreads(1)
    solver.SetTimeLimit(int(time_limit * 1000))
    params = pywraplp.MPSolverParameters()
    params.SetDoubleParam(params.RELATIVE_MIP_GAP, mip_gap)
    code = solver.Solve(params)
    status = {pywraplp.Solver.OPTIMAL: "optimal", pywraplp.Solver.FEASIBLE: "feasible",
              pywraplp.Solver.INFEASIBLE: "infeasible"}.get(code, f"status {code}")
    objective = solver.Objective()
    if status not in ("optimal", "feasible"):
        return status, None, None, None
    values = [var.solution_value() for var in xs]   # read now: the variables die with the solver
    return status, values.__getitem__, objective.Value(), objective.BestBound()


OBJECTIVE_SCALE = 1e-3   # HiGHS sees the objective in these units (milliseconds for step time)
HINT_GAP = 0.05          # a first plan this close to the LP bound starts HiGHS (_first_plan)


def _run_highs(m: Model, time_limit: float, mip_gap: float, log: bool, cutoff: float | None = None,
               groups: list[list[int]] = (), node_limit: int | None = None):
    """:func:`_run_pywraplp` with HiGHS under MathOpt: at the time limit, the best plan found so
    far is returned ("feasible", with HiGHS's bound) instead of none. The model goes in scaled
    (:meth:`Model.to_mathopt`); objective and bound come back in the model's own units. ``cutoff``
    (model units): "infeasible" once no solution can be below it (HiGHS's ``objective_bound``;
    MathOpt's own cutoff_limit is not supported for HiGHS). ``groups``: the variables of each
    node's one-hot strategy choice, for :func:`_first_plan`. ``node_limit``: stop after that many
    branch-and-bound nodes, a limit that does not depend on the machine's speed."""
    model = m.to_mathopt(OBJECTIVE_SCALE)
    scaled = None if cutoff is None else cutoff * OBJECTIVE_SCALE
    deadline = time.perf_counter() + time_limit
    first = _first_plan(model, groups, time_limit, mip_gap, log, scaled) if groups else None
    if first is not None and first[0] != "hint":
        return first
    params = _highs_parameters(max(deadline - time.perf_counter(), 0.1), mip_gap, log, presolve=first is None)
    params.node_limit = node_limit
    if scaled is not None:
        params.highs.double_options["objective_bound"] = scaled
    try:
        result = _highs(model, params, None if first is None else first[1])
    except HighsFailure:
        if first is None:
            raise
        # seen in HiGHS's handling of a new integer solution, on a 40-layer Llama-3-70B stage
        # started from the first plan: once more from nothing
        params = _highs_parameters(max(deadline - time.perf_counter(), 0.1), mip_gap, log, presolve=True)
        params.node_limit = node_limit
        if scaled is not None:
            params.highs.double_options["objective_bound"] = scaled
        result = _highs(model, params)
    reason = result.termination.reason
    # the objective is bounded below (every cost is >= 0), so "infeasible or unbounded" is infeasible
    if reason in (result_pb2.TERMINATION_REASON_INFEASIBLE, result_pb2.TERMINATION_REASON_INFEASIBLE_OR_UNBOUNDED):
        return "infeasible", None, None, None
    values = _values(result, model)
    if reason not in (result_pb2.TERMINATION_REASON_OPTIMAL, result_pb2.TERMINATION_REASON_FEASIBLE) or not values:
        detail = result_pb2.TerminationReasonProto.Name(reason).removeprefix("TERMINATION_REASON_").lower()
        return f"{detail}{': ' + result.termination.detail if result.termination.detail else ''}", None, None, None
    status = "optimal" if reason == result_pb2.TERMINATION_REASON_OPTIMAL else "feasible"
    return (status, values.__getitem__, result.solutions[0].primal_solution.objective_value / OBJECTIVE_SCALE,
            result.termination.objective_bounds.dual_bound / OBJECTIVE_SCALE)


def _first_plan(model, groups: list[list[int]], time_limit: float, mip_gap: float, log: bool,
                cutoff: float | None):
    """A plan to start HiGHS from, and the LP relaxation's bound to end early on.

    HiGHS alone finds its first plan late: on a 32-layer Llama (8x8 mesh, 40 GB) only its sub-MIP
    at ~15 s of a 17 s solve, after root separation. Yet the LP relaxation there picks one
    strategy per node outright (its fractions sit in the keep / recompute choices): fixing every
    node whose LP choice is whole and solving the small MIP left (0.3 s) gave the optimal plan at
    32 layers and one 0.09% above it at 80. Returns ("optimal", ...) as :func:`_run_highs` does
    when that plan is within the gap of the LP bound (gap 0 on the 8-layer shape), "infeasible"
    when the LP is (or its bound reaches the cutoff), ("hint", values) for HiGHS to start from,
    or None when no plan came of it.

    Each of its two solves has a fixed share of ``time_limit``, never what an earlier step left
    (a budget that shrank on a slower machine would change the path there and not here)."""
    lp = model_pb2.ModelProto()
    lp.CopyFrom(model)
    lp.variables.integers[:] = [False] * len(lp.variables.integers)
    relaxed = _highs(lp, _highs_parameters(time_limit / 4, 0.0, log))
    reason = relaxed.termination.reason
    if reason in (result_pb2.TERMINATION_REASON_INFEASIBLE, result_pb2.TERMINATION_REASON_INFEASIBLE_OR_UNBOUNDED):
        return "infeasible", None, None, None   # no fractional plan fits, so no plan does
    x = _values(relaxed, lp)
    if reason != result_pb2.TERMINATION_REASON_OPTIMAL or not x:
        return None
    bound = relaxed.solutions[0].primal_solution.objective_value
    if cutoff is not None and bound >= cutoff:
        return "infeasible", None, None, None
    fixed = model_pb2.ModelProto()
    fixed.CopyFrom(model)
    for group in groups:
        best = max(group, key=lambda i: x[i])
        if x[best] > 1 - 1e-6:
            fixed.variables.lower_bounds[best] = 1.0
    rounded = _highs(fixed, _highs_parameters(time_limit / 4, 0.0, log))
    values = _values(rounded, fixed)
    if not values:
        return None
    found = rounded.solutions[0].primal_solution.objective_value
    if cutoff is not None and found >= cutoff:
        return None
    if found - bound <= mip_gap * found:
        return "optimal", values.__getitem__, found / OBJECTIVE_SCALE, bound / OBJECTIVE_SCALE
    # Far above the LP bound, the plan is no help: at 80 layers (9.5% above, though 0.09% above
    # the optimum) HiGHS restarted on it four times and took 45 s against 36 s without it. Nearer,
    # it is: on a 2-layer Llama at 0.9 of its smallest peak without recompute (3.8% above, 0.003%
    # above the optimum) HiGHS took 31 s from it and 136 s alone, finding a slower plan.
    return ("hint", values) if found - bound <= HINT_GAP * found else None


def _highs_parameters(time_limit: float, mip_gap: float, log: bool, presolve: bool = True) -> mathopt.SolveParameters:
    """``presolve=False`` for a MIP started from a first plan: on the 32-layer Llama (8 x 8,
    40 GB) it proved the same optimum in 3.5 s instead of 7.7 s (at 80 layers 64 s against 76 s).
    The rounding MIP, most of its columns fixed, needs presolve (0.5 s against 18 s). The LP
    relaxation would take 0.5 s instead of 2.5 s without it, but lands on another vertex among
    equally fast plans, one the peak's tie-break (far below HiGHS's tolerances on small models)
    does not steer: the golden plans' storage flips between Shard(0) and Shard(1)."""
    params = mathopt.SolveParameters(time_limit=timedelta(seconds=time_limit), relative_gap_tolerance=mip_gap,
                                     random_seed=0, enable_output=log)
    params.highs.int_options["threads"] = 1   # MathOpt leaves HiGHS's thread count to HiGHS's options
    if not presolve:
        params.highs.string_options["presolve"] = "off"
    return params


class HighsFailure(SolverError):
    """HiGHS stopped with an internal error (not a limit, not infeasibility)."""


def _highs(model, params: mathopt.SolveParameters, hint: list[float] | None = None) -> result_pb2.SolveResultProto:
    """One HiGHS solve of a MathOpt proto (the proto-level call: MathOpt's Python Model would
    rebuild the model), started from ``hint`` (a value per variable) if given."""
    start = model_parameters_pb2.ModelSolveParametersProto()
    if hint is not None:
        values = start.solution_hints.add().variable_values
        values.ids.extend(range(len(hint)))
        values.values.extend(hint)
    try:
        return mathopt_core.solve(model, mathopt.SolverType.HIGHS.value, StreamableSolverInitArguments().to_proto(),
                                  params.to_proto(), start, None, CallbackRegistration().to_proto(), None, None)
    except Exception as exc:  # noqa: BLE001 - MathOpt's StatusNotOk (pybind11_abseil), typed here
        if type(exc).__name__ != "StatusNotOk":
            raise
        raise HighsFailure(f"HiGHS stopped with an internal error ({exc}); try another time_limit, "
                           f"recompute=False or 'full', or share_layers=False") from exc


def _values(result, model) -> list[float] | None:
    """The first solution's value of every variable (ids are indices), or None without one."""
    if not result.solutions or not result.solutions[0].HasField("primal_solution"):
        return None
    values = [0.0] * len(model.variables.ids)
    primal = result.solutions[0].primal_solution.variable_values
    for i, v in zip(primal.ids, primal.values):
        values[i] = v
    return values
