"""Typed errors. Every failure a user can cause says what was wrong and how to fix it."""

from __future__ import annotations


class AutoshardError(Exception):
    """Base class of every error autoshard raises on purpose."""


class TraceError(AutoshardError):
    """The model could not be traced to a joint forward+backward ATen graph
    (data-dependent Python control flow, an unsupported construct, ...)."""


class NoShardingRuleError(AutoshardError):
    """An op has no sharding rule (raised under ``strict=True``; otherwise the op is
    planned replicated and listed in ``plan.fallbacks``)."""


class CoverageGapError(NoShardingRuleError):
    """Some op's strategies all replicate an input its producer can shard (raised under
    ``strict=True``; otherwise the plan lists it in ``plan.gaps`` and a warning names it)."""


class ClusterError(AutoshardError, ValueError):
    """The cluster description is invalid or does not match the process group."""


class ConstraintError(AutoshardError, ValueError):
    """A user constraint is malformed or names nothing in the model."""


class InfeasibleError(AutoshardError):
    """No plan satisfies the constraints and memory limit.

    ``min_memory`` is the smallest per-device memory limit (bytes) under which a plan
    exists, when the solver could establish it, else ``None``.
    """

    def __init__(self, message: str, *, min_memory: float | None = None):
        super().__init__(message)
        self.min_memory = min_memory


class SolverError(AutoshardError):
    """The ILP solver failed for a reason other than infeasibility (time limit with no
    solution, backend unavailable)."""


class CutoffError(AutoshardError):
    """No plan has a predicted step time under the ``cutoff`` given to ``autoshard.plan`` (or none
    fits at all: the solver stops at the first proof of either). Planning several logical meshes
    uses it to drop a mesh as soon as it cannot beat the best one found."""


class PlanError(AutoshardError, ValueError):
    """A plan file is corrupt or of an unknown schema version."""


class PlanMismatchError(PlanError):
    """A plan was made for another model, cluster or world size."""


class CapacityError(AutoshardError, RuntimeError):
    """A rank of an expert-parallel run received more routed rows than the plan's ``moe_capacity``
    holds (raised on every rank of that expert-parallel group at once)."""


class RuntimeMismatchError(AutoshardError, ValueError):
    """Inputs given to a compiled module do not match what its plan expects
    (shape, dtype, world size)."""


class UnsupportedTorchError(AutoshardError, ImportError):
    """The installed torch is outside the range autoshard supports (raised at import)."""
