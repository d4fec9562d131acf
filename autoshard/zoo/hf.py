"""Hugging Face ``transformers`` models for the zoo, built from ``Config`` objects (nothing is
downloaded) and wrapped so that ``forward(inputs, labels)`` returns a scalar loss.

Three things make them trace to a joint graph autoshard can shard:

* Attention goes through ``"autoshard_sdpa"``, an attention function registered with
  transformers' ``AttentionInterface``. transformers' mask helpers look at mask and position
  values (packed-sequence and all-ones checks) unless they detect a tracer, and AOTAutograd's
  functional tensors are not one they detect; for an implementation it has no mask function for,
  transformers builds no mask at all. The function then runs causal or bidirectional SDPA itself,
  without a mask tensor, so the CPU flash kernel (which autoshard has a sharding rule for) is
  used, and a 70B plan holds no (batch, 1, seq, seq) mask. Padding masks are not supported.
* Dropout is 0 in every config: dropout draws different random numbers when the batch is split,
  so a sharded step could never match the single-device one.
* Mixtral's experts run as ``grouped_mm`` in bfloat16 (one GEMM per expert over its sorted
  tokens) and as ``batched_mm`` in float32, which ``grouped_mm`` does not take (the default loops
  over the experts that data selects, which cannot be traced). ``batched_mm`` gathers one full
  expert weight per token (terabytes at 8x7B), so the real size is bfloat16 only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv

from autoshard.errors import TraceError

ATTENTION = "autoshard_sdpa"


def _sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    if attention_mask is not None:
        raise TraceError(f"{ATTENTION} attention takes no mask: padding is not supported; pass unpadded "
                         "batches (no attention_mask) to the zoo's transformers models")
    groups = getattr(module, "num_key_value_groups", 1)
    # GQA by repeating K/V heads, as transformers' eager path does. SDPA's enable_gqa would keep the
    # repeated copies out of memory, but is not yet checked against autoshard's attention rule.
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    out = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, scale=scaling,
                                         is_causal=bool(causal) and query.shape[2] > 1)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, _sdpa)


class Wrapped(nn.Module):
    """A transformers model under ``.model`` (its parameter names keep that prefix), wrapped so
    that ``forward(*inputs)`` returns a scalar loss."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model


class CausalLM(Wrapped):
    """A ``*ForCausalLM`` / ``*ForMaskedLM`` model; ``forward(ids, labels)`` is the mean token
    cross-entropy of its logits against ``labels``. Every position counts: for BERT's masked-LM
    head that is the same graph as scoring the usual 15% of positions, without the ignore mask."""

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=ids, use_cache=False).logits  # a KV cache is for generation only
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))


class ImageClassifier(Wrapped):
    """A ``*ForImageClassification`` model; ``forward(pixels, labels)`` is the mean cross-entropy."""

    def forward(self, pixels: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.model(pixel_values=pixels).logits, labels)


# --- configs: tiny for numerics on CPU, real for planning on meta ----------------------------------
_NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, hidden_dropout_prob=0.0,
                   attention_probs_dropout_prob=0.0, attention_dropout=0.0)


def _config(cls, **kw):
    drop = {k: v for k, v in _NO_DROPOUT.items() if hasattr(cls(), k)}
    # bos/eos/pad ids: inside the tiny vocabularies (transformers warns otherwise); training never reads them
    return cls(**drop, **kw, attn_implementation=ATTENTION)


def gpt2_config(size: str):
    sizes = {
        "tiny": dict(vocab_size=128, n_positions=16, n_embd=64, n_layer=2, n_head=4),
        # GPT-2 (Radford et al. 2019) as released: 124M and 1.5B ("gpt2", "gpt2-xl")
        "124m": dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12),
        "1.5b": dict(vocab_size=50257, n_positions=1024, n_embd=1600, n_layer=48, n_head=25),
    }
    return _config(transformers.GPT2Config, **sizes[size], bos_token_id=0, eos_token_id=0)


