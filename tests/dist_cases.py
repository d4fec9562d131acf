"""Numerics cases run inside real gloo processes (module-level so spawned ranks can import them).

Each case compiles a model under a plan (free, or pinned by constraints), runs forward, backward
and one SGD step on every rank, and returns the largest deviation from the same step run on a
single device in this process: loss, every gradient, every parameter after the step.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import autoshard
from autoshard.zoo import GPT, MLP, GPTConfig

IN2 = [["S(0)"], ["S(0)"]]
GPT_CASES = {
    # name: (mesh shape, constraints)
    "free": (None, None),
    "ddp": (None, {"inputs": IN2, "*": ["R"]}),
    "fsdp": (None, {"inputs": IN2, "*": ["S(0)"]}),
    "megatron": (None, {"inputs": [["R"], ["R"]], "*.qkv.*": ["S(0)"], "*.fc.*": ["S(0)"],
                        "*.proj.weight": ["S(1)"], "*.out.weight": ["S(1)"]}),
}
GPT_CASES_2D = {
    "free": ((2, 2), None),
    "ddp": ((2, 2), {"inputs": [["S(0)", "S(0)"]] * 2, "*": ["R", "R"]}),
    "data_x_tensor": ((2, 2), {"inputs": [["S(0)", "R"]] * 2, "*.qkv.weight": ["R", "S(0)"],
                               "*.fc.weight": ["R", "S(0)"], "*.proj.weight": ["R", "S(1)"],
                               "*.out.weight": ["R", "S(1)"]}),
    "fsdp_x_tensor": ((2, 2), {"inputs": [["S(0)", "R"]] * 2, "*.fc.weight": ["S(1)", "S(0)"],
                               "*.out.weight": ["S(0)", "S(1)"], "wte.weight": ["S(1)", "R"]}),
}
MLP_CASES = {
    "free": (None, None),
    "ddp": (None, {"inputs": IN2, "*": ["R"]}),
    "fsdp": (None, {"inputs": IN2, "*": ["S(0)"]}),
    "megatron": (None, {"inputs": [["R"], ["R"]], "layers.0.*": ["S(0)"], "layers.1.weight": ["S(1)"]}),
}
MLP_CASES_2D = {
    "free": ((2, 2), None),
    "data_x_tensor": ((2, 2), {"inputs": [["S(0)", "R"]] * 2, "layers.0.*": ["R", "S(0)"],
                               "layers.1.weight": ["R", "S(1)"]}),
}


def _model(kind: str):
    torch.manual_seed(0)
    if kind == "gpt":
        model = GPT(GPTConfig.tiny())
        inputs = model.example_inputs(8, generator=torch.Generator().manual_seed(1))
    else:
        model = MLP()
        g = torch.Generator().manual_seed(1)
        inputs = (torch.randn(8, 32, generator=g), torch.randn(8, 16, generator=g))
    return model, inputs


def one_case(kind: str, mesh_shape, constraints, lr: float = 0.1) -> dict:
    model, inputs = _model(kind)
    ref = copy.deepcopy(model)
    cluster = autoshard.Cluster.local(dist.get_world_size(), mesh_shape)
    dm = autoshard.compile(model, cluster, inputs, constraints=constraints)
    opt = torch.optim.SGD(dm.parameters(), lr=lr)
    loss = dm(*dm.shard_inputs(*inputs))
    loss.backward()
    ref_loss = ref(*inputs)
    ref_loss.backward()
    err = {"loss": (loss.detach() - ref_loss.detach()).abs().item(), "grad": 0.0, "param": 0.0}
    for name, p in dm.named_parameters():
        err["grad"] = max(err["grad"], (p.grad.full_tensor() - ref.get_parameter(name).grad).abs().max().item())
    opt.step()
    torch.optim.SGD(ref.parameters(), lr=lr).step()
    for name, p in dm.named_parameters():
        err["param"] = max(err["param"], (p.full_tensor() - ref.get_parameter(name)).abs().max().item())
    err["storage"] = dict(dm.plan.storage)
    err["inputs"] = list(dm.plan.inputs)
    err["is_dtensor"] = all(isinstance(p, torch.distributed.tensor.DTensor) for p in dm.parameters())
    err["names"] = sorted(n for n, _ in dm.named_parameters()) == sorted(n for n, _ in ref.named_parameters())
    return err


def run_cases(cases: dict[str, tuple]) -> dict:
    """cases: name -> (kind, mesh_shape, constraints)."""
    return {name: one_case(*spec) for name, spec in cases.items()}
