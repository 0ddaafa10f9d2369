"""The diff gate on whatever device is present: a tiny BERT, the same BERT with layer 1's
feed-forward three times wider, and a repeat of the original, each captured and replayed;
`cbtrace diff --fail-on-regression` on each pair.

Per pair: calls compared, calls flagged, the planted ones among them, false positives (flagged
but neither planted nor enclosing a planted call), the time threshold the runs set, and the
exit code. On a CPU, side by side in one run: replays that time each call in one window and in
two (``cpu_windows``, the faster kept; the default 2). Usage:

    python benchmarks/bench_diff_gate.py OUT_DIR [--repeats N] [--windows 1,2]
"""
import subprocess
import sys
from pathlib import Path

HIDDEN, FF, WIDE, LAYERS = 32, 37, 111, 2   # BertConfig: intermediate 37 -> 111 in layer 1
BATCH, SEQ = 2, 8
REPLAY = dict(budget_s=0.02, min_runs=20, warmup_runs=1, profile_runs=1, progress=False)
FFN = "encoder.layer.1"
# the widened Linears, the GELU between them (its work triples too) and every call above them
PLANTED = {"", "encoder", FFN, f"{FFN}.intermediate", f"{FFN}.intermediate.dense",
           f"{FFN}.intermediate.intermediate_act_fn", f"{FFN}.output", f"{FFN}.output.dense"}


def bert(wide: bool, device: str):
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                  num_attention_heads=2, intermediate_size=FF,
                                  max_position_embeddings=16)
    model = transformers.BertModel(cfg, add_pooling_layer=False).eval()
    if wide:
        layer = model.encoder.layer[1]
        layer.intermediate.dense = torch.nn.Linear(HIDDEN, WIDE)
        layer.output.dense = torch.nn.Linear(WIDE, HIDDEN)
    return model.to(device)


def capture_replay(model, out: Path, device: str, windows: int = 2) -> Path:
    import torch

    import cbtrace

    ids = torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    with cbtrace.capture(model, out, trace=False), torch.no_grad():
        model(ids.to(device))
    cbtrace.replay(out, model=model, cpu_windows=windows, **REPLAY)
    return out


def gate(a: Path, b: Path, expect: set) -> dict:
    from cbtrace.workflows.diff import diff_runs

    df = diff_runs(a, b)
    flagged = set(df.loc[df["regression"], "fqn"])
    code = subprocess.run([sys.executable, "-m", "cbtrace", "diff", str(a), str(b),
                           "--fail-on-regression", "--no-icicle"],
                          capture_output=True).returncode
    return {"pair": f"{a.name} -> {b.name}", "compared": int(df["match"].isin(
                ("name", "position")).sum()), "flagged": len(flagged),
            "planted found": f"{len(flagged & expect)}/{len(expect)}",
            "false positives": ", ".join(sorted(f or "(root)" for f in flagged - expect)) or "-",
            "time threshold": f"+{100 * df.attrs['time_threshold_rel']:.0f}%",
            "exit": code, "expected exit": 1 if expect else 0}


def main(out_dir: str, repeats: int = 1, windows: tuple = (1, 2)):
    import pandas as pd
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for w in windows if device == "cpu" else (1,):
        out = Path(out_dir) / f"windows{w}"
        plain = bert(False, device)
        runs = {"A": capture_replay(plain, out / "A", device, w),
                "B": capture_replay(bert(True, device), out / "B", device, w)}
        for i in range(repeats):
            runs[f"A{i + 2}"] = capture_replay(plain, out / f"A{i + 2}", device, w)
        pairs = [gate(runs["A"], runs["B"], PLANTED)]
        pairs += [gate(runs[a], runs[b], set()) for a, b in identical(list(runs), repeats)]
        rows += [{"cpu_windows": w if device == "cpu" else "-", **r} for r in pairs]
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}")
    print(pd.DataFrame(rows).to_string(index=False))


def identical(names: list, repeats: int) -> list:
    """Every ordered pair of the unchanged runs (A, A2, ...): both directions of each."""
    same = ["A"] + [f"A{i + 2}" for i in range(repeats)]
    return [(a, b) for a in same for b in same if a != b]


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    n = int(sys.argv[sys.argv.index("--repeats") + 1]) if "--repeats" in sys.argv else 1
    w = (tuple(int(x) for x in sys.argv[sys.argv.index("--windows") + 1].split(","))
         if "--windows" in sys.argv else (1, 2))
    main(sys.argv[1], n, w)
