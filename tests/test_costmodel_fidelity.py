"""The cost-model terms that make predictions agree with measured runs, each against a
hand-computed formula or a count read from the traced graph: per-kind collective fits, the
optimizer step, the resharding a recomputed node runs again, and the recomputed values live in
backward. Nothing here times anything."""

from __future__ import annotations

import operator

import pytest
import torch
from torch.distributed.tensor import Partial, Shard

import autoshard
from autoshard import _torch
from autoshard.cluster import costmodel
from autoshard.cluster.calibrate import link_from_fit
from autoshard.cluster import COLLECTIVES, Cluster, DeviceSpec
from autoshard.passes.annotate import META_KEY as COST_KEY, tensor_bytes
from autoshard.passes.coarsen import repeated_layers
from autoshard.passes.strategies import META_KEY, find_strategies
from autoshard.solver.formulation import Storage, formulate
from autoshard.solver.memory import memory_model, moments, predicted_memory, recomputed_live
from autoshard.zoo import GPT, GPTConfig, MLP
from custom_ops import MLPOwnLoss

KiB, MiB = 2**10, 2**20
# one line t = a + b n per kind, as a calibration on gloo finds them: a reduce-scatter that costs
# an all-reduce (gloo runs it as one), not the ring's half
LINES = {"all_reduce": (400e-6, 6e-10), "all_gather": (150e-6, 5e-10), "reduce_scatter": (420e-6, 6.5e-10),
         "all_to_all": (180e-6, 3.5e-10)}


def _dim(p: int, lines: dict, name: str = "d0") -> dict:
    fits = {}
    for kind, (a, b) in lines.items():
        link = link_from_fit(kind, p, a, b, kind)
        fits[kind] = {"a": a, "b": b, "latency": link.latency, "bandwidth": link.bandwidth}
    return {"name": name, "size": p, "measured": True, "fits": fits}


def _calibrated(shape=(2,), lines=(LINES,), **extra) -> Cluster:
    dims = [_dim(p, lv, f"d{i}") for i, (p, lv) in enumerate(zip(shape, lines))]
    links = [link_from_fit("all_reduce", p, *lv["all_reduce"], "ar") for p, lv in zip(shape, lines)]
    device = DeviceSpec("measured", {"float32": 5e10}, 2e10, 8e9, compute_efficiency=1.0, memory_efficiency=1.0,
                        launch_overhead=2e-6, comm_overlap=0.0)
    return Cluster(shape, device=device, links=links, calibration={"mesh_dims": dims, **extra})


# --- 1. every collective kind priced by its own fit ------------------------------------------------
@pytest.mark.parametrize("kind", COLLECTIVES)
def test_each_kind_is_its_own_measured_line(kind):
    c = _calibrated()
    a, b = LINES[kind]
    for n in (64 * KiB, MiB, 16 * MiB):
        assert c.collective_time(kind, n, 0) == pytest.approx(a + b * n, rel=1e-12)
    # the same cluster without the calibration prices it by the all-reduce link's ring ratios
    bare = Cluster((2,), device=c.device, links=c.links)
    ar_a, ar_b = LINES["all_reduce"]
    ratio = 1.0 if kind == "all_reduce" else 0.5
    assert bare.collective_time(kind, MiB, 0) == pytest.approx(ratio * (ar_a + ar_b * MiB), rel=1e-12)


def test_resharding_prices_a_reduce_scatter_by_its_fit():
    c = _calibrated()
    (col,) = costmodel.resharding(c, (Partial(),), (Shard(0),), 4 * MiB)
    a, b = LINES["reduce_scatter"]
    assert col.kind == "reduce_scatter" and col.time == pytest.approx(a + b * 4 * MiB, rel=1e-12)


