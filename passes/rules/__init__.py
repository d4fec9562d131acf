"""Sharding rules and FLOP formulas autoshard adds for ops torch leaves without them.

Each module holds one family of ops and registers its rules with DTensor's registry on import,
so planning (passes/dtensor_rules.py) and execution (DTensor at run time) see the same rules.
"""

from autoshard.passes.rules import (  # noqa: F401
    attention, conv, experts, grouped_mm, index, layer_norm, norm_pool, pad, pointwise, scatter)

# op -> (node, local args, kwargs, strategy, mesh) -> its local outputs: ops the rewriter runs on
# local shards itself rather than through DTensor's dispatch (passes/rewrite.py)
LOCAL = {**conv.LOCAL, **attention.LOCAL}
# op -> (node, mesh shape) -> [(outputs, inputs, imbalance, variant)]: strategies autoshard adds
# that no DTensor rule may hold, because only the rewriter runs them right (passes/strategies.py)
EXTRA = {**attention.EXTRA}
# op -> (cluster, node, strategy, its compute seconds) -> seconds that the collectives the op runs
# inside, under that strategy, add to its compute (autoshard/cluster/costmodel.py)
INLINE_COMM = {**attention.INLINE_COMM, **experts.INLINE_COMM}
# op -> (node, strategy, mesh shape) -> bytes the op holds beyond its inputs and outputs under that
# strategy, in its working set (solver/memory.py)
HELD = {**attention.HELD}
