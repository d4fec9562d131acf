"""Expert-parallel numerics, run inside real gloo processes (module-level so spawned ranks import
them).

Each case builds transformers' Mixtral or DeepSeek-V3 from a tiny config with grouped-GEMM
experts, in bfloat16 (transformers runs float32 experts through its own op while a model is
traced), or a float32 model whose MoE layers are written the way torchtitan writes its own
(:class:`TitanStyleMoE`), compiles it with every MoE region pinned expert-parallel on one mesh
dim (the rest of the plan free), runs forward, backward and one SGD step, and returns the
largest deviation from the same step on one device, with the exchanges the ranks ran.

``routing="skewed"``: every token's first choice is expert 0 (a large constant feature in the
embeddings that only expert 0's router row reads), so expert 0 receives half the routed rows
(top-2) and the rank holding it the most.

``capacity``: plan with ``moe_capacity`` set from the single-device routing (:func:`needed`):
``"exact"`` is the busiest rank's received rows over its own in the busiest layer, a buffer that
just holds them; ``"short"`` is one row less, which must raise ``CapacityError`` on every rank.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import autoshard
from autoshard.passes.regions import ep_dim, ep_member
from dist_cases import step_errors

EXPERTS = 4


class TitanStyleMoE(nn.Module):
    """A token-choice MoE as torchtitan writes one: a softmax router's top-k, the token-expert
    pairs sorted by expert (stable), per-expert counts by ``histc`` over [0, experts], SwiGLU
    experts stored stacked ``[experts, hidden, dim]`` through grouped GEMMs with the counts'
    offsets, the scores applied after the experts, and the rows put back in token order and
    summed over the k choices."""

    def __init__(self, dim: int = 16, hidden: int = 32, experts: int = EXPERTS, top_k: int = 2):
        super().__init__()
        self.experts, self.top_k = experts, top_k
        self.router = nn.Linear(dim, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, hidden, dim) * dim ** -0.5)
        self.w2 = nn.Parameter(torch.randn(experts, dim, hidden) * hidden ** -0.5)
        self.w3 = nn.Parameter(torch.randn(experts, hidden, dim) * dim ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # x: [tokens, dim]
        top, chosen = self.router(x).softmax(-1).topk(self.top_k, dim=-1)
        ids, order = torch.sort(chosen.reshape(-1), stable=True)
        counts = torch.histc(ids.float(), bins=self.experts, min=0, max=self.experts)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        routed = x[order // self.top_k]
        h = (F.silu(torch._grouped_mm(routed, self.w1.transpose(-2, -1), offs))
             * torch._grouped_mm(routed, self.w3.transpose(-2, -1), offs))
        out = torch._grouped_mm(h, self.w2.transpose(-2, -1), offs) * top.reshape(-1)[order].unsqueeze(-1)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return out[inverse].view(-1, self.top_k, x.shape[-1]).sum(1)


class TitanStyleModel(nn.Module):
    """Embeddings, two pre-norm residual MoE blocks, a head and the cross-entropy loss."""

    def __init__(self, vocab: int = 64, dim: int = 16, layers: int = 2):
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, dim)
        self.norms = nn.ModuleList(nn.RMSNorm(dim) for _ in range(layers))
        self.moes = nn.ModuleList(TitanStyleMoE(dim) for _ in range(layers))
        self.out_norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for norm, moe in zip(self.norms, self.moes):
            h = h + moe(norm(h).flatten(0, 1)).view(h.shape)
        return F.cross_entropy(self.head(self.out_norm(h)).flatten(0, 1), labels.flatten())


def routers(model):
    """Each MoE layer's router and how its output names the chosen experts."""
    if isinstance(model, TitanStyleModel):
        return [(moe.router, lambda out, k=moe.top_k: out.topk(k, dim=-1).indices) for moe in model.moes]
    return [(layer.mlp.gate, lambda out: out[2]) for layer in model.model.model.layers]


