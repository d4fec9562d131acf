"""The backend a plan is made for: what it prices (fused elementwise chains under inductor, against
hand arithmetic), what it records, and that a plan runs only under its own backend. The compiled
programs' numerics run in tests/test_training_loop.py (the ``-inductor`` setups)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

import autoshard
from autoshard.cluster import Cluster, costmodel
from autoshard.errors import ConstraintError, PlanMismatchError
from autoshard.passes.annotate import META_KEY
from autoshard.planning.plan import Plan

N = 64 * 128   # elements of the chain's tensors


class Chain(nn.Module):
    """exp(3 x + 1) @ w: three elementwise ops in a row, then a matmul, which fuses nothing."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(128, 16))

    def forward(self, x):
        return (torch.exp(x * 3 + 1) @ self.w).sum()


def _chain():
    traced = autoshard.trace(Chain(), (torch.randn(64, 128),))
    ops = {n.target: n for n in traced.gm.graph.nodes if n.meta.get(META_KEY) and n.meta[META_KEY].phase == "fwd"}
    aten = torch.ops.aten
    return traced, [ops[aten.mul.Tensor], ops[aten.add.Tensor], ops[aten.exp.default]]


def test_a_fused_chain_reads_its_input_once_and_writes_its_end_once():
    """Eager runs three kernels, each reading and writing N floats (6N x 4 bytes, 3 launches);
    inductor one, reading x and writing exp's value, which the matmul and backward read
    (2N x 4 bytes, 1 launch): the multiply and the add run inside exp's kernel."""
    _, chain = _chain()
    mul, add, exp = (n.meta[META_KEY] for n in chain)
    assert [c.bytes for c in (mul, add, exp)] == [2 * N * 4] * 3
    assert (mul.fused_bytes, add.fused_bytes, exp.fused_bytes) == (N * 4, 0.0, N * 4)
    assert (mul.inlined, add.inlined, exp.inlined) == (True, True, False)


def test_inductor_prices_the_fused_kernel():
    """The chain's time under each backend against the roofline by hand: eager 3 x (launch +
    8N / bandwidth), inductor launch + 8N / bandwidth."""
    traced, chain = _chain()
    cluster = Cluster.local(1)
    d = cluster.device
    one = lambda nbytes: nbytes / (d.memory_bandwidth * d.memory_efficiency)  # noqa: E731
    flops = sum(n.meta[META_KEY].flops for n in chain)
    assert flops / (d.flops(torch.float32) * d.compute_efficiency) < one(8 * N)   # bandwidth-bound
    autoshard.plan(traced, cluster, progress=False)   # strategies on every node
    strategy = lambda n: n.meta["autoshard.strategies"].strategies[0]  # noqa: E731
    eager = sum(costmodel.compute_time(cluster, n, strategy(n), "eager") for n in chain)
    fused = sum(costmodel.compute_time(cluster, n, strategy(n), "inductor") for n in chain)
    assert eager == pytest.approx(3 * (d.launch_overhead + one(8 * N)))
    assert fused == pytest.approx(d.launch_overhead + one(8 * N))


def test_a_gpt_plan_under_inductor_records_it_and_computes_faster():
    from autoshard.zoo import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny())
    traced = autoshard.trace(model, model.example_inputs(8))
    cluster = Cluster.local(2)
    eager = autoshard.plan(traced, cluster, progress=False)
    fused = autoshard.plan(traced, cluster, backend="inductor", progress=False)
    assert (eager.backend, fused.backend) == ("eager", "inductor")
    # the residual adds run inside their layer norms' kernels (still written: backward reads them)
    assert fused.compute_time < eager.compute_time
    assert Plan.from_json(fused.to_json()).backend == "inductor"
    with pytest.raises(PlanMismatchError, match="backend='inductor'"):
        fused.check_matches(traced.fingerprint, cluster.to_json(), "eager")
    fused.check_matches(traced.fingerprint, cluster.to_json(), "inductor")
    # a plan saved before the backend was recorded is an eager one
    old = json.loads(fused.to_json())
    del old["backend"]
    assert Plan.from_json(json.dumps(old)).backend == "eager"


def test_an_unknown_backend_is_a_constraint_error():
    model = Chain()
    with pytest.raises(ConstraintError, match="backend must be one of 'eager', 'inductor'"):
        autoshard.plan(model, Cluster.local(2), (torch.randn(64, 128),), backend="tvm", progress=False)


def one_rank_inductor_case() -> dict:
    """On one gloo rank: the MLP compiled by inductor, a step against the eager model's, then the
    same step under a dispatch mode (which torch.compile does not run under)."""
    import copy

    from torch.utils._python_dispatch import TorchDispatchMode

    from autoshard.zoo import MLP

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(8, 32, generator=g), torch.randn(8, 16, generator=g))
    dm = autoshard.compile(model, Cluster.local(1), batch, backend="inductor")
    ref(*batch).backward()
    loss = dm(*batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in dm.named_parameters()}
    err = max((grads[n] - p.grad).abs().max().item() for n, p in ref.named_parameters())
    dm.zero_grad()
    seen = Seen()
    with warnings.catch_warnings(record=True) as caught, seen:
        warnings.simplefilter("always")
        dm(*batch).backward()
    again = max((p.grad - grads[n]).abs().max().item() for n, p in dm.named_parameters())
    return {"backend": dm.plan.backend, "err": err, "again": again, "ops_seen": seen.ops,
            "warned": [str(w.message) for w in caught if "TorchDispatchMode" in str(w.message)]}


@pytest.mark.world(1)
def test_one_rank_under_inductor_matches_eager_and_runs_uncompiled_under_a_dispatch_mode():
    from autoshard.runtime.launch import run_local

    (r,) = run_local(one_rank_inductor_case, 1, timeout=600)
    assert r["backend"] == "inductor"
    assert r["err"] <= 1e-5
    # the program ran op by op where the mode could see it, with the same gradients
    assert r["warned"] and r["ops_seen"] > 0 and r["again"] <= 1e-5


def transformers_inductor_case() -> dict:
    """transformers' Llama (from a config: RoPE, GQA, RMSNorm, SwiGLU; code autoshard did not
    write) planned for and compiled by inductor on this rank, one step against the single-device
    eager model's."""
    import copy

    from torch.distributed.tensor import DTensor

    from autoshard import zoo

    torch.manual_seed(0)
    model, batch = zoo.get("hf_llama3", "tiny")
    ref = copy.deepcopy(model)
    dm = autoshard.compile(model, Cluster.local(2), batch, backend="inductor")
    loss = dm(*dm.shard_inputs(*batch))
    loss.backward()
    ref_loss = ref(*batch)
    ref_loss.backward()
    full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731
    grad = max((full(p.grad) - ref.get_parameter(n).grad).abs().max().item() for n, p in dm.named_parameters())
    return {"loss": abs(loss.item() - ref_loss.item()), "grad": grad, "backend": dm.plan.backend,
            "compiled_calls": sum(run.compiled_calls for run in dm._run.values() if run is not None)}


@pytest.mark.world(2)
def test_transformers_llama_under_inductor_trains_like_one_device():
    from autoshard.runtime.launch import run_local

    for rank, r in enumerate(run_local(transformers_inductor_case, 2, timeout=900)):
        assert r["backend"] == "inductor" and r["compiled_calls"] >= 2, (rank, r)   # forward and backward
        assert r["loss"] <= 1e-5 and r["grad"] <= 1e-5, (rank, r)
