"""The emitted FSDP module gathers a block's parameters at once (passes/rewrite.py:
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
    """About one gather per block: the 2 layers, what lies before and after them (embeddings,
    the final norm and head), and a gather of a computed value (the tied head's weight)."""
    for r in ranks:
        for phase in ("fwd", "bwd"):
            assert 1 <= r["graph"][phase] <= r["layers"] + 3, r
            assert 3 * r["graph"][phase] <= r["listed"][phase], r   # the plan's, one per use


def test_bucketed_module_matches_single_device(ranks):
    for r in ranks:
        assert r["loss_err"] < 1e-5 and r["grad_err"] < 1e-5, r
