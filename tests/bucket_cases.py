"""The collectives a compiled FSDP module runs, inside real gloo processes (module-level so spawned
ranks can import it): tests/test_bucketing.py."""

from __future__ import annotations

import copy

import torch

import autoshard
from autoshard import _torch
from autoshard.planning.baselines import plan_baseline
from autoshard.zoo import GPT, GPTConfig


def fsdp_gathers() -> dict:
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny())
    inputs = model.example_inputs(8, generator=torch.Generator().manual_seed(1))
    cluster = autoshard.Cluster.local(2)
    plan = plan_baseline(autoshard.trace(model, inputs), cluster, "fsdp")
    ref = copy.deepcopy(model)
    dm = autoshard.compile(model, cluster, inputs, plan=plan)
    loss = dm(*dm.shard_inputs(*inputs))
    loss.backward()
    ref_loss = ref(*inputs)
    ref_loss.backward()
    grad_err = max((p.grad.full_tensor() - ref.get_parameter(n).grad).abs().max().item()
                   for n, p in dm.named_parameters())
    listed = {ph: sum(1 for n in plan.nodes if n.phase == ph for c in n.comm if c["kind"] == "all_gather")
              for ph in ("fwd", "bwd")}
    return {"graph": {ph: sum(1 for n in g.graph.nodes if _torch.is_all_gather(n))
                      for ph, g in (("fwd", dm._fw), ("bwd", dm._bw))},
            "listed": listed, "layers": GPTConfig.tiny().layers,
            "loss_err": abs(loss.item() - ref_loss.item()), "grad_err": grad_err}


def grad_reductions() -> dict:
    """Per baseline plan (DDP's all-reduce, FSDP's reduce-scatter): the gradient buckets the
    synchronizing backward graph reduces, the collectives one backward issues beyond the plain
    backward graph's own, and the gradients against the single device's."""
    from train_cases import CollectiveCounter

    out = {}
    for name in ("ddp", "fsdp"):
        torch.manual_seed(0)
        model = GPT(GPTConfig.tiny())
        inputs = model.example_inputs(8, generator=torch.Generator().manual_seed(1))
        cluster = autoshard.Cluster.local(2)
        plan = plan_baseline(autoshard.trace(model, inputs), cluster, name)
        ref = copy.deepcopy(model)
        dm = autoshard.compile(model, cluster, inputs, plan=plan)
        loss = dm(*dm.shard_inputs(*inputs))
        with CollectiveCounter() as counter:
            loss.backward()
        ref(*inputs).backward()
        issued = [n for n in dm._bw_sync.graph.nodes if n.op == "call_module" and n.target.endswith("_wait")]
        out[name] = {
            "buckets": len(issued),
            "kinds": sorted({dm._bw_sync.get_submodule(n.target).bucket.kind for n in issued}),
            "reduced": len(dm._reduced), "params": len(dm._param_names),
            "graph_collectives": sum(1 for n in dm._bw.graph.nodes
                                     if n.op == "call_function" and "c10d_functional" in str(n.target)
                                     and "wait" not in str(n.target)),
            "backward_collectives": counter.total,
            "grad_err": max((p.grad.full_tensor() - ref.get_parameter(n).grad).abs().max().item()
                            for n, p in dm.named_parameters()),
            "layers": GPTConfig.tiny().layers,
        }
    return out
