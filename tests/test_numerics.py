"""Distributed numerics on real gloo processes: 2 ranks on mesh (2,), 4 ranks on mesh (2, 2).

Loss, every gradient and every parameter after one SGD step equal the single-device run (fp32,
atol 1e-5) for the free plan and for plans pinned to DDP, FSDP-like storage, Megatron tensor
parallelism and, on the 2-D mesh, data x tensor mixes. All cases of one world size share one
launch: process start-up dominates otherwise.
"""

from __future__ import annotations

import fnmatch

import pytest

import dist_cases as dc
from autoshard.runtime.launch import run_local

pytestmark = pytest.mark.world(4)

ATOL = 1e-5


def _cases(kind_cases: list[tuple[str, dict]]) -> dict:
    return {f"{kind}-{name}": (kind, shape, cons) for kind, cases in kind_cases for name, (shape, cons) in cases.items()}


CASES_2 = _cases([("gpt", dc.GPT_CASES), ("mlp", dc.MLP_CASES)])
CASES_4 = _cases([("gpt", dc.GPT_CASES_2D), ("mlp", dc.MLP_CASES_2D)])


# Spawned, not forked from run_local's server: each rank has its own hash seed, as under torchrun,
# so ranks that would build their programs from sets iterated in different orders disagree here.
@pytest.fixture(scope="module")
def results_2():
    return run_local(dc.run_cases, 2, CASES_2, timeout=900, start_method="spawn")


@pytest.fixture(scope="module")
def results_4():
    return run_local(dc.run_cases, 4, CASES_4, timeout=900, start_method="spawn")


def _check(results, name, pins):
    for rank, res in enumerate(results):
        r = res[name]
        assert r["loss"] < ATOL and r["grad"] < ATOL and r["param"] < ATOL, (rank, name, r)
        assert r["is_dtensor"] and r["names"], (rank, name)
        for pattern, placements in (pins or {}).items():
            if pattern == "working":  # FSDP gathers at each consumer; ZeRO-2 once per step, kept
                assert (r["gathered_once"] > 0) == (placements != list(pins["*"])), (rank, name, r)
            elif pattern == "inputs":
                assert r["inputs"] == ["(" + ",".join(p) + ")" for p in placements], (rank, name, r["inputs"])
            else:
                pinned = {p: got for p, got in r["storage"].items() if fnmatch.fnmatchcase(p, pattern)}
                assert pinned and set(pinned.values()) == {"(" + ",".join(placements) + ")"}, \
                    (rank, name, pattern, pinned)


@pytest.mark.parametrize("name", list(CASES_2))
def test_two_ranks_match_single_device(results_2, name):
    _check(results_2, name, CASES_2[name][2])


@pytest.mark.parametrize("name", list(CASES_4))
def test_four_ranks_2d_mesh_match_single_device(results_4, name):
    _check(results_4, name, CASES_4[name][2])


def test_fsdp_plan_shards_storage(results_2):
    for rank, res in enumerate(results_2):
        assert set(res["gpt-fsdp"]["storage"].values()) == {"(S(0))"}, rank
        assert set(res["gpt-ddp"]["storage"].values()) == {"(R)"}, rank


@pytest.fixture(scope="module")
def recompute_runs():
    return run_local(dc.saved_bytes_cases, 2, [None, 0.7], timeout=900)


def test_recompute_plan_trains_with_single_device_numerics(recompute_runs):
    for rank in recompute_runs:
        free, tight = rank
        assert tight["recomputed"] > 0 and free["recomputed"] == 0
        for r in (free, tight):
            assert r["loss_err"] < ATOL and r["grad_err"] < ATOL, r


def test_saved_activations_measured_against_prediction(recompute_runs):
    for rank, (free, tight) in enumerate(recompute_runs):
        # with partial recompute: less than without, predicted and measured
        assert tight["measured"] < free["measured"] and tight["predicted"] < free["predicted"], (rank, free, tight)
        # the bytes saved for backward are what the plan predicts, without recompute and with it (a
        # kept view of a gathered input holds the gathered copy, not its base: memory.py
        # resharded_view; at this cap the MLP's input views are such, 22% of the saved bytes), but
        # for 4 bytes: the plan counts both 0-d outputs of nll_loss_forward, backward keeps one
        for r in (free, tight):
            assert 0 <= r["predicted"] - r["measured"] <= 4, (rank, r)
