"""The compiled module on one device: plain parameters, single-device numerics, checkpoints that
move between one rank and many (autoshard/runtime/module.py's module doc says why one device is different).

One 1-rank launch trains the tiny GPT, compiled on ``Cluster.local(1)``, through the loop users
write (AdamW + LambdaLR + ``torch.nn.utils.clip_grad_norm_``, 3 steps; one step accumulated over
K = 4 micro-batches with ``no_sync`` and with ``grad_accumulation``) next to the same loop on the eager model, and saves a checkpoint
with ``autoshard.checkpoint``. A 2-rank launch loads that checkpoint under an FSDP plan (DTensor
parameters) and saves it again; a second 1-rank launch loads that one. Each load is compared with
what was saved and then trained on against the single-device run (tests/ckpt_cases.py's helpers).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import autoshard
import autoshard.runtime.checkpoint as ckpt
import ckpt_cases as cc
import train_cases as tc
from autoshard.runtime.launch import run_local
from autoshard.zoo import GPT, GPTConfig

pytestmark = pytest.mark.world(2)

ATOL = 1e-5
LR = 1e-3
FROM_ONE, FROM_TWO = "from_one_rank", "from_two_ranks"


def _kinds(tensors) -> list[str]:
    return sorted({type(t).__name__ for t in tensors})


def _err(dm, ref) -> float:
    return max((p - ref.get_parameter(n)).abs().max().item() for n, p in dm.named_parameters())


def _loop(dm, ref) -> dict:
    """tests/train_cases.py's ``steps`` loop, fp32, plain tensors on both sides."""
    opt, sched = tc._optim(dm.parameters(), LR)
    ref_opt, ref_sched = tc._optim(ref.parameters(), LR)
    out = {"loss": 0.0, "norm": 0.0, "norm_kind": None}
    for s in range(3):
        batch = tc._batch(ref, s, 0)
        loss = dm(*dm.shard_inputs(*batch))
        loss.backward()
        out["grad_kinds"] = _kinds(p.grad for p in dm.parameters())
        norm = torch.nn.utils.clip_grad_norm_(dm.parameters(), tc.MAX_NORM)
        opt.step(), sched.step(), opt.zero_grad()
        ref_loss = ref(*batch)
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), tc.MAX_NORM)
        ref_opt.step(), ref_sched.step(), ref_opt.zero_grad()
        out["loss"] = max(out["loss"], abs(loss.item() - ref_loss.item()))
        out["norm"] = max(out["norm"], abs(norm.item() - ref_norm.item()))
        out["norm_kind"] = type(norm).__name__
    out["param"] = _err(dm, ref)
    out["state_kinds"] = _kinds(v for st in opt.state.values() for v in st.values())
    return out


def _accumulate(dm, ref, explicit: bool) -> dict:
    """One AdamW step over K micro-batches: ``no_sync`` on all but the last, or ``grad_accumulation``."""
    opt, _ = tc._optim(dm.parameters(), LR)
    ref_opt, _ = tc._optim(ref.parameters(), LR)
    dm.grad_accumulation = 1 if explicit else tc.K
    early = []
    for k in range(tc.K):
        batch = tc._batch(ref, 7, k)
        ctx = dm.no_sync() if explicit and k < tc.K - 1 else torch.enable_grad()
        with ctx:
            (dm(*dm.shard_inputs(*batch)) / tc.K).backward()
        early.append(any(p.grad is not None for p in dm.parameters()))
        (ref(*batch) / tc.K).backward()
    dm.grad_accumulation = 1
    norm = dm.clip_grad_norm_(tc.MAX_NORM)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), tc.MAX_NORM)
    opt.step(), ref_opt.step()
    opt.zero_grad(), ref_opt.zero_grad()
    return {"grads_before_last": early[:-1], "grads_after_last": early[-1],
            "norm": abs(norm.item() - ref_norm.item()), "param": _err(dm, ref)}


