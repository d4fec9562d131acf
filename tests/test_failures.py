"""A run that cannot finish fails loudly: a dead or stuck rank, and inputs the plan does not expect.

Real gloo processes train an MLP under an FSDP-like plan (every step all-gathers parameters and
reduce-scatters gradients). When one rank is SIGKILLed in the middle of its second step, the
other rank's next collective raises (gloo sees the peer's socket close) and ``run_local`` raises
:class:`DistributedRunError` with every child reaped. When one rank stops answering instead, the
survivor raises after the process group's timeout (``init_process_group(timeout=...)``, which
``run_local`` sets from ``pg_timeout``), not after gloo's 30-minute default. (Wrong local inputs
never reach a collective: the module checks them first; tests/test_checkpoint.py covers that.)
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

import autoshard
from autoshard.runtime.launch import DistributedRunError, run_local
from autoshard.zoo import MLP
from dist_cases import live_ranks

pytestmark = pytest.mark.world(2)

FSDP = {"inputs": [["S(0)"], ["S(0)"]], "*": ["S(0)"]}
PG_TIMEOUT = 5.0


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 32, generator=g), torch.randn(8, 16, generator=g)


def _plan() -> str:
    """Planned by the caller: a rank waiting on rank 0's solve would count against PG_TIMEOUT."""
    return autoshard.plan(MLP(), autoshard.Cluster.local(2), _batch(), constraints=FSDP).to_json()


def _compiled(plan: str):
    torch.manual_seed(0)
    batch = _batch()
    dm = autoshard.compile(MLP(), autoshard.Cluster.local(dist.get_world_size()), batch,
                           plan=autoshard.Plan.from_json(plan))
    return dm, torch.optim.SGD(dm.parameters(), lr=0.1), dm.shard_inputs(*batch)


def _train_until_peer_fails(tmp: str, plan: str, on_rank1) -> None:
    """Step 1 on both ranks; in step 2 rank 1 calls ``on_rank1`` after its forward, while rank 0
    keeps stepping. Rank 0 records what it raised (and when) in ``tmp``, then re-raises."""
    dm, opt, local = _compiled(plan)
    loss = dm(*local)
    loss.backward()
    opt.step()
    opt.zero_grad()
    dist.barrier()
    loss = dm(*local)  # step 2
    if dist.get_rank() == 1:
        on_rank1()
    t0 = time.monotonic()
    try:
        for _ in range(100):  # backward of step 2 needs rank 1: this cannot complete
            loss.backward()
            opt.step()
            opt.zero_grad()
            loss = dm(*local)
    except BaseException as exc:
        with open(os.path.join(tmp, "rank0.json"), "w") as f:
            json.dump({"type": type(exc).__name__, "message": str(exc)[:2000], "after_s": time.monotonic() - t0}, f)
        raise
    raise AssertionError("rank 0 kept training without its peer")


def _sigkill_self():
    time.sleep(0.5)  # let rank 0 block in the collective first
    os.kill(os.getpid(), signal.SIGKILL)


def _stop_answering():
    time.sleep(3600)


def killed_rank_job(tmp: str, plan: str) -> None:
    _train_until_peer_fails(tmp, plan, _sigkill_self)


def stuck_rank_job(tmp: str, plan: str) -> None:
    _train_until_peer_fails(tmp, plan, _stop_answering)


def _assert_reaped():
    assert multiprocessing.active_children() == []
    if os.path.isdir("/proc"):  # no rank left alive, no zombie either
        assert live_ranks() == []


def test_killed_rank_fails_the_run_and_all_processes_are_reaped(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(DistributedRunError) as info:
        run_local(killed_rank_job, 2, str(tmp_path), _plan(), timeout=60, pg_timeout=30)
    assert time.monotonic() - t0 < 60
    err = info.value
    assert 1 in err.errors or 1 in err.missing, str(err)
    if 1 in err.errors:
        assert "died" in str(err) and "code -9" in str(err), str(err)
    # the survivor raised on its own (gloo saw the peer go), well before the pg timeout
    report = json.loads((tmp_path / "rank0.json").read_text())
    assert report["after_s"] < 30, report
    assert report["type"] in {"RuntimeError", "DistBackendError", "DistNetworkError"}, report
    _assert_reaped()


def test_stuck_rank_times_out_after_pg_timeout_and_all_processes_are_reaped(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(DistributedRunError) as info:
        run_local(stuck_rank_job, 2, str(tmp_path), _plan(), timeout=60, pg_timeout=PG_TIMEOUT)
    elapsed = time.monotonic() - t0
    assert elapsed < 60
    err = info.value
    assert 0 in err.errors and 1 in err.missing, str(err)  # rank 0 raised; rank 1 was still stuck
    assert "timed out" in err.errors[0].lower() or "timeout" in err.errors[0].lower(), err.errors[0]
    report = json.loads((tmp_path / "rank0.json").read_text())
    assert PG_TIMEOUT - 1 <= report["after_s"] < PG_TIMEOUT + 15, report
    _assert_reaped()


def _pipeline_plan() -> str:
    """A 1F1B pipeline of 2 stages x 2 ranks over a tiny Llama, planned by the caller."""
    from autoshard.planning.pipeline import plan_pipeline
    from autoshard.zoo import Llama, LlamaConfig

    torch.manual_seed(0)
    model = Llama(LlamaConfig(layers=4))
    return plan_pipeline(model, autoshard.Cluster.local(4, (2, 2)), model.example_inputs(8), stages=2,
                         micro_batches=4, schedules="1f1b").to_json()


def killed_stage_job(tmp: str, plan: str) -> None:
    """Step 1 on every rank; then the last stage's rank 3 is SIGKILLed while the others start step 2."""
    from autoshard.planning.pipeline import PipelinePlan
    from autoshard.zoo import Llama, LlamaConfig

    torch.manual_seed(0)
    model = Llama(LlamaConfig(layers=4))
    batch = model.example_inputs(8)
    pm = autoshard.compile(model, autoshard.Cluster.local(4, (2, 2)), batch, plan=PipelinePlan.from_json(plan))
    pm.step(*batch)
    dist.barrier()
    if dist.get_rank() == 3:
        _sigkill_self()
    t0 = time.monotonic()
    try:
        for _ in range(100):
            pm.step(*batch)
    except BaseException as exc:
        with open(os.path.join(tmp, f"rank{dist.get_rank()}.json"), "w") as f:
            json.dump({"type": type(exc).__name__, "after_s": time.monotonic() - t0}, f)
        raise
    raise AssertionError("the pipeline kept stepping without its last stage's rank 3")


@pytest.mark.world(4)
def test_a_rank_killed_mid_schedule_fails_the_pipeline_and_all_processes_are_reaped(tmp_path):
    """Rank 3 (the last stage) dies; its stage peer's next collective and its sender's next
    send fail at once, the others' receives follow: DistributedRunError, every child reaped."""
    plan = _pipeline_plan()
    with pytest.raises(DistributedRunError) as info:
        run_local(killed_stage_job, 4, str(tmp_path), plan, timeout=240, pg_timeout=120)
    err = info.value
    assert 3 in err.errors or 3 in err.missing, str(err)
    if 3 in err.errors:
        assert "died" in str(err) and "code -9" in str(err), str(err)
    # the ranks that raised did so on their own, well before the process group's timeout
    reports = [json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")]
    assert reports and all(r["after_s"] < 100 for r in reports), reports
    _assert_reaped()