def test_a_renamed_mesh_keeps_the_fits_and_a_regrouped_one_drops_them():
    c = _calibrated()
    roles = c.with_mesh((2,), ("dp",))   # what a baseline does: same ranks, a role for a name
    assert roles.calibration == c.calibration and roles.mesh_dim_names == ("dp",)
    for kind in COLLECTIVES:
        assert roles.collective_time(kind, MiB, "dp") == c.collective_time(kind, MiB, 0)
    one = c.with_mesh((1,))
    assert one.calibration is None and one.collective_time("reduce_scatter", MiB, 0) == 0.0


def test_local_keeps_a_saved_calibration(monkeypatch, tmp_path):
    c = _calibrated()
    path = tmp_path / "calib.json"
    path.write_text(c.to_json())
    monkeypatch.setenv("AUTOSHARD_CALIBRATION", str(path))
    local = Cluster.local(2)
    a, b = LINES["reduce_scatter"]
    assert local.collective_time("reduce_scatter", MiB, 0) == pytest.approx(a + b * MiB, rel=1e-12)
    assert Cluster.local(4, (2, 2)).calibration is None   # other ranks per dim: the fits do not apply


def test_hierarchical_all_reduce_takes_its_pieces_fits():
    """(2, 2) with dim 1 the faster: all_reduce(n, both) = RS_1(n) + AR_0(n/2) + AG_1(n)."""
    fast = {k: (a / 4, b / 4) for k, (a, b) in LINES.items()}
    c = _calibrated((2, 2), (LINES, fast))
    n = 8 * MiB
    line = lambda lv, kind, m: lv[kind][0] + lv[kind][1] * m  # noqa: E731
    expected = line(fast, "reduce_scatter", n) + line(LINES, "all_reduce", n / 2) + line(fast, "all_gather", n)
    assert c.collective_time("all_reduce", n, (0, 1)) == pytest.approx(expected, rel=1e-12)


# --- 4. the optimizer step ---------------------------------------------------------------------------
def _mlp_problem(cluster, dims=(8, 16, 4), batch=8, freeze=()):
    torch.manual_seed(0)
    model = MLP(dims)
    for name, p in model.named_parameters():
        if name in freeze:
            p.requires_grad_(False)
    traced = autoshard.trace(model, (torch.randn(batch, dims[0]), torch.randn(batch, dims[-1])))
    find_strategies(traced.gm, _torch.planning_mesh(cluster.mesh_shape, cluster.mesh_dim_names))
    return traced, formulate(traced, cluster)


def test_optimizer_time_by_hand():
    c = _calibrated(dtensor_op_overhead=7e-6)
    traced, problem = _mlp_problem(c)
    for name, p in traced.params:
        st = problem.storage[p]
        for s, strategy in enumerate(p.meta[META_KEY].strategies):
            numel = p.meta["val"].numel()
            shards = 2 if isinstance(strategy.outputs[0][0], Shard) else 1
            # 9 kernels, each a launch plus a DTensor dispatch; 7 passes of the local shard
            hand = 9 * (2e-6 + 7e-6) + 7 * numel * 4 / shards / 2e10
            assert costmodel.optimizer_time(c, p, strategy) == pytest.approx(hand, rel=1e-12), name
            assert problem.cost[st][s] == pytest.approx(hand, rel=1e-12)
    assert any(isinstance(n, Storage) for n in problem.nodes)
    # one device: the module's parameters are plain tensors (runtime.py), no DTensor dispatch
    c2 = _calibrated(dtensor_op_overhead=7e-6)
    one = Cluster((1,), device=c2.device, links=c2.links[:1], calibration=c2.calibration)
    name, p = traced.params[0]
    hand = 9 * 2e-6 + 7 * p.meta["val"].numel() * 4 / 2e10
    assert costmodel.optimizer_time(one, p, p.meta[META_KEY].strategies[0]) == pytest.approx(hand, rel=1e-12)


def test_a_frozen_parameter_has_no_optimizer_step():
    c = _calibrated()
    traced, problem = _mlp_problem(c, freeze=("layers.0.weight",))
    frozen = dict(traced.params)["layers.0.weight"]
    assert not any(problem.cost[problem.storage[frozen]])
    trained = dict(traced.params)["layers.0.bias"]
    assert all(t > 0 for t in problem.cost[problem.storage[trained]])


