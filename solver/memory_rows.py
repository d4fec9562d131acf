"""memory_rows: the memory block of the ILP, one group of rows per term of solver/memory.py's
formulas (its docstring derives them): one row per moment of the step, each <= the peak <= the
limit, and the save-or-recompute decisions behind the activations' terms.

    forward             S + A + T_fwd
    backward phase p    S + G_p + A_p + R_p + T_p
    end of backward     S + G + D
    optimizer step      S + G + O

Bytes enter in MiB, the recompute terms of the objective (compute again, inputs resharded again)
in microseconds (solver/model.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autoshard.solver.formulation import Problem
from autoshard.solver.memory import (END, FORWARD, MemoryModel, backward_start_reads, bucket_of, delivered, gather_of,
                                     gathered, in_flight, moved_copy, rematerialized)
from autoshard.solver.model import INF, MB, US, Model

Terms = list[tuple[int, float]]   # [(variable, coefficient)]
# Bytes live in backward's phases, by profile (a tuple: the share live in each phase), each
# profile summed into one variable (_summed) so that each phase's row reads a few of them
Profiles = dict[tuple, Terms]


@dataclass
class MemoryRows:
    r: dict            # recompute binaries
    peak: int          # the largest moment, in MiB: the objective of minimize="memory", a tie-break otherwise


@dataclass
class _Rows:
    """What every group of memory rows reads. ``reshard_terms``: each edge's resharding cost as
    [(var, microseconds, (source, destination placement))] (before overlap), for charging a
    recomputed node's input moves again and a saved view's moved copy."""

    m: Model
    problem: Problem
    mm: MemoryModel
    x: dict
    reshard_terms: dict

    def expr(self, table: dict, v) -> Terms:
        """sum_s table[v][s] x[v,s]."""
        return [(self.x[v, s], table[v][s]) for s in self.problem.allowed[v]]

    def product(self, v, b: int) -> dict[int, int]:
        """x[v,s] * b for each strategy s of v, b binary (r_v or keep_v), in the tight
        (convex-hull) form: z[v,s] <= x[v,s], sum_s z[v,s] = b, which is the product for binary x."""
        m = self.m
        z = {s: m.var(0.0, 1.0) for s in self.problem.allowed[v]}
        for s, var in z.items():
            m.add([(var, 1.0), (self.x[v, s], -1.0)], upper=0)
        m.add([*((var, 1.0) for var in z.values()), (b, -1.0)], lower=0, upper=0)
        return z


def _per_mb(terms, sign: float = 1.0) -> Terms:
    return [(var, sign * c / MB) for var, c in terms]


def memory_rows(m: Model, problem: Problem, mm: MemoryModel, x, held: list, reshard_terms: dict) -> MemoryRows:
    """The memory block's variables and rows, in an order to keep: HiGHS's path follows the
    model's order, and with it which of equally fast plans comes out. ``held``: the working
    copies' [(var, bytes)]."""
    rows = _Rows(m, problem, mm, x, reshard_terms)
    r, keep = _recompute_decisions(m, mm)
    _validity_rows(rows, r, keep)
    saved: Profiles = {}
    recomputed: Profiles = {}
    _saved_views(rows, keep, saved)
    a = {v: m.var(0.0, 1.0) for v in r}   # replayed at the start of backward (_replayed_at_start_rows)
    _recompute_cost(rows, r, a, recomputed)
    _inputs_resharded_again(rows, r)
    _saved_activations(rows, keep, saved)
    _replayed_at_start_rows(rows, r, a)
    working, bucket = _working_sets(rows)
    grads, acts, replays = _summed(m, _gradients_made(rows)), _summed(m, saved), _summed(m, recomputed)
    state = _state(rows, held)
    peak = _Peak(m, state, m.var(0.0, mm.limit / MB), working)   # each moment <= peak <= limit
    _forward_and_backward_moments(mm, peak, grads, acts, replays)
    _end_of_backward(rows, peak, grads, bucket)
    _optimizer_step(rows, peak, grads)
    return MemoryRows(r, peak.var)


