"""The paper's two demos reproduced side by side: DeepFM-DLRM and NanoGPT, per module.

The seed paper (Component Benchmark, 2026) reports on one H100, with no dtype or batch stated:
DLRM's sparse arch "almost pure bandwidth", ``deep_fm`` at 27.06 % MFU beside its FM-cross
sibling at 0.06 %, the two dense Linears 1024x4096 and 4096x512 at 25.91 % and 20.74 %, ReLU at 0
FLOPs "painted red"; NanoGPT's 12 blocks alike, inside a block attention ~10 % MFU, the MLP
~20 %, layer-norm / GELU / dropout ~0. This script profiles our models at several settings (the
default bf16 run, and fp32 and small-batch runs that may explain the paper's figures), prints
paper vs ours per module with dtype, batch and FLOP convention (dense: causal attention counts
the full square; MFU against the dtype's datasheet peak), and writes the icicles of the default
runs. Alternative settings capture only the modules the table needs (``include``). Usage:

    python benchmarks/paper_demos.py OUT_DIR [--device cuda|cpu] [--quick] [--models dlrm,nanogpt]
"""
import argparse
import time
from pathlib import Path

PAPER = {  # module (fqn or class) -> the paper's MFU (fraction), or its words
    "dlrm": [("sparse_arch", "MBU", "almost pure bandwidth"),
             ("inter_arch.deep_fm", "MFU", 0.2706), ("inter_arch.fm", "MFU", 0.0006),
             ("inter_arch.deep_fm.dense_module.0", "MFU", 0.2591),   # Linear 1024 -> 4096
             ("inter_arch.deep_fm.dense_module.2", "MFU", 0.2074),   # Linear 4096 -> 512
             ("inter_arch.deep_fm.dense_module.1", "MBU", "0 FLOPs, painted red")],  # ReLU
    "nanogpt": [("transformer.h.0", "MFU", "12 blocks alike"),
                ("transformer.h.0.attn", "MFU", 0.10), ("transformer.h.0.mlp", "MFU", 0.20),
                ("transformer.h.0.ln_1", "MFU", 0.0), ("transformer.h.0.mlp.gelu", "MFU", 0.0),
                ("transformer.h.0.attn.resid_dropout", "MFU", 0.0)],
}
# (label, spec, dtype, options, include globs: None = the whole tree, for the icicle)
SETTINGS = {
    "dlrm": [("bf16 b8192", "dlrm", "bf16", {"batch_size": 8192}, None),
             ("fp32 b8192", "dlrm", None, {"batch_size": 8192}, ("", "sparse_arch", "inter_arch*")),
             ("bf16 b512", "dlrm", "bf16", {"batch_size": 512}, ("", "sparse_arch", "inter_arch*")),
             ("fp32 b512", "dlrm", None, {"batch_size": 512}, ("", "sparse_arch", "inter_arch*"))],
    "nanogpt": [("bf16 b8", "nanogpt", "bf16", {"batch_size": 8}, None),
                ("fp32 b8", "nanogpt", None, {"batch_size": 8}, ("", "transformer.h.0*")),
                ("bf16 b1", "nanogpt", "bf16", {"batch_size": 1}, ("", "transformer.h.0*")),
                ("fp32 b1", "nanogpt", None, {"batch_size": 1}, ("", "transformer.h.0*"))],
}
QUICK = {"dlrm": ("tiny dlrm", "dlrm:tiny", None, {}, None),
         "nanogpt": ("tiny nanogpt", "nanogpt:tiny", None, {}, None)}


def profile_one(out: Path, spec, dtype, options, include, device):
    from cbtrace.workflows.profile_model import profile

    kw = dict(device=device, dtype=dtype, options=options)
    if include:
        kw["include"] = include
    return profile(spec, out, **kw).set_index("fqn")


def figure(df, fqn, metric):
    if fqn not in df.index:
        return "-"
    r = df.loc[fqn]
    r = r.iloc[0] if hasattr(r, "ndim") and r.ndim > 1 else r
    v = r.get(metric.lower())
    return "-" if v is None or v != v else f"{100 * v:.2f} %"


def main():
    import pandas as pd

    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="the tiny presets only (a CPU check)")
    ap.add_argument("--models", default=",".join(PAPER), help="which demos, comma-separated")
    a = ap.parse_args()
    out = Path(a.out)
    for model in a.models.split(","):
        rows = PAPER[model]
        settings = [QUICK[model]] if a.quick else SETTINGS[model]
        frames = {}
        for label, spec, dtype, options, include in settings:
            t0 = time.perf_counter()
            run = out / f"{model}-{label.replace(' ', '-')}"
            frames[label] = profile_one(run, spec, dtype, options, include, a.device)
            print(f"{model} {label}: {len(frames[label])} calls in {time.perf_counter() - t0:.0f} s")
            if include is None:
                from cbtrace.workflows.report import write_report

                print(f"  icicle: {write_report(run)}")
        table = []
        for fqn, metric, paper in rows:
            line = {"module": fqn, "metric": metric,
                    "paper": paper if isinstance(paper, str) else f"{100 * paper:.2f} %"}
            for label, df in frames.items():
                line[label] = figure(df, fqn, metric)
                if metric == "MBU" and fqn in df.index:  # what the paper's red box hides
                    line[label] += f" (MFU {figure(df, fqn, 'MFU')})"
            table.append(line)
        print(f"\n== {model}: the paper (H100, dtype and batch not stated) vs ours "
              f"({a.device}; dense FLOP convention; MFU/MBU against the dtype's datasheet peak)")
        print(pd.DataFrame(table).to_string(index=False))
        if model == "nanogpt":  # "12 blocks alike": the spread of the blocks' MFU
            df = next(iter(frames.values()))
            blocks = df[df["module_type"] == "Block"]["mfu"] if "module_type" in df else []
            if len(blocks):
                print(f"blocks: {len(blocks)}, MFU {100 * blocks.min():.2f}…{100 * blocks.max():.2f} %")


if __name__ == "__main__":
    main()
