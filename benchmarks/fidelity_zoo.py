"""Isolation fidelity over a zoo of models: `cbtrace profile` (in-process) of each model, then
per model and phase (fwd; bwd too with --step train, whose replay times each call's backward):
calls, errors, the share of calls >= 10 us in situ that read within +-5 % of in situ, the
EmbeddingBag class median, the root's error and the median |error| of calls < 10 us; then the
median error by module class. OUT gets, per model, <model>.json (its rows and class medians),
<model>_classes.csv and <model>_rows.csv.gz (per call, the columns a miss is looked into with),
and fidelity.csv (all rows): summaries only, the run directories go to a temporary folder
(--keep-runs keeps them under OUT/runs).

    python benchmarks/fidelity_zoo.py --out OUT [--models nanogpt,dcn,...] [--device cuda]
        [--dtype bf16] [--size real|tiny] [--step train] [--cold] [--no-context]
        [--variant NAME:KEY=VALUE[,KEY=VALUE]] ...

A/B in one run (``--variant``, repeatable): each model is captured once and its run replayed
once per setting, the base settings first, then each variant's (``ReplayConfig`` fields over
the base's), every replay compared with the same captured step. Each variant gets its rows in
the table (model@NAME) and files (model.NAME_rows.csv.gz, ...), and one paired line per model
and phase: of the calls >= 10 us timed in both, how many each reads within +-5 %, how many
the variant moved in and out of it, and the median change of the isolated time. Two runs of
one setting differ by how their hosts and steps differ; two replays of one capture do not.

Models whose library is not installed are skipped with a note. --size defaults to real on a
GPU (the sizes of benchmarks/zoo.py and the providers' default presets) and tiny on the CPU,
--device to cuda where there is one. On a CPU the figures say only that the pipeline runs: a
busy CPU's in-situ and isolated times do not agree to 5 %.
"""
import argparse
import dataclasses
import importlib.util
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

from cbtrace.attribution.miss import CLOCKED_BASES
from cbtrace.replay.config import CONTEXT_REWRITES, ReplayConfig

MIN_MS, WITHIN_PCT = 0.010, 5.0
ZOO = str(Path(__file__).resolve().parent / "zoo.py")
TINY, REAL = {"size": "tiny"}, {"size": "real"}
# name -> (tiny spec, tiny options, real spec, real options, the module it needs)
MODELS = {
    "nanogpt": ("nanogpt:tiny", {}, "nanogpt", {"batch_size": 8}, None),
    "dlrm": ("dlrm:tiny", {}, "dlrm", {}, None),                      # batch 8192
    "dcn": ("dcn:tiny", {}, "dcn", {}, None),                         # 64 tables, batch 8192
    "hstu": ("hstu:tiny", {}, "hstu", {}, None),                      # 4 layers, T 1024
    "resnet50": (f"{ZOO}:tv_resnet50", TINY, f"{ZOO}:tv_resnet50", REAL, "torchvision"),
    "efficientnet_b0": (f"{ZOO}:timm_efficientnet_b0", TINY, f"{ZOO}:timm_efficientnet_b0",
                        REAL, "timm"),
    "convnext_tiny": (f"{ZOO}:timm_convnext_tiny", TINY, f"{ZOO}:timm_convnext_tiny", REAL,
                      "timm"),
    "vit_b16": (f"{ZOO}:timm_vit_b16", TINY, f"{ZOO}:timm_vit_b16", REAL, "timm"),
    "bert-base": (f"{ZOO}:hf_bert", TINY, f"{ZOO}:hf_bert", REAL, "transformers"),
    "t5-small": (f"{ZOO}:hf_t5", TINY, f"{ZOO}:hf_t5", REAL, "transformers"),
    "t5-base": (f"{ZOO}:hf_t5_base", TINY, f"{ZOO}:hf_t5_base", REAL, "transformers"),
    "gpt2": (f"{ZOO}:hf_gpt2", TINY, f"{ZOO}:hf_gpt2", REAL, "transformers"),
    "llama": (f"{ZOO}:hf_llama", TINY, f"{ZOO}:hf_llama", REAL, "transformers"),
    "mixtral": (f"{ZOO}:hf_mixtral", TINY, f"{ZOO}:hf_mixtral", REAL, "transformers"),
    "fasterrcnn": (f"{ZOO}:tv_fasterrcnn", TINY, f"{ZOO}:tv_fasterrcnn", REAL, "torchvision"),
    # a training step passes boxes and labels (the model then returns its losses)
    "fasterrcnn-train": (f"{ZOO}:tv_fasterrcnn", {**TINY, "targets": True},
                         f"{ZOO}:tv_fasterrcnn", {**REAL, "targets": True}, "torchvision"),
    "gnn": (f"{ZOO}:pyg_gnn", TINY, f"{ZOO}:pyg_gnn", REAL, "torch_geometric"),
    "wav2vec2": (f"{ZOO}:hf_wav2vec2", TINY, f"{ZOO}:hf_wav2vec2", REAL, "transformers"),
    "compiled-gpt2": ("nanogpt:tiny", {}, f"{ZOO}:compiled_nanogpt", REAL, None),
}
DEFAULT_MODELS = "nanogpt,dlrm,dcn,hstu,resnet50,efficientnet_b0,convnext_tiny,vit_b16,bert-base"
# models that run only in their own dtype: --dtype is not applied to them (torchvision's nms has
# no bf16 kernel)
OWN_DTYPE = {"fasterrcnn", "fasterrcnn-train"}
# the modules table's columns of each phase: status, in-situ ms, error %
PHASES = {"fwd": ("status", "insitu_ms", "error_pct"),
          "bwd": ("bwd_status", "bwd_insitu_ms", "bwd_error_pct")}