def _recompute_decisions(m: Model, mm: MemoryModel) -> tuple[dict, dict]:
    """r_v (recompute v in backward) and keep_v (save v for backward): free binaries, or held
    fixed by recompute="full" or by a decision taken before (:attr:`MemoryModel.decided`)."""
    fixed = lambda v: float(v not in mm.checkpoints and v in mm.inside)  # noqa: E731 - recompute="full"
    r = {v: m.var(fixed(v), fixed(v)) if mm.recompute_all else
         m.var(float(mm.decided[v]), float(mm.decided[v])) if v in mm.decided else m.binary()
         for v in mm.recomputable}
    keep = {v: m.binary() for v in mm.candidates}
    return r, keep


def _available(r: dict, keep: dict, u) -> Terms:
    """keep_u + r_u: u is in memory when backward wants it, saved or recomputed."""
    return [(keep[u], 1.0), (r[u], 1.0)] if u in r else [(keep[u], 1.0)]


def _validity_rows(rows: _Rows, r: dict, keep: dict) -> None:
    # validity: backward's inputs exist (keep_u + r_u >= 1); a recomputed node's inputs exist
    # (keep_u + r_u >= r_v); a view's base exists (_saved_views)
    m, mm = rows.m, rows.mm
    for u in mm.needed:
        m.add(_available(r, keep, u), lower=1)
    for v in mm.recomputable:
        for u in mm.inputs_of[v]:
            m.add(_available(r, keep, u) + [(r[v], -1.0)], lower=0)


def _saved_views(rows: _Rows, keep: dict, saved: Profiles) -> None:
    # saving a view holds its base (keep_u >= keep_v; recomputing the base frees nothing); when
    # the plan moves the view's input by a collective, the view holds the moved copy (memory.py:
    # resharded_view):
    #   c_v >= sum moved / MB - big / MB (1 - keep_v)
    m, mm = rows.m, rows.mm
    for v, u in mm.base_of.items():
        m.add([(keep[u], 1.0), (keep[v], -1.0)], lower=0)
        moved = [(var, b) for var, _, (q, p) in rows.reshard_terms.get(mm.view_edge.get(v), [])
                 for b in [moved_copy(mm, v, q, p)] if b is not None]
        if moved:
            big = max(b for _, b in moved) / MB
            c = m.var()
            m.add([(c, 1.0), *_per_mb(moved, -1.0), (keep[v], -big)], lower=-big)
            saved.setdefault(mm.live[v], []).append((c, MB))
            _held_too(mm, saved, v, [(c, MB)])


def _recompute_cost(rows: _Rows, r: dict, a: dict, recomputed: Profiles) -> None:
    # recompute cost: sum_s c[v,s] x[v,s] r_v; a nanosecond per recomputed node breaks ties
    # towards saving (recomputing a free view gains nothing). A recomputed value backward reads
    # is live (R_p) from backward's start (g = x a) or from its first reader (j - g, j = x r) to
    # its last.
    m, mm, problem = rows.m, rows.mm, rows.problem
    live = set(rematerialized(mm))
    for v, rv in r.items():
        m.cost[rv] += 1e-3
        allowed = problem.allowed[v]
        cost = max(problem.cost[v][s] for s in allowed) > 0
        act = v in live and max((mm.act[v][s] for s in allowed), default=0.0) > 0
        if not (cost or act):
            continue
        j = rows.product(v, rv)
        for s, var in j.items():
            m.cost[var] += problem.cost[v][s] * US
        if act:
            g = rows.product(v, a[v])
            recomputed.setdefault(mm.start[v], []).extend((g[s], mm.act[v][s]) for s in allowed)
            recomputed.setdefault(mm.replay[v], []).extend(
                (var, sign * mm.act[v][s]) for s in allowed for var, sign in ((j[s], 1.0), (g[s], -1.0)))


def _inputs_resharded_again(rows: _Rows, r: dict) -> None:
    # a recomputed node's inputs resharded again: w_e >= R_e - M_e (1 - r_v), w_e >= 0, charged
    # in full (exposed)
    m = rows.m
    for e, e_terms in rows.reshard_terms.items():
        big = max((c for _, c, _ in e_terms), default=0.0)   # one variable of an edge's terms is 1
        if e.kind != "input" or e.dst not in r or big <= 0:
            continue
        w = m.var()
        m.cost[w] += 1.0
        m.add([(w, 1.0), *((var, -c) for var, c, _ in e_terms), (r[e.dst], -big)], lower=-big)


