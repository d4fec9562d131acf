"""solver/: the ILP's optimum against brute force, the cost coefficients by hand, determinism."""

import itertools
import math
import random

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import autoshard
from autoshard import Cluster, _torch
from autoshard.cluster import costmodel
from autoshard.cluster import H100, NVLINK4
from autoshard.passes.annotate import META_KEY as COST_KEY
from autoshard.passes.graph import tensor_inputs, value_of
from autoshard.passes.rules.attention import exchange_time, is_attention
from autoshard.passes.strategies import META_KEY, find_strategies
from autoshard.solver.formulation import formulate
from autoshard.solver.solve import solve
from autoshard.zoo import GPT, GPTConfig, MLP

pytestmark = pytest.mark.filterwarnings("ignore:autoshard.*planned replicated")

CLUSTERS = {
    "cpu": lambda: Cluster.local(2),
    # fast link, fast device: compute and communication of the same order for tiny tensors
    "h100": lambda: Cluster((2,), ("d0",), H100, [NVLINK4]),
    # 2-D: multi-dim resharding on the edges
    "h100_2x2": lambda: Cluster((2, 2), ("a", "b"), H100, [NVLINK4, NVLINK4]),
}


def _mlp_traced(dims=(8, 16, 4), batch=8):
    torch.manual_seed(0)
    return autoshard.trace(MLP(dims), (torch.randn(batch, dims[0]), torch.randn(batch, dims[-1])))


def _problem(traced, cluster):
    find_strategies(traced.gm, _torch.planning_mesh(cluster.mesh_shape, cluster.mesh_dim_names))
    return formulate(traced, cluster)


def _bucketed(e, q, p, cluster) -> bool:
    """Whether the runtime buckets the move (priced without its latency): every parameter gather;
    a gradient's reduction when it only sums partials (into Replicate, or into one Shard) and
    every rank's piece has one shape (a flat bucket's layout is the same on all ranks)."""
    if e.kind != "grad":
        return e.overlap
    shape = e.dst.param.meta["val"].shape
    return costmodel.bucket_move(q, p) is not None and all(
        costmodel.splits_evenly(shape, pl, cluster.mesh_shape) for pl in (q, p))


def _edge_table(problem, e, cluster):
    """Resharding time of edge e for every (src strategy, dst strategy) pair, by costmodel.resharding_time
    (a parameter's or gradient's move, bucketed by the runtime, without its latency)."""
    src_strats = e.src.meta[META_KEY].strategies
    dst_opts = [None] if e.dst is None else problem.allowed[e.dst]
    table = {}
    for s in problem.allowed[e.src]:
        q = src_strats[s].outputs[e.src_out]
        for t in dst_opts:
            p = e.fixed if e.dst is None else e.dst_in[t]
            table[s, t] = costmodel.resharding_time(cluster, q, p, e.nbytes, _bucketed(e, q, p, cluster))
    return table


def _objective(problem, cluster, choice, tables=None):
    """Step time by hand: compute, plus every activation resharding, plus per block the part of
    its parameter/gradient moves its compute (times the device's comm_overlap) cannot hide."""
    params = {e.dst for e in problem.edges if e.kind == "gather"}  # storage -> working placement
    views = {e.dst for e in problem.edges if e.aligned}
    a = cluster.device.comm_overlap
    total = sum(problem.cost[v][choice[v]] for v in problem.nodes)
    moves: dict = {}
    for i, e in enumerate(problem.edges):
        t = None if e.dst is None else choice[e.dst]
        q = e.src.meta[META_KEY].strategies[choice[e.src]].outputs[e.src_out]
        p = e.fixed if e.dst is None else e.dst_in[t]
        if tables is not None:
            r = tables[i][choice[e.src], t]
        else:
            r = costmodel.resharding_time(cluster, q, p, e.nbytes, _bucketed(e, q, p, cluster))
        # a gradient hides only when backward reduces it in a bucket; any other moves after backward
        hideable = (e.kind == "grad" and _bucketed(e, q, p, cluster)) or e.kind == "gather" or \
            (not e.aligned and (e.src in params or e.src in views))
        if hideable and a > 0:
            b = (e.src if e.kind == "grad" else e.dst).meta.get("autoshard.layer", (None, None))[1]
            moves[b] = moves.get(b, 0.0) + r
        else:
            total += r
    for b, m in moves.items():
        compute = sum(problem.cost[v][choice[v]] for v in problem.nodes
                      if v.meta.get("autoshard.layer", (None, None))[1] == b)
        total += max(0.0, m - a * compute)
    return total