# per call, for <model>_rows.csv.gz (what a miss is looked into with)
ROW_COLUMNS = ("call_id", "parent_call_id", "fqn", "module_type", "status", "status_reason",
               "timer", "timer_fallback", "timer_notes",
               "insitu_ms", "isolated_ms", "error_pct", "device_ms", "host_ms", "bound",
               "kernel_count",
               "bwd_status", "bwd_status_reason", "bwd_insitu_ms", "bwd_ms", "bwd_error_pct",
               "bwd_timer_fallback", "bwd_timer_notes", "host_syncs", "insitu_span_ms",
               "insitu_hooked_ms", "bwd_insitu_hooked_ms", "error_basis", "step_compiled",
               "eager_ms", "insitu_kernel_count", "kernel_error_pct", "miss_cause",
               "step_clock_mhz", "timed_clock_mhz", "clock_error_pct",
               "bwd_kernel_count", "bwd_insitu_kernel_count", "bwd_device_ms",
               "bwd_kernel_error_pct", "bwd_miss_cause")
COLUMNS = ("model", "phase", "calls", "errors", "skipped", "n>=10us", "fell_back", "by_kernels",
           "within5%",
           "EmbBag_med%",
           "root_err%", "<10us_|err|_med%", "<10us_|kern|_med%", "misses_named",
           "hooked_within5%", "step/timed_MHz", "clock_free_within5%")


def _pct(x) -> float:
    return float("nan") if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def misses(big, err: str, cause: str) -> dict:
    """misses_named (calls outside +-5 % with a cause / all of them) and their causes by kind."""
    miss = big[big[err].abs() > WITHIN_PCT]
    return {"misses_named": f"{int(miss[cause].notna().sum())}/{len(miss)}",
            "causes": (miss[cause].dropna().str.split(":| \\(| \\d").str[0]
                       .value_counts().to_dict())}