# --- 2. resharding again for recomputed nodes ----------------------------------------------------------
def test_fsdp_recompute_gathers_every_parameter_again():
    """FSDP with full recompute on an MLP: backward replays both linears, so each parameter is
    all-gathered once more (bucketed: bandwidth only). At this size the plan splits the first
    linear's batch and gathers its output before the activation, and computes the rest
    replicated, so the replays also gather that output (16 x 128) and the batch-sharded target
    (the loss) again. The ILP's objective grows by those gathers and the replayed compute."""
    from autoshard.planning.baselines import plan_baseline

    c = Cluster.local(2)
    torch.manual_seed(0)
    model = MLPOwnLoss((64, 128, 32))   # its loss an op with no rule: replicated, the target gathered
    traced = autoshard.trace(model, (torch.randn(16, 64), torch.randn(16, 32)))
    plain = plan_baseline(traced, c, "fsdp")
    # each weight's storage ties between its two dims (equal pieces): pinned to plain's choice
    again = plan_baseline(traced, c, "fsdp+recompute", constraints=plain.storage)
    assert [n.strategy for n in plain.nodes] == [n.strategy for n in again.nodes]   # same placements
    # parameter gathers run bucketed (one latency per bucket, not per parameter: costmodel's
    # ``bucketed``); the batch's are single collectives
    latency = 2 * c.collective_time("all_gather", 1.0, 0) - c.collective_time("all_gather", 2.0, 0)
    gathers = sum(c.collective_time("all_gather", p.numel() * 4, 0) - latency for p in model.parameters())
    gathers += c.collective_time("all_gather", 16 * 128 * 4, 0) + c.collective_time("all_gather", 16 * 32 * 4, 0)
    replayed = again.breakdown["recompute"]
    assert gathers > 0 and replayed > 0
    assert again.solver["objective"] - plain.solver["objective"] == pytest.approx(
        replayed + gathers, rel=1e-6, abs=2e-9 * sum(n.recompute for n in again.nodes))


# --- 3. recomputed values live in backward ------------------------------------------------------------
BATCH = 4


@pytest.fixture(scope="module")
def gpt():
    cfg = GPTConfig(vocab=64, seq=16, hidden=32, heads=2, layers=3)
    model = GPT(cfg)
    traced = autoshard.trace(model, model.example_inputs(BATCH, generator=torch.Generator().manual_seed(0)))
    cluster = Cluster.local(2)
    find_strategies(traced.gm, _torch.planning_mesh(cluster.mesh_shape, cluster.mesh_dim_names))
    repeated_layers(traced)
    problem = formulate(traced, cluster)
    mm = memory_model(traced, problem, cluster, float("inf"), 2.0)
    choice = {v: 0 for v in problem.nodes}   # every node replicated: act = the full output bytes
    return cfg, mm, choice, _read_by_backward(traced.gm.graph)


