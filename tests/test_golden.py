"""Golden plans: every zoo case re-planned and compared with tests/golden/torch-<release>/<case>.json
(the installed torch release's goldens), written by ``make golden``. Fails when any decision (node strategy or recompute, parameter storage, input
placement, mesh) changed, or the predicted step time or peak memory moved by more than REL either
way: a plan is deterministic, so any such change is a change in what autoshard plans or predicts.
Regenerate with ``make golden`` and review its printed diff."""

import json
import math

import pytest

from golden_update import REL, cases, changes, path, plan_case, summary


@pytest.mark.parametrize("name", cases())
def test_plan_matches_golden(name):
    if not path(name).is_file():
        import torch

        pytest.fail(f"no golden for {name} on torch {torch.__version__}: run `make golden TORCH=<this version>` "
                    f"and commit {path(name).relative_to(path(name).parents[2])}")
    want = json.loads(path(name).read_text())
    assert want["decisions"] and want["storage"] and want["inputs"], f"{name}: the golden pins no decisions"
    plan = plan_case(name)
    # a plan stopped at the time limit is any plan within its gap, not the golden's optimum
    assert plan.solver["status"] == "optimal", f"{name}: solve stopped {plan.solver}"
    got = json.loads(json.dumps(summary(name, plan)))  # the same JSON round trip as the file
    wrong = [f"{key}: {want[key] * scale:.6f} -> {got[key] * scale:.6f} {unit} ({got[key] / want[key] - 1:+.2e}, "
             f"tolerance {REL:g})" for key, unit, scale in (("step_time", "ms", 1e3), ("peak_memory", "B", 1))
             if not math.isclose(got[key], want[key], rel_tol=REL, abs_tol=0)] + changes(want, got)
    assert not wrong, f"{name}: the plan differs from its golden (golden -> now), {len(wrong)} changes:\n" + \
        "\n".join(wrong[:20])
