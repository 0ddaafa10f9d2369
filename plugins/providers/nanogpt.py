"""NanoGPT (GPT-2) in plain PyTorch, with nanoGPT's module names (karpathy/nanoGPT model.py).

Presets: ``gpt2`` (default: 12 layers, d=768, 12 heads, seq 1024, vocab 50304, batch 8) and
``tiny`` (2 layers, d=64, 4 heads, seq 64, vocab 512, batch 2) for CPU. The provider fills
nanoGPT's init distributions from per-parameter generators (``weights.py``); ``GPT(config)``
alone initialises as nanoGPT does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from cbtrace.model.provider import Provider, pick_preset
from cbtrace.plugins.providers.weights import build


@dataclass
class GPTConfig:
    block_size: int = 1024   # max sequence length
    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True


PRESETS = {
    "gpt2": dict(config=GPTConfig(), batch_size=8, seq_len=1024),
    "tiny": dict(config=GPTConfig(block_size=64, vocab_size=512, n_layer=2, n_head=4, n_embd=64),
                 batch_size=2, seq_len=64),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        assert c.n_embd % c.n_head == 0
        self.c_attn = nn.Linear(c.n_embd, 3 * c.n_embd, bias=c.bias)
        self.c_proj = nn.Linear(c.n_embd, c.n_embd, bias=c.bias)
        self.attn_dropout = nn.Dropout(c.dropout)
        self.resid_dropout = nn.Dropout(c.dropout)
        self.n_head, self.n_embd, self.dropout = c.n_head, c.n_embd, c.dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(c.n_embd, 4 * c.n_embd, bias=c.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * c.n_embd, c.n_embd, bias=c.bias)
        self.dropout = nn.Dropout(c.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(c.n_embd, bias=c.bias)
        self.attn = CausalSelfAttention(c)
        self.ln_2 = nn.LayerNorm(c.n_embd, bias=c.bias)
        self.mlp = MLP(c)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.config = c
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(c.vocab_size, c.n_embd),
            wpe=nn.Embedding(c.block_size, c.n_embd),
            drop=nn.Dropout(c.dropout),
            h=nn.ModuleList([Block(c) for _ in range(c.n_layer)]),
            ln_f=nn.LayerNorm(c.n_embd, bias=c.bias),
        ))
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as in nanoGPT
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * c.n_layer))

    @staticmethod
    def _init_weights(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)  # (t,)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)  # (b, t, vocab)
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def nanogpt_init(c: GPTConfig, name: str, module) -> tuple:
    """nanoGPT's init of one parameter (``GPT._init_weights`` and the scaled c_proj)."""
    if isinstance(module, nn.LayerNorm):
        return ("constant", 1.0 if name.endswith("weight") else 0.0, None)
    if name.endswith("bias"):
        return ("constant", 0.0, None)
    std = 0.02 / math.sqrt(2 * c.n_layer) if name.endswith("c_proj.weight") else 0.02
    return ("normal", 0.0, std)


@dataclass
class NanoGPTProvider(Provider):
    """GPT-2 small by default; options: preset, batch_size, seq_len, targets (bool)."""

    OPTIONS = ("preset", "batch_size", "seq_len", "targets")
    options: dict = field(default_factory=dict)

    def _preset(self):
        return pick_preset("nanogpt", PRESETS, self.options.get("preset", "gpt2"))

    def build_model(self, device):
        c = self._preset()["config"]
        return build(lambda: GPT(c), device, self.seed, lambda n, m, p: nanogpt_init(c, n, m))

    def build_batch(self, device):
        p = self._preset()
        b = int(self.options.get("batch_size", p["batch_size"]))
        t = int(self.options.get("seq_len", p["seq_len"]))
        idx = torch.randint(0, p["config"].vocab_size, (b, t), device=device)
        if self.options.get("targets", False):
            return (idx, torch.randint(0, p["config"].vocab_size, (b, t), device=device))
        return (idx,)
