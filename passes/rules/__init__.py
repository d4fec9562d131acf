"""Sharding rules and FLOP formulas autoshard adds for ops torch leaves without them.

Each module holds one family of ops and registers its rules with DTensor's registry on import,
so planning (passes/strategies.py) and execution (DTensor at run time) see the same rules.
"""

from autoshard.passes.rules import attention, conv, grouped_mm, pointwise  # noqa: F401