def one_rank_job(tmp: str) -> dict:
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny())
    model.batch = 8
    ref, start = copy.deepcopy(model), copy.deepcopy(model.state_dict())
    dm = autoshard.compile(model, autoshard.Cluster.local(1), tc._batch(model, 0, 0))
    out = {"param_kinds": _kinds(dm.parameters()), "dtensors": sum(isinstance(p, DTensor) for p in dm.parameters()),
           "state_kinds": _kinds(dm.state_dict().values()),
           "names": sorted(dm.state_dict()) == sorted(ref.state_dict())}
    out["loop"] = _loop(dm, ref)
    for explicit in (True, False):
        dm.load_state_dict(start), ref.load_state_dict(start)   # plain full tensors in, both sides
        out["no_sync" if explicit else "grad_accumulation"] = _accumulate(dm, ref, explicit)
    plain = GPT(GPTConfig.tiny())
    out["eager_loads_state_dict"] = str(plain.load_state_dict(dm.state_dict(), strict=True))
    out["storage"] = sorted(set(dm.plan.storage.values()))
    out["grad_placements"] = sorted({str(pl) for pl in dm._grad_placements})
    # checkpoint: one AdamW step, saved with autoshard.checkpoint; then resumed on one rank
    expected = cc._reference()
    _, saver = cc._compile(0, None, None)
    opt = cc._opt(saver)
    out["ckpt_loss1"] = abs(cc._step(saver, opt, cc._batches()[0], True) - expected["loss1"])
    saved = cc._snapshot(saver, opt)
    out["ckpt_vs_single_device"] = cc._max_diff(saved, expected["after1"])
    ckpt.save(os.path.join(tmp, FROM_ONE), saver, opt)
    torch.save({"saved": saved, "expected": expected}, os.path.join(tmp, FROM_ONE + ".pt"))
    _, dm2 = cc._compile(5, None, None)
    opt2 = cc._opt(dm2)
    ckpt.load(os.path.join(tmp, FROM_ONE), dm2, opt2)
    out["resume_one_rank"] = cc._resume_errors(dm2, opt2, saved, expected)
    return out


def two_rank_job(tmp: str) -> dict:
    """Load the 1-rank checkpoint under an FSDP plan; save it again (unchanged) for 1 rank to load."""
    box = torch.load(os.path.join(tmp, FROM_ONE + ".pt"))
    _, dm = cc._compile(7, None, cc.FSDP)
    opt = cc._opt(dm)
    ckpt.load(os.path.join(tmp, FROM_ONE), dm, opt)
    out = {"kinds": _kinds(dm.parameters()), "vs_saved": cc._max_diff(cc._snapshot(dm, opt), box["saved"])}
    ckpt.save(os.path.join(tmp, FROM_TWO), dm, opt)
    out["resume"] = cc._resume_errors(dm, opt, box["saved"], box["expected"])
    return out


def back_to_one_rank_job(tmp: str) -> dict:
    box = torch.load(os.path.join(tmp, FROM_ONE + ".pt"))
    _, dm = cc._compile(9, None, None)
    opt = cc._opt(dm)
    ckpt.load(os.path.join(tmp, FROM_TWO), dm, opt)
    return {"kinds": _kinds(dm.parameters()), "world": dist.get_world_size(),
            "resume": cc._resume_errors(dm, opt, box["saved"], box["expected"])}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("one_rank"))
    one = run_local(one_rank_job, 1, tmp, timeout=600)[0]
    two = run_local(two_rank_job, 2, tmp, timeout=600)
    back = run_local(back_to_one_rank_job, 1, tmp, timeout=600)[0]
    return one, two, back


def test_one_device_parameters_are_plain_tensors(runs):
    one, _, _ = runs
    assert one["param_kinds"] == ["Parameter"] and one["dtensors"] == 0, one
    assert one["state_kinds"] == ["Tensor"], one["state_kinds"]   # state_dict() detaches
    assert one["names"] and one["eager_loads_state_dict"] == "<All keys matched successfully>"
    assert one["loop"]["grad_kinds"] == ["Tensor"] and one["loop"]["norm_kind"] == "Tensor"
    assert one["loop"]["state_kinds"] == ["Tensor"]
    # a mesh dim of one offers Replicate alone: the gradient leaves the graph in its storage placement
    assert one["storage"] == ["(R)"] and one["grad_placements"] == ["(Replicate(),)"], one


def test_one_device_training_loop_matches_eager(runs):
    one, _, _ = runs
    loop = one["loop"]
    assert loop["loss"] < ATOL and loop["norm"] < ATOL and loop["param"] < ATOL, loop
    for key in ("no_sync", "grad_accumulation"):
        r = one[key]
        assert r["grads_before_last"] == [False] * (tc.K - 1) and r["grads_after_last"], (key, r)
        assert r["norm"] < ATOL and r["param"] < ATOL, (key, r)


def test_one_device_checkpoint_resumes_on_one_rank(runs):
    one, _, _ = runs
    assert one["ckpt_loss1"] < ATOL and one["ckpt_vs_single_device"] < ATOL, one
    r = one["resume_one_rank"]
    assert r["vs_saved"] == 0.0 and max(r["loss2"], r["param2"], r["loss3"]) < ATOL, r


def test_one_device_checkpoint_moves_to_two_ranks_and_back(runs):
    _, two, back = runs
    for rank in two:
        assert rank["kinds"] == ["DTensor"] and rank["vs_saved"] == 0.0, rank
        r = rank["resume"]
        assert max(r["loss2"], r["param2"], r["loss3"]) < ATOL, r
    assert back["kinds"] == ["Parameter"] and back["world"] == 1
    r = back["resume"]
    assert r["vs_saved"] == 0.0 and max(r["loss2"], r["param2"], r["loss3"]) < ATOL, r
