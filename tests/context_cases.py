"""Context-parallel numerics, run inside real gloo processes (module-level so spawned ranks import
them).

Each case compiles a tiny Llama (rotary positions, grouped-query attention, sequence 256) with
every attention op and the batch pinned to a sequence split on one mesh dim (the rest of the plan
free), runs
forward, backward and one SGD step, and returns the largest deviation from the same step on one
device: loss, every gradient, every parameter after the step.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

import autoshard
from autoshard import Plan
from autoshard.passes.rewrite import ORIGIN
from autoshard.passes.rules.attention import BWD, FWD, sequence_mesh_dim
from autoshard.zoo import Llama, LlamaConfig
from dist_cases import step_errors

SEQ = 256


def _model(kind: str, causal: bool):
    torch.manual_seed(0)
    if kind == "llama":
        model = Llama(LlamaConfig(seq=SEQ, hidden=64, heads=4, kv_heads=2, layers=2, causal=causal))
        return model, model.example_inputs(2, generator=torch.Generator().manual_seed(1))
    # a transformers model from its config (Llama: causal; BERT: bidirectional, learned positions)
    import transformers
    from autoshard.zoo import hf

    config_fn, wrapper, cls_name, _ = hf.BUILDERS[kind]
    config = config_fn("tiny")
    config.max_position_embeddings = SEQ
    model = wrapper(getattr(transformers, cls_name)(config))
    g = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(0, config.vocab_size, (2, SEQ), generator=g) for _ in range(2))
    return model, (ids, labels)


def _sequence_split(model, inputs, cp_dim: int, data_dim: int | None, variant: str, heads_dim: int | None):
    """An ``allow``: attention split by sequence on ``cp_dim`` as ``variant`` ("": keys and values
    gathered, contiguous; "balanced"; "ring"; "balanced ring"), by heads on ``heads_dim``, the
    inputs too (and by batch on ``data_dim``); everything else the solver's."""
    batch = {n.name for n in autoshard.trace(model, inputs).inputs}

    def allow(node, s) -> bool:
        if node.op == "call_function" and node.target in (FWD, BWD):
            query = s.inputs[1 if node.target is BWD else 0]
            return sequence_mesh_dim(node, s) == cp_dim and s.variant == variant and \
                (heads_dim is None or query[heads_dim] == Shard(1))
        if node.name in batch:
            return s.outputs[0][cp_dim] == Shard(1) and (data_dim is None or s.outputs[0][data_dim] == Shard(0))
        return True
    return allow


def plan_case(causal: bool, mesh_shape, cp_dim: int, data_dim: int | None, variant: str = "",
              kind: str = "llama", backend: str = "eager", heads_dim: int | None = None) -> str:
    """The case's plan as JSON, made once, in the test's own process (a 2-D solve takes ~15 s
    here; every rank solving it at once takes that several times over), without recompute (a
    smaller problem; recompute is not what these cases check)."""
    model, inputs = _model(kind, causal)
    cluster = autoshard.Cluster.local(math.prod(mesh_shape), mesh_shape)
    return autoshard.plan(model, cluster, inputs, allow=_sequence_split(model, inputs, cp_dim, data_dim, variant, heads_dim),
                          backend=backend, recompute=False).to_json()


def one_case(spec: tuple, plan_json: str, lr: float = 0.1) -> dict:
    """Run the plan of ``spec`` (plan_case's arguments) on this rank's process group."""
    causal, mesh_shape = spec[:2]
    kind = spec[5] if len(spec) > 5 else "llama"
    model, inputs = _model(kind, causal)
    ref = copy.deepcopy(model)
    cluster = autoshard.Cluster.local(dist.get_world_size(), mesh_shape)
    dm = autoshard.compile(model, cluster, inputs, plan=Plan.from_json(plan_json))
    err = step_errors(dm, ref, inputs, lr)
    err["attention"] = sorted({n.strategy for n in dm.plan.nodes if "flash_attention" in n.op})
    # all-to-alls that an attention op runs itself (not a resharding between ops)
    attention = {n.name for n in dm.plan.nodes if "flash_attention" in n.op}
    err["all_to_all"] = sum("all_to_all" in str(n.target) and (n.meta.get("custom") or {}).get(ORIGIN) in attention
                            for g in (dm._fw, dm._bw) for n in g.graph.nodes)
    err["inputs"] = list(dm.plan.inputs)
    err["compiled_calls"] = sum(getattr(run, "compiled_calls", 0) for run in dm._run.values() if run is not None)
    return err


def run_cases(cases: dict[str, tuple]) -> dict:
    """cases: name -> (spec, plan JSON)."""
    return {name: one_case(*case) for name, case in cases.items()}
