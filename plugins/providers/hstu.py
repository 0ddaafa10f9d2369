"""An HSTU sequence model in plain PyTorch (Zhai et al. 2024, "Actions Speak Louder than Words";
meta-recsys/generative-recommenders), on jagged user histories. Presets default (4 layers,
d=256, 4 heads, histories of 16-1024 items, batch 64) and tiny (CPU).

    item_emb / pos_emb   nn.Embedding over the jagged item ids and their positions
    layers.i             HSTULayer: U, V, Q, K = SiLU(Linear(LayerNorm(x)));
                         attention.rel_bias  relative position + log-bucketed time bias (B, T, T)
                         attention           SiLU(Q K^T + bias) / T, causal, times V (padded)
                         out                 Linear(LayerNorm(A V) * U), added to x
    final_norm           LayerNorm

Histories arrive jagged, like a JaggedTensor: ``forward(item_ids (N,), timestamps (N,),
offsets (B + 1,), lengths)``, lengths a tuple of host ints. Attention runs on the padded
(B, T) layout, scattered and gathered through one flat index, so nothing waits on the device.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from cbtrace.model.provider import Provider, pick_preset
from cbtrace.plugins.providers.dcn import skewed_ids, zipf_probs
from cbtrace.plugins.providers.weights import build

LENGTH_S = 0.5  # history lengths: P(l) ~ (l + 1)^-s, a long tail of heavy users


@dataclass
class HSTUConfig:
    num_items: int = 500_000
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    d_qk: int = 64                # per head
    d_v: int = 64                 # per head
    min_len: int = 16
    max_len: int = 1024           # T: the longest history
    time_buckets: int = 64        # log2 buckets of the gap between two events (seconds)
    batch_size: int = 64


PRESETS = {
    "default": HSTUConfig(),
    "tiny": HSTUConfig(num_items=1000, d_model=32, n_layers=2, n_heads=2, d_qk=8, d_v=8,
                       min_len=2, max_len=16, time_buckets=8, batch_size=4),
}


class RelativeBias(nn.Module):
    """bias[b, i, j] = pos_w[T - 1 + j - i] + ts_w[bucket(|t_i - t_j|)], shared by the heads."""

    def __init__(self, max_len: int, time_buckets: int):
        super().__init__()
        self.pos_w = nn.Parameter(torch.empty(2 * max_len - 1))
        self.ts_w = nn.Parameter(torch.empty(time_buckets + 1))
        self.max_len, self.time_buckets = max_len, time_buckets

    def forward(self, ts, T: int):  # ts: (B, T) int64 seconds
        idx = torch.arange(T, device=ts.device)
        pos = self.pos_w[self.max_len - 1 + idx[None, :] - idx[:, None]]  # (T, T)
        gap = (ts[:, :, None] - ts[:, None, :]).abs().float()  # (B, T, T)
        bucket = torch.log2(gap + 1).long().clamp_(max=self.time_buckets)
        return pos[None] + self.ts_w[bucket]  # (B, T, T)


class PointwiseAttention(nn.Module):
    """HSTU's pointwise aggregated attention on the padded layout, back to jagged rows."""

    def __init__(self, c: HSTUConfig):
        super().__init__()
        self.rel_bias = RelativeBias(c.max_len, c.time_buckets)
        self.h, self.d_qk, self.d_v = c.n_heads, c.d_qk, c.d_v

    def forward(self, q, k, v, ts, flat, mask, B: int, T: int):
        def pad(x, d):  # (N, h*d) -> (B, h, T, d)
            out = x.new_zeros(B * T, x.shape[1]).index_copy_(0, flat, x)
            return out.view(B, T, self.h, d).transpose(1, 2)

        qp, kp, vp = pad(q, self.d_qk), pad(k, self.d_qk), pad(v, self.d_v)
        s = qp @ kp.transpose(-1, -2) + self.rel_bias(ts, T)[:, None]  # (B, h, T, T)
        a = F.silu(s) / T * mask[:, None].to(s.dtype)
        out = (a @ vp).transpose(1, 2).reshape(B * T, self.h * self.d_v)
        return out.index_select(0, flat)  # (N, h*d_v)


