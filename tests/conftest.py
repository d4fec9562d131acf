"""Shared test setup: importable job modules for the ranks, one OpenMP thread, no saved
calibration; tests that launch ranks carry the `world` marker, and a job whose rank crashed in
native code runs once more."""

import functools
import os
import re
import sys
import warnings

import pytest

import autoshard.runtime.launch as _launch

# Ranks import job functions by module name (e.g. ``test_launch``): keep tests/ on sys.path
# whatever pytest's import mode; each rank takes its launcher's sys.path.
_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "world(n): test launches n local ranks via autoshard.launch")


# The quick lanes (`make test-fast`, `-m "not world"`) leave out the tests marked `world`: a test
# that launches ranks without the marker would slip its ranks into them.
_item = [None]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _item[0] = item  # module fixtures that launch ranks are set up here, for their first test


# A rank that dies inside torch's native code (torch 2.15 once aborted in pybind11's dealloc, 2.11
# once with "malloc(): unaligned tcache chunk detected", each in one whole-suite run whose same
# job passed alone) fails the job; it runs once more, with a warning, in freshly spawned ranks.
# Anything else fails at once, and so does a job that crashes twice. A rank killed on purpose
# (SIGKILL) is no crash.
_NATIVE_CRASH = re.compile(r"exited with code -\d+ \((SIGABRT|SIGSEGV|SIGBUS)\)")


def _world_marked(run_local):
    @functools.wraps(run_local)
    def checked(fn, world_size, *args, **kwargs):
        item = _item[0]
        if item is not None and item.get_closest_marker("world") is None:
            pytest.fail(f"{item.nodeid} launches {world_size} ranks: mark it @pytest.mark.world({world_size})",
                        pytrace=False)
        try:
            return run_local(fn, world_size, *args, **kwargs)
        except _launch.DistributedRunError as exc:
            if not any(_NATIVE_CRASH.search(text) for text in exc.errors.values()):
                raise
            warnings.warn(f"a rank crashed in native code; the job runs once more, spawned:\n{exc}")
        return run_local(fn, world_size, *args, **{**kwargs, "start_method": "spawn"})
    return checked


_launch.run_local = _world_marked(_launch.run_local)


@pytest.fixture(autouse=True)
def _no_calibration(monkeypatch, tmp_path):
    # Cluster.local prices links from ~/.cache/autoshard/calibration.json when one exists: a
    # developer's file must not change the plans a test sees (the ranks take it too).
    monkeypatch.delenv("AUTOSHARD_CALIBRATION", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
