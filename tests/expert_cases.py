"""Expert-parallel numerics, run inside real gloo processes (module-level so spawned ranks import
them).

Each case builds transformers' Mixtral or DeepSeek-V3 from a tiny config with grouped-GEMM
experts, in bfloat16 (torch traces grouped GEMMs in bfloat16 only), compiles it with every MoE
region pinned expert-parallel on one mesh dim (the rest of the plan
free), runs forward, backward and one SGD step, and returns the largest deviation from the same
step on one device, with the exchanges the ranks ran.

``routing="skewed"``: every token's first choice is expert 0 (a large constant feature in the
embeddings that only expert 0's router row reads), so expert 0 receives half the routed rows
(top-2) and the rank holding it the most.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import autoshard
from autoshard.passes.regions import ep_dim, ep_member
from dist_cases import step_errors

EXPERTS = 4


def model_and_inputs(routing: str = "even", kind: str = "mixtral"):
    """transformers' tiny Mixtral (4 experts, top-2) or DeepSeek-V3 (8 small experts in 2 groups,
    top-2 of one group, a shared expert, a dense first layer), bfloat16, with a batch of 4 x 16."""
    import transformers
    from autoshard.zoo import hf

    torch.manual_seed(0)
    if kind == "deepseek_v3":
        config = hf.deepseek_v3_config("tiny")
        model = hf.CausalLM(transformers.DeepseekV3ForCausalLM(config)).to(torch.bfloat16)
    else:
        config = hf.mixtral_config("tiny", "grouped_mm")
        config.num_local_experts = EXPERTS
        model = hf.CausalLM(transformers.MixtralForCausalLM(config)).to(torch.bfloat16)
    if routing == "skewed":
        inner = model.model.model
        with torch.no_grad():
            inner.embed_tokens.weight[:, 0] = 30.0
            for layer in inner.layers:
                layer.mlp.gate.weight[0, 0] = 4.0
                layer.mlp.gate.weight[1:, 0] = 0.0
    g = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(0, config.vocab_size, (4, 16), generator=g) for _ in range(2))
    return model, (ids, labels)


def pinned(ep_on: int):
    """An ``allow``: every member of every MoE region runs expert-parallel over mesh dim ``ep_on``."""
    def allow(node, s) -> bool:
        if node.op == "call_function" and ep_member(node):
            return ep_dim(s) == ep_on
        return True
    return allow


def expert_loads(model, inputs) -> list[float]:
    """Per expert, the share of the routed rows it receives (the single-device forward)."""
    picks = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, out: picks.append(out[2].reshape(-1)))
             for layer in model.model.model.layers]
    with torch.no_grad():
        model(*inputs)
    for h in hooks:
        h.remove()
    counts = torch.bincount(torch.cat(picks), minlength=EXPERTS).double()
    return (counts / counts.sum()).tolist()


def one_case(mesh_shape, ep_on: int, routing: str, kind: str = "mixtral") -> dict:
    model, inputs = model_and_inputs(routing, kind)
    ref = copy.deepcopy(model)
    loads = expert_loads(ref, inputs) if kind == "mixtral" else None
    cluster = autoshard.Cluster.local(dist.get_world_size(), mesh_shape)
    dm = autoshard.compile(model, cluster, inputs, allow=pinned(ep_on))
    err = step_errors(dm, ref, inputs, lr=0.1)
    err["loads"] = loads
    err["grad_scale"] = max(p.grad.abs().max().item() for p in ref.parameters() if p.grad is not None)
    err["ep_nodes"] = sum(1 for n in dm.plan.nodes if n.strategy.endswith(f" ep{ep_on}"))
    err["exchanges"] = {phase: sum(1 for n in gm.graph.nodes if n.op == "call_function"
                                   and str(n.target).startswith(("autoshard.moe_dispatch", "autoshard.moe_combine")))
                        for phase, gm in (("fwd", dm._fw), ("bwd", dm._bw))}
    return err


def run_cases(cases: dict[str, tuple]) -> dict:
    return {name: one_case(*spec) for name, spec in cases.items()}