def llama3_config(size: str):
    sizes = {
        "tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16),
        # Llama 3 as released: GQA with 8 K/V heads, rope theta 500000
        "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                   rope_theta=500000.0),
        "70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                    num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192,
                    rope_theta=500000.0),
    }
    return _config(transformers.LlamaConfig, **sizes[size], bos_token_id=0, eos_token_id=0)


def bert_config(size: str):
    sizes = {
        "tiny": dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=256, max_position_embeddings=16),
        # BERT-large (Devlin et al. 2019), uncased vocabulary
        "large": dict(vocab_size=30522, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                      intermediate_size=4096, max_position_embeddings=512),
    }
    return _config(transformers.BertConfig, **sizes[size], pad_token_id=0)


def vit_config(size: str):
    sizes = {
        "tiny": dict(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=256, num_labels=10),
        # ViT-L/16 at 224 x 224 (Dosovitskiy et al. 2021), ImageNet-1k head
        "l16": dict(image_size=224, patch_size=16, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                    intermediate_size=4096, num_labels=1000),
    }
    return _config(transformers.ViTConfig, **sizes[size])


def mixtral_config(size: str, experts_implementation: str = "batched_mm"):
    sizes = {
        "tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                     max_position_embeddings=16),
        # Mixtral 8x7B as released: 8 experts, top-2 routing, GQA with 8 K/V heads
        "8x7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                     max_position_embeddings=32768, rope_theta=1e6),
    }
    return _config(transformers.MixtralConfig, **sizes[size], bos_token_id=0, eos_token_id=0,
                   experts_implementation=experts_implementation)


def deepseek_v3_config(size: str):
    """A fine-grained MoE: DeepSeek-V3's architecture (multi-head latent attention, sigmoid routing
    with a bias, group-limited top-k, shared experts, dense first layers), experts as grouped
    GEMMs. Not in :data:`BUILDERS` (its grouped GEMMs trace in bfloat16 only): build it with
    ``transformers.DeepseekV3ForCausalLM(deepseek_v3_config(size)).to(torch.bfloat16)``."""
    sizes = {
        "tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                     num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
                     n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                     q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                     max_position_embeddings=16),
        # 16B, 64 small experts (Moonlight-16B-A3B's published sizes): 2 shared, 6 routed per token
        "16b": dict(vocab_size=163840, hidden_size=2048, intermediate_size=11264, moe_intermediate_size=1408,
                    num_hidden_layers=27, first_k_dense_replace=1, num_attention_heads=16, num_key_value_heads=16,
                    n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, n_group=1, topk_group=1,
                    q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                    v_head_dim=128, max_position_embeddings=8192, routed_scaling_factor=2.446),
    }
    return _config(transformers.DeepseekV3Config, **sizes[size], bos_token_id=0, eos_token_id=0,
                   experts_implementation="grouped_mm")


BUILDERS = {
    # name: (config function, wrapper, model class name, sizes (first is "tiny", second is "real"))
    "hf_gpt2": (gpt2_config, CausalLM, "GPT2LMHeadModel", ("tiny", "124m", "1.5b")),
    "hf_llama3": (llama3_config, CausalLM, "LlamaForCausalLM", ("tiny", "8b", "70b")),
    "bert": (bert_config, CausalLM, "BertForMaskedLM", ("tiny", "large")),
    "vit": (vit_config, ImageClassifier, "ViTForImageClassification", ("tiny", "l16")),
    "mixtral": (mixtral_config, CausalLM, "MixtralForCausalLM", ("tiny", "8x7b")),
}


def build(name: str, size: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The wrapped model (on the current default device; use ``with torch.device("meta")``),
    with weights in ``dtype``."""
    config_fn, wrapper, cls_name, _ = BUILDERS[name]
    if name != "mixtral":
        config = config_fn(size)
    elif dtype == torch.bfloat16:
        config = config_fn(size, "grouped_mm")
    elif size == "tiny":
        config = config_fn(size, "batched_mm")
    else:
        raise ValueError(f"Mixtral {size} plans in bfloat16 only: its float32 experts run as batched_mm, "
                         f"which gathers one full expert weight per token (terabytes at this size)")
    return wrapper(getattr(transformers, cls_name)(config)).to(dtype)
