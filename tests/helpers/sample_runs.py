"""Synthetic run directories for tests and docs: a REAL module tree, MADE-UP figures.

The tree comes from ``named_modules()`` of a real ``nn.Module`` (a small transformer or a
DLRM-like recommender), one call per module in pre-order, like a capture would record it.
The figures (times, FLOPs, bytes, MFU/MBU, bound) come from a roofline on a nominal H200 with
fixed efficiencies and seeded noise: plausible, but test data. The manifest says so
(``"synthetic_figures": true``) and the icicle's subtitle shows it.

    python -m tests.helpers.sample_runs OUT_DIR [transformer|dlrm] [--no-timings]
"""
from __future__ import annotations

import random
import sys
from pathlib import Path

PEAK_FLOPS = 989e12     # nominal dense BF16 FLOP/s of an H200 SXM (datasheet)
PEAK_BYTES = 4.8e12     # nominal HBM3e bytes/s of an H200
LAUNCH_MS = 0.004       # per-kernel launch floor
TOKENS = 16384          # rows flowing through every layer (batch x sequence)
CONTAINERS = ("ModuleList", "ModuleDict", "ParameterList", "ParameterDict")


def transformer():
    """Embedding -> 4-layer nn.TransformerEncoder (d=512) -> LayerNorm -> Linear head."""
    from torch import nn

    class TinyLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(8192, 512)
            layer = nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(512)
            self.head = nn.Linear(512, 8192)

    return TinyLM()


def dlrm():
    """DLRM-like: 8 EmbeddingBags + bottom MLP, a pairwise interaction, a top MLP."""
    from torch import nn

    class Interaction(nn.Module):
        pass

    class DLRM(nn.Module):
        def __init__(self):
            super().__init__()
            self.sparse = nn.ModuleList(nn.EmbeddingBag(4096, 64, mode="sum") for _ in range(8))
            self.bottom = nn.Sequential(nn.Linear(13, 512), nn.ReLU(), nn.Linear(512, 256),
                                        nn.ReLU(), nn.Linear(256, 64), nn.ReLU())
            self.interaction = Interaction()
            self.top = nn.Sequential(nn.Linear(100, 1024), nn.ReLU(), nn.Linear(1024, 1024),
                                     nn.ReLU(), nn.Linear(1024, 1), nn.Sigmoid())

    return DLRM()


MODELS = {"transformer": transformer, "dlrm": dlrm}


def _leaf_cost(m, width: int) -> tuple[float, float]:
    """(FLOPs, bytes) of one call of a leaf module over TOKENS rows; made-up but roofline-shaped."""
    name = type(m).__name__
    t, f4 = TOKENS, 2  # bf16 activations and weights
    if hasattr(m, "in_features"):
        flops = 2.0 * t * m.in_features * m.out_features
        return flops, f4 * (m.weight.numel() + t * (m.in_features + m.out_features))
    if name in ("Embedding", "EmbeddingBag"):
        pooled = 20 if name == "EmbeddingBag" else 1
        return 0.0, f4 * t * m.embedding_dim * (pooled + 1)
    if name == "MultiheadAttention":
        d, s = m.embed_dim, 512
        return 4.0 * t * s * d, f4 * t * d * 4
    if name == "LayerNorm":
        return 5.0 * t * width, f4 * 2 * t * width
    if name == "Interaction":
        return 2.0 * t * 9 * 9 * 64, f4 * t * (9 * 64 + 100)
    return 0.0, f4 * 2 * t * width  # ReLU, GELU, Dropout, Sigmoid: elementwise, no FLOPs


def _calls(model):
    """(fqn, module, parent fqn) per module call, in pre-order; containers are never called."""
    parents = {"": None}
    out = []
    for fqn, m in model.named_modules():
        if type(m).__name__ in CONTAINERS:
            parents[fqn] = parents.get(fqn.rpartition(".")[0])
            continue
        parent = parents.get(fqn.rpartition(".")[0]) if fqn else None
        parents[fqn] = fqn
        out.append((fqn, m, parent))
    return out


