"""The emitted FSDP module gathers a block's parameters at once (passes/bucket.py:
bucket_gathers), as FSDP does per module, where the plan lists one gather per parameter use; the
numerics stay the single device's (2 gloo ranks, tests/bucket_cases.py)."""

from __future__ import annotations

import pytest

import bucket_cases
from autoshard.launch import run_local


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
