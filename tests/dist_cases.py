"""Numerics cases run inside real gloo processes (module-level so spawned ranks can import them).

Each case compiles a model under a plan (free, or pinned by constraints), runs forward, backward
and one SGD step on every rank, and returns the largest deviation from the same step run on a
single device in this process: loss, every gradient, every parameter after the step.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import autoshard
from autoshard.zoo import GPT, MLP, GPTConfig

IN2 = [["S(0)"], ["S(0)"]]
GPT_CASES = {
    # name: (mesh shape, constraints)
    "free": (None, None),
    "ddp": (None, {"inputs": IN2, "*": ["R"]}),
    # storage sharded, each consumer gathering (FSDP), or one gather per step kept (ZeRO-2)
    "fsdp": (None, {"inputs": IN2, "*": ["S(0)"], "working": ["S(0)"]}),
    "zero2": (None, {"inputs": IN2, "*": ["S(0)"], "working": ["R"]}),
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
    "fsdp": (None, {"inputs": IN2, "*": ["S(0)"], "working": ["S(0)"]}),
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


def _working(model, inputs, placements):
    """An ``allow`` pinning every parameter's working placement (what its consumers read)."""
    from autoshard.notation import parse_placements

    want = tuple(parse_placements(placements, len(placements)))
    names = {node.name for _, node in autoshard.trace(model, inputs).params}  # same names when compiled
    return lambda node, s: node.op != "placeholder" or node.name not in names or tuple(s.outputs[0]) == want


def step_errors(dm, ref, inputs, lr: float) -> dict:
    """One forward, backward and SGD step of the compiled ``dm`` and of the single-device
    ``ref`` (a copy of the same model) on ``inputs``: the largest deviation of the loss, of any
    gradient and of any parameter after the step."""
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
    return err


def one_case(kind: str, mesh_shape, constraints, lr: float = 0.1) -> dict:
    model, inputs = _model(kind)
    ref = copy.deepcopy(model)
    cluster = autoshard.Cluster.local(dist.get_world_size(), mesh_shape)
    constraints = dict(constraints) if constraints else None
    working = constraints.pop("working", None) if constraints else None
    allow = _working(model, inputs, working) if working else None
    dm = autoshard.compile(model, cluster, inputs, constraints=constraints, allow=allow)
    err = step_errors(dm, ref, inputs, lr)
    err["storage"] = dict(dm.plan.storage)
    err["gathered_once"] = len(dm._working)  # parameters computed with a kept working copy
    err["inputs"] = list(dm.plan.inputs)
    params = list(dm.parameters())
    err["is_dtensor"] = bool(params) and all(isinstance(p, DTensor) for p in params)
    names = sorted(n for n, _ in dm.named_parameters())
    err["names"] = bool(names) and names == sorted(n for n, _ in ref.named_parameters())
    return err


def run_cases(cases: dict[str, tuple]) -> dict:
    """cases: name -> (kind, mesh_shape, constraints)."""
    return {name: one_case(*spec) for name, spec in cases.items()}


def saved_bytes_case(fraction) -> dict:
    """Train one step of a small GPT under ``memory_limit`` and measure the bytes its forward
    saves for backward on this rank (distinct storages, parameters, their working copies and
    inputs excluded)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=128, seq=64, hidden=128, heads=4, layers=2))
    inputs = model.example_inputs(16, generator=torch.Generator().manual_seed(1))
    ref = copy.deepcopy(model)
    cluster = autoshard.Cluster.local(dist.get_world_size())
    limit = None if fraction is None else autoshard.plan(model, cluster, inputs).peak_memory * fraction
    dm = autoshard.compile(model, cluster, inputs, memory_limit=limit)
    local = dm.shard_inputs(*inputs)
    exclude = {p.to_local().untyped_storage().data_ptr() for p in dm.parameters()}
    exclude |= {t.untyped_storage().data_ptr() for t in local}
    storages: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        # parameters' working copies (gathered once per step) are state, not activations
        working = {w.untyped_storage().data_ptr() for _, w in dm.__dict__["_working_cache"].values()}
        if ptr not in exclude and ptr not in working:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = dm(*local)
    loss.backward()
    ref_loss = ref(*inputs)
    ref_loss.backward()
    grad_err = max((p.grad.full_tensor() - ref.get_parameter(n).grad).abs().max().item() for n, p in dm.named_parameters())
    return {"measured": float(sum(storages.values())), "predicted": dm.plan.saved_for_backward,
            "recomputed": sum(n.recompute for n in dm.plan.nodes), "peak": dm.plan.peak_memory,
            "loss_err": (loss - ref_loss).abs().item(), "grad_err": grad_err}


def saved_bytes_cases(fractions) -> list:
    """fractions: of the unconstrained plan's predicted peak (None: no cap)."""
    return [saved_bytes_case(f) for f in fractions]


def mismatched_world_case() -> str:
    """compile on this process group with a cluster of the wrong size: returns the error text."""
    model, inputs = _model("mlp")
    try:
        autoshard.compile(model, autoshard.Cluster.local(dist.get_world_size() * 2), inputs)
    except autoshard.errors.ClusterError as exc:
        return f"ClusterError: {exc}"
    return "no error"


def live_ranks() -> list[int]:
    """Pids of rank processes still alive, or dead and unreaped, from this process's launches
    (Linux /proc): its spawned children, the forkserver's children, zombies among its own."""
    from multiprocessing import forkserver

    me, server, live = os.getpid(), forkserver._forkserver._forkserver_pid, []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        ppid = int(ppid)
        if (ppid == me and (state == "Z" or b"spawn_main" in cmd)) or (server is not None and ppid == server):
            live.append(int(pid))
    return live
