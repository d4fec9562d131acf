"""The memory and recompute rows of the ILP against brute force.

On a restricted MLP problem small enough to enumerate every strategy choice x every recompute
subset, the plan's peak is what solver/memory.py's ``predicted_memory`` says the runtime holds
(an evaluation written apart from the ILP rows, recomputed values live in backward included), its
time the node and edge costs plus the recomputed nodes' compute and their inputs' resharding
again (``recompute_resharding``). Under a cap that binds, the solver's optimum must equal the
best enumerated combination that fits, and its choice must fit.
"""

from __future__ import annotations

import itertools
import operator
import random
from types import SimpleNamespace

import pytest
import torch

from autoshard.cluster import Cluster
from autoshard.errors import InfeasibleError
from autoshard.solver.memory import memory_model, predicted_memory, recompute_resharding
from autoshard.solver.solve import solve
from test_solver import _aligned_ok, _edge_table, _mlp_traced, _objective, _problem, _restrict

pytestmark = pytest.mark.filterwarnings("ignore:autoshard.*planned replicated")


@pytest.mark.parametrize(("seed", "backend"), [(0, "HIGHS"), (1, "HIGHS"), (2, "HIGHS"), (0, "SCIP")])
def test_memory_and_recompute_match_brute_force(seed, backend):
    """HiGHS (started from its LP-rounded first plan) and SCIP (the same model through pywraplp)."""
    cluster = Cluster.local(2)
    # a batch whose activations outweigh the gradients handed over at the end of backward
    traced = _mlp_traced(dims=(8, 16, 16, 4), batch=64)
    problem = _problem(traced, cluster)
    rng = random.Random(seed)
    _restrict(problem, rng, budget=64)
    # every node its own block, as if each were a layer: a recomputed value is then live only
    # while its own backward runs (one at a time), so recomputing saves memory
    problem.block = {v: v.name for v in problem.nodes}
    mm = memory_model(traced, problem, cluster, float("inf"), 2.0)
    worth = [v for v in mm.recomputable if max(problem.cost[v]) > 0]
    mm.recomputable = sorted(rng.sample(worth, min(4, len(worth))), key=lambda n: n.name)

    free = [v for v in problem.nodes if len(problem.allowed[v]) > 1]
    fixed = {v: problem.allowed[v][0] for v in problem.nodes if len(problem.allowed[v]) == 1}
    tables = [_edge_table(problem, e, cluster) for e in problem.edges]
    combos = []
    for strategies in itertools.product(*[problem.allowed[v] for v in free]):
        choice = {**fixed, **dict(zip(free, strategies))}
        if not _aligned_ok(problem, choice):
            continue
        base = _objective(problem, cluster, choice, tables)
        for k in range(len(mm.recomputable) + 1):
            for subset in itertools.combinations(mm.recomputable, k):
                time = (base + sum(problem.cost[v][choice[v]] for v in subset)
                        + recompute_resharding(problem, cluster, choice, set(subset)))
                peak = sum(predicted_memory(mm, choice, set(subset)).values())
                combos.append((time, peak))
    peaks = sorted(p for _, p in combos)
    fastest = min(t for t, _ in combos)
    # the largest cap that every fastest combination exceeds
    cap = max(p for p in peaks if p < min(q for t, q in combos if t == fastest))
    best = min(t for t, p in combos if p <= cap)
    assert best > min(t for t, _ in combos), "the cap must bind"

    mm.limit = cap
    sol = solve(problem, cluster, mm, backend=backend, mip_gap=0.0)   # SCIP stops at its gap otherwise
    assert sol.status == "optimal"
    recomputed_tiebreak = 1e-9 * len(sol.recompute)  # memory_rows.py adds a nanosecond per recomputed node
    assert sol.objective - recomputed_tiebreak == pytest.approx(best, rel=1e-6, abs=1e-9)
    peak = sum(predicted_memory(mm, sol.choice, sol.recompute).values())
    assert peak <= cap * (1 + 1e-9)
    # of the equally fast combinations that fit, one with the least memory (solve.PEAK_TIE_BREAK)
    assert peak <= min(p for t, p in combos if p <= cap and t <= best * (1 + 1e-9)) * (1 + 1e-9)

    mm.limit = peaks[0] * 0.999  # below every combination
    with pytest.raises(InfeasibleError):
        solve(problem, cluster, mm, backend=backend)