def sample_records(model, *, timings: bool = True, seed: int = 0):
    """ModuleRecords of one step of ``model``: real tree, synthetic figures if ``timings``."""
    from cbtrace.schema.modules import ModuleRecord

    rng = random.Random(seed)
    calls = _calls(model)
    ids = {fqn: i for i, (fqn, _, _) in enumerate(calls)}
    recs, kids = {}, {}
    for i, (fqn, m, parent) in enumerate(calls):
        pid = ids[parent] if parent is not None else -1
        kids.setdefault(pid, []).append(i)
        pb = sum(p.numel() * p.element_size() for p in m.parameters())
        recs[i] = ModuleRecord(
            fqn=fqn, call_index=0, call_id=i, parent_call_id=pid, parent_fqn=parent,
            depth=0 if pid < 0 else recs[pid].depth + 1, module_type=type(m).__name__,
            module_class=f"{type(m).__module__}.{type(m).__qualname__}", param_bytes=pb,
            buffer_bytes=0, input_bytes=4 * TOKENS * 512, input_shapes=f"[[{TOKENS}, 512]]",
            input_meta="[]", output_meta="[]", training=True, grad_enabled=True,
            autocast_dtype=None, inputs_ref="{}")
    if timings:
        for i in sorted(recs, reverse=True):  # children (larger call_id) before parents
            _fill(recs[i], calls[i][1], [recs[k] for k in kids.get(i, [])], rng)
    return [recs[i] for i in sorted(recs)]


def _fill(r, m, children, rng) -> None:
    """Synthetic replay + attribution figures for one record (children already filled)."""
    r.status, r.timer, r.runs, r.compute_dtype = "ok", "graph", 50, "bfloat16"
    if children:
        flops = sum(c.flops or 0 for c in children)
        nbytes = sum(c.bytes or 0 for c in children)
        r.residual_ms = rng.uniform(0.0, 0.08) * sum(c.isolated_ms for c in children)
        ms = sum(c.isolated_ms for c in children) + r.residual_ms
        r.kernel_count = sum(c.kernel_count for c in children) + 1
    else:
        flops, nbytes = _leaf_cost(m, 512)
        compute = flops / (PEAK_FLOPS * rng.uniform(0.35, 0.75)) * 1e3
        memory = nbytes / (PEAK_BYTES * rng.uniform(0.45, 0.85)) * 1e3
        r.kernel_count = rng.choice((1, 1, 2, 3))
        ms = max(compute, memory) + LAUNCH_MS * r.kernel_count
    r.flops, r.flops_executed, r.bytes = flops or None, flops or None, nbytes
    r.isolated_ms = ms
    r.isolated_ms_p10, r.isolated_ms_p90 = ms * 0.97, ms * 1.05
    r.insitu_ms = ms * rng.uniform(0.9, 1.25)
    r.error_pct = 100 * (r.isolated_ms / r.insitu_ms - 1)
    r.mfu = flops / (ms * 1e-3) / PEAK_FLOPS if flops else None
    r.hfu = r.mfu
    r.mbu = nbytes / (ms * 1e-3) / PEAK_BYTES
    r.launch_overhead_ms = LAUNCH_MS * r.kernel_count
    if r.launch_overhead_ms > 0.5 * ms:
        r.bound = "launch"
    else:
        r.bound = "compute" if (r.mfu or 0) > r.mbu else "memory"
    r.peak_mem_bytes = int(nbytes)
    r.peak_mem_source = "estimate"
    r.aggregated = False


def write_sample_run(out_dir, kind: str = "transformer", *, timings: bool = True,
                     extra: dict | None = None) -> Path:
    """Write a run directory (manifest.json + modules.parquet) with a synthetic run of ``kind``.

    ``extra`` maps attribute names to modules added to the model's root before the walk
    (e.g. a module named ``<script>alert(1)</script>`` for escaping tests).
    """
    from cbtrace.schema.manifest import ModelSource

    from .runs import write_run

    model = MODELS[kind]()
    for name, mod in (extra or {}).items():
        model.add_module(name, mod)
    cls = type(model)
    return write_run(out_dir, sample_records(model, timings=timings),
                     model=ModelSource(model_class=f"{cls.__module__}.{cls.__qualname__}",
                                       spec=f"{kind} (synthetic figures)"),
                     device_name="NVIDIA H200 (nominal, test data)", synthetic_figures=True)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if not args:
        sys.exit(__doc__)
    print(write_sample_run(args[0], args[1] if len(args) > 1 else "transformer",
                           timings="--no-timings" not in sys.argv))