def _aligned_ok(problem, choice) -> bool:
    """A view of a parameter takes the parameter's storage placement (Edge.aligned)."""
    return all(problem.src_placement(e, choice[e.src]) == e.dst_in[choice[e.dst]]
               for e in problem.edges if e.aligned)


def _restrict(problem, rng, budget=4096):
    """Keep 1-3 random strategies per node so the product of choices stays <= budget; a view of a
    parameter keeps the strategies that match the parameter's remaining placements."""
    aligned = {e.dst: e for e in problem.edges if e.aligned}
    nodes = [v for v in problem.nodes if len(problem.allowed[v]) > 1 and v not in aligned]
    rng.shuffle(nodes)
    product = 1
    for v in nodes:
        opts = problem.allowed[v]
        k = 3 if len(opts) >= 3 and product * 3 <= budget and rng.random() < 0.3 else 2 if product * 2 <= budget else 1
        problem.allowed[v] = sorted(rng.sample(opts, k))
        product *= k
    for v, e in aligned.items():
        placements = {problem.src_placement(e, s) for s in problem.allowed[e.src]}
        problem.allowed[v] = [s for s in problem.allowed[v] if e.dst_in[s] in placements]
    return math.prod(len(problem.allowed[v]) for v in problem.nodes)


@pytest.mark.parametrize("cluster_name", sorted(CLUSTERS))
@pytest.mark.parametrize("seed", range(5))
def test_solver_matches_brute_force(cluster_name, seed):
    cluster = CLUSTERS[cluster_name]()
    traced = _mlp_traced()
    problem = _problem(traced, cluster)
    product = _restrict(problem, random.Random(seed))
    assert 256 <= product <= 40000, product

    free = [v for v in problem.nodes if len(problem.allowed[v]) > 1]
    tables = [_edge_table(problem, e, cluster) for e in problem.edges]
    fixed = {v: problem.allowed[v][0] for v in problem.nodes if len(problem.allowed[v]) == 1}
    best, best_choice, objectives = math.inf, None, []
    for combo in itertools.product(*[problem.allowed[v] for v in free]):
        choice = dict(fixed)
        choice.update(zip(free, combo))
        if not _aligned_ok(problem, choice):
            continue
        obj = _objective(problem, cluster, choice, tables)
        objectives.append(obj)
        if obj < best:
            best, best_choice = obj, choice
    assert objectives, "no feasible combination"
    assert max(objectives) > best * (1 + 1e-3), "degenerate instance: every combination costs the same"

    solution = solve(problem, cluster)
    assert solution.status == "optimal"
    assert solution.objective == pytest.approx(best, rel=1e-6)
    for v in problem.nodes:
        assert solution.choice[v] in problem.allowed[v], v.name
    # the solver's choice attains the optimum (recomputed edge by edge, without the tables)
    assert _objective(problem, cluster, solution.choice) == pytest.approx(best, rel=1e-6)
    assert solution.bound <= solution.objective * (1 + 1e-6)


@pytest.mark.parametrize("cluster_name", sorted(CLUSTERS))
def test_unrestricted_optimum_no_worse_than_replicated_or_restricted(cluster_name):
    cluster = CLUSTERS[cluster_name]()
    traced = _mlp_traced()
    problem = _problem(traced, cluster)
    full = solve(problem, cluster)
    assert _objective(problem, cluster, full.choice) == pytest.approx(full.objective, rel=1e-6)
    # all-replicate: the first strategy of every node is (R, ..)->(R); hand objective >= optimum
    rep = {}
    for v in problem.nodes:
        idx = [i for i, s in enumerate(v.meta[META_KEY].strategies)
               if all(p is None or all(isinstance(x, Replicate) for x in p) for p in (*s.outputs, *s.inputs))]
        assert idx, v.name
        rep[v] = idx[0]
    assert full.objective <= _objective(problem, cluster, rep) * (1 + 1e-9)
    _restrict(problem, random.Random(0))
    restricted = solve(problem, cluster)
    assert full.objective <= restricted.objective * (1 + 1e-9)