def _aliases(n) -> bool:
    """Whether n's output shares its input's memory, by torch's schema (a getitem: part of a tuple)."""
    if n.target is operator.getitem:
        return True
    schema = getattr(n.target, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def _base(n):
    while n.op == "call_function" and _aliases(n):
        n = n.all_input_nodes[0]
    return n


def _read_by_backward(graph) -> dict:
    """The forward ops whose outputs (through views and getitems) a backward op of the graph reads:
    {op: bytes of all its outputs}."""
    phase = lambda n: n.meta[COST_KEY].phase if n.op == "call_function" else None  # noqa: E731
    return {u: tensor_bytes(u.meta["val"]) for n in graph.nodes if phase(n) == "bwd"
            for u in map(_base, n.all_input_nodes) if phase(u) == "fwd"}


def _per_phase(mm, choice, recompute, part: str) -> list[float]:
    """One part of every backward phase's moment, in backward's order: before the layers, each
    layer from the last to the first, after the layers."""
    every = moments(mm, choice, recompute)
    return [every[name][part] for name in mm.phase_names]


def test_recomputing_the_gelus_holds_one_layers_gelu(gpt):
    """Gelus recomputed (with the views fc2 reads them through): each comes back in its own
    layer's backward, one at a time; what they replay from, the fc outputs, backward reads anyway
    (gelu's backward), so the saved bytes drop by the gelus' outputs, and each backward phase
    holds as many fewer gelus as it held saved: every layer's before the layers, then one layer
    fewer per layer done."""
    cfg, mm, choice, read = gpt
    gelus = {v for v in mm.recomputable if v.target is torch.ops.aten.gelu.default}
    views = {v for v in mm.recomputable if _aliases(v) and _base(v) in gelus}
    assert len(gelus) == cfg.layers and len(views) == cfg.layers
    assert gelus <= read.keys() and {_base(a) for g in gelus for a in g.all_input_nodes} <= read.keys()
    one = BATCH * cfg.seq * 4 * cfg.hidden * 4   # batch x seq x 4h fp32
    assert predicted_memory(mm, choice, set()).saved == sum(read.values())
    assert predicted_memory(mm, choice, gelus | views).saved == sum(read.values()) - cfg.layers * one
    assert mm.phases == cfg.layers + 2
    held = [cfg.layers] + [cfg.layers - k for k in range(cfg.layers)] + [0]   # saved gelus live per phase
    kept = _per_phase(mm, choice, set(), "activations")
    assert _per_phase(mm, choice, gelus | views, "activations") == [a - g * one for a, g in zip(kept, held)]
    assert _per_phase(mm, choice, gelus | views, "recomputed") == [0.0] + [one] * cfg.layers + [0.0]
    assert recomputed_live(mm, choice, gelus | views) == one


def test_recomputing_everything_brings_the_forward_back_at_the_start(gpt):
    """Full recompute: the loss's backward needs the logits, whose replay runs back through the
    whole residual stream, so what backward reads comes back at once, as if saved, except the
    attention's output (random-seeded: saved, never replayed) and what only the attention reads,
    a layer's first LayerNorm and qkv projection, which come back one layer at a time, when that
    layer's attention backward needs them. Each value then dies in the phase of its last reader:
    the head's after the first phase, a layer's after its own."""
    cfg, mm, choice, read = gpt
    seeded = {u for u in read if torch.Tag.nondeterministic_seeded in getattr(u.target, "tags", ())}
    assert len(seeded) == cfg.layers and not seeded & set(mm.recomputable)
    tokens, h, f32 = BATCH * cfg.seq, cfg.hidden, 4
    norm = tokens * h * f32 + 2 * tokens * f32                   # LayerNorm out, mean, rstd
    lazy = norm + tokens * 3 * h * f32                           # and q, k, v
    loss = 2 * f32                                               # nll_loss's output and total weight
    head = tokens * cfg.vocab * f32 + loss + norm + tokens * h * f32   # log_softmax, loss, final norm, its input
    # the rest of a layer: fc1's output and gelu, the second norm, the layer's input and mid residual
    layer = 2 * tokens * 4 * h * f32 + norm + 2 * tokens * h * f32
    positions = cfg.seq * 8                                      # the position ids (int64) the embedding reads
    attention = sum(read[u] for u in seeded)
    assert sum(read.values()) == head + cfg.layers * (layer + lazy) + positions + attention
    at_start = sum(b for u, b in read.items() if u not in seeded) - cfg.layers * lazy
    assert at_start == head + cfg.layers * layer + positions
    live = _per_phase(mm, choice, set(mm.recomputable), "recomputed")
    assert live == ([at_start]
                    + [(cfg.layers - k) * layer + positions + lazy for k in range(cfg.layers)]
                    + [positions])
    # the head's replayed values (with the loss) outweigh one layer's lazy ones: the peak is the first phase
    assert recomputed_live(mm, choice, set(mm.recomputable)) == max(live) == at_start
