"""A LLaMA-style decoder in plain PyTorch: RMSNorm, rotary position embeddings, SwiGLU, optional QK-norm and GQA.

The attention calls ``torch.nn.functional.scaled_dot_product_attention`` with ``is_causal=True`` (and
``enable_gqa=True`` when there are fewer key/value heads than query heads), which is what
``sage_lightning.SageAttentionMixin`` swaps to SageBwd: the model itself knows nothing about low-bit attention.
One file, one config dataclass with named presets, the attention call as a method a subclass can override
(litgpt's layout).

Example::

    import torch
    from examples.llama import Llama, LlamaConfig

    model = Llama(LlamaConfig.from_name("tiny"))
    logits = model(torch.randint(0, 256, (2, 64)))      # [2, 64, padded_vocab_size]
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    """The shape of a :class:`Llama` model.

    Args:
        vocab_size: token ids are in ``[0, vocab_size)``; the embedding and the head are padded to a multiple of
            ``pad_vocab_to`` (the padded rows are never a target, so they only cost a little memory).
        n_layers: transformer blocks.
        d_model: model width; a multiple of ``n_heads``.
        n_heads: query heads; the head dim is ``d_model // n_heads`` (SageBwd's Triton kernels take head dims up
            to 128).
        n_kv_heads: key/value heads (grouped-query attention); ``None`` for ``n_heads`` (plain multi-head).
            ``n_heads`` must be a multiple of it.
        ffn_dim: SwiGLU hidden width; ``None`` for LLaMA's ``8/3 * d_model`` rounded up to a multiple of 64.
        qk_norm: RMSNorm over each head's queries and keys before the rotary embedding (OLMo 2, Qwen 3). It bounds
            the attention scores, which keeps the INT8 ``QK^T`` accurate: the SageBwd study needed it at 325M
            parameters and 2.1M tokens per step.
        rope_theta: base of the rotary embedding's frequencies.
        max_seq_len: the longest sequence the rotary tables cover.
        norm_eps: RMSNorm's epsilon.
        tie_embeddings: share the embedding matrix with the output head.
        pad_vocab_to: pad the vocabulary to a multiple of this (64 keeps the head's matrix multiply aligned).

    Raises:
        ValueError: a size that does not fit the others; the message names the argument, the value received and
            what works.

    Example::

        config = LlamaConfig(n_layers=8, d_model=512, n_heads=8, n_kv_heads=2, qk_norm=True)
        config = LlamaConfig.from_name("small", qk_norm=True)
    """

    vocab_size: int = 256
    n_layers: int = 4
    d_model: int = 256
    n_heads: int = 4
    n_kv_heads: int | None = None
    ffn_dim: int | None = None
    qk_norm: bool = False
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    pad_vocab_to: int = 64

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layers", "d_model", "n_heads", "max_seq_len", "pad_vocab_to"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LlamaConfig: {name} must be a positive integer; received {value!r}.")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"LlamaConfig: d_model must be a multiple of n_heads ({self.n_heads}); received d_model={self.d_model}."
            )
        if self.n_kv_heads is not None and (
            not isinstance(self.n_kv_heads, int) or self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads
        ):
            raise ValueError(
                f"LlamaConfig: n_kv_heads must divide n_heads ({self.n_heads}), e.g. 1, 2 or {self.n_heads}, or be "
                f"None; received {self.n_kv_heads!r}."
            )
        if self.ffn_dim is not None and (not isinstance(self.ffn_dim, int) or self.ffn_dim < 1):
            raise ValueError(f"LlamaConfig: ffn_dim must be a positive integer or None; received {self.ffn_dim!r}.")
        if self.head_dim % 2:
            raise ValueError(
                f"LlamaConfig: the head dim (d_model / n_heads) must be even for the rotary embedding; received "
                f"d_model={self.d_model}, n_heads={self.n_heads} (head dim {self.head_dim})."
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads (``n_kv_heads``, or ``n_heads`` when it is ``None``)."""
        return self.n_kv_heads or self.n_heads

    @property
    def hidden_dim(self) -> int:
        """SwiGLU hidden width: ``ffn_dim``, or LLaMA's ``8/3 * d_model`` rounded up to a multiple of 64."""
        if self.ffn_dim is not None:
            return self.ffn_dim
        return 64 * math.ceil(8 * self.d_model / 3 / 64)

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding and the head: ``vocab_size`` rounded up to a multiple of ``pad_vocab_to``."""
        return self.pad_vocab_to * math.ceil(self.vocab_size / self.pad_vocab_to)

    def num_parameters(self, *, embeddings: bool = True) -> int:
        """Parameter count of the model this config builds, without building it.

        Args:
            embeddings: count the embedding (and an untied head); ``False`` gives the non-embedding count
                scaling laws use.
        """
        attention = self.d_model * (self.n_heads + 2 * self.kv_heads) * self.head_dim + self.d_model**2
        mlp = 3 * self.d_model * self.hidden_dim
        norms = 2 * self.d_model + (2 * self.head_dim if self.qk_norm else 0)
        total = self.n_layers * (attention + mlp + norms) + self.d_model
        if embeddings:
            total += self.padded_vocab_size * self.d_model * (1 if self.tie_embeddings else 2)
        return total

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> LlamaConfig:
        """A named preset (see :data:`PRESETS`), with some fields changed.

        Args:
            name: ``"tiny"``, ``"small"`` or ``"llama-325m"``.
            overrides: fields to change, e.g. ``qk_norm=True``.

        Raises:
            ValueError: an unknown name.

        Example::

            LlamaConfig.from_name("llama-325m", vocab_size=32000)
        """
        if name not in PRESETS:
            raise ValueError(f"LlamaConfig.from_name: name must be one of {sorted(PRESETS)}; received {name!r}.")
        return dataclasses.replace(PRESETS[name], **overrides)


#: The example's model sizes, as in ``examples/configs/``: ``tiny`` (0.85M parameters with byte tokens),
#: ``small`` (37M) and ``llama-325m``, a LLaMA of the SageBwd study's size (325M parameters, sequence 4096): 20
#: layers of width 1024, 16 heads of 64, SwiGLU 2816, a 32K vocabulary, 322M parameters in all. The study reports
#: the size, not the widths; these are LLaMA's proportions at that size.
PRESETS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(n_layers=4, d_model=128, n_heads=4, n_kv_heads=2, max_seq_len=256),
    "small": LlamaConfig(n_layers=8, d_model=640, n_heads=10, n_kv_heads=5, qk_norm=True, max_seq_len=2048),
    "llama-325m": LlamaConfig(
        vocab_size=32000, n_layers=20, d_model=1024, n_heads=16, ffn_dim=2816, qk_norm=True, max_seq_len=4096
    ),
}


def rotary_tables(config: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine and sine tables ``[max_seq_len, head_dim]`` of the rotary embedding (float32).

    Example::

        cos, sin = rotary_tables(LlamaConfig(d_model=64, n_heads=2, max_seq_len=128))
    """
    half = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(half, dtype=torch.float64) / half))
    angles = torch.outer(torch.arange(config.max_seq_len, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[batch, heads, seq, head_dim]`` by position (the rotate-half form), in float32.

    Example::

        q = apply_rotary(q, cos[:seq], sin[:seq])
    """
    x32 = x.float()
    first, second = x32.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return x32 * cos + rotated * sin


class RMSNorm(nn.RMSNorm):
    """``torch.nn.RMSNorm`` with its weight cast to the input's dtype.

    Under bf16 autocast the attention's projections hand QK-norm bf16 tensors, and PyTorch's fused RMSNorm
    kernel refuses a float32 weight with a bf16 input (it warns and runs a slower composite); the fused kernel
    accumulates in float32 either way.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else self.weight.to(x.dtype)
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)


class Attention(nn.Module):
    """Causal self-attention with rotary embeddings, optional QK-norm and grouped-query attention.

    The attention product itself is :meth:`attend`, one ``scaled_dot_product_attention`` call: the module the
    SageBwd swap catches (its class name contains "Attention").

    Args:
        config: the model's shape.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.kv_heads, config.head_dim
        self.wq = nn.Linear(config.d_model, config.n_heads * config.head_dim, bias=False)
        self.wk = nn.Linear(config.d_model, config.kv_heads * config.head_dim, bias=False)
        self.wv = nn.Linear(config.d_model, config.kv_heads * config.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.d_model, bias=False)
        self.q_norm = RMSNorm(config.head_dim, eps=config.norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, eps=config.norm_eps) if config.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # The rotation runs in float32; q and k go back to v's dtype (bf16 under autocast), as the kernel wants
        # all three alike.
        q = apply_rotary(q, cos, sin).to(v.dtype)
        k = apply_rotary(k, cos, sin).to(v.dtype)
        out = self.attend(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, self.n_heads * self.head_dim))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of ``q`` ``[B, Hq, N, D]`` over ``k``, ``v`` ``[B, Hkv, N, D]``; override to change it."""
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_heads != self.n_kv_heads)