def model_and_inputs(routing: str = "even", kind: str = "mixtral"):
    """transformers' tiny Mixtral (4 experts, top-2) or DeepSeek-V3 (8 small experts in 2 groups,
    top-2 of one group, a shared expert, a dense first layer), bfloat16, or ``"titan"``
    (:class:`TitanStyleModel`, 4 experts, top-2) in float32; with a batch of 4 x 16."""
    import transformers
    from autoshard.zoo import hf

    torch.manual_seed(0)
    if kind == "titan":
        model = TitanStyleModel()
        if routing == "skewed":
            with torch.no_grad():
                model.embed.weight[:, 0] = 30.0
                for moe in model.moes:
                    moe.router.weight[0, 0] = 4.0
                    moe.router.weight[1:, 0] = 0.0
        g = torch.Generator().manual_seed(1)
        return model, tuple(torch.randint(0, model.vocab, (4, 16), generator=g) for _ in range(2))
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
    counts = torch.bincount(torch.cat(_picks(model, inputs)), minlength=EXPERTS).double()
    return (counts / counts.sum()).tolist()


def received(model, inputs, ranks: int) -> list[list[int]]:
    """Per MoE layer (in order), the routed rows each rank's experts receive when ``ranks`` ranks
    hold ``EXPERTS / ranks`` experts each, from the single-device forward's router picks."""
    return [torch.bincount(p // (EXPERTS // ranks), minlength=ranks).tolist() for p in _picks(model, inputs)]


def _picks(model, inputs) -> list[torch.Tensor]:
    """Per MoE layer, the experts its router chose for each token (the single-device forward)."""
    picks = []
    hooks = [router.register_forward_hook(lambda m, i, out, chosen=chosen: picks.append(chosen(out).reshape(-1)))
             for router, chosen in routers(model)]
    with torch.no_grad():
        model(*inputs)
    for h in hooks:
        h.remove()
    return picks


def needed(model, inputs, ranks: int) -> tuple[int, int]:
    """(the most rows any rank receives in any layer, each rank's own routed rows)."""
    loads = received(model, inputs, ranks)
    return max(max(layer) for layer in loads), sum(loads[0]) // ranks


def one_case(mesh_shape, ep_on: int, routing: str, kind: str = "mixtral", capacity: str | None = None) -> dict:
    model, inputs = model_and_inputs(routing, kind)
    ref = copy.deepcopy(model)
    loads = expert_loads(ref, inputs) if kind != "deepseek_v3" else None
    cluster = autoshard.Cluster.local(dist.get_world_size(), mesh_shape)
    moe_capacity = None
    if capacity is not None:
        # every rank's tokens route over the one dim: its own rows are the routed rows / ranks
        assert len(mesh_shape) == 1, "capacity cases run on a 1-D mesh"
        most, own = needed(ref, inputs, mesh_shape[ep_on])
        moe_capacity = (most - (capacity == "short")) / own
    dm = autoshard.compile(model, cluster, inputs, allow=pinned(ep_on), moe_capacity=moe_capacity)
    if capacity == "short":
        try:
            dm(*dm.shard_inputs(*inputs))
        except Exception as e:   # noqa: BLE001 - the test checks the type
            return {"raised": type(e).__name__, "message": str(e), "received": received(ref, inputs, mesh_shape[ep_on]),
                    "capacity": moe_capacity}
        return {"raised": None}
    err = step_errors(dm, ref, inputs, lr=0.1)
    err["loads"] = loads
    err["capacity"] = moe_capacity
    err["grad_scale"] = max(p.grad.abs().max().item() for p in ref.parameters() if p.grad is not None)
    variants = [n.strategy.rsplit(" ", 1)[-1] for n in dm.plan.nodes]
    err["ep_variants"] = sorted({v for v in variants if v.startswith("ep")})
    err["ep_nodes"] = sum(1 for v in variants if v.split("@")[0] == f"ep{ep_on}")
    err["exchanges"] = {phase: sum(1 for n in gm.graph.nodes if n.op == "call_function"
                                   and str(n.target).startswith(("autoshard.moe_dispatch", "autoshard.moe_combine")))
                        for phase, gm in (("fwd", dm._fw), ("bwd", dm._bw))}
    return err


def run_cases(cases: dict[str, tuple]) -> dict:
    return {name: one_case(*spec) for name, spec in cases.items()}