def test_node_costs_by_hand():
    cluster = Cluster((2, 2), ("a", "b"), H100, [NVLINK4, NVLINK4])
    model = GPT(GPTConfig.tiny())
    traced = autoshard.trace(model, model.example_inputs(2))
    problem = _problem(traced, cluster)
    d = cluster.device
    for v in problem.nodes:
        if v.op == "storage":  # a storage decision runs the optimizer on its shard: foreach AdamW
            # (the H100's, torch's default on CUDA): 20 passes, its kernels shared by every parameter
            for s, strategy in enumerate(v.meta[META_KEY].strategies):
                shard = v.param.meta["val"].nbytes
                for p, m in zip(strategy.outputs[0], cluster.mesh_shape):
                    shard /= m if isinstance(p, Shard) else 1
                want = 20 * shard / (d.memory_bandwidth * d.memory_efficiency)
                assert problem.cost[v][s] == pytest.approx(want, rel=1e-12), (v.name, str(strategy))
            continue
        cost = v.meta[COST_KEY]
        for s, strategy in enumerate(v.meta[META_KEY].strategies):
            shards = 1
            for dim, m in enumerate(cluster.mesh_shape):
                if any(p is not None and not isinstance(p[dim], Replicate) for p in (*strategy.outputs, *strategy.inputs)):
                    shards *= m
            # the slowest rank's share of a causal sequence split, and its balanced variant's
            # all-to-alls, are checked by hand in tests/test_context.py
            shards /= strategy.imbalance
            if cost.flops == 0 and cost.bytes == 0:
                want = 0.0
            else:
                want = max(cost.flops / shards / (d.flops(cost.dtype) * d.compute_efficiency),
                           cost.bytes / shards / (d.memory_bandwidth * d.memory_efficiency)) + d.launch_overhead
                if is_attention(v):
                    want += exchange_time(cluster, v, strategy, want)
            assert problem.cost[v][s] == pytest.approx(want, rel=1e-12), (v.name, str(strategy))


def test_edges_cover_every_tensor_use():
    cluster = Cluster.local(2)
    traced = _mlp_traced()
    problem = _problem(traced, cluster)
    calls = [v for v in problem.nodes if v.op == "call_function"]
    inputs = [e for e in problem.edges if e.kind == "input"]
    assert len(inputs) == sum(len(tensor_inputs(v)) for v in calls)
    for v in calls:
        mine = [e for e in inputs if e.dst is v]
        assert [(e.src, e.src_out) for e in mine] == [value_of(a) for a in tensor_inputs(v)]
        for i, e in enumerate(mine):
            assert e.dst_in == [s.inputs[i] for s in v.meta[META_KEY].strategies]
            assert e.nbytes == tensor_inputs(v)[i].meta["val"].numel() * 4
    outs = [e for e in problem.edges if e.kind == "output"]
    assert len(outs) == 1 and outs[0].dst is None and outs[0].fixed == (Replicate(),)
    grads = [e for e in problem.edges if e.kind == "grad"]
    params = dict(traced.params)
    assert sorted(e.dst.name for e in grads) == sorted(n.name for n in params.values())
    for e in grads:
        assert e.dst_in == [s.outputs[0] for s in e.dst.meta[META_KEY].strategies]


def _plan_json(model, inputs, cluster):
    return autoshard.plan(model, cluster, inputs).to_json()


def test_plans_are_deterministic():
    model = GPT(GPTConfig.tiny())
    inputs = model.example_inputs(2, generator=torch.Generator().manual_seed(0))
    cluster = Cluster.local(2)
    texts = [_plan_json(model, inputs, cluster) for _ in range(3)]
    assert texts[0] == texts[1] == texts[2]


def test_plan_decisions_are_deterministic():
    """Everything but the solver's wall-clock time is identical across three plans."""
    import json

    model = GPT(GPTConfig.tiny())
    inputs = model.example_inputs(2, generator=torch.Generator().manual_seed(0))
    cluster = Cluster.local(2)
    docs = []
    for _ in range(3):
        d = json.loads(_plan_json(model, inputs, cluster))
        d["solver"].pop("time", None)
        docs.append(d)
    assert docs[0] == docs[1] == docs[2]