def fidelity(df, phase: str = "fwd") -> tuple[dict, list[dict]]:
    """(the model's row for ``phase``, its class medians) from a profiled modules table."""
    status, insitu, err = PHASES[phase]
    ok = df[(df[status] == "ok") & df[err].notna()]
    big, small = ok[ok[insitu] >= MIN_MS], ok[ok[insitu] < MIN_MS]
    root = df[df["parent_call_id"] == -1]
    bags = big[big["module_type"] == "EmbeddingBag"]
    row = {"phase": phase, "calls": int(df[status].notna().sum()),
           "errors": int(df[status].isin(["error", "timeout"]).sum()),
           "skipped": int((df[status] == "skipped").sum()), "n>=10us": len(big),
           "within5%": 100 * (big[err].abs() <= WITHIN_PCT).mean() if len(big) else float("nan"),
           "EmbBag_med%": _pct(bags[err].median()) if len(bags) else float("nan"),
           "root_err%": _pct(root[err].iloc[0]) if len(root) else float("nan"),
           "<10us_|err|_med%": _pct(small[err].abs().median()) if len(small) else float("nan"),
           "hooked_within5%": hooked_within(big, phase), "fell_back": fell_back(big, phase),
           "by_kernels": by_kernels(ok, phase)}
    if phase == "fwd" and "kernel_error_pct" in df:  # like with like: kernels alone vs in the step
        kern = small["kernel_error_pct"].dropna().abs()
        row["<10us_|kern|_med%"] = _pct(kern.median()) if len(kern) else float("nan")
        row.update(misses(big, err, "miss_cause"))
        row.update(clock_columns(big, err))
    if phase == "bwd" and "bwd_miss_cause" in df:  # no clock is read around a backward's timing
        row.update(misses(big, err, "bwd_miss_cause"))
    g = big.groupby("module_type")
    classes = [{"phase": phase, "module_type": t, "count": len(d),
                "median_err%": float(d[err].median()),
                "insitu_ms_median": float(d[insitu].median()),
                "within5%": 100 * float((d[err].abs() <= WITHIN_PCT).mean()),
                "timer_notes": _most_common(d["timer_notes"])}
               for t, d in g]
    classes.sort(key=lambda c: -c["insitu_ms_median"])
    return row, classes


def by_kernels(ok, phase: str) -> int:
    """Of the timed calls, those whose figure is their own kernels' busy time in profiled runs
    (after their context, ``ReplayConfig.context_kernels_max_ms``, or of many kernels,
    ``kernels_figure_min``; the row's note says so): how much of a table that figure, not the
    graph's, makes."""
    column = "timer_notes" if phase == "fwd" else "bwd_timer_notes"
    if column not in ok:
        return 0
    return int(ok[column].fillna("").str.contains("kernels in context, |kernels' busy time \\(")
               .sum())


def fell_back(big, phase: str) -> int:
    """Of ``big``'s calls, those the first timer of the chain refused (a graph capture that
    failed, a call that asks whether it is captured), timed by a fallback: where a phase's
    misses gather, their timer is the first suspect."""
    column = "timer_fallback" if phase == "fwd" else "bwd_timer_fallback"
    return int(big[column].notna().sum()) if column in big else 0


def clock_columns(big, err: str) -> dict:
    """The SM clock after the plain step against the median after the calls' timings, and the
    share (%) of ``big``'s calls within 5 % once the clocks' difference is taken out of each
    compared on a clocked basis (``miss.CLOCKED_BASES``: its busy time, or its eager figure
    against the eager step's): what timing at the step's clock would give, were every call's
    time to follow the clock (a bound, not a measurement). Empty without clock readings."""
    if "clock_error_pct" not in big or big["clock_error_pct"].isna().all():
        return {}
    clock = big["clock_error_pct"].where(big["error_basis"].isin(CLOCKED_BASES), 0.0).fillna(0.0)
    return {"step/timed_MHz": f"{big['step_clock_mhz'].median():.0f}/"
                              f"{big['timed_clock_mhz'].median():.0f}",
            "clock_free_within5%": 100 * float(((big[err] - clock).abs() <= WITHIN_PCT).mean())}


def hooked_within(big, phase: str) -> float:
    """Share (%) of ``big``'s calls within 5 % of the captured step's own busy time (input
    copies and hooks around each call) instead of the plain step's: the A/B of the in-situ
    step, on one capture. NaN without a plain step."""
    err = PHASES[phase][2]
    iso, col = ("isolated_ms", "insitu_hooked_ms") if phase == "fwd" else (
        "bwd_ms", "bwd_insitu_hooked_ms")
    if col not in big or not len(big) or big[col].isna().all():
        return float("nan")
    alt = 100 * (big[iso] / big[col] - 1)
    use = big[col].notna()
    if phase == "fwd":  # a forward call compared with another figure (host, step) keeps it
        use &= big["error_basis"] == "busy"
    return 100 * float((alt.where(use, big[err]).abs() <= WITHIN_PCT).mean())


def _most_common(notes) -> str:
    """The note most of a class's calls were timed with ('' when none has one)."""
    counts = notes.dropna().value_counts()
    return str(counts.index[0]) if len(counts) else ""


