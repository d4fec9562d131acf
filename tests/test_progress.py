"""Progress: each planning stage on stderr when asked (a terminal by default), nothing otherwise."""

from __future__ import annotations

import autoshard
from autoshard.zoo import GPT, GPTConfig


def _plan(**kwargs):
    model = GPT(GPTConfig.tiny())
    return autoshard.plan(model, autoshard.Cluster.local(2), model.example_inputs(4), **kwargs)


def test_quiet_when_not_a_terminal(capfd):
    _plan()
    assert "autoshard:" not in capfd.readouterr().err


def test_stages_shown_when_asked(capfd):
    plan = _plan(progress=True)
    err = capfd.readouterr().err
    for stage in ("tracing", "strategies", "formulating", "solving"):
        assert f"autoshard: {stage} " in err, (stage, err)
    assert {"trace_s", "strategies_s", "formulate_s", "solve_s", "total_s"} <= set(plan.stats)
