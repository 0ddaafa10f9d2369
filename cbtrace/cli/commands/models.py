import click

from cbtrace import registry


@click.command("models")
def command():
    """List registered model providers, serializers, measurement backends and reporters."""
    for title, items in [("models", registry.models()), ("backends", registry.backends()),
                         ("reporters", registry.reporters())]:
        click.echo(f"{title}: {', '.join(sorted(items)) or '-'}")
    names = [getattr(s, "name", type(s).__name__) for s in registry.serializers()]
    click.echo(f"serializers: {', '.join(names) or '-'}")
