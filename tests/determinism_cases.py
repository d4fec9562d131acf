"""Plans whose JSON must not depend on the process that made them (tests/test_determinism.py).

Run as a script it plans one case at a given memory cap in a fresh process and prints the plan's
JSON (``python determinism_cases.py CASE CAP``); the test compares that with its own.
"""

from __future__ import annotations

import random
import sys
import warnings
from contextlib import contextmanager

import torch
import torch.fx as fx

import autoshard
from autoshard.planning import baselines
from autoshard.zoo import corpus
from autoshard.cluster import Cluster
from autoshard.errors import InfeasibleError
from autoshard.zoo import GPT, GPTConfig, Llama, LlamaConfig


def llama(layers: int = 4, hidden: int = 512, seq: int = 512, batch: int = 16):
    """A Llama-style decoder with grouped-query attention (8 query heads on 4 key/value heads),
    on ``meta``."""
    cfg = LlamaConfig(**{**LlamaConfig.tiny().__dict__, "hidden": hidden, "heads": 8, "kv_heads": 4,
                         "layers": layers, "seq": seq, "intermediate": hidden * 11 // 4})
    with torch.device("meta"):
        model = Llama(cfg)
    ids = torch.empty(batch, seq, dtype=torch.long, device="meta")
    return autoshard.trace(model, (ids, ids))


def gpt():
    config = GPTConfig.tiny()
    ids = torch.randint(0, config.vocab, (8, config.seq), generator=torch.Generator().manual_seed(0))
    return autoshard.trace(GPT(config), (ids, ids))


def transformers_model(name: str = "qwen2"):
    model, inputs = corpus.get(name)
    return autoshard.trace(model, inputs)


# name -> (traced model, cluster, plan options, sweep): the case plans without a cap (sweep None)
# or at the last cap of a sweep (factor, steps) down from the free plan's peak, ``factor`` times
# per step, for ``steps`` steps or, with None, until the next is infeasible. Each such cap binds:
# the free plan does not fit under it. The full sweep stays on a 1-D mesh and shared layers: near
# its smallest peak, a 2-D problem of even a 1-layer model takes HiGHS past a minute, and so does
# an unshared 2-layer Llama (docs/design.md, "Limitations in detail"). Qwen2 and the accumulated
# GPT step 0.9x once: at 0.6x (Qwen2's tightest) HiGHS takes 17 s to 40 s over each of their
# solves, at 0.9x 1 s to 6 s.
CASES = {
    "1d": (llama, lambda: Cluster.preset("dgx-h100"), {}, (0.6, None)),
    "2d": (gpt, lambda: Cluster.local(4, (2, 2)), {}, None),
    "auto": (gpt, lambda: Cluster.local(4), {"meshes": "auto"}, None),
    "unshared": (gpt, lambda: Cluster.preset("dgx-h100"), {"share_layers": False}, (0.6, 1)),
    "accumulation": (gpt, lambda: Cluster.preset("dgx-h100"), {"grad_accumulation": 2}, (0.9, 1)),
    "qwen2": (transformers_model, lambda: Cluster.local(2), {}, (0.9, 1)),
}


def plan_json(case: str, traced, cap: float | None) -> str:
    """The case's plan at ``cap`` bytes per device, as JSON."""
    _, cluster, options, _ = CASES[case]
    with warnings.catch_warnings():
        # a solve stopped at its time limit may differ run to run: here it fails the test
        warnings.filterwarnings("error", message="autoshard: the solver stopped")
        return autoshard.plan(traced, cluster(), memory_limit=cap, **options).to_json()


def cap(case: str, traced) -> float | None:
    """The case's memory cap (``CASES``); None: it plans without one."""
    _, cluster, options, sweep = CASES[case]
    if sweep is None:
        return None
    factor, steps = sweep
    limit = autoshard.plan(traced, cluster(), **options).peak_memory
    for step in range(10**6 if steps is None else steps):
        try:
            autoshard.plan(traced, cluster(), memory_limit=limit * factor, **options)
        except InfeasibleError:
            if step == 0 or steps is not None:   # the case would plan free, or short of its sweep
                raise
            break
        limit *= factor
    return limit


def baselines_json(traced) -> dict[str, str]:
    """FSDP's, Megatron's and TP+FSDP's plans and the free one on 4 CPU ranks, as JSON (an
    error's text when none fits)."""
    plans = baselines.compare(traced, Cluster.local(4), baselines=["fsdp", "fsdp+recompute", "megatron", "tp_fsdp"])
    return {name: p.to_json() if isinstance(p, autoshard.Plan) else str(p) for name, p in plans.items()}


@contextmanager
def permuted_node_hash(seed: int):
    """Hash every fx.Node by a random number instead of its address: a set of nodes then
    iterates in another order, as it would in a process whose allocations fell elsewhere."""
    rng, drawn = random.Random(seed), {}

    def hash_(node):
        return drawn.setdefault(id(node), rng.getrandbits(61))

    real = fx.Node.__hash__
    fx.Node.__hash__ = hash_
    try:
        yield
    finally:
        fx.Node.__hash__ = real


if __name__ == "__main__":
    case, limit = sys.argv[1], None if sys.argv[2] == "None" else float(sys.argv[2])
    sys.stdout.write(plan_json(case, CASES[case][0](), limit))
