import click

from cbtrace.plugins.reporters.opportunities import opportunity_table
from cbtrace.plugins.reporters.summary import summary_table
from cbtrace.rundir.read import read_modules
from cbtrace.workflows.report import report_run


@click.command("report")
@click.argument("run", type=click.Path(exists=True, file_okay=False))
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="directory for the reports (default: RUN)")
@click.option("--svg", is_flag=True, help="also write icicle.svg (static, for docs and papers)")
@click.option("--reporter", "-r", "extra", multiple=True, metavar="NAME",
              help="also run this registered reporter (repeatable; see `cbtrace models`)")
@click.option("--top", type=click.IntRange(min=1), default=15, show_default=True,
              help="rows in the summary")
@click.option("--opportunities", is_flag=True,
              help="also print the modules ranked by what compile or a CUDA graph saves a step "
                   "(a replay with --modes compile,cudagraph)")
def command(run, out_dir, svg, extra, top, opportunities):
    """Write RUN/icicle.html and summary.txt (icicle.svg with --svg); print the top modules.

    icicle.html is one self-contained file: open it in any browser, offline.
    Example: cbtrace report runs/gpt --svg; cbtrace report runs/gpt --opportunities
    """
    names = ["icicle", "summary"] + (["svg"] if svg else [])
    names += [n for n in extra if n not in names]
    for path in report_run(run, out_dir=out_dir, names=names):
        click.echo(f"wrote {path}")
    df = read_modules(run)
    click.echo(summary_table(df, top=top))
    if opportunities:
        click.echo("")
        click.echo(opportunity_table(df, top=top))
