"""`cbtrace profile` over several models in one run: statuses, fidelity and the error tables.

Per model: capture (the model's spec, dtype and options), replay (default timer) of the model
the capture ran, as `cbtrace profile` does (the variant +rebuild rebuilds it from its spec, as
`cbtrace replay RUN` does), in-situ join; then where the replay wall went (manifest.replay:
timings_s inside the per-call loop, outside_s the rest), one line per model (calls, ok /
skipped / error, share of calls with in-situ >= 10 us that read within +-5 % of in situ, the
root's error, replay wall, the part outside the loop and duty cycle) and its error table by
module class. A variant (NAME+VARIANT, after NAME) replays the same capture with other
settings (VARIANTS: each shortcut turned off, or an option turned on) and is compared call by
call with NAME's default replay. Writes OUT_DIR/<model>_modules.csv. Usage:

    python benchmarks/profile_models.py OUT_DIR nanogpt dlrm [...]   (names from MODELS)
    python benchmarks/profile_models.py OUT_DIR nanogpt nanogpt+every nanogpt+full
"""
import contextlib
import sys
import time
from pathlib import Path

from fidelity_zoo import MIN_MS, WITHIN_PCT, fidelity  # one definition of the figures

GPU = dict(device="cuda", dtype="bf16")
ZOO = str(Path(__file__).resolve().parent / "zoo.py")
REAL = {"size": "real"}
MODELS = {
    "nanogpt": dict(spec="nanogpt", options={"batch_size": 8}, **GPU),
    "dlrm": dict(spec="dlrm", options={"batch_size": 8192}, **GPU),
    "llama-0.5b": dict(spec=f"{ZOO}:hf_llama", options=REAL, **GPU),       # batch 4 x 1024
    "bert-base": dict(spec=f"{ZOO}:hf_bert", options=REAL, **GPU),         # batch 16 x 512
    "vit-b16": dict(spec=f"{ZOO}:timm_vit_b16", options=REAL, **GPU),      # timm, batch 64
    "resnet50": dict(spec=f"{ZOO}:tv_resnet50", options=REAL, **GPU),      # torchvision, batch 64
    "gpt2-compiled": dict(spec=f"{ZOO}:compiled_nanogpt", options=REAL, **GPU),
    "dlrm-large": dict(spec="dlrm:large", options={}, **GPU),               # 1,022 calls
    "dcn": dict(spec="dcn", options={}, **GPU),                  # 64 tables of 2-48 MB, batch 8192
    "dcn-large": dict(spec="dcn:large", options={}, **GPU),      # 256 tables, ~1,100 calls
    "hstu": dict(spec="hstu", options={}, **GPU),                # jagged histories up to 1024
    "nanogpt-train": dict(spec="nanogpt", options={"batch_size": 8}, step="train", **GPU),
    "nanogpt-tiny-cpu": dict(spec="nanogpt:tiny", device="cpu", dtype=None, options={}),
    "dlrm-tiny-cpu": dict(spec="dlrm:tiny", device="cpu", dtype=None, options={}),
    "dcn-tiny-cpu": dict(spec="dcn:tiny", device="cpu", dtype=None, options={}),
}
# NAME+VARIANT[+...]: the same model replayed with other settings, side by side in one table
VARIANTS = {"warm": {"warm_inputs": True},        # inputs rewritten in place before each call
            "reuse": {"reuse_timing": True},       # --reuse-timing
            "every": {"reuse_counts": False},      # --count-every-call: no count/profile reuse
            "full": {"converge_spread": 0.0, "converge_ci": 0.0},  # no early stop: the budget
            "again": {},                           # the default again: run-to-run noise
            "host10": {"host_runs": 10},           # host issue: the median of 10 runs, not 5
            "spin": {},                            # graph timer: a spin after the flush too
            "rebuild": {}}                         # the model rebuilt from its spec


@contextlib.contextmanager
def timer_settings(variants):
    """The graph timer's module-level setting a variant turns on (+spin: SPIN_UNDER_FLUSH)."""
    from cbtrace.plugins.backends import graph

    before = graph.SPIN_UNDER_FLUSH
    graph.SPIN_UNDER_FLUSH = "spin" in variants
    try:
        yield
    finally:
        graph.SPIN_UNDER_FLUSH = before


def against(df, base) -> dict:
    """How a variant's per-call figures compare with its model's default replay (same
    capture): |isolated_ms| differences, and the counted and profiled figures alike."""
    both = df.merge(base, on="call_id", suffixes=("", "_base"))
    both = both[(both["status"] == "ok") & (both["status_base"] == "ok")]
    diff = (100 * (both["isolated_ms"] / both["isolated_ms_base"] - 1)).abs()
    big = both["insitu_ms"] >= MIN_MS
    same = {c: (both[c] == both[f"{c}_base"]).mean() for c in ("flops", "bytes", "kernel_count")}
    host = (100 * (both["host_ms"] / both["host_ms_base"] - 1)).abs()
    return {"calls": len(both), "|d host|% median": host.median(), "|d iso|% median": diff.median(),
            "|d iso|% p90": diff.quantile(0.9), "|d iso|% max (>=10us)": diff[big].max(),
            **{f"same {c}": v for c, v in same.items()}}


