"""Zoo numerics run inside real gloo processes (module level so spawned ranks can import it).

Each model of the zoo at its tiny size (or of autoshard/zoo/corpus.py, named "corpus:NAME"), is compiled under the solver's own plan and trained
for ``STEPS`` SGD steps on every rank; each rank also runs the same steps on a single-device copy.
Returned per model: the largest deviation of the loss (every step), of every gradient (every
step) and of every parameter (after the last step), the distributed run's loss at each step, the
largest single-device gradient element, plus the plan's fallbacks.
"""

from __future__ import annotations

import copy
import operator
import time
import traceback

import torch
import torch.distributed as dist

import autoshard
from autoshard import zoo
from autoshard.zoo import corpus
from autoshard.cluster import DeviceSpec, LinkSpec

STEPS = 2
LR = 0.1


def sharding_cluster(mesh_shape) -> autoshard.Cluster:
    """Devices with almost no compute joined by near-free links: every op's time is its FLOPs and
    bytes divided by the shards, so the solver splits every op a rule lets it split. At tiny sizes
    a realistic cluster replicates nearly everything, which would test no sharding rule."""
    device = DeviceSpec("slow", peak_flops={"float32": 1e6}, memory_bandwidth=1e6, memory=2**40,
                        launch_overhead=0.0, comm_overlap=0.0)
    link = LinkSpec("free", latency=1e-9, bandwidth=1e15)
    return autoshard.Cluster(mesh_shape, device=device, links=[link] * len(mesh_shape))


def train_case(name: str, mesh_shape=None, constraints=None, plan=None, dtype=None) -> dict:
    """mesh_shape None: the realistic ``Cluster.local`` (free plan); ("local", shape): the same on a
    mesh of that shape; else ``sharding_cluster``."""
    start = time.perf_counter()
    model, inputs = corpus.get(name[7:]) if name.startswith("corpus:") else zoo.get(name, "tiny", seed=0, dtype=dtype)
    ref = copy.deepcopy(model)
    world = dist.get_world_size()
    if mesh_shape is None or mesh_shape[0] == "local":
        cluster = autoshard.Cluster.local(world, None if mesh_shape is None else mesh_shape[1])
    else:
        cluster = sharding_cluster(mesh_shape)
    dm = autoshard.compile(model, cluster, inputs, constraints=constraints, plan=plan)
    opt = torch.optim.SGD(dm.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    local = dm.shard_inputs(*inputs)
    err = {"loss": 0.0, "grad": 0.0, "param": 0.0, "losses": [], "grad_scale": 0.0}
    for _ in range(STEPS):
        loss = dm(*local)
        loss.backward()
        ref_loss = ref(*inputs)
        ref_loss.backward()
        err["losses"].append(loss.item())
        err["loss"] = max(err["loss"], (loss.detach() - ref_loss.detach()).abs().item())
        for pname, p in dm.named_parameters():
            want = ref.get_parameter(pname).grad
            err["grad"] = max(err["grad"], (p.grad.full_tensor() - want).abs().max().item())
            err["grad_scale"] = max(err["grad_scale"], want.abs().max().item())
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for pname, p in dm.named_parameters():
        err["param"] = max(err["param"], (p.full_tensor() - ref.get_parameter(pname)).abs().max().item())
    err["fallbacks"] = sorted({reason for _, reason in dm.plan.fallbacks})
    err["gaps"] = [g["node"] for g in dm.plan.gaps]
    err["storage"] = dict(dm.plan.storage)
    err["inputs"] = list(dm.plan.inputs)
    err["sharded_nodes"] = sum(1 for n in dm.plan.nodes if "S(" in n.strategy)
    err["sorts"] = [n.strategy for n in dm.plan.nodes if n.op == str(torch.ops.aten.sort.default)]
    err["names"] = sorted(n for n, _ in dm.named_parameters()) == sorted(n for n, _ in ref.named_parameters())
    err["seconds"] = time.perf_counter() - start
    return err


def _heads_then_gathered(node, strategy) -> bool:
    """Attention split over heads, and the transpose that reads its output replicated: the plan
    must gather the CPU flash-attention output, which is (b, t, h, d) in memory."""
    from torch.distributed.tensor import Replicate, Shard

    if node.target is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default:
        return strategy.outputs[0] == (Shard(1),)
    if node.target is torch.ops.aten.transpose.int and node.args[0].target is operator.getitem and \
            node.args[0].args[0].target is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default:
        return strategy.inputs[0] == (Replicate(),)
    return True


def gathered_attention_case(name: str) -> dict:
    """``name`` trained under a plan that gathers the attention output (see above)."""
    model, inputs = zoo.get(name, "tiny", seed=0)
    plan = autoshard.plan(model, sharding_cluster((dist.get_world_size(),)), inputs, allow=_heads_then_gathered)
    return train_case(name, (dist.get_world_size(),), plan=plan)


def run_zoo(cases: dict[str, tuple]) -> dict:
    """cases: label -> (zoo name, mesh shape or "gathered", constraints[, dtype]). A case that raises reports its
    traceback under "error" and the others still run (every rank raises alike: the plan and the
    graphs are the same on every rank)."""
    out = {}
    for label, spec in cases.items():
        try:
            if spec[1] == "gathered":
                out[label] = gathered_attention_case(spec[0])
            else:
                out[label] = train_case(*spec[:3], dtype=spec[3] if len(spec) > 3 else None)
        except Exception:  # noqa: BLE001 - reported to the test of this case
            out[label] = {"error": traceback.format_exc()}
    return out
