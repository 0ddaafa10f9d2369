"""Thin CLI: each command parses flags, calls one library function, prints the result.

Commands live in ``cbtrace/commands/<name>.py`` and are imported only when invoked,
so ``cbtrace --help`` imports neither torch nor pyarrow.
"""
import importlib
import importlib.util
import sys

import click

# name -> (module, short help). Each module defines a click command named ``command``.
COMMANDS = {
    "demo": ("cbtrace.cli.commands.demo", "Capture and replay the embedded CPU demo model."),
    "capture": ("cbtrace.cli.commands.capture", "Capture one step of a model into a run directory."),
    "replay": ("cbtrace.cli.commands.replay", "Replay every captured module standalone and measure it."),
    "profile": ("cbtrace.cli.commands.profile", "Capture, replay and attribute: the isolation error table."),
    "attribute": ("cbtrace.cli.commands.attribute", "Attribute time in Kineto traces to modules."),
    "annotate": ("cbtrace.cli.commands.annotate", "Write annotated_<trace> with per-module figures."),
    "diff": ("cbtrace.cli.commands.diff", "Compare two runs module by module; flag regressions."),
    "report": ("cbtrace.cli.commands.report", "Write the interactive icicle (icicle.html) of a run."),
    "calibrate": ("cbtrace.cli.commands.calibrate", "Measure this device's achievable FLOP/s and bandwidth."),
    "models": ("cbtrace.cli.commands.models", "List model providers and other registered plugins."),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(c for c, (m, _) in COMMANDS.items() if importlib.util.find_spec(m))

    def get_command(self, ctx, name):
        if name not in COMMANDS:
            return None
        module = importlib.import_module(COMMANDS[name][0])
        return module.command

    def format_commands(self, ctx, formatter):
        rows = [(name, COMMANDS[name][1]) for name in self.list_commands(ctx)]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


@click.group(cls=LazyGroup)
@click.version_option(package_name="cbtrace")
def cli():
    """cbtrace: which nn.Module is slow, and why."""


def main(argv=None):
    from cbtrace.errors import CbtraceError

    try:
        cli.main(args=argv, prog_name="cbtrace", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(1)
    except click.UsageError as e:  # one line, like every other error: no usage block
        where = f" (see {e.ctx.command_path} --help)" if e.ctx is not None else ""
        click.echo(f"Error: {e.format_message()}{where}", err=True)
        sys.exit(e.exit_code)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except CbtraceError as e:
        click.echo(f"Error: {e}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("Interrupted.", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
