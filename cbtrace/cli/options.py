"""Flags shared by several commands; each maps to exactly one library argument."""
import sys

import click

from cbtrace import registry
from cbtrace.replay.config import MODES, ReplayConfig
from cbtrace.replay.timer import choice


def parse_kv(items) -> dict:
    """("batch_size=8", "preset=tiny") -> {"batch_size": 8, "preset": "tiny"}."""
    out = {}
    for item in items:
        if "=" not in item:
            raise click.BadParameter(f"'{item}': expected KEY=VALUE", param_hint="--option")
        k, v = item.split("=", 1)
        for conv in (int, float):
            try:
                v = conv(v)
                break
            except ValueError:
                pass
        if v in ("true", "false"):
            v = v == "true"
        out[k] = v
    return out


def model_options(f):
    """--model/--device/--dtype/--step/--option/--include/--exclude/--max-depth/--with-stack/
    --seed."""
    for deco in reversed([
        click.option("--model", "spec", required=True,
                     help="nanogpt[:tiny], dlrm[:tiny|large], dcn[:tiny|large], hstu[:tiny], "
                          "torchrec[:tiny], pkg.module:fn or file.py:fn"),
        click.option("--device", default="auto", show_default=True, help="cpu, cuda, cuda:N or auto"),
        click.option("--dtype", default=None, help="cast the model and float inputs: fp32, bf16, fp16"),
        click.option("--step", type=click.Choice(["forward", "train"]), default="forward",
                     show_default=True, help="forward only, or forward + backward"),
        click.option("--option", "-o", "opts", multiple=True, metavar="KEY=VALUE",
                     help="provider option, e.g. -o batch_size=8 (repeatable)"),
        click.option("--include", multiple=True, metavar="GLOB", help="capture only matching fqns"),
        click.option("--exclude", multiple=True, metavar="GLOB", help="skip matching fqns"),
        click.option("--max-depth", type=click.IntRange(min=0), default=None,
                     help="deepest module level captured (0: the root only)"),
        click.option("--synthesize-above", "synthesize_above_bytes", type=click.IntRange(min=0),
                     default=None, metavar="BYTES", help="store larger inputs as metadata only"),
        click.option("--with-stack", is_flag=True,
                     help="profile the captured step with Python frames (slower; attribution "
                          "does not need them)"),
        click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True),
    ]):
        f = deco(f)
    return f


class TimerChoice(click.Choice):
    """``--timer``: ``auto`` or any timer in the backend registry (plugins included), listed
    when first needed so that ``cbtrace --help`` loads no plugin."""

    def __init__(self):
        super().__init__([], case_sensitive=True)

    @property
    def choices(self):
        return choice.names(registry.backends())

    @choices.setter
    def choices(self, value):  # click.Choice.__init__ assigns it
        pass


def timer_option(f):
    # a fixed metavar: listing the choices in --help would load the timer plugins (torch)
    return click.option("--timer", type=TimerChoice(), default="auto", show_default=True,
                        metavar="NAME",
                        help="measurement backend: auto or a registered timer (cbtrace models "
                             "lists them; fallbacks are recorded per row)")(f)


def replay_options(f):
    """The replay flags that ``replay`` and ``profile`` share: --timer/--cold/--context/
    --timeout-s/--reuse-timing/--eager-only/--strict (each one ReplayConfig field, --strict
    aside)."""
    for deco in reversed([
        timer_option,
        click.option("--cold", is_flag=True,
                     help="time each call alone after an L2 flush, for do_bench's 25 ms warm-up "
                          "and 100 ms of runs (triton do_bench's convention, launch-free) "
                          "instead of K calls back to back in one CUDA graph (in-situ-like)"),
        click.option("--context/--no-context", default=None,
                     help="run each call's step-order predecessors untimed before every timed "
                          "run, so the cache holds what it held in the step (default: on a GPU, "
                          "off on a CPU)"),
        click.option("--timeout-s", type=click.FloatRange(min=0), default=ReplayConfig.timeout_s,
                     show_default=True, help="a call running longer ends status=timeout and "
                                             "replay goes on (0: no limit)"),
        click.option("--reuse-timing", is_flag=True,
                     help="time once the calls that are the same work and cannot depend on "
                          "values (e.g. 12 identical blocks): the second of each group checks "
                          "the first"),
        click.option("--eager-only", is_flag=True,
                     help="time every call eagerly, also those the step ran under torch.compile "
                          "(by default timed compiled, their eager time in eager_ms)"),
        click.option("--strict", is_flag=True, help="exit 1 if any call is not ok (for CI)"),
    ]):
        f = deco(f)
    return f


def timer_warning(df, requested: str) -> str | None:
    """One line when --timer named a timer that some calls could not use (they fell back, and
    each row's timer_fallback says why), else None."""
    if requested == "auto" or "timer" not in df:
        return None
    timed = df[df["timer"].notna()]
    other = timed[timed["timer"] != requested]
    if not len(other):
        return None
    why = other["timer_fallback"].dropna() if "timer_fallback" in other else []
    return (f"Warning: --timer {requested}: {len(other)} of {len(timed)} calls timed with "
            f"{', '.join(sorted(set(other['timer'])))} instead"
            + (f" ({why.iloc[0]})" if len(why) else ""))


def strict_exit(df, strict: bool) -> None:
    """Exit 1 when no call ended ok (figures of nothing are no result), and with --strict when
    any call ended other than ok (the counts are already printed)."""
    if len(df) and not (df["status"] == "ok").any():
        raise click.ClickException(f"no call replayed successfully ({len(df)} calls, none ok: "
                                   "see the reasons above)")
    if strict and (df["status"] != "ok").any():
        sys.exit(1)


def parse_workers(text: str) -> int | None:
    """--compile-workers: "auto" -> None (ReplayConfig's own choice), else a count >= 0."""
    if text == "auto":
        return None
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise click.BadParameter(f"expected a count >= 0 or auto, got {text!r}",
                                 param_hint="--compile-workers")
    return n


def parse_modes(text: str) -> tuple:
    """"eager,compile" -> ("eager", "compile"), checked against the replay modes."""
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in modes if m != "eager" and m not in MODES]
    if bad:
        raise click.BadParameter(f"unknown mode {bad[0]!r} (modes: eager, {', '.join(MODES)})",
                                 param_hint="--modes")
    return modes
