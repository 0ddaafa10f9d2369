"""torchrec's own DeepFM (``torchrec.models.deepfm.SimpleDeepFMNN``) or DLRM on KeyedJaggedTensor.

Needs torchrec (``pip install --no-deps torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0``).
Options: arch (deepfm|dlrm), preset (default|tiny), batch_size.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cbtrace.errors import ProviderError
from cbtrace.model.provider import RecSysProvider, TableConfig, pick_preset

PRESETS = {
    "default": dict(tables=26, rows=1_000_000, dim=64, dense=13, hidden=1024, deep_fm=512,
                    batch_size=8192),
    "tiny": dict(tables=4, rows=100, dim=8, dense=13, hidden=16, deep_fm=8, batch_size=8),
}


@dataclass
class TorchRecDeepFMProvider(RecSysProvider):
    OPTIONS = ("preset", "batch_size", "arch")

    options: dict = field(default_factory=dict)

    def _p(self):
        return pick_preset("torchrec", PRESETS, self.options.get("preset", "default"))

    def tables(self):
        p = self._p()
        return [TableConfig(f"t_{i}", p["rows"], p["dim"], (f"f_{i}",)) for i in range(p["tables"])]

    def build_model(self, device):
        try:
            from torchrec.modules.embedding_configs import EmbeddingBagConfig
            from torchrec.modules.embedding_modules import EmbeddingBagCollection
        except Exception as e:  # torchrec missing or incompatible with this torch
            raise ProviderError(f"torchrec provider: torchrec is not usable here ({e})") from None
        p = self._p()
        ebc = EmbeddingBagCollection(device=torch.device("cpu"), tables=[
            EmbeddingBagConfig(name=t.name, embedding_dim=t.embedding_dim,
                               num_embeddings=t.num_embeddings, feature_names=list(t.feature_names))
            for t in self.tables()])
        if self.options.get("arch", "deepfm") == "dlrm":
            from torchrec.models.dlrm import DLRM

            return DLRM(embedding_bag_collection=ebc, dense_in_features=p["dense"],
                        dense_arch_layer_sizes=[p["hidden"], p["dim"]],
                        over_arch_layer_sizes=[p["hidden"], 1])
        from torchrec.models.deepfm import SimpleDeepFMNN

        return SimpleDeepFMNN(num_dense_features=p["dense"], embedding_bag_collection=ebc,
                              hidden_layer_size=p["hidden"], deep_fm_dimension=p["deep_fm"])

    def build_batch(self, device):
        b = int(self.options.get("batch_size", self._p()["batch_size"]))
        dense = torch.randn(b, self._p()["dense"])
        return (dense, self.keyed_jagged_batch(b))
