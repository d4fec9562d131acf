"""Models autoshard is tested and demonstrated on, built from config with random weights.

``GPT`` is a GPT-2-style decoder (pre-LayerNorm, fused QKV, GELU MLP, causal SDPA, LM head tied
to the token embedding) whose forward
takes token ids and targets and returns the mean cross-entropy loss; ``MLP`` a regression MLP
returning the mean squared error; ``Llama`` a Llama-style decoder (RMSNorm, rotary, SwiGLU, GQA).
All three trace to the ops a transformer training step needs.

The registry builds these and more by name, tiny (numerics on CPU) or at a real size (planning
on ``meta``): ResNet-50 (``autoshard.zoo.resnet``) and, from ``transformers`` configs with
nothing downloaded, GPT-2, Llama 3, BERT, ViT and Mixtral (``autoshard.zoo.hf``)::

    >>> zoo.names()
    ['mlp', 'gpt', 'llama', 'resnet50', 'hf_gpt2', 'hf_llama3', 'bert', 'vit', 'mixtral']
    >>> model, inputs = zoo.get("hf_llama3", "70b", device="meta")   # model(*inputs) is the loss
    >>> zoo.sizes("hf_llama3")
    ('tiny', '8b', '70b')
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 128
    seq: int = 16
    hidden: int = 64
    heads: int = 4
    layers: int = 2

    @classmethod
    def tiny(cls) -> "GPTConfig":
        return cls()

    @classmethod
    def gpt2_small(cls) -> "GPTConfig":
        # GPT-2 124M with the vocabulary padded to a multiple of 64 (50257 -> 50304), as nanoGPT
        # does, so it shards evenly.
        return cls(vocab=50304, seq=1024, hidden=768, heads=12, layers=12)


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of a language model's logits."""
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def _token_batch(config, batch: int, device, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (token ids, targets) of shape (batch, config.seq) for a language model."""
    def ids():
        return torch.randint(0, config.vocab, (batch, config.seq), device=device, generator=generator)
    return ids(), ids()


def _gpt2_init(module: nn.Module) -> None:
    """GPT-2's initialization (N(0, 0.02) weights, zero biases); with torch's defaults the tied
    N(0, 1) embedding would make a first loss near 40 instead of ln(vocab)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, 0.0, 0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.heads = c.heads
        self.ln1 = nn.LayerNorm(c.hidden)
        self.qkv = nn.Linear(c.hidden, 3 * c.hidden)
        self.proj = nn.Linear(c.hidden, c.hidden)
        self.ln2 = nn.LayerNorm(c.hidden)
        self.fc = nn.Linear(c.hidden, 4 * c.hidden)
        self.out = nn.Linear(4 * c.hidden, c.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig = GPTConfig()):
        super().__init__()
        self.config = c
        self.wte = nn.Embedding(c.vocab, c.hidden)
        self.wpe = nn.Embedding(c.seq, c.hidden)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.ln_f = nn.LayerNorm(c.hidden)
        self.head = nn.Linear(c.hidden, c.vocab, bias=False)
        self.head.weight = self.wte.weight  # tied, as in GPT-2
        self.apply(_gpt2_init)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return _lm_loss(self.head(self.ln_f(x)), targets)

    def example_inputs(self, batch: int, device="cpu", generator=None) -> tuple[torch.Tensor, torch.Tensor]:
        return _token_batch(self.config, batch, device, generator)


class MLP(nn.Module):
    def __init__(self, dims=(32, 64, 64, 16)):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        return F.mse_loss(x, y)


# --- Llama ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LlamaConfig:
    """A Llama-style decoder: RMSNorm, rotary embeddings, SwiGLU MLP, causal attention, untied head.

    ``kv_heads`` < ``heads`` gives grouped-query attention (each K/V head serves
    ``heads // kv_heads`` query heads); ``None`` means ``heads`` (multi-head attention).
    ``causal=False`` makes every position attend to every other (an encoder's attention).
    """

    vocab: int = 128
    seq: int = 16
    hidden: int = 64
    heads: int = 4
    kv_heads: int | None = None
    intermediate: int = 176
    layers: int = 2
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    causal: bool = True

    def __post_init__(self) -> None:
        kv = self.heads if self.kv_heads is None else self.kv_heads
        if self.hidden % self.heads or (self.hidden // self.heads) % 2 or self.heads % kv:
            raise ValueError(f"LlamaConfig: hidden ({self.hidden}) must split into {self.heads} heads of even "
                             f"size, and heads into groups of kv_heads ({kv})")
        object.__setattr__(self, "kv_heads", kv)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @classmethod
    def tiny(cls) -> "LlamaConfig":
        return cls()

    @classmethod
    def llama2_7b(cls, seq: int = 4096) -> "LlamaConfig":
        # Llama 2 7B (Touvron et al. 2023, table 1 / the released config): 6.74e9 parameters.
        return cls(vocab=32000, seq=seq, hidden=4096, heads=32, intermediate=11008, layers=32)

    @classmethod
    def llama3_8b(cls, seq: int = 8192) -> "LlamaConfig":
        # Llama 3 8B (the released config): GQA with 8 K/V heads, rope theta 500000; 8.03e9 parameters.
        return cls(vocab=128256, seq=seq, hidden=4096, heads=32, kv_heads=8, intermediate=14336, layers=32,
                   rope_theta=500000.0)

    @classmethod
    def llama3_70b(cls, seq: int = 8192) -> "LlamaConfig":
        # Llama 3 70B (the released config): GQA with 8 K/V heads; 70.6e9 parameters.
        return cls(vocab=128256, seq=seq, hidden=8192, heads=64, kv_heads=8, intermediate=28672, layers=80,
                   rope_theta=500000.0)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, written with plain ops so it traces to pow/mean/rsqrt/mul."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaBlock(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.causal = c.heads, c.kv_heads, c.head_dim, c.causal
        self.attn_norm = RMSNorm(c.hidden, c.norm_eps)
        self.q = nn.Linear(c.hidden, c.heads * c.head_dim, bias=False)
        self.k = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=False)
        self.v = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=False)
        self.o = nn.Linear(c.heads * c.head_dim, c.hidden, bias=False)
        self.mlp_norm = RMSNorm(c.hidden, c.norm_eps)
        self.gate = nn.Linear(c.hidden, c.intermediate, bias=False)
        self.up = nn.Linear(c.hidden, c.intermediate, bias=False)
        self.down = nn.Linear(c.intermediate, c.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.attn_norm(x)
        q = self.q(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if self.kv_heads != self.heads:  # GQA: repeat each K/V head for its group of query heads
            rep = self.heads // self.kv_heads
            k, v = (z.repeat_interleave(rep, dim=1) for z in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    """Llama-style decoder; ``forward(idx, targets)`` returns the mean cross-entropy loss.

    The rotary frequencies are a non-persistent buffer (not in ``state_dict``); cos/sin are
    computed from it in forward. A model built on ``meta`` and materialized with ``to_empty``
    must call :meth:`init_buffers` (buffers are not parameters, nothing else restores them).
    """

    def __init__(self, c: LlamaConfig = LlamaConfig()):
        super().__init__()
        self.config = c
        self.embed = nn.Embedding(c.vocab, c.hidden)
        self.blocks = nn.ModuleList(LlamaBlock(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.hidden, c.norm_eps)
        self.head = nn.Linear(c.hidden, c.vocab, bias=False)  # untied, as in Llama
        self.register_buffer("inv_freq", torch.empty(c.head_dim // 2), persistent=False)
        self.init_buffers()

    def init_buffers(self) -> None:
        c = self.config
        with torch.no_grad():
            steps = torch.arange(0, c.head_dim, 2, dtype=torch.float32, device=self.inv_freq.device)
            self.inv_freq.copy_(1.0 / (c.rope_theta ** (steps / c.head_dim)))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq)             # (t, head_dim / 2)
        angles = torch.cat((freqs, freqs), dim=-1)          # (t, head_dim), rotate_half layout
        x = self.embed(idx)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin)
        return _lm_loss(self.head(self.norm(x)), targets)

    def example_inputs(self, batch: int, device="cpu", generator=None) -> tuple[torch.Tensor, torch.Tensor]:
        return _token_batch(self.config, batch, device, generator)


# --- registry ------------------------------------------------------------------------------------
# name -> sizes, first "tiny" (numerics on CPU), then real ones (planning on meta); "real" means
# the first real one. Real global batches: 8 sequences, as the GPT-2 demo plans (32 of BERT's
# 512 tokens), 256 images (a common per-node ImageNet batch).
_OWN_SIZES = {"mlp": ("tiny", "real"), "gpt": ("tiny", "124m"), "llama": ("tiny", "8b", "70b"),
              "resnet50": ("tiny", "real")}
TINY_BATCH = 8
_REAL_BATCH = {"mlp": 1024, "resnet50": 256, "vit": 256, "bert": 32}  # default 8 sequences
_REAL_SEQ = {"hf_llama3": 8192, "mixtral": 4096, "bert": 512}  # else the config's context length


def _hf():
    from autoshard.zoo import hf as zoo_hf  # imports transformers (seconds): only when an HF model is asked for
    return zoo_hf


def names() -> list[str]:
    """Every model :func:`get` builds."""
    return [*_OWN_SIZES, "hf_gpt2", "hf_llama3", "bert", "vit", "mixtral"]


def sizes(name: str) -> tuple[str, ...]:
    """The sizes of a model, "tiny" first; "real" names the second."""
    if name in _OWN_SIZES:
        return _OWN_SIZES[name]
    if name in names():
        return _hf().BUILDERS[name][3]
    raise KeyError(f"unknown zoo model {name!r}; known: {', '.join(names())}")


def _resolve(name: str, size: str) -> str:
    known = sizes(name)
    size = known[1] if size == "real" else size
    if size not in known:
        raise KeyError(f"zoo model {name!r} has sizes {', '.join(known)} (and 'real' = {known[1]}), not {size!r}")
    return size


def _build(name: str, size: str, dtype: torch.dtype) -> nn.Module:
    if name == "mlp":
        return MLP() if size == "tiny" else MLP((8192, 32768, 32768, 8192))
    if name == "gpt":
        return GPT(GPTConfig.tiny() if size == "tiny" else GPTConfig.gpt2_small())
    if name == "llama":
        return Llama({"tiny": LlamaConfig.tiny, "8b": LlamaConfig.llama3_8b, "70b": LlamaConfig.llama3_70b}[size]())
    if name == "resnet50":
        from autoshard.zoo.resnet import ResNet, ResNetConfig
        return ResNet(ResNetConfig.tiny() if size == "tiny" else ResNetConfig.resnet50())
    return _hf().build(name, size, dtype)


def _input_specs(name: str, size: str, model: nn.Module, batch: int) -> list[tuple[tuple[int, ...], int | None]]:
    """(shape, high) per input: token ids / labels in [0, high), or floats (high None)."""
    if name == "mlp":
        return [((batch, model.layers[0].in_features), None), ((batch, model.layers[-1].out_features), None)]
    if name in ("gpt", "llama"):
        return [((batch, model.config.seq), model.config.vocab)] * 2
    if name == "resnet50":
        c = model.config
        return [((batch, 3, c.image, c.image), None), ((batch,), c.classes)]
    config = model.model.config
    if name == "vit":
        s = config.image_size
        return [((batch, 3, s, s), None), ((batch,), config.num_labels)]
    seq = 16 if size == "tiny" else _REAL_SEQ.get(name) or config.n_positions
    return [((batch, seq), config.vocab_size)] * 2


def get(name: str, size: str = "tiny", *, device=None, batch: int | None = None, seed: int = 0,
        dtype: torch.dtype | None = None) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """``(model, inputs)``: ``model(*inputs)`` is a scalar training loss; ``inputs`` are the
    global batch, drawn from ``seed`` (the same on every call and rank), on ``device``.

    Weights are random, from ``seed`` too, unless ``device`` is ``"meta"`` (no memory: for
    planning real sizes). ``size`` is one of :func:`sizes` or ``"real"``. Real sizes default to a
    global batch of 8 sequences (256 images for the vision models) and train in ``dtype``
    (default: float32 for tiny, bfloat16 for real sizes on meta)."""
    size = _resolve(name, size)
    device = torch.device(device if device is not None else "cpu")
    if dtype is None:
        dtype = torch.bfloat16 if size != "tiny" and device.type == "meta" else torch.float32
    batch = batch or (TINY_BATCH if size == "tiny" else _REAL_BATCH.get(name, 8))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device(device):
            model = _build(name, size, dtype)
    model.to(dtype)
    g = torch.Generator().manual_seed(seed + 1)
    inputs = []
    for shape, high in _input_specs(name, size, model, batch):
        if device.type == "meta":
            inputs.append(torch.empty(shape, dtype=dtype if high is None else torch.long, device=device))
        elif high is None:
            inputs.append(torch.randn(shape, generator=g).to(device=device, dtype=dtype))
        else:
            inputs.append(torch.randint(0, high, shape, generator=g).to(device))
    return model, tuple(inputs)
