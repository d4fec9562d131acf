"""The collectives a compiled FSDP module runs, inside real gloo processes (module-level so spawned
ranks can import it): tests/test_bucketing.py."""

from __future__ import annotations

import copy

import torch

import autoshard
from autoshard import _torch
from autoshard.baselines import plan_baseline
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
