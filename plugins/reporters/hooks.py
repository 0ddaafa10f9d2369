"""Built-in reporters, registered through the same hook as third-party ones.

A reporter has ``report(records, manifest, out_dir) -> list[Path]`` (records: the run's
ModuleRecords; manifest: its ``cbtrace.schema.manifest.Manifest``) and ``close()``.
"""
from cbtrace.hookspecs import hookimpl
from cbtrace.plugins.reporters.icicle import IcicleReporter
from cbtrace.plugins.reporters.summary import SummaryReporter
from cbtrace.plugins.reporters.svg import SvgReporter


@hookimpl
def register_reporters(register):
    register("icicle", IcicleReporter())
    register("svg", SvgReporter())
    register("summary", SummaryReporter())