def summary(name, df, wall_s, outside_s):
    """One row of the model table (a dict)."""
    status = df["status"].value_counts().to_dict()
    fid, _ = fidelity(df)
    # timed work: the time inside the timers' events, K calls per graph replay (timed_ms);
    # duty_old is the figure earlier sessions reported (one call per replay: isolated x runs)
    device_s = df["timed_ms"].fillna(0).sum() / 1e3
    old_s = (df["isolated_ms"].fillna(0) * df["runs"].fillna(0)).sum() / 1e3
    return {"model": name, "calls": len(df), "ok": status.get("ok", 0),
            "skipped": status.get("skipped", 0), "error": status.get("error", 0),
            "calls>=10us": fid["n>=10us"], "within5%": fid["within5%"] / 100,
            "root_err%": fid["root_err%"], "<10us|err|%": fid["<10us_|err|_med%"],
            "replay_wall_s": wall_s, "outside_loop_s": outside_s,
            "timed_s": device_s, "duty": device_s / wall_s if wall_s else float("nan"),
            "duty_old": old_s / wall_s if wall_s else float("nan")}


def backward_table(df) -> str:
    """The backward's isolation error by class (calls with in-situ backward >= 10 us), and the
    forward and backward MFU per class."""
    d = df[(df["bwd_status"] == "ok") & (df["bwd_insitu_ms"] >= MIN_MS)]
    within = (d["bwd_error_pct"].abs() <= WITHIN_PCT).mean() if len(d) else float("nan")
    g = d.groupby("module_type").agg(count=("bwd_error_pct", "size"),
                                     bwd_err_median=("bwd_error_pct", "median"),
                                     fwd_mfu=("mfu", "median"), bwd_mfu=("bwd_mfu", "median"),
                                     bwd_insitu_ms=("bwd_insitu_ms", "median"))
    return (f"backward: {len(d)} calls >= 10 us in situ, {100 * within:.1f} % within "
            f"+-{WITHIN_PCT:.0f} %\n" + g.to_string(float_format=lambda x: f"{x:.3g}"))


def main(out_dir, names):
    import pandas as pd

    from cbtrace.attribution.join import error_table, join_insitu
    from cbtrace.capture.from_spec import capture_model
    from cbtrace.replay.engine import replay
    from cbtrace.rundir.read import read_manifest
    from cbtrace.workflows.profile_model import live_model

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows, captured = [], {}  # a variant replays its model's capture again (same in-situ step)
    bases, compared = {}, []  # model -> its default replay's table; variant rows against it
    live = {}  # the last captured model only (GPU memory); an earlier one's variants rebuild
    for name in names:
        base, *variants = name.split("+")
        m = MODELS[base]
        replay_opts = {k: v for x in variants for k, v in VARIANTS[x].items()}
        try:
            step = m.get("step", "forward")
            if base not in captured:
                live.clear()
                cap = capture_model(m["spec"], out / base, device=m["device"], dtype=m["dtype"],
                                    options=m["options"], step=step)
                captured[base], live[base] = cap.out, live_model(cap)
                del cap
            run = captured[base]
            model = None if "rebuild" in variants else live.get(base)
            t0 = time.perf_counter()
            with timer_settings(variants):
                replay(run, model=model, model_spec=m["spec"], backward=step == "train",
                       progress=False, **replay_opts)
            wall = time.perf_counter() - t0
            df = join_insitu(run)
        except Exception as e:  # noqa: BLE001 - one model failing must not hide the others
            print(f"\n== {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        df.to_csv(out / f"{name.replace('+', '_')}_modules.csv", index=False)
        if not variants:
            bases[base] = df
        elif base in bases:
            compared.append({"variant": name, **against(df, bases[base])})
        info = read_manifest(run).replay
        loop_s, outside_s = sum(info.timings_s.values()), sum(info.outside_s.values())
        rows.append(summary(name, df, wall, outside_s))
        print(f"\n== {name}: replay() {wall:.2f} s = per-call loop {loop_s:.2f} s + outside it "
              f"{outside_s:.2f} s (+ the manifest write {wall - info.wall_s:.2f} s)")
        print(f"   loop phases (s): {info.timings_s}")
        print(f"   outside the loop (s): {info.outside_s}")
        if step == "train":
            print(backward_table(df))
        root = df[df["parent_call_id"] == -1].iloc[0]
        print(f"\n== {name}: root {root['module_type']}: isolated {root['isolated_ms']:.4g} ms, "
              f"in situ {root['insitu_ms']:.4g} ms ({root['error_pct']:+.1f} %), device "
              f"{root['device_ms']:.4g} ms, host issue {root['host_ms']:.4g} ms, kernels "
              f"{root['kernel_count']}, timer {root['timer']} ({root['timer_notes']}); "
              f"fallback: {str(root['timer_fallback'])[:200]}")
        timers = df["timer"].value_counts().to_dict()
        fell = df["timer_fallback"].dropna()
        print(f"\n== {name}: timers {timers}; fallbacks {len(fell)}"
              + "".join(f"\n   {n} x {why[:240]}" for why, n in fell.value_counts().head(4).items()))
        errors = df[df["status"] != "ok"][["fqn", "status", "status_reason"]]
        print(f"\n== {name}: error table (calls with in-situ >= {MIN_MS * 1e3:.0f} us)")
        print(error_table(df).to_string(float_format=lambda x: f"{x:.1f}"))
        if len(errors):
            print(errors.head(10).to_string(index=False))
        print(pd.DataFrame(rows[-1:]).to_string(index=False, float_format=lambda x: f"{x:.3g}"),
              flush=True)
    print("\n== models")
    print(pd.DataFrame(rows).to_string(index=False, float_format=lambda x: f"{x:.3g}"))
    if compared:
        print("\n== variants against their model's default replay (per call)")
        print(pd.DataFrame(compared).to_string(index=False, float_format=lambda x: f"{x:.3g}"))


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2:])
