"""solve: the ILP of formulation.py with OR-Tools, deterministically.

HiGHS is the default backend (on random Alpa-style problems it reached the optimum where CBC and
SCIP left gaps). The model is built as plain arrays (:class:`Model`: pywraplp's expression objects
cost ~10 us a term, 3.5 s of an 8-layer Llama's 6 s solve) and HiGHS runs under MathOpt on its
proto: pywraplp's HiGHS bridge (OR-Tools 9.15) drops the best plan found when the time limit stops
the search (status 99; or-tools issues 5016 and 5372), and ignores the gap and thread options.
Other backends (SCIP, CBC, ...) solve the same model through pywraplp. Times enter the model in
microseconds so coefficients stay well scaled; one thread and a fixed seed make the same problem
give the same answer.
"""

from __future__ import annotations

import math
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

US = 1e6  # seconds -> microseconds
MB = 2**20  # bytes -> MiB in the memory rows (keeps coefficients near the time terms' scale)
# Microseconds per MiB of peak in the step-time objective: storage placements often tie in time
# (a weight sharded on either dim moves the same bytes) but not in memory (ResNet-50's golden plan
# held 5% more after such a tie flipped). 40 us on a 40 GB peak; taken off the reported objective.
PEAK_TIE_BREAK = 1e-3
INF = math.inf


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


@dataclass
class _MemoryRows:
    r: dict            # recompute binaries
    peak: int          # the largest moment, in MiB: the objective of minimize="memory", a tie-break otherwise