def replay_options(args) -> dict:
    """The base replay's ``ReplayConfig`` fields, from the command line."""
    options = {"cold": args.cold, "timer": args.timer, "backward": args.step == "train"}
    if args.no_context:
        options["context"] = False
    if args.context_max_ms is not None:
        options["context_max_ms"] = args.context_max_ms
    if args.context_rewrite is not None:
        options["context_rewrite"] = args.context_rewrite
    if args.budget_s is not None:
        options["budget_s"] = args.budget_s
    return options


def profiled(name, spec, options, args, run_dir):
    """Yield (variant, modules table, wall seconds) for the base settings ("") and then each
    ``--variant``: the model captured once, its run replayed with each and joined with the same
    in-situ times (``cbtrace profile``'s steps, the replay on the model the capture ran). A
    variant whose replay fails yields "FAILED ..." for its table; the base's failure raises."""
    from cbtrace.attribution.join import join_insitu
    from cbtrace.capture.from_spec import capture_model
    from cbtrace.replay.engine import replay
    from cbtrace.workflows.profile_model import live_model

    t0 = time.perf_counter()
    dtype = None if name in OWN_DTYPE else args.dtype
    cap = capture_model(spec, run_dir, device=args.device, dtype=dtype, step=args.step,
                        options=options)
    run, model = cap.out, live_model(cap, args.device)
    del cap  # the capture's own buffers go before replay starts
    captured = time.perf_counter() - t0
    base = dict(replay_options(args), model_spec=spec, device=args.device)
    for variant, overrides in [("", {})] + args.variant:
        t1 = time.perf_counter()
        try:
            replay(run, model=model, **{**base, **overrides})
            df = join_insitu(run)
        except Exception as e:  # noqa: BLE001 - a failing variant leaves the others their turn
            if not variant:
                raise  # without the base replay there is nothing to compare with
            yield variant, f"FAILED {type(e).__name__}: {str(e)[:300]}", 0.0
            continue
        yield variant, df, time.perf_counter() - t1 + (captured if not variant else 0.0)


def paired(base, other, phase: str = "fwd") -> dict | None:
    """How a variant's replay of a run compares with the base replay of it, call by call: of the
    calls >= 10 us in situ that both timed, how many each reads within +-5 %, how many the
    variant moved into (``in``) and out of (``out``) that band, and the median change of the
    isolated time (%). None when no call qualifies."""
    status, insitu, err = PHASES[phase]
    iso = "isolated_ms" if phase == "fwd" else "bwd_ms"
    cols = ["call_id", status, insitu, err, iso]
    both = base[cols].merge(other[cols], on="call_id", suffixes=("_a", "_b"))
    ok = both[(both[f"{status}_a"] == "ok") & (both[f"{status}_b"] == "ok")
              & both[f"{err}_a"].notna() & both[f"{err}_b"].notna()
              & (both[f"{insitu}_a"] >= MIN_MS)]
    if not len(ok):
        return None
    a, b = ok[f"{err}_a"].abs() <= WITHIN_PCT, ok[f"{err}_b"].abs() <= WITHIN_PCT
    change = 100 * (ok[f"{iso}_b"] / ok[f"{iso}_a"] - 1)
    return {"phase": phase, "calls": len(ok), "within_base": int(a.sum()),
            "within_variant": int(b.sum()), "in": int((b & ~a).sum()),
            "out": int((a & ~b).sum()), "median_change%": _pct(change.median()),
            "median_|err|_base%": _pct(ok[f"{err}_a"].abs().median()),
            "median_|err|_variant%": _pct(ok[f"{err}_b"].abs().median())}


def paired_line(name: str, variant: str, p: dict) -> str:
    return (f"  {name}@{variant} {p['phase']} against the base, paired ({p['calls']} calls >= "
            f"10 us): within 5 % {p['within_base']} -> {p['within_variant']} (moved in "
            f"{p['in']}, out {p['out']}); median |error| {p['median_|err|_base%']:.1f} -> "
            f"{p['median_|err|_variant%']:.1f} %; isolated time median change "
            f"{p['median_change%']:+.2f} %")


