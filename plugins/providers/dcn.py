"""A DCN-v2 recommender in plain PyTorch (Wang et al. 2021, "DCN V2"; torchrec's
LowRankCrossNet), sized like production: presets default (64 tables of 2-48 MB in bf16, batch
8192: each lookup reads ~12-60 MB), tiny (CPU) and large (256 tables, batch 4096).

    sparse_arch  nn.EmbeddingBag tables of varied rows and dims (64 or 128), most mode="sum",
                 every fifth mode="mean"; jagged bags of Zipf-distributed length, skewed ids
    dense_arch   MLP over the 13 dense features -> dense_dim
    cross_net    low-rank cross layers: x_{l+1} = x0 * (U (V x_l) + b) + x_l
    over_arch    MLP -> 1 logit

Sparse ids arrive jagged and key-major, like a KeyedJaggedTensor's values/offsets:
``forward(dense (B, 13), values (N,), offsets (T*B + 1,), length_per_key)``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from cbtrace.model.provider import RecSysProvider, TableConfig, pick_preset
from cbtrace.plugins.providers.dlrm import bag_lookups, mlp, torch_default_init
from cbtrace.plugins.providers.weights import build

ZIPF_S = 1.2  # bag lengths: P(l) ~ (l + 1)^-s on [lo, hi], the long tail of user histories


@dataclass
class DCNConfig:
    num_tables: int = 64
    min_table_mb: float = 2.0         # table sizes (bf16 bytes) spread log-uniformly between
    max_table_mb: float = 48.0
    dims: tuple = (128, 64, 64)       # table i gets dims[i % len(dims)]
    batch_size: int = 8192            # sets the mean bag length, so each lookup reads
    min_lookup_mb: float = 12.0       # between these many bf16 bytes
    max_lookup_mb: float = 60.0
    empty_bags_every: int = 7         # every 7th table allows empty bags (lo = 0)
    mean_every: int = 5               # every 5th table pools with mode="mean"
    num_dense: int = 13
    dense_hidden: int = 512
    dense_dim: int = 128
    cross_layers: int = 3
    cross_rank: int = 512
    over_hidden: tuple = (1024, 1024, 512, 256)


PRESETS = {
    "default": DCNConfig(),
    "tiny": DCNConfig(num_tables=8, min_table_mb=0.0005, max_table_mb=0.005, dims=(8, 4),
                      batch_size=16, min_lookup_mb=0.0004, max_lookup_mb=0.002, empty_bags_every=3,
                      mean_every=4, dense_hidden=16, dense_dim=8, cross_layers=2, cross_rank=4,
                      over_hidden=(16, 8)),
    # the scale case: 256 tables, ~1,100 module calls
    "large": DCNConfig(num_tables=256, min_table_mb=1.0, max_table_mb=24.0, batch_size=4096,
                       min_lookup_mb=4.0, max_lookup_mb=24.0, cross_rank=256),
}


def table_configs(c: DCNConfig) -> list[TableConfig]:
    """Each table's rows, dim, pooling and bag-length range, from the config alone."""
    out = []
    for i in range(c.num_tables):
        d = c.dims[i % len(c.dims)]
        # a fixed stride through [0, 1) mixes big and small tables along the table order
        u, v = (i * 0.618034) % 1.0, (i * 0.414214) % 1.0
        mb = c.min_table_mb * (c.max_table_mb / c.min_table_mb) ** u
        rows = max(8, int(mb * 2**20 / (2 * d)))
        lookup_mb = c.min_lookup_mb * (c.max_lookup_mb / c.min_lookup_mb) ** v
        lo = 0 if i % c.empty_bags_every == c.empty_bags_every - 1 else 1
        hi = zipf_hi(lo, lookup_mb * 2**20 / (2 * d * c.batch_size))
        pooling = "mean" if i % c.mean_every == c.mean_every - 1 else "sum"
        out.append(TableConfig(f"t_{i}", rows, d, (f"f_{i}",), pooling, (lo, hi)))
    return out


def zipf_probs(lo: int, hi: int, s: float = ZIPF_S) -> torch.Tensor:
    """P(length = lo + k) for k = 0 .. hi - lo, proportional to (length + 1)^-s."""
    lengths = torch.arange(lo, hi + 1, dtype=torch.float64, device="cpu")
    p = (lengths + 1) ** -s
    return p / p.sum()


