"""The diff gate on whatever device is present: a tiny BERT, the same BERT with layer 1's
feed-forward three times wider, and a repeat of the original, each captured and replayed;
`cbtrace diff --fail-on-regression` on each pair.

Per pair: calls compared, calls flagged, the planted ones among them, false positives (flagged
but neither planted nor enclosing a planted call), the time threshold the runs set, and the
exit code. Usage:

    python benchmarks/bench_diff_gate.py OUT_DIR [--repeats N]
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


def capture_replay(model, out: Path, device: str) -> Path:
    import torch

    import cbtrace

    ids = torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    with cbtrace.capture(model, out, trace=False), torch.no_grad():
        model(ids.to(device))
    cbtrace.replay(out, model=model, **REPLAY)
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


def main(out_dir: str, repeats: int = 1):
    import pandas as pd
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = Path(out_dir)
    plain = bert(False, device)
    runs = {"A": capture_replay(plain, out / "A", device),
            "B": capture_replay(bert(True, device), out / "B", device)}
    for i in range(repeats):
        runs[f"A{i + 2}"] = capture_replay(plain, out / f"A{i + 2}", device)
    rows = [gate(runs["A"], runs["B"], PLANTED)]
    rows += [gate(runs["A"], runs[f"A{i + 2}"], set()) for i in range(repeats)]
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}")
    print(pd.DataFrame(rows).to_string(index=False))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    n = int(sys.argv[sys.argv.index("--repeats") + 1]) if "--repeats" in sys.argv else 1
    main(sys.argv[1], n)