def _memory_rows(m: Model, problem: Problem, mm: MemoryModel, x, held: list, reshard_terms: dict) -> _MemoryRows:
    """The memory block of the ILP (formulas in solver/memory.py: one row per moment, each <= the
    peak); ``held``: the working copies' [(var, bytes)]; ``reshard_terms``: each edge's resharding
    cost as [(var, microseconds, (source, destination placement))] (before overlap), for charging
    a recomputed node's input moves again and a saved view's moved copy."""
    from autoshard.solver.memory import (END, FORWARD, backward_start_reads, bucket_of, delivered, gather_of,
                                         gathered, in_flight, moved_copy, rematerialized)

    expr = lambda table, v: [(x[v, s], table[v][s]) for s in problem.allowed[v]]  # noqa: E731
    per_mb = lambda terms, sign=1.0: [(var, sign * c / MB) for var, c in terms]  # noqa: E731
    fixed = lambda v: float(v not in mm.checkpoints and v in mm.inside)  # noqa: E731 - recompute="full"
    r = {v: m.var(fixed(v), fixed(v)) if mm.recompute_all else
         m.var(float(mm.decided[v]), float(mm.decided[v])) if v in mm.decided else m.binary()
         for v in mm.recomputable}
    keep = {v: m.binary() for v in mm.candidates}
    avail = lambda u: [(keep[u], 1.0), (r[u], 1.0)] if u in r else [(keep[u], 1.0)]  # noqa: E731

    # validity: backward's inputs exist; a recomputed node's inputs exist; a view's base exists
    for u in mm.needed:
        m.add(avail(u), lower=1)
    for v in mm.recomputable:
        for u in mm.inputs_of[v]:
            m.add(avail(u) + [(r[v], -1.0)], lower=0)
    # Bytes live in backward's phases, summed per profile (a tuple: the share live in each phase)
    # into one variable each, so each phase's row reads a few of them: {profile: [(var, bytes)]}
    saved: dict[tuple, list] = {}
    recomputed: dict[tuple, list] = {}
    # saving a view holds its base (recomputing the base frees nothing); when the plan moves the
    # view's input by a collective, the view holds the moved copy (memory.py: resharded_view):
    #   c_v >= sum moved / MB - big / MB (1 - keep_v)
    for v, u in mm.base_of.items():
        m.add([(keep[u], 1.0), (keep[v], -1.0)], lower=0)
        moved = [(var, b) for var, _, (q, p) in reshard_terms.get(mm.view_edge.get(v), [])
                 for b in [moved_copy(mm, v, q, p)] if b is not None]
        if moved:
            big = max(b for _, b in moved) / MB
            c = m.var()
            m.add([(c, 1.0), *per_mb(moved, -1.0), (keep[v], -big)], lower=-big)
            saved.setdefault(mm.live[v], []).append((c, MB))

    # The products x[v,s] * r_v and x[v,s] * keep_v in their tight (convex-hull) form:
    #   z[v,s] <= x[v,s],  sum_s z[v,s] = b_v   (b = r or keep)  =>  z = x * b for binary x, b
    def product(v, b):
        z = {s: m.var(0.0, 1.0) for s in problem.allowed[v]}
        for s, var in z.items():
            m.add([(var, 1.0), (x[v, s], -1.0)], upper=0)
        m.add([*((var, 1.0) for var in z.values()), (b, -1.0)], lower=0, upper=0)
        return z

    # recompute cost: sum_s c[v,s] x[v,s] r_v; a nanosecond per recomputed node breaks ties
    # towards saving (recomputing a free view gains nothing)
    live = set(rematerialized(mm))
    a = {v: m.var(0.0, 1.0) for v in r}   # replayed at the start of backward (below)
    for v, rv in r.items():
        m.cost[rv] += 1e-3
        allowed = problem.allowed[v]
        cost = max(problem.cost[v][s] for s in allowed) > 0
        act = v in live and max((mm.act[v][s] for s in allowed), default=0.0) > 0
        if not (cost or act):
            continue
        j = product(v, rv)
        for s, var in j.items():
            m.cost[var] += problem.cost[v][s] * US
        if act:   # live from backward's start (g) or from its first reader (j - g) to its last
            g = product(v, a[v])
            recomputed.setdefault(mm.start[v], []).extend((g[s], mm.act[v][s]) for s in allowed)
            recomputed.setdefault(mm.replay[v], []).extend(
                (var, sign * mm.act[v][s]) for s in allowed for var, sign in ((j[s], 1.0), (g[s], -1.0)))

    # its inputs resharded again: w_e >= R_e - M_e (1 - r_v), w_e >= 0, charged in full (exposed)
    for e, e_terms in reshard_terms.items():
        big = max((c for _, c, _ in e_terms), default=0.0)   # one variable of an edge's terms is 1
        if e.kind != "input" or e.dst not in r or big <= 0:
            continue
        w = m.var()
        m.cost[w] += 1.0
        m.add([(w, 1.0), *((var, -c) for var, c, _ in e_terms), (r[e.dst], -big)], lower=-big)

    # saved activations: sum_s act[v,s] x[v,s] keep_v
    for v, kv in keep.items():
        if max((mm.act[v][s] for s in problem.allowed[v]), default=0.0) > 0:
            saved.setdefault(mm.live[v], []).extend((var, mm.act[v][s]) for s, var in product(v, kv).items())

    # a replay at backward's start: a_u >= r_u (u read first), a_u >= a_v + r_u - 1 (u an input of
    # v), a_v <= r_v
    for u in dict.fromkeys(mm.alias.get(u, u) for u in backward_start_reads(mm.recomputable, mm.block)):
        if u in r:
            m.add([(a[u], 1.0), (r[u], -1.0)], lower=0)
    for v in r:
        m.add([(a[v], 1.0), (r[v], -1.0)], upper=0)
        for u in mm.inputs_of.get(v, []):
            if u in r and u is not v:
                m.add([(a[u], 1.0), (a[v], -1.0), (r[u], -1.0)], lower=-1)

    # working sets, per group of moments they may occur in (an op's copies run in several phases):
    #   T_X >= sum_s work[v,s] x[v,s], a block's gradients in flight, its gathered parameters
    def grouped(edges, key, nbytes) -> dict:   # key -> [(var, bytes)] over the edges' moves
        out: dict = {}
        for e in edges:
            out.setdefault(key(e), []).extend((var, b) for var, _, (q, p) in reshard_terms.get(e, [])
                                              for b in [nbytes(e, q, p)] if b > 0)
        return out

    working: dict[frozenset, int] = {}   # moments -> T_X

    def working_set(moments: frozenset, terms: list) -> None:
        if moments not in working:
            working[moments] = m.var()
        m.add([(working[moments], 1.0), *per_mb(terms, -1.0)], lower=0)

    for v in mm.work:
        working_set(mm.at[v], expr(mm.work, v))
    bucket = grouped(mm.grads, lambda e: (bucket_of(mm, e), mm.at[e]), lambda e, q, p: in_flight(mm, e, q, p))
    gathers = grouped(mm.uses, lambda e: (gather_of(mm, e)[0], mm.at[e]),
                      lambda e, q, p: gather_of(mm, e)[1] * gathered(mm, e, q, p))
    for (b, moments), terms in [*bucket.items(), *gathers.items()]:
        if terms and b != END:
            working_set(moments, terms)

    # one variable per profile: its bytes (in MiB) live in a phase are profile[p] times it
    def summed(groups: dict[tuple, list]) -> list[tuple[tuple, int]]:
        out = []
        for profile, terms in groups.items():
            total = m.var(-INF)   # replays' j - g terms may sum below 0 in the LP
            m.add([(total, 1.0), *per_mb(terms, -1.0)], lower=0)
            out.append((profile, total))
        return out

    made: dict[tuple, list] = {}
    for st in mm.grad:
        made.setdefault(mm.made.get(st, (1.0,) * mm.phases), []).extend(expr(mm.grad, st))
    grads, acts, replays = summed(made), summed(saved), summed(recomputed)
    # S: the state without gradients, and the kept working copies
    state = m.var()
    m.add([(state, 1.0), *per_mb([term for v in mm.state for term in expr(mm.state, v)] + held, -1.0)], lower=0)
    everywhere = mm.grads_live_everywhere()
    all_grads = [(var, 1.0) for _, var in grads]
    peak = m.var(0.0, mm.limit / MB)   # each moment <= peak <= limit

    def moment(terms, moments_at=None) -> None:
        """peak >= S + terms (+ T_X for every group of working sets in that moment)."""
        sets = [t for ms, t in working.items() if moments_at in ms] if moments_at is not None else []
        for t in sets or [None]:
            m.add([(peak, 1.0), (state, -1.0), *((var, -c) for var, c in terms),
                   *([(t, -1.0)] if t is not None else [])], lower=0)

    # forward: S + A + T_fwd (the gradients too with K > 1)
    moment([(var, 1.0) for _, var in acts] + (all_grads if everywhere else []), FORWARD)
    # backward phase p: S + G_p + A_p + R_p + T_p, through M_p = G_p + A_p + R_p
    for p in range(mm.phases):
        terms = [(var, 1.0 if everywhere else profile[p]) for profile, var in grads] + \
            [(var, profile[p]) for profile, var in [*acts, *replays]]
        at_p = m.var(-INF)
        m.add([(at_p, 1.0), *((var, -c) for var, c in terms if c)], lower=0)
        moment([(at_p, 1.0)], p)
    # end of backward: S + G + D, a moment where backward hands anything over
    handed = [term for (b, _), terms in bucket.items() if b == END for term in terms] + \
        [(var, d) for e in mm.grads for var, _, (q, p) in reshard_terms.get(e, [])
         for d in [delivered(mm, e, q, p)] if d > 0]
    if handed:
        moment(all_grads + per_mb(handed))
    # optimizer step: S + G + O
    if mm.param and mm.optimizer == "foreach":
        moment(all_grads + per_mb([term for st in mm.param for term in expr(mm.param, st)]))
    elif mm.param and mm.optimizer == "for-loop":   # two temporaries of its largest parameter
        largest = m.var()
        for st in mm.param:
            m.add([(largest, 1.0), *per_mb(expr(mm.param, st), -2.0 / mm.copies.get(st, 1))], lower=0)
        moment(all_grads + [(largest, 1.0)])
    else:
        moment(all_grads)
    return _MemoryRows(r, peak)


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
    figure the infeasibility report quotes as the smallest cap that fits."""
    if mip_gap is None:
        mip_gap = 1e-3 if minimize == "time" else 1e-4
    start = time.perf_counter()
    price = _Prices(cluster)
    m = Model()

    # x[v,s]: node v takes strategy s; exactly one per node.
    x = {}
    for v in problem.nodes:
        allowed = problem.allowed[v]
        for s in allowed:
            x[v, s] = m.binary() if len(allowed) > 1 else m.var(1.0, 1.0)
            m.cost[x[v, s]] += problem.cost[v][s] * US
        if len(allowed) > 1:
            m.add([(x[v, s], 1.0) for s in allowed], lower=1, upper=1)

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

    # Token-local regions: on each mesh dim, every member splits tokens there or none does
    for tie in problem.ties:
        (h, hs), *rest = tie
        for v, vs in rest:
            m.add([*((x[v, s], 1.0) for s in vs), *((x[h, s], -1.0) for s in hs)], lower=0, upper=0)

    # Edges: resharding cost, linear in x when one side has a single placement, else flow form.
    # A parameter's or gradient's move goes to its block's comm instead (formulation.py: Overlap).
    hideable: dict[object, list] = {}

    def charge(e, var, c, q, p):
        if problem.overlap > 0 and e.hides(q, p, cluster.mesh_shape, problem.micro_batches):
            hideable.setdefault(e.block, []).append((var, c))
        else:
            m.cost[var] += c

    held = []  # a parameter's working copy, when its working placement is not its storage
    reshard_terms: dict = {}  # edge -> [(var, microseconds, (source, destination placement))]
    for e in problem.edges:
        if e.aligned:
            continue
        terms, flows = _edge_cost(problem, e, x, price)
        for qs, ps, r in flows:
            y = [[m.var(0.0, 1.0) for _ in ps] for _ in qs]
            terms += [(y[i][j], r[i][j], (q, p)) for i, (q, _, _) in enumerate(qs) for j, (p, _, _) in enumerate(ps)]
            for i, (_, _, ss) in enumerate(qs):
                m.add([*((var, 1.0) for var in y[i]), *((x[e.src, s], -1.0) for s in ss)], lower=0, upper=0)
            for j, (_, _, ss) in enumerate(ps):
                m.add([*((row[j], 1.0) for row in y), *((x[e.dst, s], -1.0) for s in ss)], lower=0, upper=0)
        for var, c, (q, p) in terms:
            charge(e, var, c * US, q, p)
            reshard_terms.setdefault(e, []).append((var, c * US, (q, p)))
            if e.kind == "gather" and q != p:  # the working copy, kept for the step
                held.append((var, e.weight * costmodel.local_bytes(e.kept, p, cluster.mesh_shape)))

    # E_b >= comm_b - a * compute_b, E_b >= 0
    members: dict[object, list] = {}
    for v in problem.nodes:
        if v.op != "storage":  # the optimizer step runs after backward: it hides nothing
            members.setdefault(problem.block.get(v), []).append(v)
    for b, terms in hideable.items():
        compute = [(x[v, s], problem.overlap * problem.cost[v][s] * US)
                   for v in members.get(b, []) for s in problem.allowed[v] if problem.cost[v][s] > 0]
        exposed = m.var()
        m.cost[exposed] += 1.0
        m.add([(exposed, 1.0), *((var, -c) for var, c in terms), *compute], lower=0)

    mem = _memory_rows(m, problem, memory, x, held, reshard_terms) if memory is not None else None
    if minimize == "memory":
        m.cost = [0.0] * len(m.cost)
        m.cost[mem.peak] = 1.0
    elif mem is not None:   # of equally fast plans, the one with the least memory
        m.cost[mem.peak] = PEAK_TIE_BREAK
    limit = None if cutoff is None or minimize != "time" else cutoff * US
    if limit is not None and backend != "HIGHS":   # the others take it as a row: objective <= cutoff
        m.add([(i, c) for i, c in enumerate(m.cost) if c], upper=limit)
    log = bool(os.environ.get("AUTOSHARD_SOLVER_LOG"))  # solver progress, for diagnosing slow solves
    if backend == "HIGHS":
        groups = [[x[v, s] for s in problem.allowed[v]] for v in problem.nodes if len(problem.allowed[v]) > 1]
        status, value, found, bound = _run_highs(m, time_limit, mip_gap, log, limit, groups)
    else:
        status, value, found, bound = _run_pywraplp(m, backend, time_limit, mip_gap, log)
    elapsed = time.perf_counter() - start
    if minimize == "time" and mem is not None and value is not None:   # report the step alone
        tie = PEAK_TIE_BREAK * value(mem.peak)
        found, bound = found - tie, bound - tie
    # HiGHS prunes its search by the bound but keeps a plan it finds at the root or in presolve
    if limit is not None and (status == "infeasible" or (status == "optimal" and found >= limit)):
        raise CutoffError(f"no plan predicts a step under {cutoff:.6g} s (or none fits)")
    if limit is not None and status == "feasible" and found >= limit:   # stopped before proving either
        raise SolverError(f"{backend} found no plan under the cutoff within {time_limit:.0f}s; raise time_limit")
    if status == "infeasible":
        raise InfeasibleError("no plan satisfies the constraints and the memory limit")
    if status not in ("optimal", "feasible"):
        raise SolverError(f"{backend} found no plan within {time_limit:.0f}s ({status}); raise time_limit")
    choice = {}
    for v in problem.nodes:
        allowed = problem.allowed[v]
        choice[v] = max(allowed, key=lambda s: value(x[v, s]))
    recompute, breakdown = set(), Breakdown({}, "")
    if mem is not None:
        recompute = {v for v, var in mem.r.items() if value(var) > 0.5}
        breakdown = predicted_memory(memory, choice, recompute)
    scale = US if minimize == "time" else 1 / MB
    return Solution(choice, recompute, breakdown, found / scale, bound / scale, status, elapsed, backend,
                    len(m.cost), len(m.rows))


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
    result = _highs(model, params, None if first is None else first[1])
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


def _highs(model, params: mathopt.SolveParameters, hint: list[float] | None = None) -> result_pb2.SolveResultProto:
    """One HiGHS solve of a MathOpt proto (the proto-level call: MathOpt's Python Model would
    rebuild the model), started from ``hint`` (a value per variable) if given."""
    start = model_parameters_pb2.ModelSolveParametersProto()
    if hint is not None:
        values = start.solution_hints.add().variable_values
        values.ids.extend(range(len(hint)))
        values.values.extend(hint)
    return mathopt_core.solve(model, mathopt.SolverType.HIGHS.value, StreamableSolverInitArguments().to_proto(),
                              params.to_proto(), start, None, CallbackRegistration().to_proto(), None, None)


def _values(result, model) -> list[float] | None:
    """The first solution's value of every variable (ids are indices), or None without one."""
    if not result.solutions or not result.solutions[0].HasField("primal_solution"):
        return None
    values = [0.0] * len(model.variables.ids)
    primal = result.solutions[0].primal_solution.variable_values
    for i, v in zip(primal.ids, primal.values):
        values[i] = v
    return values