def zipf_hi(lo: int, mean: float, s: float = ZIPF_S) -> int:
    """The smallest upper length whose truncated Zipf on [lo, hi] has at least ``mean``
    (plain floats: module naming builds the tables under the meta device)."""
    weight = weighted = 0.0
    hi = lo - 1
    while hi < lo + 1 or weighted / weight < mean:
        hi += 1
        w = (hi + 1) ** -s
        weight, weighted = weight + w, weighted + w * hi
    return hi


def skewed_ids(n: int, rows: int, generator=None) -> torch.Tensor:
    """``n`` ids in [0, rows): a power law over hot rows (u^3), scattered over the table by a
    multiplicative hash, as hashed feature ids are."""
    u = torch.rand(n, generator=generator, dtype=torch.float64)
    rank = (rows * u.pow(3)).long().clamp_(max=rows - 1)
    return (rank * 2654435761) % rows


class SparseArch(nn.Module):
    def __init__(self, tables: list[TableConfig]):
        super().__init__()
        self.embedding_bags = nn.ModuleDict({
            t.name: nn.EmbeddingBag(t.num_embeddings, t.embedding_dim, mode=t.pooling)
            for t in tables})

    def forward(self, values, offsets, length_per_key):
        return torch.cat(bag_lookups(self.embedding_bags, values, offsets, length_per_key),
                         dim=1)  # (B, sum D_i)


class LowRankCrossLayer(nn.Module):
    """x0 * (U (V x_l) + b) + x_l, V: d -> r without bias, U: r -> d with bias b."""

    def __init__(self, d: int, rank: int):
        super().__init__()
        self.V = nn.Linear(d, rank, bias=False)
        self.U = nn.Linear(rank, d)

    def forward(self, x0, xl):
        return x0 * self.U(self.V(xl)) + xl


class CrossNet(nn.Module):
    def __init__(self, d: int, layers: int, rank: int):
        super().__init__()
        self.layers = nn.ModuleList([LowRankCrossLayer(d, rank) for _ in range(layers)])

    def forward(self, x0):
        x = x0
        for layer in self.layers:
            x = layer(x0, x)
        return x


class DCNv2(nn.Module):
    def __init__(self, c: DCNConfig, tables: list[TableConfig]):
        super().__init__()
        d = c.dense_dim + sum(t.embedding_dim for t in tables)
        self.sparse_arch = SparseArch(tables)
        self.dense_arch = mlp([c.num_dense, c.dense_hidden, c.dense_dim])
        self.cross_net = CrossNet(d, c.cross_layers, c.cross_rank)
        self.over_arch = mlp([d, *c.over_hidden, 1], final_relu=False)

    def forward(self, dense_features, values, offsets, length_per_key):
        x0 = torch.cat([self.dense_arch(dense_features),
                        self.sparse_arch(values, offsets, length_per_key)], dim=1)  # (B, d)
        return torch.sigmoid(self.over_arch(self.cross_net(x0)))


@dataclass
class DCNProvider(RecSysProvider):
    """DCN-v2; options: preset (default|tiny|large), batch_size."""

    OPTIONS = ("preset", "batch_size")
    options: dict = field(default_factory=dict)

    def config(self) -> DCNConfig:
        return pick_preset("dcn", PRESETS, self.options.get("preset", "default"))

    def batch_size(self) -> int:
        return int(self.options.get("batch_size", self.config().batch_size))

    def tables(self):
        return table_configs(self.config())

    def jagged_ids(self, batch_size: int, generator=None):
        """(values, lengths), key-major: per table, Zipf bag lengths on its range, skewed ids."""
        values, lengths = [], []
        for t in self.tables():
            lo, hi = t.ids_per_bag
            n = lo + torch.multinomial(zipf_probs(lo, hi), batch_size, replacement=True,
                                       generator=generator)
            lengths.append(n)
            values.append(skewed_ids(int(n.sum()), t.num_embeddings, generator))
        return torch.cat(values), torch.cat(lengths)

    def build_model(self, device):
        c = self.config()
        return build(lambda: DCNv2(c, self.tables()), device, self.seed, torch_default_init)

    def build_batch(self, device):
        return self.dense_and_jagged(self.batch_size(), self.config().num_dense, device)