def _saved_activations(rows: _Rows, keep: dict, saved: Profiles) -> None:
    # saved activations (A): sum_s act[v,s] x[v,s] keep_v
    mm, allowed = rows.mm, rows.problem.allowed
    for v, kv in keep.items():
        if max((mm.act[v][s] for s in allowed[v]), default=0.0) > 0:
            terms = [(var, mm.act[v][s]) for s, var in rows.product(v, kv).items()]
            saved.setdefault(mm.live[v], []).extend(terms)
            _held_too(mm, saved, v, terms)


def _held_too(mm: MemoryModel, saved: Profiles, v, terms: Terms) -> None:
    # the H - 1 other micro-batches a pipeline stage holds keep all of v, in every moment of
    # forward and backward (memory.py: MemoryModel.held_batches)
    if mm.held_of(v) > 1:
        saved.setdefault((1.0,) * mm.phases, []).extend((var, b * (mm.held_of(v) - 1)) for var, b in terms)


def _replayed_at_start_rows(rows: _Rows, r: dict, a: dict) -> None:
    # a replay at backward's start: a_u >= r_u (u read first), a_u >= a_v + r_u - 1 (u an input
    # of v), a_v <= r_v
    m, mm = rows.m, rows.mm
    for u in dict.fromkeys(mm.alias.get(u, u) for u in backward_start_reads(mm.recomputable, mm.block)):
        if u in r:
            m.add([(a[u], 1.0), (r[u], -1.0)], lower=0)
    for v in r:
        m.add([(a[v], 1.0), (r[v], -1.0)], upper=0)
        for u in mm.inputs_of.get(v, []):
            if u in r and u is not v:
                m.add([(a[u], 1.0), (a[v], -1.0), (r[u], -1.0)], lower=-1)


def _moves(rows: _Rows, edges, key, nbytes) -> dict:
    """key(e) -> [(var, bytes)] over the edges' placement pairs that hold bytes."""
    out: dict = {}
    for e in edges:
        out.setdefault(key(e), []).extend((var, b) for var, _, (q, p) in rows.reshard_terms.get(e, [])
                                          for b in [nbytes(e, q, p)] if b > 0)
    return out


def _working_sets(rows: _Rows) -> tuple[dict[frozenset, int], dict]:
    # working sets, per group of moments they may occur in (an op's copies run in several phases):
    #   T_X >= sum_s work[v,s] x[v,s], a block's gradients in flight, its gathered parameters
    # Returns ({moments: T_X}, the gradient buckets' bytes by (bucket, moments): END's go in D).
    m, mm = rows.m, rows.mm
    working: dict[frozenset, int] = {}

    def working_set(moments: frozenset, terms: list) -> None:
        if moments not in working:
            working[moments] = m.var()
        m.add([(working[moments], 1.0), *_per_mb(terms, -1.0)], lower=0)

    for v in mm.work:
        working_set(mm.at[v], rows.expr(mm.work, v))
    bucket = _moves(rows, mm.grads, lambda e: (bucket_of(mm, e), mm.at[e]), lambda e, q, p: in_flight(mm, e, q, p))
    gathers = _moves(rows, mm.uses, lambda e: (gather_of(mm, e)[0], mm.at[e]),
                     lambda e, q, p: gather_of(mm, e)[1] * gathered(mm, e, q, p))
    for (b, moments), terms in [*bucket.items(), *gathers.items()]:
        if terms and b != END:
            working_set(moments, terms)
    return working, bucket


def _gradients_made(rows: _Rows) -> Profiles:
    """G_p's terms: sum_s grad[v,s] x[v,s] by the phases the gradient is live in (made[v,p])."""
    mm = rows.mm
    made: Profiles = {}
    for st in mm.grad:
        made.setdefault(mm.made.get(st, (1.0,) * mm.phases), []).extend(rows.expr(mm.grad, st))
    return made