class HSTULayer(nn.Module):
    def __init__(self, c: HSTUConfig):
        super().__init__()
        self.norm = nn.LayerNorm(c.d_model)
        self.uvqk = nn.Linear(c.d_model, c.n_heads * (2 * c.d_v + 2 * c.d_qk))
        self.attention = PointwiseAttention(c)
        self.attn_norm = nn.LayerNorm(c.n_heads * c.d_v)
        self.out = nn.Linear(c.n_heads * c.d_v, c.d_model)
        self.splits = [c.n_heads * c.d_v] * 2 + [c.n_heads * c.d_qk] * 2

    def forward(self, x, ts, flat, mask, B: int, T: int):  # x: (N, d) jagged rows
        u, v, q, k = F.silu(self.uvqk(self.norm(x))).split(self.splits, dim=1)
        av = self.attention(q, k, v, ts, flat, mask, B, T)
        return x + self.out(self.attn_norm(av) * u)


class HSTU(nn.Module):
    def __init__(self, c: HSTUConfig):
        super().__init__()
        self.item_emb = nn.Embedding(c.num_items, c.d_model)
        self.pos_emb = nn.Embedding(c.max_len, c.d_model)
        self.layers = nn.ModuleList([HSTULayer(c) for _ in range(c.n_layers)])
        self.final_norm = nn.LayerNorm(c.d_model)
        self.scale = math.sqrt(c.d_model)

    def forward(self, item_ids, timestamps, offsets, lengths):
        B, T, N = len(lengths), max(lengths), item_ids.numel()
        lens = offsets[1:] - offsets[:-1]  # (B,) on the device; the host ints size everything
        seg = torch.repeat_interleave(torch.arange(B, device=offsets.device), lens, output_size=N)
        pos = torch.arange(N, device=offsets.device) - offsets[seg]  # position within its user
        flat = seg * T + pos  # row of each item in the padded (B*T) layout
        ts = timestamps.new_zeros(B * T).index_copy_(0, flat, timestamps).view(B, T)
        idx = torch.arange(T, device=offsets.device)
        mask = (idx[None, :] <= idx[:, None])[None] & (idx[None, :] < lens[:, None])[:, None]
        x = self.item_emb(item_ids) * self.scale + self.pos_emb(pos)  # (N, d)
        for layer in self.layers:
            x = layer(x, ts, flat, mask, B, T)
        return self.final_norm(x)  # (N, d)


def hstu_init(name: str, module, param) -> tuple:
    """Embeddings and the relative bias N(0, 0.02); LayerNorms 1 and 0; a Linear's weight and
    bias U(+-1/sqrt(in_features)), PyTorch's default."""
    if isinstance(module, nn.LayerNorm):
        return ("constant", 1.0 if name.endswith("weight") else 0.0, None)
    if isinstance(module, (nn.Embedding, RelativeBias)):
        return ("normal", 0.0, 0.02)
    if isinstance(module, nn.Linear):
        bound = 1 / math.sqrt(module.in_features)
        return ("uniform", -bound, bound)
    raise ValueError(f"hstu_init: no init for {name} ({type(module).__name__})")


@dataclass
class HSTUProvider(Provider):
    """HSTU on jagged histories; options: preset (default|tiny), batch_size."""

    OPTIONS = ("preset", "batch_size")
    options: dict = field(default_factory=dict)

    def config(self) -> HSTUConfig:
        return pick_preset("hstu", PRESETS, self.options.get("preset", "default"))

    def build_model(self, device):
        c = self.config()
        return build(lambda: HSTU(c), device, self.seed, hstu_init)

    def build_batch(self, device):
        c = self.config()
        b = int(self.options.get("batch_size", c.batch_size))
        lengths = c.min_len + torch.multinomial(zipf_probs(c.min_len, c.max_len, LENGTH_S), b,
                                                replacement=True)
        lengths[0] = c.max_len  # one user of the longest history fixes T = max_len
        n = int(lengths.sum())
        items = skewed_ids(n, c.num_items)
        timestamps = torch.randint(1, 86_400, (n,)).cumsum(0)  # a gap of up to a day per event
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        lens = tuple(int(x) for x in lengths)
        return (items.to(device), timestamps.to(device), offsets.to(device), lens)
