"""Run directories built by hand for tests: a modules table and a valid manifest."""
from __future__ import annotations

from pathlib import Path

from cbtrace.rundir import writer
from cbtrace.schema import manifest as ms
from cbtrace.schema.modules import ModuleRecord, frame_to_records


def record(fqn: str, call_id: int, parent_call_id: int = -1, **fields) -> ModuleRecord:
    """A ModuleRecord with plain capture fields (override any with ``fields``)."""
    base = dict(fqn=fqn, call_index=0, call_id=call_id, parent_call_id=parent_call_id,
                parent_fqn=None, depth=0 if parent_call_id == -1 else 1, module_type="Module",
                module_class="torch.nn.Module", param_bytes=0, buffer_bytes=0, input_bytes=0,
                input_shapes="[]", input_meta="[]", output_meta="[]", training=False,
                grad_enabled=False, autocast_dtype=None, inputs_ref="{}")
    return ModuleRecord(**{**base, **fields})


def manifest(**fields) -> ms.Manifest:
    """A valid Manifest of a CPU run of a test model; ``fields`` override its defaults."""
    base = dict(created="2026-01-01T00:00:00", device="cpu", device_name="cpu (test data)",
                environment=ms.Environment(cbtrace_version="test", torch_version="test",
                                           python_version="test", hostname="test"),
                model=ms.ModelSource(model_class="tests.Model"))
    return ms.Manifest(**{**base, **fields})


def write_run(run, records, **manifest_fields) -> Path:
    """``run``/modules.parquet from ModuleRecords (or a DataFrame of their columns) and a valid
    manifest.json (``manifest_fields`` override the defaults)."""
    run = Path(run)
    run.mkdir(parents=True, exist_ok=True)
    if hasattr(records, "to_dict"):
        records = frame_to_records(records)
    writer.write_records(run, records)
    writer.write_manifest(run, manifest(**manifest_fields))
    return run
