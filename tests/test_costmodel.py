"""Cost model against hand arithmetic: memory of a 7B Llama shape, and resharding collectives."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import autoshard
from autoshard.cluster import costmodel
from autoshard.cluster import Cluster, training_state_bytes, transformer_activation_bytes
from autoshard.zoo import Llama, LlamaConfig

GiB = 2**30
R, P = Replicate(), Partial()


# --- memory: a Llama-2 7B shape -------------------------------------------------------------------
H, L, I, V, A = 4096, 32, 11008, 32000, 32   # hidden, layers, intermediate, vocab, heads
LLAMA_7B_PARAMS = (
    V * H                                    # token embedding
    + L * (4 * H * H                         # q, k, v, o (no biases)
           + 3 * H * I                       # gate, up, down
           + 2 * H)                          # two RMSNorm weights
    + H                                      # final RMSNorm
    + V * H)                                 # untied LM head


def test_llama_7b_parameter_count():
    assert LLAMA_7B_PARAMS == 6_738_415_616  # the published "6.74B"
    with torch.device("meta"):
        model = Llama(LlamaConfig.llama2_7b())
    assert sum(p.numel() for p in model.parameters()) == LLAMA_7B_PARAMS


def test_training_state_16_bytes_per_param():
    n = LLAMA_7B_PARAMS
    # bf16 mixed precision with AdamW: 2 (bf16 param) + 2 (bf16 grad) + 4 (fp32 master) + 8 (moments).
    mixed = training_state_bytes(n, "bf16-mixed", "adam", breakdown=True)
    assert mixed == {"params": 2 * n, "grads": 2 * n, "master": 4 * n, "optimizer": 8 * n, "total": 16 * n}
    assert training_state_bytes(n, "bf16-mixed") == 16 * n == pytest.approx(107.81e9, rel=1e-4)
    # fp32 with Adam: 4 + 4 + 8, no master copy; the same 16 bytes.
    assert training_state_bytes(n, "fp32") == 16 * n
    assert training_state_bytes(n, "fp32", breakdown=True)["master"] == 0
    assert training_state_bytes(n, "bf16-mixed", fp32_grads=True) == 18 * n
    assert training_state_bytes(n, "fp32", "sgd") == 8 * n
    assert training_state_bytes(n, "fp32", "sgd-momentum") == 12 * n
    # Sharded over 8 GPUs (ZeRO-3 / FSDP) it fits an 80 GB device: 13.5 GB each.
    assert training_state_bytes(n, "bf16-mixed") / 8 == pytest.approx(13.48e9, rel=1e-3)
    with pytest.raises(ValueError, match="fp32, bf16-mixed"):
        training_state_bytes(n, "fp8")
    with pytest.raises(ValueError, match="adam"):
        training_state_bytes(n, "fp32", "lion")


def test_activation_formula_by_hand():
    s, b = 4096, 1
    per_layer_token = 34 * H + 5 * A * s
    assert per_layer_token == 794_624
    full = transformer_activation_bytes(H, A, s, b, L)
    assert full == per_layer_token * s * b * L == 104_152_956_928      # ~97 GiB at 4k context
    # Fused (flash) attention drops the 5*a*s score term: 34*h per token per layer.
    assert transformer_activation_bytes(H, A, s, b, L, fused_attention=True) == 34 * H * s * L == 18_253_611_008
    # Full recompute keeps each layer's input, 2*h bytes per token.
    assert transformer_activation_bytes(H, A, s, b, L, recompute=True) == 2 * H * s * L == 1_073_741_824
    # Linear in batch; the score term grows with s^2.
    assert transformer_activation_bytes(H, A, s, 8, L) == 8 * full
    assert transformer_activation_bytes(H, A, 2 * s, b, L) == (34 * H + 5 * A * 2 * s) * 2 * s * L
    with pytest.raises(ValueError, match="heads"):
        transformer_activation_bytes(H, 0, s, b, L)


def test_7b_mixed_precision_total_by_hand():
    # Training state + activations of one data-parallel replica, batch 1 at 4k, no recompute:
    # 16 * 6.74e9 + 104.15e9 = 211.97e9 bytes -- why a 7B model needs sharding or recompute on 80 GB.
    total = training_state_bytes(LLAMA_7B_PARAMS, "bf16-mixed") + transformer_activation_bytes(H, A, 4096, 1, L)
    assert total == 16 * LLAMA_7B_PARAMS + 104_152_956_928 == pytest.approx(211.97e9, rel=1e-4)


def test_plan_state_memory_matches_the_formula():
    # The planner's fp32 Adam accounting on one device (everything replicated) is the formula's, at
    # the optimizer step, when every gradient is there: the for-loop AdamW of a CPU adds two
    # temporaries of its largest parameter, and the batch and the rotary buffer are there too.
    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny())
    n = sum(p.numel() for p in model.parameters())
    batch = model.example_inputs(2)
    plan = autoshard.plan(model, Cluster.local(1), batch)
    moment, held = plan.memory_timeline[-1]
    temporaries = 2 * 4 * max(p.numel() for p in model.parameters())
    assert moment == "optimizer step"
    others = sum(t.nbytes for t in batch) + sum(b.nbytes for b in model.buffers())
    assert held - temporaries - others == training_state_bytes(n, "fp32")
    assert plan.memory["params"] + plan.memory["optimizer"] == training_state_bytes(n, "fp32") * 12 / 16


# --- resharding -------------------------------------------------------------------------------------
N = 64 * 2**20  # a 64 MiB tensor (global)


@pytest.fixture
def one_node():
    return Cluster.preset("dgx-a100-80gb")  # mesh (1, 8): node dim of 1, gpu dim of 8 on NVLink 3


@pytest.fixture
def two_nodes():
    return Cluster.preset("dgx-a100-80gb", nodes=2)  # mesh (2, 8)


NV, NV_A, IB, IB_A = 300e9 * 0.8, 3e-6, 25e9 * 0.8, 8e-6  # effective B and alpha of each link


def _one(colls):
    assert len(colls) == 1, colls
    return colls[0]


def test_partial_to_replicate_is_all_reduce(one_node):
    c = _one(costmodel.resharding(one_node, (R, P), (R, R), N))
    assert (c.kind, c.mesh_dim, c.nbytes) == ("all_reduce", 1, N)
    assert c.time == pytest.approx(2 * 7 / 8 * N / NV + 2 * 7 * NV_A, rel=1e-12)
    assert c.time == one_node.collective_time("all_reduce", N, "gpu")


def test_shard_to_replicate_is_all_gather(one_node):
    c = _one(costmodel.resharding(one_node, (R, Shard(0)), (R, R), N))
    assert (c.kind, c.mesh_dim, c.nbytes) == ("all_gather", 1, N)  # n = the gathered size
    assert c.time == pytest.approx(7 / 8 * N / NV + 7 * NV_A, rel=1e-12)


def test_bucketed_moves_pay_bandwidth_only(one_node):
    """A parameter's gather or a gradient's reduction runs in a bucket with others (one latency
    per bucket): priced by its bandwidth term alone, (p-1)/p n/B and 2(p-1)/p n/B by hand."""
    c = _one(costmodel.resharding(one_node, (R, Shard(0)), (R, R), N, bucketed=True))
    assert c.time == pytest.approx(7 / 8 * N / NV, rel=1e-9)
    c = _one(costmodel.resharding(one_node, (R, P), (R, R), N, bucketed=True))
    assert c.time == pytest.approx(2 * 7 / 8 * N / NV, rel=1e-9)


def test_partial_to_shard_is_reduce_scatter(one_node):
    c = _one(costmodel.resharding(one_node, (R, P), (R, Shard(1)), N))
    assert (c.kind, c.mesh_dim, c.nbytes) == ("reduce_scatter", 1, N)  # n = the input size
    assert c.time == pytest.approx(7 / 8 * N / NV + 7 * NV_A, rel=1e-12)


def test_shard_to_shard_is_all_to_all_kind(one_node):
    c = _one(costmodel.resharding(one_node, (R, Shard(0)), (R, Shard(1)), N))
    assert (c.kind, c.mesh_dim) == ("all_to_all", 1)


def test_shard_to_shard_all_to_all_bytes(one_node):
    # Each rank holds N/8 and keeps 1/8 of it: it sends 7/8 * N/8 = (p-1)/p * n with n = N/8.
    c = _one(costmodel.resharding(one_node, (R, Shard(0)), (R, Shard(1)), N))
    assert c.nbytes == N / 8
    assert c.time == pytest.approx(7 / 8 * (N / 8) / NV + 7 * NV_A, rel=1e-12)


@pytest.mark.parametrize("src, dst", [
    ((R, R), (R, Shard(0))),      # replicate -> shard: keep a slice
    ((R, R), (R, P)),             # replicate -> partial: zero all but one copy
    ((R, Shard(0)), (R, Shard(0))),
    ((R, P), (R, P)),
    ((P, R), (P, R)),             # unchanged placements
])
def test_free_reshardings(one_node, src, dst):
    assert costmodel.resharding(one_node, src, dst, N) == []
    assert costmodel.resharding_time(one_node, src, dst, N) == 0.0


def test_none_placements_are_free(one_node):
    assert costmodel.resharding(one_node, None, (R, R), N) == []


def test_two_dim_other_dim_sharded_divides_bytes(two_nodes):
    # Sharded over the 2 nodes, partial over the 8 GPUs: the GPU all-reduce moves each node's half.
    c = _one(costmodel.resharding(two_nodes, (Shard(0), P), (Shard(0), R), N))
    assert (c.kind, c.mesh_dim, c.nbytes) == ("all_reduce", 1, N / 2)
    assert c.time == pytest.approx(2 * 7 / 8 * (N / 2) / NV + 2 * 7 * NV_A, rel=1e-12)
    # Sharded over the 8 GPUs, gathered over the 2 nodes (on IB): each GPU's eighth.
    c = _one(costmodel.resharding(two_nodes, (Shard(0), Shard(1)), (R, Shard(1)), N))
    assert (c.kind, c.mesh_dim, c.nbytes) == ("all_gather", 0, N / 8)
    assert c.time == pytest.approx(1 / 2 * (N / 8) / IB + 1 * IB_A, rel=1e-12)
    # The other dim's shard counts when either side has it: S(1) on GPUs stays, so n = N/8 too.
    c = _one(costmodel.resharding(two_nodes, (P, Shard(1)), (Shard(0), Shard(1)), N))
    assert (c.kind, c.mesh_dim, c.nbytes) == ("reduce_scatter", 0, N / 8)
    assert c.time == pytest.approx(1 / 2 * (N / 8) / IB + 1 * IB_A, rel=1e-12)


def test_two_dims_touched_sum(two_nodes):
    # Partial on both dims -> replicated: one all-reduce per dim, each on the whole tensor, summed
    # (docs/cost_model.md: multi-dim resharding is the sum over the dims it touches).
    colls = costmodel.resharding(two_nodes, (P, P), (R, R), N)
    assert [(c.kind, c.mesh_dim, c.nbytes) for c in colls] == [("all_reduce", 0, N), ("all_reduce", 1, N)]
    expected = (2 * 1 / 2 * N / IB + 2 * IB_A) + (2 * 7 / 8 * N / NV + 2 * 7 * NV_A)
    assert costmodel.resharding_time(two_nodes, (P, P), (R, R), N) == pytest.approx(expected, rel=1e-12)


def test_local_bytes(two_nodes):
    assert costmodel.local_bytes(N, (Shard(0), P), two_nodes.mesh_shape) == N / 2   # partial holds a full copy
    assert costmodel.local_bytes(N, (Shard(0), Shard(1)), two_nodes.mesh_shape) == N / 16
    assert costmodel.local_bytes(N, (R, R), two_nodes.mesh_shape) == N
    assert costmodel.local_bytes(N, None, two_nodes.mesh_shape) == N