def _summed(m: Model, groups: Profiles) -> list[tuple[tuple, int]]:
    """One variable per profile: its bytes (in MiB) live in phase p are profile[p] times it."""
    out = []
    for profile, terms in groups.items():
        total = m.var(-INF)   # replays' j - g terms may sum below 0 in the LP
        m.add([(total, 1.0), *_per_mb(terms, -1.0)], lower=0)
        out.append((profile, total))
    return out


def _state(rows: _Rows, held: list) -> int:
    # S: the state without gradients (storage placements, buffers, inputs), and the kept working copies
    m, mm = rows.m, rows.mm
    state = m.var()
    m.add([(state, 1.0), *_per_mb([term for v in mm.state for term in rows.expr(mm.state, v)] + held, -1.0)], lower=0)
    return state


@dataclass
class _Peak:
    """peak >= every moment: S plus the moment's terms plus, in a moment working sets may occur
    in, each of their T_X."""

    m: Model
    state: int
    var: int
    working: dict[frozenset, int] = field(default_factory=dict)

    def moment(self, terms: Terms, moments_at=None) -> None:
        """peak >= S + terms (+ T_X for every group of working sets in that moment)."""
        sets = [t for ms, t in self.working.items() if moments_at in ms] if moments_at is not None else []
        for t in sets or [None]:
            self.m.add([(self.var, 1.0), (self.state, -1.0), *((var, -c) for var, c in terms),
                        *([(t, -1.0)] if t is not None else [])], lower=0)


def _all_grads(grads: list) -> Terms:
    """G: every gradient."""
    return [(var, 1.0) for _, var in grads]


def _forward_and_backward_moments(mm: MemoryModel, peak: _Peak, grads: list, acts: list, replays: list) -> None:
    everywhere = mm.grads_live_everywhere()
    # forward: S + A + T_fwd (the gradients too with K > 1)
    peak.moment([(var, 1.0) for _, var in acts] + (_all_grads(grads) if everywhere else []), FORWARD)
    # backward phase p: S + G_p + A_p + R_p + T_p, through M_p = G_p + A_p + R_p
    m = peak.m
    for p in range(mm.phases):
        terms = [(var, 1.0 if everywhere else profile[p]) for profile, var in grads] + \
            [(var, profile[p]) for profile, var in [*acts, *replays]]
        at_p = m.var(-INF)
        m.add([(at_p, 1.0), *((var, -c) for var, c in terms if c)], lower=0)
        peak.moment([(at_p, 1.0)], p)


def _end_of_backward(rows: _Rows, peak: _Peak, grads: list, bucket: dict) -> None:
    # end of backward: S + G + D, a moment where backward hands anything over (the last bucket
    # in flight, the gradients handed over unreduced)
    mm = rows.mm
    handed = [term for (b, _), terms in bucket.items() if b == END for term in terms] + \
        [(var, d) for e in mm.grads for var, _, (q, p) in rows.reshard_terms.get(e, [])
         for d in [delivered(mm, e, q, p)] if d > 0]
    if handed:
        peak.moment(_all_grads(grads) + _per_mb(handed))


def _optimizer_step(rows: _Rows, peak: _Peak, grads: list) -> None:
    # optimizer step: S + G + O; foreach AdamW: O = sum_s param[v,s] x[v,s], the for-loop version:
    # O >= 2 sum_s param[v,s] x[v,s] for every parameter v (one copy of a shared class), fused: 0
    m, mm = rows.m, rows.mm
    if mm.param and mm.optimizer == "foreach":
        peak.moment(_all_grads(grads) + _per_mb([term for st in mm.param for term in rows.expr(mm.param, st)]))
    elif mm.param and mm.optimizer == "for-loop":   # two temporaries of its largest parameter
        largest = m.var()
        for st in mm.param:
            m.add([(largest, 1.0), *_per_mb(rows.expr(mm.param, st), -2.0 / mm.copies.get(st, 1))], lower=0)
        peak.moment(_all_grads(grads) + [(largest, 1.0)])
    else:
        peak.moment(_all_grads(grads))
