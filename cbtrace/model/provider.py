"""Model providers: a Provider gives a model and a batch; RecSysProvider adds embedding tables."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from cbtrace.errors import ProviderError


@dataclass
class Provider:
    """A model and one batch for it.

    Subclasses override ``build_model`` and ``build_batch``; ``run`` calls the model on the batch
    (positional args for a tuple batch, keyword args for a dict batch). ``OPTIONS`` names the
    options a subclass reads; ``cbtrace.model.spec.resolve`` refuses any other (None: any).
    """

    OPTIONS: ClassVar[tuple[str, ...] | None] = None
    spec: str = ""                 # the spec that built it, e.g. "nanogpt:tiny"
    seed: int = 0                  # seeds torch before building the model and the batch
    options: dict = field(default_factory=dict)  # provider-specific options, stored in the manifest

    def build_model(self, device) -> Any:
        raise NotImplementedError

    def build_batch(self, device) -> tuple | dict:
        raise NotImplementedError

    def model_and_batch(self, device="cpu", dtype=None):
        """(model, batch) on ``device``; floating parameters and inputs cast to ``dtype`` if given."""
        import torch  # here: attribution imports this module and runs without torch

        torch.manual_seed(self.seed)
        model = self.build_model("cpu")  # init on CPU: identical weights on every device
        torch.manual_seed(self.seed + 1)
        batch = self.build_batch("cpu")
        model = model.to(device)
        if dtype is not None:
            model = model.to(dtype)
        return model, move_batch(batch, device, dtype)

    @staticmethod
    def run(model, batch):
        """Call the model on the batch: tuple -> *args, dict -> **kwargs."""
        if isinstance(batch, dict):
            return model(**batch)
        return model(*batch)


@dataclass
class TableConfig:
    """One embedding table of a recommendation model."""

    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: tuple = ()
    pooling: str = "sum"           # sum | mean
    ids_per_bag: tuple = (1, 3)    # min, max ids per bag in generated batches


@dataclass
class RecSysProvider(Provider):
    """A Provider for recommenders: embedding-table configs and (Keyed)Jagged sparse batches."""

    def tables(self) -> list[TableConfig]:
        raise NotImplementedError

    def jagged_ids(self, batch_size: int, generator=None):
        """(values, lengths) of a key-major jagged batch: per table, per sample, 1-3 valid ids."""
        import torch  # here: attribution imports this module and runs without torch

        values, lengths = [], []
        for t in self.tables():
            lo, hi = t.ids_per_bag
            n = torch.randint(lo, hi + 1, (batch_size,), generator=generator)
            lengths.append(n)
            values.append(torch.randint(0, t.num_embeddings, (int(n.sum()),), generator=generator))
        return torch.cat(values), torch.cat(lengths)

    def dense_and_jagged(self, batch_size: int, num_dense: int, device):
        """(dense features, key-major jagged ids, their offsets, ids per table as host ints) on
        ``device``: the batch of the plain-PyTorch recommenders (dlrm, dcn). Host ints split the
        ids without a device sync, as KeyedJaggedTensor.length_per_key() does."""
        import torch  # here: attribution imports this module and runs without torch

        values, lengths = self.jagged_ids(batch_size)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        dense = torch.randn(batch_size, num_dense)
        per_key = tuple(int(x) for x in lengths.view(len(self.tables()), batch_size).sum(1))
        return (dense.to(device), values.to(device), offsets.to(device), per_key)

    def keyed_jagged_batch(self, batch_size: int, generator=None):
        """A torchrec KeyedJaggedTensor for the tables' features (needs torchrec)."""
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # optional dependency

        values, lengths = self.jagged_ids(batch_size, generator)
        keys = [f for t in self.tables() for f in (t.feature_names or (t.name,))]
        return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths)


def move_batch(batch, device, dtype=None):
    """Move every tensor of a (nested) batch; floating tensors are cast to ``dtype`` if given."""
    import torch  # here: attribution imports this module and runs without torch

    from cbtrace.nested import map_tensors  # torch too

    def mv(x):
        if dtype is not None and x.is_floating_point():
            return x.to(device=device, dtype=dtype)
        return x.to(device)

    return map_tensors(mv, batch, torchrec=lambda x: x.to(torch.device(device)))


def pick_preset(provider: str, presets: dict, name: str):
    """``presets[name]``, or a ProviderError naming the provider and the known presets."""
    if name not in presets:
        raise ProviderError(f"{provider}: unknown preset '{name}' (known: {', '.join(presets)})")
    return presets[name]
