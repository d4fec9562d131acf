"""The emitted FSDP module gathers a block's parameters at once (passes/bucket.py:
bucket_gathers), as FSDP does per module, where the plan lists one gather per parameter use; the
numerics stay the single device's (2 gloo ranks, tests/bucket_cases.py)."""

from __future__ import annotations

import pytest

import bucket_cases
from autoshard.runtime.launch import run_local

pytestmark = pytest.mark.world(2)


@pytest.fixture(scope="module")
def ranks():
    return run_local(bucket_cases.fsdp_gathers, 2, timeout=300)


def test_one_gather_per_block_and_phase(ranks):
    """About one gather per block: the 2 layers, each parameter outside them alone (the two
    embeddings; the final norm's go with the last layer's), and a gather of a computed value
    (the tied head's weight)."""
    for r in ranks:
        for phase in ("fwd", "bwd"):
            assert 1 <= r["graph"][phase] <= r["layers"] + 4, r
            assert 3 * r["graph"][phase] <= r["listed"][phase], r   # the plan's, one per use


def test_bucketed_module_matches_single_device(ranks):
    for r in ranks:
        assert r["loss_err"] < 1e-5 and r["grad_err"] < 1e-5, r


@pytest.fixture(scope="module")
def reductions():
    return run_local(bucket_cases.grad_reductions, 2, timeout=300)


@pytest.mark.parametrize("name,kind", [("ddp", "all_reduce"), ("fsdp", "reduce_scatter")])
def test_backward_reduces_each_blocks_gradients_in_one_collective(reductions, name, kind):
    """Every gradient moves inside backward (passes/bucket.py: reduce_gradients), in about one
    bucket per block (the layers, what lies before and after them), each one collective."""
    for r in reductions:
        a = r[name]
        assert a["reduced"] == a["params"], a
        assert a["kinds"] == [kind], a
        assert 2 <= a["buckets"] <= a["layers"] + 2, a   # the layers, and what lies before and after
        assert a["backward_collectives"] - a["graph_collectives"] == a["buckets"], a
        assert a["grad_err"] < 1e-5, a


def shared_chain_gathers() -> dict:
    """Two blocks' gathers, the second block's two reading one transpose of an input (a weight
    and its transposed copy, as a backward reads them), bucketed per block: the graph is still
    topologically ordered and computes what it did (module-level: spawned ranks import it)."""
    import torch
    import torch.distributed as dist
    from torch.fx.experimental.proxy_tensor import make_fx

    from autoshard.passes.bucket import bucket_gathers
    from autoshard.passes.rewrite import ORIGIN

    c10d, group = torch.ops._c10d_functional, dist.group.WORLD.group_name
    ranks = dist.get_world_size()

    def gathered(t):
        return c10d.wait_tensor(c10d.all_gather_into_tensor(t, ranks, group))

    def step(w0, w1):
        a1, a2 = gathered(w0.clone()), gathered(w0 * 2)
        t = w1.t()
        b1, b2 = gathered(t.clone(memory_format=torch.contiguous_format)), gathered(t.contiguous() + 1)
        return a1.sum() + a2.sum() + b1 @ b2.t()

    w0, w1 = (torch.randn(4, 6, generator=torch.Generator().manual_seed(dist.get_rank() + s)) for s in (0, 9))
    gm = make_fx(step, tracing_mode="fake")(w0, w1)
    gathers = [n for n in gm.graph.nodes if n.target is c10d.all_gather_into_tensor.default]
    for i, n in enumerate(gathers):
        n.meta.setdefault("custom", {})[ORIGIN] = f"g{i}"
    want = step(w0, w1)
    bucket_gathers(gm, {"g0": "block0", "g1": "block0", "g2": "block1", "g3": "block1"})
    return {"gathers": sum(1 for n in gm.graph.nodes if "all_gather" in str(n.target)),
            "err": (gm(w0, w1) - want).abs().max().item()}


def test_blocks_sharing_an_input_chain_bucket_in_topological_order():
    for r in run_local(shared_chain_gathers, 2, timeout=300):
        assert r["gathers"] == 2 and r["err"] < 1e-6, r
