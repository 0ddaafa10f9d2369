"""DeepFM-DLRM in plain PyTorch, laid out like torchrec's SimpleDeepFMNN; presets default
(26 tables, batch 8192), tiny (CPU) and large (600 tables, a 200-layer over-arch: the scale
benchmark's 1,000+ calls).

    sparse_arch  26 nn.EmbeddingBag tables (pooled sum, 1-3 ids per bag)
    dense_arch   MLP over the 13 dense features -> n_dense_fields x D
    inter_arch   deep_fm: Linear(F*D -> 4096) ReLU Linear(4096 -> 512) ReLU  (F*D = 1024 by default)
                 fm: FM second-order cross term over the F fields
    over_arch    MLP -> 1 logit

Sparse ids arrive jagged and key-major, like a KeyedJaggedTensor's values/offsets:
``forward(dense (B, 13), sparse_values (N,), sparse_offsets (26*B + 1,), length_per_key)``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from cbtrace.model.provider import RecSysProvider, TableConfig, pick_preset
from cbtrace.plugins.providers.weights import build


@dataclass
class DLRMConfig:
    num_tables: int = 26
    num_embeddings: int = 1_000_000   # rows per table
    embedding_dim: int = 32           # D
    num_dense: int = 13
    dense_hidden: int = 512
    n_dense_fields: int = 6           # dense_arch emits 6 x D; fields F = 26 + 6 = 32, F*D = 1024
    deep_fm_hidden: tuple = (4096, 512)
    over_hidden: tuple = (512, 256)


PRESETS = {
    "default": dict(config=DLRMConfig(), batch_size=8192),
    "tiny": dict(config=DLRMConfig(num_embeddings=1000, embedding_dim=8, dense_hidden=32,
                                   n_dense_fields=2, deep_fm_hidden=(64, 16), over_hidden=(16,)),
                 batch_size=16),
    # the scale benchmark: 600 tables and a 200-layer over-arch, ~1,020 module calls
    "large": dict(config=DLRMConfig(num_tables=600, num_embeddings=20_000, n_dense_fields=8,
                                    over_hidden=(1024,) * 200 + (256,)),
                  batch_size=2048),
}


def mlp(sizes, final_relu=True) -> nn.Sequential:
    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if final_relu or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class SparseArch(nn.Module):
    def __init__(self, c: DLRMConfig):
        super().__init__()
        self.embedding_bags = nn.ModuleDict({
            f"t_cat_{i}": nn.EmbeddingBag(c.num_embeddings, c.embedding_dim, mode="sum")
            for i in range(c.num_tables)})

    def forward(self, values, offsets, length_per_key):
        return torch.stack(bag_lookups(self.embedding_bags, values, offsets, length_per_key),
                           dim=1)  # (B, num_tables, D)


def bag_lookups(bags: nn.ModuleDict, values, offsets, length_per_key) -> list:
    """Each table's pooled lookup of its ids, (B, D_i) per table, from key-major jagged ids.
    length_per_key: host ints (ids per table), like KeyedJaggedTensor.length_per_key():
    splitting by them needs no device sync, so the module stays CUDA-graph capturable."""
    B = (offsets.numel() - 1) // len(bags)
    per_table = values.split(list(length_per_key))
    out = []
    for i, (bag, ids) in enumerate(zip(bags.values(), per_table)):
        o = offsets[i * B:(i + 1) * B]
        out.append(bag(ids, o - o[0]))  # (B, D_i)
    return out


class DenseArch(nn.Module):
    def __init__(self, c: DLRMConfig):
        super().__init__()
        self.model = mlp([c.num_dense, c.dense_hidden, c.n_dense_fields * c.embedding_dim])

    def forward(self, x):
        return self.model(x)  # (B, n_dense_fields * D)


class DeepFM(nn.Module):
    def __init__(self, in_features: int, hidden: tuple):
        super().__init__()
        self.dense_module = mlp([in_features, *hidden])

    def forward(self, fields):
        return self.dense_module(fields.flatten(1))  # (B, hidden[-1])


class FactorizationMachine(nn.Module):
    """Second-order FM cross term: 0.5 * sum_d ((sum_f v_fd)^2 - sum_f v_fd^2)."""

    def forward(self, fields):  # (B, F, D)
        square_of_sum = fields.sum(dim=1).pow(2)
        sum_of_square = fields.pow(2).sum(dim=1)
        return 0.5 * (square_of_sum - sum_of_square).sum(dim=1, keepdim=True)  # (B, 1)


class FMInteractionArch(nn.Module):
    def __init__(self, c: DLRMConfig):
        super().__init__()
        n_fields = c.num_tables + c.n_dense_fields
        self.deep_fm = DeepFM(n_fields * c.embedding_dim, c.deep_fm_hidden)
        self.fm = FactorizationMachine()
        self.n_dense_fields, self.d = c.n_dense_fields, c.embedding_dim

    def forward(self, dense, sparse):
        fields = torch.cat([dense.view(-1, self.n_dense_fields, self.d), sparse], dim=1)
        return torch.cat([dense, self.deep_fm(fields), self.fm(fields)], dim=1)


class OverArch(nn.Module):
    def __init__(self, in_features: int, hidden: tuple):
        super().__init__()
        self.model = mlp([in_features, *hidden, 1], final_relu=False)

    def forward(self, x):
        return self.model(x)


class SimpleDeepFMNN(nn.Module):
    def __init__(self, c: DLRMConfig):
        super().__init__()
        self.sparse_arch = SparseArch(c)
        self.dense_arch = DenseArch(c)
        self.inter_arch = FMInteractionArch(c)
        over_in = c.n_dense_fields * c.embedding_dim + c.deep_fm_hidden[-1] + 1
        self.over_arch = OverArch(over_in, c.over_hidden)

    def forward(self, dense_features, sparse_values, sparse_offsets, length_per_key):
        embedded_dense = self.dense_arch(dense_features)
        embedded_sparse = self.sparse_arch(sparse_values, sparse_offsets, length_per_key)
        return torch.sigmoid(self.over_arch(self.inter_arch(embedded_dense, embedded_sparse)))


def torch_default_init(name: str, module, param) -> tuple:
    """PyTorch's own init of these modules: N(0, 1) embeddings; a Linear's weight
    (kaiming_uniform_, a=sqrt(5)) and bias both U(+-1/sqrt(in_features))."""
    if isinstance(module, nn.EmbeddingBag):
        return ("normal", 0.0, 1.0)
    if isinstance(module, nn.Linear):
        bound = 1 / math.sqrt(module.in_features)
        return ("uniform", -bound, bound)
    raise ValueError(f"torch_default_init: no init for {name} ({type(module).__name__})")


@dataclass
class DLRMProvider(RecSysProvider):
    """DeepFM-DLRM; options: preset (default|tiny|large), batch_size, num_embeddings."""

    OPTIONS = ("preset", "batch_size", "num_embeddings")
    options: dict = field(default_factory=dict)

    def config(self) -> DLRMConfig:
        import dataclasses

        c = self._preset()["config"]
        if "num_embeddings" in self.options:
            c = dataclasses.replace(c, num_embeddings=int(self.options["num_embeddings"]))
        return c

    def _preset(self) -> dict:
        return pick_preset("dlrm", PRESETS, self.options.get("preset", "default"))

    def batch_size(self) -> int:
        return int(self.options.get("batch_size", self._preset()["batch_size"]))

    def tables(self):
        c = self.config()
        return [TableConfig(f"t_cat_{i}", c.num_embeddings, c.embedding_dim, (f"cat_{i}",))
                for i in range(c.num_tables)]

    def build_model(self, device):
        c = self.config()
        return build(lambda: SimpleDeepFMNN(c), device, self.seed, torch_default_init)

    def build_batch(self, device):
        return self.dense_and_jagged(self.batch_size(), self.config().num_dense, device)
