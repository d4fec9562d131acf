"""autoshard: plan and run sharded PyTorch training from one ILP.

    plan = autoshard.plan(model, cluster, example_inputs)          # no process group needed
    dist_model = autoshard.compile(model, cluster, example_inputs)  # inside torch.distributed
"""

from autoshard import _torch  # noqa: F401  first: it checks the torch version before anything uses torch
from autoshard import errors
from autoshard.api import compile, plan, trace
from autoshard.cluster import Cluster, DeviceSpec, LinkSpec
from autoshard.plan import Plan
from autoshard.precision import MixedPrecision

__all__ = ["Cluster", "DeviceSpec", "LinkSpec", "MixedPrecision", "Plan", "compile", "plan", "trace", "errors"]
