"""Sharding rules and FLOP formulas autoshard adds for ops torch leaves without them.

Each module holds one family of ops and registers its rules with DTensor's registry on import,
so planning (passes/dtensor_rules.py) and execution (DTensor at run time) see the same rules.
"""

from autoshard.passes.rules import (  # noqa: F401
    attention, conv, grouped_mm, index, layer_norm, norm_pool, pad, pointwise, scatter)

# op -> its arguments made local, given its local tensors: ops the rewriter runs on local shards
# itself rather than through DTensor's dispatch (passes/rewrite.py)
LOCAL = {**conv.LOCAL}