def test_random_ops_are_never_recomputed():
    import torch

    import autoshard
    from autoshard import _torch
    from autoshard.passes.strategies import find_strategies
    from autoshard.solver.formulation import formulate

    class Dropout(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

        def forward(self, x, y):
            return ((self.b(torch.nn.functional.dropout(self.a(x), 0.5, training=True)) - y) ** 2).mean()

    cluster = Cluster.local(2)
    traced = autoshard.trace(Dropout(), (torch.randn(8, 8), torch.randn(8, 4)))
    find_strategies(traced.gm, _torch.planning_mesh(cluster.mesh_shape, cluster.mesh_dim_names))
    problem = formulate(traced, cluster)
    mm = memory_model(traced, problem, cluster, float("inf"), 2.0)
    seeded = [n for n in problem.nodes if torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())]
    assert seeded, "the trace has a seeded random op"
    assert not set(seeded) & set(mm.recomputable)


# ----------------------------------------------------------------- gradient buckets, gathered copies
def test_gradient_bucket_and_gathered_copy_bytes_by_hand():
    """One gradient of N bytes (global) on 2 ranks: reduced in backward it holds its unreduced
    copy and the flat bucket's (2N for a partial sum, whichever the storage); a use that gathers
    a sharded parameter holds the full copy (N); nothing moves, nothing is held."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    from autoshard.cluster import costmodel
    from autoshard.solver.formulation import Edge
    from autoshard.solver.memory import MemoryModel, delivered, gathered, in_flight

    N = 4096.0   # a float32 (64, 16) gradient
    storage = SimpleNamespace(param=SimpleNamespace(meta={"val": torch.empty(64, 16, device="meta")}))
    e = Edge(None, 0, storage, None, N, kind="grad", kept=N)
    mm = MemoryModel(1e9, mesh_shape=(2,))
    P, R, S0, S1 = (Partial(),), (Replicate(),), (Shard(0),), (Shard(1),)
    assert costmodel.bucket_move(P, R) == ("all_reduce", (0,))
    assert costmodel.bucket_move(P, S1) == ("reduce_scatter", 0, 1)
    assert costmodel.bucket_move(S0, R) is None and costmodel.bucket_move(R, R) is None
    assert in_flight(mm, e, P, R) == in_flight(mm, e, P, S0) == 2 * N
    assert in_flight(mm, e, S0, S0) == 0 and delivered(mm, e, P, R) == 0   # reduced in backward
    # with accumulation the runtime hands it over unreduced: the gradient, its bucket copy, and
    # a reduce-scatter's result (N / 2)
    mm.reduce_in_backward = False
    assert in_flight(mm, e, P, S0) == 0 and delivered(mm, e, P, S0) == 2.5 * N and delivered(mm, e, P, R) == 2 * N
    # a gradient whose rows do not split evenly over 2 ranks is handed over whatever K is (the
    # runtime moves it through DTensor after backward): its bytes go to the end of backward
    mm.reduce_in_backward = True
    odd = SimpleNamespace(param=SimpleNamespace(meta={"val": torch.empty(3, 16, device="meta")}))
    e3 = Edge(None, 0, odd, None, 192.0, kind="grad", kept=192.0)
    assert in_flight(mm, e3, P, S1) == 2 * 192 and in_flight(mm, e3, P, S0) == 0
    assert delivered(mm, e3, P, S0) == 2.5 * 192 and delivered(mm, e3, P, S1) == 0
    use = Edge(None, 0, None, None, N)
    assert gathered(mm, use, S0, R) == N and gathered(mm, use, S0, S0) == 0 and gathered(mm, use, R, S0) == 0


@pytest.mark.parametrize("name, size", [("mlp", "tiny"), ("hf_gpt2", "124m")])
def test_equally_fast_plans_tie_break_towards_less_memory(monkeypatch, name, size):
    """The step-time objective carries PEAK_TIE_BREAK (1 ns per MiB of peak), taken off the
    reported objective. Against a lexicographic solve of the same problem, both to a proven
    optimum: the least peak of any plan no slower than the tie-broken one (its step a row, the
    peak the objective). Without the tie-break HiGHS may land on any of the equally fast plans
    (on the tiny MLP, 8 KiB of 80 KiB heavier on torch 2.13, the lightest on 2.11), so only the
    comparison with the lexicographic optimum can tell the tie-break works."""
    import autoshard
    import autoshard.solver.solve as solve_mod
    from autoshard import zoo
    from autoshard.solver.model import US

    model, inputs = zoo.get(name, size, device="cpu" if size == "tiny" else "meta")
    traced = autoshard.trace(model, inputs)
    cluster = Cluster.preset("perlmutter", 1)
    problem = _problem(traced, cluster)
    mm = memory_model(traced, problem, cluster, float("inf"), 2.0)
    peak = lambda sol: sum(predicted_memory(mm, sol.choice, sol.recompute).values())  # noqa: E731
    fastest = solve(problem, cluster, mm, mip_gap=0.0)
    assert fastest.status == "optimal"

    real = solve_mod._objective

    def lexicographic(m, mem, minimize, cutoff, backend):
        m.add([(i, c) for i, c in enumerate(m.cost) if c], upper=fastest.objective * US * (1 + 1e-9))
        return real(m, mem, minimize, cutoff, backend)

    monkeypatch.setattr(solve_mod, "_objective", lexicographic)
    least = solve(problem, cluster, mm, minimize="memory", mip_gap=0.0)
    assert least.status == "optimal"
    assert peak(fastest) == pytest.approx(peak(least), rel=1e-6)


def test_full_recompute_saves_each_layers_inputs_and_replays_one_layer_at_a_time():
    """``recompute="full"`` is per-layer activation checkpointing: a 6-layer GPT saves what crosses
    a layer's boundary and recomputes everything else; in backward one layer's recomputed values
    are live at a time, about a sixth of what the plan without recompute saves (recomputing the
    boundaries too would replay the whole forward at backward's start: 19.2 of 26.1 MB)."""
    import autoshard
    from autoshard.passes.coarsen import LAYER_KEY
    from autoshard.zoo import GPT, GPTConfig

    layers = 6
    model = GPT(GPTConfig(vocab=128, seq=64, hidden=128, heads=4, layers=layers))
    traced = autoshard.trace(model, model.example_inputs(16))
    cluster = Cluster.local(2)
    plain = autoshard.plan(traced, cluster, recompute=False)
    full = autoshard.plan(traced, cluster, recompute="full")
    layer = lambda n: (n.meta.get(LAYER_KEY) or (None, None))[1]  # noqa: E731
    fwd = {n.name: n for n in traced.gm.graph.nodes if n.op == "call_function"
           and n.meta["autoshard.cost"].phase == "fwd" and n.target is not operator.getitem}
    reads = lambda n: [w for u in n.users for w in (reads(u) if u.target is operator.getitem else [u])]  # noqa: E731
    crosses = {name for name, n in fwd.items() if any(u.name in fwd and layer(u) != layer(n) for u in reads(n))}
    assert len(crosses) >= layers + 1   # every layer's input, and the last one's output
    decided = {d.name: d.recompute for d in full.nodes if d.name in fwd and d.layer is not None}
    # what else is saved draws random numbers (CPU flash attention takes a dropout seed), which
    # is never recomputed
    seeded = {n for n in decided if torch.Tag.nondeterministic_seeded in fwd[n].target.tags}
    assert {n for n, rc in decided.items() if not rc} - crosses == seeded
    assert all(decided[n] is False for n in crosses if n in decided)
    assert full.memory["recomputed"] <= plain.memory["activations"] / layers * 1.1
    assert full.memory["activations"] + full.memory["recomputed"] < plain.memory["activations"] / 3
