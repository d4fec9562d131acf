"""Bad input gets a typed error that names the problem; missing rules are reported, not hidden."""

from __future__ import annotations

import warnings

import pytest
import torch

import autoshard
import dist_cases as dc
from autoshard.errors import ClusterError, NoShardingRuleError, TraceError
from autoshard.runtime.launch import run_local
from autoshard.zoo import MLP
from custom_ops import MLPOwnLoss


@pytest.mark.world(2)
def test_cluster_size_differs_from_world_size():
    msgs = run_local(dc.mismatched_world_case, 2, timeout=300)
    for rank, msg in enumerate(msgs):
        assert msg.startswith("ClusterError"), (rank, msg)
        assert "4 devices" in msg and "world size 2" in msg, (rank, msg)


def test_compile_without_process_group():
    model = MLP()
    with pytest.raises(ClusterError, match="initialized process group"):
        autoshard.compile(model, autoshard.Cluster.local(2), (torch.randn(8, 32), torch.randn(8, 16)))


class DataDependent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # the offending line
            return self.lin(x).sum()
        return x.sum()


def test_data_dependent_control_flow_names_the_line():
    with pytest.raises(TraceError) as info:
        autoshard.plan(DataDependent(), autoshard.Cluster.local(2), (torch.randn(2, 4),))
    assert "if x.sum() > 0:  # the offending line" in str(info.value)
    assert "test_errors.py" in str(info.value)


def test_op_without_rule_is_replicated_reported_and_warned():
    inputs = (torch.randn(8, 32), torch.randn(8, 16))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = autoshard.plan(MLPOwnLoss(), autoshard.Cluster.local(2), inputs)
    ops = {name for name, _ in plan.fallbacks}
    assert {"squared_error", "squared_error_backward"} <= ops
    assert any("squared_error" in str(w.message) for w in caught)
    for n in plan.nodes:
        if n.name in ops:
            assert set(n.strategy.replace("->", ",").split(",")) <= {"(R)"}, n.strategy
    with pytest.raises(NoShardingRuleError, match="squared_error"):
        autoshard.plan(MLPOwnLoss(), autoshard.Cluster.local(2), inputs, strict=True)

