"""A corpus of real architectures, to hold strategy coverage to: model code autoshard's authors
did not write.

Each entry builds a ``transformers`` model from its config class at tiny size (nothing is
downloaded; dropout 0), with the attention the library picks by default for it (SDPA, or its
eager attention where transformers has no SDPA path), wrapped so that ``forward(*inputs)``
returns a scalar loss. Beside them stand hand-written models in the styles other projects use:
interleaved rotary embeddings with ``torch.stack``, ``unbind`` and ``view_as_complex``, attention
by ``einsum``, projections split by ``chunk``.

    >>> from autoshard.zoo import corpus
    >>> model, inputs = corpus.get("gptj")
    >>> corpus.names()[:3]
    ['mistral', 'qwen2', 'qwen3']

``KNOWN_GAPS`` names the entries whose plans are expected to replicate some op, and why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from autoshard.zoo.hf import CausalLM, ImageClassifier, Wrapped  # the zoo's wrappers: (ids, labels), (pixels, labels)

SEQ, BATCH, VOCAB, IMAGE = 32, 8, 128, 32

_DECODER = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
_ENCODER = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=64)
_NO_DROPOUT = ("resid_pdrop", "embd_pdrop", "attn_pdrop", "hidden_dropout_prob", "attention_probs_dropout_prob",
               "attention_dropout", "hidden_dropout", "dropout", "activation_dropout", "dropout_rate",
               "classifier_dropout", "drop_path_rate", "embed_dropout", "ffn_dropout", "seq_classif_dropout",
               "qa_dropout", "summary_first_dropout", "emb_pdrop", "mlp_dropout", "attn_dropout")


@dataclass(frozen=True)
class Entry:
    config: str                       # transformers config class, or "" for a hand-written model
    model: str                        # transformers model class, or the hand-written model's name
    kwargs: dict = field(default_factory=dict)
    kind: str = "lm"                  # lm | seq2seq | image | clip | hand
    attention: str | None = None      # None: transformers' default for the class


ENTRIES: dict[str, Entry] = {
    # decoders
    "mistral": Entry("MistralConfig", "MistralForCausalLM", dict(_DECODER, sliding_window=16)),
    "qwen2": Entry("Qwen2Config", "Qwen2ForCausalLM", _DECODER),
    "qwen3": Entry("Qwen3Config", "Qwen3ForCausalLM", dict(_DECODER, head_dim=16)),
    "gemma2": Entry("Gemma2Config", "Gemma2ForCausalLM", dict(_DECODER, head_dim=16, sliding_window=16),
                    attention="eager"),
    "gemma3": Entry("Gemma3TextConfig", "Gemma3ForCausalLM", dict(_DECODER, head_dim=16, sliding_window=16)),
    "phi3": Entry("Phi3Config", "Phi3ForCausalLM", dict(_DECODER, pad_token_id=0, bos_token_id=0, eos_token_id=0)),
    "phi": Entry("PhiConfig", "PhiForCausalLM", _DECODER),
    "gpt_neox": Entry("GPTNeoXConfig", "GPTNeoXForCausalLM", _ENCODER),
    "gptj": Entry("GPTJConfig", "GPTJForCausalLM", dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4,
                                                        n_positions=64, rotary_dim=8, bos_token_id=0, eos_token_id=0)),
    "falcon": Entry("FalconConfig", "FalconForCausalLM", dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                                              num_attention_heads=4)),
    "falcon_alibi": Entry("FalconConfig", "FalconForCausalLM", dict(vocab_size=VOCAB, hidden_size=64,
                                                                    num_hidden_layers=2, num_attention_heads=4,
                                                                    alibi=True), attention="eager"),
    "olmo": Entry("OlmoConfig", "OlmoForCausalLM", _DECODER),
    "olmo2": Entry("Olmo2Config", "Olmo2ForCausalLM", _DECODER),
    "stablelm": Entry("StableLmConfig", "StableLmForCausalLM", _DECODER),
    "starcoder2": Entry("Starcoder2Config", "Starcoder2ForCausalLM", _DECODER),
    "cohere": Entry("CohereConfig", "CohereForCausalLM", dict(_DECODER, pad_token_id=0, bos_token_id=0,
                                                              eos_token_id=0)),
    "granite": Entry("GraniteConfig", "GraniteForCausalLM", _DECODER),
    "opt": Entry("OPTConfig", "OPTForCausalLM", dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                                     num_attention_heads=4, ffn_dim=128, max_position_embeddings=64,
                                                     word_embed_proj_dim=64, pad_token_id=0, bos_token_id=0,
                                                     eos_token_id=0)),
    "bloom": Entry("BloomConfig", "BloomForCausalLM", dict(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4),
                   attention="eager"),
    "mpt": Entry("MptConfig", "MptForCausalLM", dict(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4,
                                                     max_seq_len=64), attention="eager"),
    "gpt_bigcode": Entry("GPTBigCodeConfig", "GPTBigCodeForCausalLM", dict(vocab_size=VOCAB, n_embd=64, n_layer=2,
                                                                           n_head=4, n_positions=64)),
    "qwen3_moe": Entry("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(_DECODER, head_dim=16, moe_intermediate_size=32,
                                                                     num_experts=4, num_experts_per_tok=2,
                                                                     experts_implementation="batched_mm")),
    # encoders
    "roberta": Entry("RobertaConfig", "RobertaForMaskedLM", dict(_ENCODER, pad_token_id=0)),
    "distilbert": Entry("DistilBertConfig", "DistilBertForMaskedLM", dict(vocab_size=VOCAB, dim=64, n_layers=2,
                                                                          n_heads=4, hidden_dim=128,
                                                                          max_position_embeddings=64)),
    "electra": Entry("ElectraConfig", "ElectraForMaskedLM", dict(_ENCODER, embedding_size=64)),
    # encoder-decoders
    # 8 heads as T5-small: its relative-position bias table is (buckets, heads), and a bucket split is
    # the vocab-parallel embedding's masked partial, which autoshard does not plan
    "t5": Entry("T5Config", "T5ForConditionalGeneration", dict(vocab_size=VOCAB, d_model=64, d_kv=8, d_ff=128,
                                                               num_layers=2, num_heads=8, decoder_start_token_id=0,
                                                               pad_token_id=0), kind="seq2seq"),
    "bart": Entry("BartConfig", "BartForConditionalGeneration", dict(vocab_size=VOCAB, d_model=64, encoder_layers=2,
                                                                     decoder_layers=2, encoder_attention_heads=4,
                                                                     decoder_attention_heads=4, encoder_ffn_dim=128,
                                                                     decoder_ffn_dim=128, max_position_embeddings=64,
                                                                     pad_token_id=0, bos_token_id=0, eos_token_id=0,
                                                                     decoder_start_token_id=0), kind="seq2seq"),
    # vision
    "deit": Entry("DeiTConfig", "DeiTForImageClassification", dict(image_size=IMAGE, patch_size=8, hidden_size=64,
                                                                   num_hidden_layers=2, num_attention_heads=4,
                                                                   intermediate_size=128, num_labels=16),
                  kind="image"),
    "swin": Entry("SwinConfig", "SwinForImageClassification", dict(image_size=IMAGE, patch_size=2, embed_dim=16,
                                                                   depths=[2, 2], num_heads=[2, 4], window_size=4,
                                                                   num_labels=16), kind="image"),
    "convnext": Entry("ConvNextConfig", "ConvNextForImageClassification", dict(image_size=IMAGE, num_channels=3,
                                                                               hidden_sizes=[16, 32], depths=[2, 2], num_stages=2,
                                                                               num_labels=16), kind="image"),
    "clip": Entry("CLIPConfig", "CLIPModel", dict(text_config=dict(vocab_size=VOCAB, hidden_size=64,
                                                                   intermediate_size=128, num_hidden_layers=2,
                                                                   num_attention_heads=4, max_position_embeddings=64),
                                                  vision_config=dict(image_size=IMAGE, patch_size=8, hidden_size=64,
                                                                     intermediate_size=128, num_hidden_layers=2,
                                                                     num_attention_heads=4),
                                                  projection_dim=32), kind="clip"),
    # hand-written, in other projects' styles
    "rope_stack": Entry("", "stack", kind="hand"),
    "rope_unbind": Entry("", "unbind", kind="hand"),
    "rope_complex": Entry("", "complex", kind="hand"),
    "einsum_attention": Entry("", "einsum", kind="hand"),
    "chunk_swiglu": Entry("", "chunk", kind="hand"),
    "rope_cat": Entry("", "cat", kind="hand"),
}

# entry -> why its plans replicate some op (an op that cannot shard, or no rule torch has)
KNOWN_GAPS: dict[str, str] = {
    "swin": "functionalization turns the pooler's flatten of a (batch, channels, 1) mean with the strides of "
            "a transpose into as_strided / as_strided_scatter (no rule: an arbitrary-stride view does not "
            "split in general); batch x channels values, once per step",
}


def names() -> list[str]:
    return list(ENTRIES)


# ------------------------------------------------------------------------ transformers wrappers
class Seq2SeqLM(Wrapped):
    """``forward(ids, labels)``: the decoder reads ``labels`` (teacher forcing) and is scored on
    them, as the encoder-decoder training recipes do."""

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=ids, decoder_input_ids=labels, use_cache=False).logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))


class Contrastive(Wrapped):
    """CLIP's symmetric contrastive loss over the batch's (text, image) pairs."""

    def forward(self, ids: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, pixel_values=pixels, return_loss=True).loss


# ------------------------------------------------------------------------ hand-written models
class _Attention(nn.Module):
    """Multi-head causal attention with rotary positions, written the way ``style`` names."""

    def __init__(self, style: str, dim: int = 64, heads: int = 4, seq: int = SEQ):
        super().__init__()
        assert style in ("stack", "unbind", "complex", "einsum", "chunk", "cat"), style
        self.style, self.heads = style, heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        half = dim // heads // 2
        freqs = torch.outer(torch.arange(seq).float(), 1.0 / 10000 ** (torch.arange(half).float() / half))
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def rope(self, x: torch.Tensor) -> torch.Tensor:   # x: (batch, heads, seq, head_dim)
        if self.style == "cat":   # Hugging Face's Llama: halves rotated, joined with cat
            x1, x2 = x.chunk(2, dim=-1)
            cos, sin = torch.cat((self.cos, self.cos), -1), torch.cat((self.sin, self.sin), -1)
            return x * cos + torch.cat((-x2, x1), dim=-1) * sin
        if self.style in ("stack", "einsum", "chunk"):  # GPT-J-style interleaved pairs
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.stack((x1 * self.cos - x2 * self.sin, x1 * self.sin + x2 * self.cos), dim=-1).flatten(-2)
        if self.style == "unbind":
            x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
            return torch.stack((x1 * self.cos - x2 * self.sin, x1 * self.sin + x2 * self.cos), dim=-1).flatten(-2)
        # Meta's Llama reference: pairs as complex numbers, rotated by a unit complex
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * torch.polar(torch.ones_like(self.cos), self.cos)).flatten(-2).type_as(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        if self.style == "chunk":
            q, k, v = self.qkv(x).chunk(3, dim=-1)
        else:
            q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        q, k = self.rope(q), self.rope(k)
        if self.style == "einsum":
            scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.size(-1))
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            att = scores.masked_fill(~mask, float("-inf")).softmax(-1)
            y = torch.einsum("bhqk,bhkd->bhqd", att, v)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class _Block(nn.Module):
    def __init__(self, style: str, dim: int, heads: int, ffn: int, seq: int):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attn = _Attention(style, dim, heads, seq)
        self.up = nn.Linear(dim, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        gate, up = self.up(self.norm2(x)).chunk(2, dim=-1)   # SwiGLU with one fused projection
        return x + self.down(F.silu(gate) * up)


class HandLM(nn.Module):
    """A Llama-style decoder LM (RMSNorm, rotary positions written as ``style`` says, SwiGLU);
    ``forward(ids, labels)`` is the mean cross-entropy. Tiny by default; bench/coverage.py builds
    it at 13B size on ``meta``."""

    def __init__(self, style: str, dim: int = 64, layers: int = 2, heads: int = 4, ffn: int = 256,
                 vocab: int = VOCAB, seq: int = SEQ):
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(_Block(style, dim, heads, ffn, seq) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.view(-1, self.vocab), labels.view(-1))


# ------------------------------------------------------------------------ building
_WRAPPERS = {"lm": CausalLM, "seq2seq": Seq2SeqLM, "image": ImageClassifier, "clip": Contrastive}


def build(name: str) -> nn.Module:
    """The wrapped model, float32, random weights (on the current default device)."""
    e = ENTRIES[name]
    if e.kind == "hand":
        return HandLM(e.model)
    import transformers

    config = getattr(transformers, e.config)(**e.kwargs)
    for sub in (config, *(getattr(config, k) for k in ("text_config", "vision_config") if hasattr(config, k))):
        for key in _NO_DROPOUT:   # dropout draws other numbers when the batch is split
            if isinstance(getattr(sub, key, None), float):
                setattr(sub, key, 0.0)
    if e.attention is not None:
        config._attn_implementation = e.attention
    return _WRAPPERS[e.kind](getattr(transformers, e.model)(config))


def get(name: str, *, seed: int = 0, batch: int = BATCH) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """``(model, inputs)``, both drawn from ``seed``: ``model(*inputs)`` is a scalar loss."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build(name)
    g = torch.Generator().manual_seed(seed + 1)
    kind = ENTRIES[name].kind
    ids = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    pixels = torch.randn(batch, 3, IMAGE, IMAGE, generator=g)
    if kind == "image":
        return model, (pixels, torch.randint(0, model.model.config.num_labels, (batch,), generator=g))
    if kind == "clip":
        return model, (ids, pixels)
    return model, (ids, torch.randint(0, VOCAB, (batch, SEQ), generator=g))
