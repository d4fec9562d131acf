"""Shared test setup: importable job modules for spawned ranks, one OpenMP thread, no saved
calibration."""

import os
import sys

import pytest

# Spawned ranks import job functions by module name (e.g. ``test_launch``): keep tests/ on
# sys.path whatever pytest's import mode; children inherit the parent's sys.path.
_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "world(n): test launches n local ranks via autoshard.launch")


@pytest.fixture(autouse=True)
def _no_calibration(monkeypatch, tmp_path):
    # Cluster.local prices links from ~/.cache/autoshard/calibration.json when one exists: a
    # developer's file must not change the plans a test sees (spawned ranks inherit this too).
    monkeypatch.delenv("AUTOSHARD_CALIBRATION", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
