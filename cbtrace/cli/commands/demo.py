import importlib
from pathlib import Path

import click


@click.command("demo")
@click.option("--out", default="runs/demo", show_default=True, type=click.Path(file_okay=False),
              help="new directory for the demo runs")
@click.option("--model", "models", multiple=True, default=("nanogpt:tiny", "dlrm:tiny"),
              show_default=True, help="provider specs to run")
def command(out, models):
    """Run the embedded CPU demo: capture, replay, attribute, annotate and report.

    For each demo model: RUN/modules.parquet (per-module figures), the Kineto trace and its
    annotated_ copy, and RUN/icicle.html.
    """
    # imported on use, so that `cbtrace demo --help` imports no torch/pandas/pyarrow
    from cbtrace.attribution.join import error_table
    from cbtrace.plugins.reporters.summary import status_text, summary_table
    from cbtrace.workflows.profile_model import profile

    for spec in models:
        run = Path(out) / spec.replace(":", "-").replace("/", "_")
        click.echo(f"== {spec} -> {run}")
        df = profile(spec, run, device="cpu", replay_options=dict(timer="cpu", budget_s=0.1))
        click.echo(summary_table(df, top=10))
        click.echo(status_text(df))
        click.echo(error_table(df).to_string(float_format=lambda x: f"{x:.1f}"))
        for name, target in (("annotate", "cbtrace.annotate.write:annotate"),
                             ("report", "cbtrace.workflows.report:write_report")):
            _optional_step(name, target, run)


def _optional_step(name, target, run):
    mod, fn = target.split(":")
    try:
        func = getattr(importlib.import_module(mod), fn)
    except (ImportError, AttributeError):
        click.echo(f"   ({name}: not installed)")
        return
    click.echo(f"   {name}: {func(run)}")