def test_solver_options_reach_highs(capfd):
    """pywraplp's HiGHS interface ignores MPSolverParameters and SuppressOutput's banner; under
    MathOpt (solve.py) the gap and the quiet switch reach HiGHS: without them HiGHS prints its
    banner and log on every solve."""
    model = GPT(GPTConfig.tiny())
    inputs = model.example_inputs(2, generator=torch.Generator().manual_seed(0))
    cluster = Cluster.local(2)
    traced = autoshard.trace(model, inputs)
    capfd.readouterr()
    plan = autoshard.plan(traced, cluster)
    out = capfd.readouterr()
    assert "HiGHS" not in out.out + out.err
    assert plan.solver["status"] == "optimal" and plan.solver["gap"] <= 1e-3


def _market_split(rows=4, n=30, seed=0):
    """A market-split instance (Cornuejols-Dawande): sum_j a_ij x_j + s+_i - s-_i = d_i, minimize
    the slacks. All-zero x is feasible at once; proving the optimum takes HiGHS ~10 s."""
    from autoshard.solver.solve import Model

    rng = random.Random(seed)
    m = Model()
    x = [m.binary() for _ in range(n)]
    a = [[rng.randint(0, 99) for _ in range(n)] for _ in range(rows)]
    slacks = []
    for row in a:
        plus, minus = m.var(), m.var()
        m.add([*zip(x, row), (plus, 1.0), (minus, -1.0)], lower=sum(row) // 2, upper=sum(row) // 2)
        slacks += [plus, minus]
    for v in slacks:
        m.cost[v] = 1.0
    return m, a, x, slacks


def test_a_stopped_solve_keeps_the_best_plan_found():
    """Stopped by a limit, HiGHS has a plan; OR-Tools 9.15's pywraplp bridge drops it (status
    99), the MathOpt route returns it: the values satisfy the rows and give the objective
    reported. A node limit stops it, as the time limit would, on any machine's speed."""
    from autoshard.solver.solve import _run_highs

    m, a, x, slacks = _market_split()
    status, value, found, bound = _run_highs(m, 600.0, 0.0, False, node_limit=10)
    assert status == "feasible"
    picked = [round(value(v)) for v in x]
    residual = [sum(c * p for c, p in zip(row, picked)) - sum(row) // 2 for row in a]
    assert found == pytest.approx(sum(abs(r) for r in residual), abs=1e-6)
    assert sum(value(v) for v in slacks) == pytest.approx(found, abs=1e-6)
    assert 0 <= bound <= found


def test_plan_warns_when_the_solver_stops_at_its_time_limit(monkeypatch):
    """A plan not proven within the gap is returned with a warning and its status and gap."""
    from autoshard.solver import solve as solve_mod

    real = solve_mod._run_highs

    def stopped(m, time_limit, mip_gap, log, cutoff=None, groups=()):
        status, value, found, bound = real(m, time_limit, mip_gap, log, cutoff)
        return "feasible", value, found, 0.5 * found   # as if stopped with half the gap proven

    monkeypatch.setattr(solve_mod, "_run_highs", stopped)
    traced = _mlp_traced()
    with pytest.warns(UserWarning, match="stopped at time_limit=7s with a plan within 50.0%"):
        plan = autoshard.plan(traced, Cluster.local(2), time_limit=7)
    assert plan.solver["status"] == "feasible" and plan.solver["gap"] == pytest.approx(0.5)


def test_a_time_limited_plan_above_the_cutoff_is_not_called_slower(monkeypatch):
    """Stopped by the time limit with a plan no better than the cutoff, the solver has proven
    nothing: that is a SolverError (not priced), not a CutoffError (proven no faster)."""
    from autoshard.solver import solve as solve_mod

    real = solve_mod._run_highs

    def stopped(m, time_limit, mip_gap, log, cutoff=None, groups=()):
        status, value, found, bound = real(m, time_limit, mip_gap, log)
        return "feasible", value, found, 0.5 * found

    traced = _mlp_traced()
    best = autoshard.plan(traced, Cluster.local(2))
    monkeypatch.setattr(solve_mod, "_run_highs", stopped)
    with pytest.raises(autoshard.errors.SolverError, match="no plan under the cutoff"):
        autoshard.plan(traced, Cluster.local(2), cutoff=best.solver["objective"] * 0.99)
