"""Small models written the way people write them, not for us: the swap must work on them unmodified.

* :class:`NanoGPT`: Karpathy's nanoGPT layout (``F.scaled_dot_product_attention`` with ``dropout_p`` set only
  in training, ``is_causal=True``, tied embeddings).
* :class:`LitGPT`: litgpt's layout (grouped-query attention, ``scaled_dot_product_attention`` imported by name and
  called from an overridable method with ``scale``, ``enable_gqa`` and an optional mask).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.functional import scaled_dot_product_attention


@dataclass
class NanoConfig:
    vocab_size: int = 64
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    def __init__(self, config: NanoConfig) -> None:
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config: NanoConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, config: NanoConfig | None = None) -> None:
        super().__init__()
        config = config or NanoConfig()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


@dataclass
class LitConfig:
    vocab_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_query_groups: int = 2
    head_size: int = 16

    @property
    def n_embd(self) -> int:
        return self.n_head * self.head_size


class LitCausalSelfAttention(nn.Module):
    """litgpt's attention, down to the method a subclass may override."""

    def __init__(self, config: LitConfig) -> None:
        super().__init__()
        self.config = config
        shape = (config.n_head + 2 * config.n_query_groups) * config.head_size
        self.qkv = nn.Linear(config.n_embd, shape, bias=False)
        self.proj = nn.Linear(config.n_head * config.head_size, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.size()
        c = self.config
        q, k, v = self.qkv(x).split(
            (c.n_head * c.head_size, c.n_query_groups * c.head_size, c.n_query_groups * c.head_size), dim=-1
        )
        q = q.view(B, T, c.n_head, c.head_size).transpose(1, 2)
        k = k.view(B, T, c.n_query_groups, c.head_size).transpose(1, 2)
        v = v.view(B, T, c.n_query_groups, c.head_size).transpose(1, 2)
        y = self.scaled_dot_product_attention(q, k, v, mask)
        return self.proj(y.transpose(1, 2).reshape(B, T, c.n_head * c.head_size))

    def scaled_dot_product_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        scale = 1.0 / math.sqrt(self.config.head_size)
        return scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=0.0, scale=scale, is_causal=mask is None, enable_gqa=True
        )


class LitBlock(nn.Module):
    def __init__(self, config: LitConfig) -> None:
        super().__init__()
        self.norm_1 = nn.RMSNorm(config.n_embd)
        self.attn = LitCausalSelfAttention(config)
        self.norm_2 = nn.RMSNorm(config.n_embd)
        self.mlp = MLP(config.n_embd)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm_1(x), mask)
        return x + self.mlp(self.norm_2(x))


class LitGPT(nn.Module):
    def __init__(self, config: LitConfig | None = None) -> None:
        super().__init__()
        config = config or LitConfig()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                h=nn.ModuleList(LitBlock(config) for _ in range(config.n_layer)),
                ln_f=nn.RMSNorm(config.n_embd),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x, mask)
        return self.lm_head(self.transformer.ln_f(x))


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.detach().double().flatten(), b.detach().double().flatten(), dim=0).item()