def parse_variant(text: str) -> tuple[str, dict]:
    """``NAME:KEY=VALUE[,KEY=VALUE]`` -> (NAME, {field: value}) over ``ReplayConfig``'s fields;
    values: true/false, none, numbers, else strings. Raises ValueError saying what is wrong."""
    name, sep, body = text.partition(":")
    if not sep or not name or not body or not name.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"{text!r}: expected NAME:KEY=VALUE[,KEY=VALUE] (NAME of letters, "
                         "digits, - and _)")
    known = {f.name for f in dataclasses.fields(ReplayConfig)}
    out = {}
    for item in body.split(","):
        key, eq, value = item.partition("=")
        if not eq or key not in known:
            raise ValueError(f"{text!r}: {key!r} is not a ReplayConfig field" if eq
                             else f"{text!r}: {item!r} is not KEY=VALUE")
        out[key] = _value(value)
    try:  # a bad value fails here, not after the base replay of the first model
        ReplayConfig(**out)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{text!r}: {e}") from None
    return name, out


def _value(text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def table(rows) -> str:
    """The compact table: one line per model and phase."""
    def cell(v):
        return f"{v:.1f}" if isinstance(v, float) else str(v)

    cells = [[cell(r.get(c, "")) for c in COLUMNS] for r in rows]
    widths = [max([len(c), *(len(x[i]) for x in cells)]) for i, c in enumerate(COLUMNS)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(COLUMNS, widths))]
    lines += ["  ".join(x.rjust(w) for x, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


def class_lines(name, classes, top: int) -> str:
    """One model's class medians, the classes with the most in-situ time per call first."""
    out = []
    for phase in PHASES:
        cs = [c for c in classes if c["phase"] == phase][:top]
        if cs:
            out.append(f"  {name} {phase} class medians (>= 10 us; count, median error %): "
                       + ", ".join(f"{c['module_type']} {c['count']} {c['median_err%']:+.1f}"
                                   for c in cs))
    return "\n".join(out)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for the summaries")
    p.add_argument("--models", default=DEFAULT_MODELS,
                   help=f"comma-separated, of: {', '.join(MODELS)}; or all")
    p.add_argument("--device", default=None, help="cuda, cpu, ... (default: cuda if there is one)")
    p.add_argument("--dtype", default=None, help="fp32, bf16 or fp16 (default: the model's)")
    p.add_argument("--size", choices=("tiny", "real"), default=None,
                   help="model sizes (default: real on a GPU, tiny on the CPU)")
    p.add_argument("--step", choices=("forward", "train"), default="forward",
                   help="train: capture a training step and replay each call's backward too")
    p.add_argument("--timer", default="auto")
    p.add_argument("--cold", action="store_true", help="replay with --cold (do_bench's way)")
    p.add_argument("--no-context", action="store_true",
                   help="replay each call on its own (ReplayConfig.context=False)")
    p.add_argument("--context-max-ms", type=float, default=None,
                   help="ReplayConfig.context_max_ms (calls timed in context: under this)")
    p.add_argument("--context-rewrite", choices=CONTEXT_REWRITES, default=None,
                   help="ReplayConfig.context_rewrite (inputs no context call wrote, rewritten "
                        "as x + 0 * y: sum, the default, or x * 1: self; off: neither)")
    p.add_argument("--budget-s", type=float, default=None, help="ReplayConfig.budget_s")
    p.add_argument("--top", type=int, default=8, help="classes printed per model and phase")
    p.add_argument("--keep-runs", action="store_true", help="keep the run directories in OUT/runs")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE[,...]",
                   help="also replay each capture with these ReplayConfig fields over the base "
                        "settings, compared call by call (repeatable), e.g. "
                        "self:context_rewrite=self")
    args = p.parse_args(argv)
    try:
        args.variant = [parse_variant(v) for v in args.variant]
    except ValueError as e:
        p.error(f"--variant: {e}")
    names = [n for n, _ in args.variant]
    if len(set(names)) != len(names):
        p.error(f"--variant: a name given twice ({', '.join(names)})")
    if args.models == "all":
        args.models = ",".join(MODELS)
    unknown = [m for m in args.models.split(",") if m not in MODELS]
    if unknown:
        p.error(f"--models: unknown {', '.join(unknown)} (known: {', '.join(MODELS)})")
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.size is None:
        args.size = "tiny" if args.device == "cpu" else "real"
    return args


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = out / "runs" if args.keep_runs else Path(tempfile.mkdtemp(prefix="fidelity_zoo_"))
    rows, notes = [], []
    for name in args.models.split(","):
        tiny_spec, tiny_opts, real_spec, real_opts, needs = MODELS[name]
        spec, options = (tiny_spec, tiny_opts) if args.size == "tiny" else (real_spec, real_opts)
        if needs and importlib.util.find_spec(needs) is None:
            notes.append(f"{name}: skipped ({needs} is not installed)")
            print(notes[-1], flush=True)
            continue
        base = None
        try:
            for variant, df, wall in profiled(name, spec, options, args, runs / name):
                label = f"{name}@{variant}" if variant else name
                if isinstance(df, str):  # that variant's replay failed
                    notes.append(f"{label}: {df}")
                    print(notes[-1], flush=True)
                    continue
                rows += summarize(label, df, wall, spec, options, args, out, variant)
                if not variant:
                    base = df
                    continue
                for phase in phases(args):
                    p = paired(base, df, phase)
                    if p is not None:
                        print(paired_line(name, variant, p), flush=True)
        except Exception as e:  # noqa: BLE001 - one model failing must not hide the others
            notes.append(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}")
            print(notes[-1], flush=True)
            continue
        finally:
            if not args.keep_runs:
                shutil.rmtree(runs / name, ignore_errors=True)
            _free_memory()  # the next model gets the device's memory
    _write_csv(out / "fidelity.csv", rows, COLUMNS)
    variants = "".join(f"; @{n}: " + ", ".join(f"{k}={v}" for k, v in o.items())
                       for n, o in args.variant)
    print(f"\n== fidelity ({args.device}, {args.dtype or 'model dtype'}, {args.size}, "
          f"{args.step}{', cold' if args.cold else ''}{', no context' if args.no_context else ''}"
          f"{f', context under {args.context_max_ms} ms' if args.context_max_ms else ''}"
          f"{'' if args.context_rewrite is None else f', rewrite {args.context_rewrite}'}"
          f"{variants})")
    print(table(rows))
    for n in notes:
        print(n)
    if not args.keep_runs:
        shutil.rmtree(runs, ignore_errors=True)
    return 0 if rows else 1


def phases(args) -> list[str]:
    return ["fwd", "bwd"] if args.step == "train" else ["fwd"]


def summarize(label, df, wall, spec, options, args, out, variant) -> list[dict]:
    """One replay's rows of the table (a row per phase); its files written and its figures
    printed."""
    keep = [c for c in ROW_COLUMNS if c in df.columns]
    stem = label.replace("@", ".")  # "@" is no character for a file name every tool carries
    df[keep].to_csv(out / f"{stem}_rows.csv.gz", index=False)
    model_rows, classes = [], []
    for phase in phases(args):
        row, cls = fidelity(df, phase)
        model_rows.append({"model": label, **row})
        classes += cls
    summary = {"model": label, "spec": spec, "options": options, "device": args.device,
               "dtype": None if label.split("@")[0] in OWN_DTYPE else args.dtype,
               "step": args.step, "cold": args.cold, "context": not args.no_context,
               "context_max_ms": args.context_max_ms,
               "context_rewrite": {**replay_options(args), **dict(args.variant).get(
                   variant, {})}.get("context_rewrite", ReplayConfig().context_rewrite),
               "variant": dict(args.variant).get(variant, {}),
               "profile_wall_s": wall, "rows": model_rows, "classes": classes,
               "timer_notes": df["timer_notes"].value_counts().head(5).to_dict()}
    (out / f"{stem}.json").write_text(json.dumps(summary, indent=1, default=str))
    _write_csv(out / f"{stem}_classes.csv", classes,
               ("phase", "module_type", "count", "median_err%", "insitu_ms_median", "within5%",
                "timer_notes"))
    causes = "".join(f"\n  {label} {r['phase']} misses (>= 10 us) by cause: {r['causes']}"
                     for r in model_rows if r.get("causes"))
    what = "replayed again" if variant else "profiled"
    print(f"{label}: {what} in {wall:.1f} s\n{table(model_rows)}\n"
          f"{class_lines(label, classes, args.top)}{causes}", flush=True)
    return model_rows


def _free_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _write_csv(path, rows, columns) -> None:
    import csv

    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    sys.exit(main())
