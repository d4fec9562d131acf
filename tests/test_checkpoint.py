"""Checkpoints across plans on real gloo processes, single-device interop, typed mismatch errors
and run-time input checks.

One 2-rank launch trains the tiny GPT one AdamW step under an FSDP-like plan, saves it with DCP,
and loads it back under a Megatron plan (through torch's get_state_dict / dcp.load /
set_state_dict, through the module's own state_dict(), and through autoshard.checkpoint), then
exercises single-device import/export, mismatched checkpoints and wrong inputs. A 4-rank launch
loads the same checkpoint under a 2-D plan on mesh (2, 2). After each load, every parameter and
optimizer-state element must equal what was saved, and the next steps' losses and parameters must
equal the single-device run's (fp32, atol 1e-5). See ckpt_cases.py for the cases themselves.
"""

from __future__ import annotations

import pytest

import ckpt_cases as cc
from autoshard.runtime.launch import run_local

pytestmark = pytest.mark.world(2)
ATOL = 1e-5


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def two(ckpt_dir):
    return run_local(cc.two_rank_suite, 2, ckpt_dir, timeout=300)


@pytest.fixture(scope="module")
def four(two, ckpt_dir):  # reads what the 2-rank launch saved
    return run_local(cc.four_rank_load, 4, ckpt_dir, timeout=300)


def _resumed(err: dict):
    assert err["vs_saved"] == 0.0, err  # every parameter and optimizer-state element, exactly
    assert err["loss2"] < ATOL and err["loss3"] < ATOL and err["param2"] < ATOL, err


# --- DCP across plans ------------------------------------------------------------------------------
def test_state_dict_has_the_model_keys_with_dtensor_values(two):
    for r in two:
        assert r["state_keys"] == r["single_keys"]  # tied head.weight included, no graph constants
        assert r["dtensor_values"]
        assert r["fsdp_storage"] == ["(S(0))"]


def test_saved_state_is_the_single_device_state(two):
    for r in two:
        assert r["save_loss1"] < ATOL and r["saved_vs_single"] < ATOL, r


def test_fsdp_checkpoint_resumes_under_megatron_with_get_set_state_dict(two):
    for r in two:
        assert "(S(1))" in r["tp_storage"], r["tp_storage"]  # really another plan
        _resumed(r["tp"])


def test_module_state_dict_round_trips_through_dcp(two):
    for r in two:
        assert r["tp_model_only_vs_saved"] == 0.0
        assert r["get_state_dict_keys"] == r["single_keys"]


def test_checkpoint_without_the_tied_alias_loads(two):
    for r in two:  # saved by a module that did not know head.weight is wte.weight
        assert r["tp_untied_vs_saved"] == 0.0


def test_checkpoint_helpers_resume_under_megatron(two):
    for r in two:
        _resumed(r["tp_helpers"])


def test_fsdp_checkpoint_resumes_on_four_ranks_under_a_2d_plan(four):
    for r in four:
        assert any("," in s and "S" in s.split(",")[1] for s in r["storage"]), r["storage"]  # sharded on dim 1
        _resumed(r)
    assert four[0]["export_vs_saved"] == 0.0 and all(r["export_vs_saved"] is None for r in four[1:])


def test_2d_mesh_sub_groups_use_the_process_group_timeout(four):
    for r in four:
        world, *dims = r["group_timeouts"]
        assert dims == [world] * len(dims), r["group_timeouts"]


# --- single-device interop -------------------------------------------------------------------------
def test_full_state_dict_on_rank0_loads_strictly_into_the_single_device_model(two):
    r0, r1 = two
    assert r0["export_rank0_only"] and r1["export_rank0_only"]  # rank 1 got {}
    assert r0["export_keys"] and r0["export_tied"]
    assert r0["export_vs_saved"] == 0.0
    assert r0["export_loss2"] < ATOL


def test_load_full_state_dict_from_a_single_device_model(two):
    for r in two:
        assert r["import_vs_single"] == 0.0 and r["import_rank0_vs_single"] == 0.0
        assert r["import_loss"] < ATOL


# --- mismatches: typed, naming both sides, nothing changed -------------------------------------------
def _mismatch(two, key) -> str:
    msgs = {r[key] for r in two}
    assert len(msgs) == 1, msgs  # every rank raises the same error, none hangs
    (msg,) = msgs
    assert msg.startswith("RuntimeMismatchError: "), msg
    return msg


def test_checkpoint_of_another_model_names_both_sides(two):
    msg = _mismatch(two, "mismatch_names")
    assert "missing from checkpoint" in msg and "wte.weight" in msg
    assert "but not in the module" in msg and "layers.0.weight" in msg
    msg = _mismatch(two, "mismatch_names_rev")
    assert "layers.0.weight" in msg and "wte.weight" in msg


def test_checkpoint_with_other_shapes_names_both_shapes(two):
    msg = _mismatch(two, "mismatch_shapes")
    assert "layers.0.weight: the module expects global shape [48, 32]" in msg and "has [64, 32]" in msg


def test_checkpoint_without_optimizer_state_when_one_is_asked_for(two):
    assert "no optimizer state" in _mismatch(two, "mismatch_no_optim")
    assert "no optimizer state" in _mismatch(two, "mismatch_no_optim_nested")
    assert all(r["fresh_optimizer_untouched"] for r in two)


def test_missing_checkpoint_directory(two):
    assert "no checkpoint at" in _mismatch(two, "mismatch_missing_dir")


def test_full_and_module_state_dict_mismatches(two):
    assert "[48, 32]" in _mismatch(two, "mismatch_full") and "[64, 32]" in _mismatch(two, "mismatch_full")
    msg = _mismatch(two, "mismatch_full_rank0")
    assert "rank 0's state dict" in msg and "layers.0.weight" in msg and "wte.weight" in msg
    assert "[48, 32]" in _mismatch(two, "mismatch_module")


def test_failed_loads_leave_the_module_unchanged(two):
    for r in two:
        assert r["after_mismatch_vs_single"] == 0.0


# --- run-time input validation ---------------------------------------------------------------------
def test_global_batch_given_to_a_sharded_plan_names_the_local_shape(two):
    msg = _mismatch(two, "input_global_batch")
    assert "expected the local shard of shape [4, 16]" in msg and "on each rank" in msg
    assert "got [8, 16]" in msg and "global [8, 16]" in msg and "shard_inputs" in msg


def test_wrong_input_dtype_and_count(two):
    msg = _mismatch(two, "input_dtype")
    assert "torch.int64" in msg and "torch.int32" in msg and "shard_inputs" in msg
    assert "takes 2 inputs, got 1" in _mismatch(two, "input_count")
    for r in two:
        assert r["input_ok"] < ATOL  # the right local inputs still run after the errors