class SwiGLU(nn.Module):
    """LLaMA's feed-forward: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.d_model, config.hidden_dim, bias=False)
        self.w3 = nn.Linear(config.d_model, config.hidden_dim, bias=False)
        self.w2 = nn.Linear(config.hidden_dim, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, eps=config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.d_model, eps=config.norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """Token embedding, ``n_layers`` pre-norm blocks, a final RMSNorm and a linear head.

    Weights start as GPT-2's: normal with std 0.02, the projections into the residual stream (``wo``, ``w2``)
    scaled down by ``sqrt(2 * n_layers)``, so the residual stream does not grow with depth.

    Args:
        config: the model's shape.

    Example::

        model = Llama(LlamaConfig.from_name("tiny"))
        logits = model(torch.randint(0, 256, (2, 64)))
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.padded_vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, eps=config.norm_eps)
        self.head = nn.Linear(config.d_model, config.padded_vocab_size, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.embed.weight
        cos, sin = rotary_tables(config)
        # Not saved with the weights: rebuilt from the config.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2's initialisation (see the class docstring)."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, parameter in self.named_parameters():
            if parameter.dim() < 2:
                continue  # norm weights stay at one
            std = residual_std if name.endswith(("wo.weight", "w2.weight")) else 0.02
            nn.init.normal_(parameter, mean=0.0, std=std)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[batch, seq, padded_vocab_size]`` for token ids ``[batch, seq]``.

        Raises:
            ValueError: a sequence longer than ``config.max_seq_len``.
        """
        seq = ids.shape[1]
        if seq > self.config.max_seq_len:
            raise ValueError(
                f"Llama: input length must be at most max_seq_len ({self.config.max_seq_len}); received {seq}. "
                "Raise LlamaConfig.max_seq_len."
            )
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))
