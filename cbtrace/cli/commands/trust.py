"""cbtrace trust: sign a run from elsewhere, once read, so that replay rebuilds its model."""
from pathlib import Path

import click

from cbtrace.model.spec import is_registered
from cbtrace.rundir.layout import MANIFEST
from cbtrace.rundir.read import read_manifest
from cbtrace.rundir.signature import key_path, trust


@click.command("trust")
@click.argument("run", type=click.Path(exists=True, file_okay=False))
@click.option("--yes", "-y", is_flag=True, help="sign without asking (you have read the code)")
def command(run, yes):
    """Show the code RUN's model spec runs, then sign RUN with your key so that a plain
    `cbtrace replay RUN` rebuilds its model from that spec.

    Runs you capture are signed already; editing a run's manifest drops its signature.
    Example: cbtrace trust runs/from-a-teammate
    """
    shown = (Path(run) / MANIFEST).read_bytes() if (Path(run) / MANIFEST).is_file() else None
    manifest = read_manifest(run)
    for line in describe(manifest):
        click.echo(line)
    if not yes and not click.confirm(f"Sign {run} so that replay runs this code?",
                                     default=False):
        raise click.ClickException(f"{run}: not signed")
    trust(run, shown)
    click.echo(f"signed {run} (key {key_path()})")


def describe(manifest) -> list[str]:
    """What replaying the run would run, one line each."""
    m = manifest.model
    out = [f"captured {manifest.created} on {manifest.environment.hostname} "
           f"(cbtrace {manifest.environment.cbtrace_version})"]
    if not m.spec:
        return out + ["model: captured from a live model (no spec): replay needs model= or "
                      "--model SPEC; signing runs nothing"]
    target, _, fn = m.spec.rpartition(":")
    if is_registered(m.spec):
        out.append(f"model: {m.spec}, a registered provider (cbtrace models): no code of the "
                   "run's is run")
    elif target.endswith(".py"):
        out.append(f"model: {m.spec}: replay executes the file {target} and calls {fn}()")
    else:
        out.append(f"model: {m.spec}: replay imports the module {target} (from the working "
                   f"directory or sys.path) and calls {fn}()")
    out.append(f"  with options {dict(m.options)!r}, seed {m.seed}")
    return out
