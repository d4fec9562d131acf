"""autoshard.launch.run_local: results by rank; failing or hung ranks raise and are reaped."""

import multiprocessing
import os
import resource
import time

import pytest
import torch
import torch.distributed as dist

from autoshard.runtime.launch import DistributedRunError, free_port, run_local
from dist_cases import live_ranks

pytestmark = pytest.mark.world(2)


# What a timeout that fired may take beyond its deadline: killing and reaping two ranks, on a
# 2-core machine that other jobs load (the deadline itself counts from the launch, the ranks' start included)
SLACK = 30


# Job functions run in the ranks: module level, so they pickle by name.
def allreduce_job(base):
    rank = dist.get_rank()
    t = torch.tensor([base + rank, 10.0 * (rank + 1)])
    dist.all_reduce(t)
    return rank, os.environ["OMP_NUM_THREADS"], torch.get_num_threads(), t.tolist()


def raise_on_rank1_job():
    if dist.get_rank() == 1:
        raise ValueError("boom from rank one")
    dist.barrier()
    return "unreachable"


def hang_on_rank1_job():
    if dist.get_rank() == 1:
        while True:
            time.sleep(3600)
    dist.all_reduce(torch.ones(1))  # waits for rank 1 until pg_timeout
    return "unreachable"


def crash_on_rank1_job():
    if dist.get_rank() == 1:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file
        os.abort()
    dist.all_reduce(torch.ones(1))  # its link to rank 1 breaks: this rank raises too
    return "unreachable"


def crash_once_job(flag):
    if dist.get_rank() == 1 and not os.path.exists(flag):
        open(flag, "w").close()
        crash_on_rank1_job()
    dist.all_reduce(torch.ones(1))
    return "ok"


def sleep_job():
    time.sleep(3600)


def env_job():
    return os.environ.get("AUTOSHARD_TEST_LAUNCH"), os.environ.get("AUTOSHARD_TEST_EXTRA"), os.environ["RANK"]


def _assert_reaped():
    assert multiprocessing.active_children() == []
    if os.path.isdir("/proc"):
        assert live_ranks() == []


def test_free_port():
    assert 0 < free_port() < 65536


def test_allreduce_results_by_rank():
    out = run_local(allreduce_job, 2, 1.0, timeout=120)
    assert out == [(0, "1", 1, [3.0, 30.0]), (1, "1", 1, [3.0, 30.0])]
    _assert_reaped()


def test_rank_error_names_rank_and_reaps():
    t0 = time.monotonic()
    with pytest.raises(DistributedRunError) as ei:
        run_local(raise_on_rank1_job, 2, timeout=60, pg_timeout=30)
    assert time.monotonic() - t0 < 45
    msg = str(ei.value)
    assert "rank 1 raised" in msg and "ValueError: boom from rank one" in msg
    assert 1 in ei.value.errors
    _assert_reaped()


def test_a_crash_is_named_beside_the_errors_it_causes():
    """A rank that aborts takes its peers' collectives down: their errors ("connection reset")
    tend to arrive first, and the crash, the cause, is named with them."""
    # (the unwrapped launcher: tests/conftest.py runs a job whose rank crashed once more)
    with pytest.raises(DistributedRunError) as ei:
        run_local.__wrapped__(crash_on_rank1_job, 2, timeout=60, pg_timeout=30)
    assert "rank 1 died" in str(ei.value) and "(SIGABRT)" in ei.value.errors[1], str(ei.value)
    _assert_reaped()


def test_the_suite_runs_a_crashed_job_once_more(tmp_path):
    with pytest.warns(UserWarning, match="crashed in native code"):
        assert run_local(crash_once_job, 2, str(tmp_path / "crashed"), timeout=60, pg_timeout=30) == ["ok"] * 2
    _assert_reaped()


def test_hung_rank_raises_within_timeout_and_reaps():
    t0 = time.monotonic()
    with pytest.raises(DistributedRunError) as ei:
        run_local(hang_on_rank1_job, 2, timeout=20, pg_timeout=10)
    assert time.monotonic() - t0 < 20 + SLACK
    assert 1 in ei.value.missing  # the hung rank never reported
    assert 1 not in ei.value.errors
    _assert_reaped()


def test_deadline_names_timed_out_ranks():
    t0 = time.monotonic()
    with pytest.raises(DistributedRunError, match=r"ranks \[0, 1\] had not reported \(timed out"):
        run_local(sleep_job, 2, timeout=8, pg_timeout=60)
    assert time.monotonic() - t0 < 8 + SLACK
    _assert_reaped()


def test_retries_once_when_port_in_use(monkeypatch):
    import socket

    import autoshard.runtime.launch as launch

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        ports = [busy.getsockname()[1]]
        monkeypatch.setattr(launch, "free_port", lambda: ports.pop() if ports else free_port())
        out = run_local(allreduce_job, 2, 1.0, timeout=120, pg_timeout=30)
    assert not ports and [r[3] for r in out] == [[3.0, 30.0]] * 2
    _assert_reaped()


def test_each_start_method_gives_the_callers_environment(monkeypatch):
    """Forked from the server (started by an earlier launch, with another environment) or
    spawned, a rank sees the caller's environment as it is at this launch, plus ``env``."""
    monkeypatch.delenv("AUTOSHARD_TEST_LAUNCH", raising=False)
    assert run_local(env_job, 2, timeout=120) == [(None, None, str(r)) for r in range(2)]   # the server runs
    monkeypatch.setenv("AUTOSHARD_TEST_LAUNCH", "caller")
    for how in ("forkserver", "spawn"):
        out = run_local(env_job, 2, timeout=120, env={"AUTOSHARD_TEST_EXTRA": how}, start_method=how)
        assert out == [("caller", how, str(r)) for r in range(2)], (how, out)
    with pytest.raises(ValueError, match="start_method='fork'"):
        run_local(env_job, 2, start_method="fork")
    _assert_reaped()


def test_a_job_that_cannot_load_in_the_rank_is_named(tmp_path, monkeypatch):
    """The job's module imports in the caller but not in the ranks (its folder is gone from the
    path they take): the rank says it could not load the job, not that the group failed."""
    (tmp_path / "vanishing_job.py").write_text("def job():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import vanishing_job

    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p != str(tmp_path)])
    with pytest.raises(DistributedRunError, match=r"rank \d could not load the job") as err:
        run_local(vanishing_job.job, 2, timeout=60)
    # every rank that reported says so (the grace after the first report reads the others'
    # reports too; one slower than that is listed as terminated)
    assert err.value.errors and "init_process_group" not in str(err.value) and " died" not in str(err.value)
    assert set(err.value.errors) | set(err.value.missing) == {0, 1}
    _assert_reaped()
