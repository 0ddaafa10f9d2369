"""The run-directory schema: a typed manifest, columns declared once, one writer."""
import json
import subprocess
import sys

import pytest
from helpers.runs import manifest, record, write_run

from cbtrace.errors import RunDirError, SchemaError
from cbtrace.rundir import writer
from cbtrace.rundir.read import read_manifest, read_modules
from cbtrace.schema import manifest as ms
from cbtrace.schema.modules import (COLUMNS, STAGES, ModuleRecord, arrow_schema, required_fields,
                                    stage_columns)

DATA = __import__("pathlib").Path(__file__).parent / "data"


def test_every_column_is_declared_once_with_a_stage_and_a_doc():
    assert set(COLUMNS) == set(ModuleRecord.__dataclass_fields__)
    assert [n for s in STAGES for n in stage_columns(s)] == sorted(COLUMNS, key=list(COLUMNS).index)
    for c in COLUMNS.values():
        assert c.stage in STAGES and c.doc, c.name
        assert c.type in (str, int, float, bool), c.name
    assert arrow_schema().names == list(COLUMNS)
    assert set(required_fields()) <= set(stage_columns("capture"))
    assert COLUMNS["isolated_ms"].unit == "ms" and COLUMNS["fqn"].nullable is False
    assert COLUMNS["insitu_ms"].stage == "insitu" and COLUMNS["insitu_host_ms"].stage == "host_insitu"


def test_a_stage_writing_an_undeclared_column_fails(tmp_path):
    run = write_run(tmp_path / "r", [record("", 0), record("a", 1, 0)])
    with pytest.raises(SchemaError, match="stage 'replay' wrote undeclared column.*made_up"):
        writer.write_stage(run, "replay", {0: {"isolated_ms": 1.0, "made_up": 2}})
    with pytest.raises(SchemaError, match="insitu_ms"):  # declared, but for another stage
        writer.write_stage(run, "replay", {0: {"insitu_ms": 1.0}})
    assert read_modules(run)["isolated_ms"].isna().all()  # nothing was written


def test_write_stage_merges_and_clears_what_derives_from_it(tmp_path):
    run = write_run(tmp_path / "r", [record("", 0), record("a", 1, 0)])
    writer.write_stage(run, "replay", {0: {"isolated_ms": 2.0, "status": "ok"},
                                       1: {"isolated_ms": 1.0, "status": "ok"}})
    writer.write_stage(run, "insitu", {0: {"insitu_ms": 1.0, "error_pct": 100.0}})
    df = read_modules(run).set_index("call_id")
    assert df.loc[0, "error_pct"] == 100.0 and df.loc[1, "isolated_ms"] == 1.0
    before = read_manifest(run).files["modules.parquet"]
    writer.write_stage(run, "replay", {0: {"isolated_ms": 3.0}})  # a new replay
    df = read_modules(run).set_index("call_id")
    assert df.loc[0, "isolated_ms"] == 3.0 and df["error_pct"].isna().all()  # stale error gone
    assert df.loc[1, "isolated_ms"] != df.loc[1, "isolated_ms"]  # not given: back to default
    assert read_manifest(run).files["modules.parquet"] != before  # checksum refreshed once


def test_manifest_round_trips_and_keeps_provider_options_apart(tmp_path):
    m = manifest(model=ms.ModelSource(model_class="x.Y", spec="nanogpt:tiny",
                                      options={"device": "a provider's own", "step": 3}, seed=7),
                 step=ms.StepSettings(device="cpu", dtype="bf16", step="train", warmup=2))
    back = ms.decode(ms.encode(m), "test")
    assert back == m and back.model.options == {"device": "a provider's own", "step": 3}
    assert back.step.device == "cpu" and back.title == "nanogpt:tiny"


@pytest.mark.parametrize("field, value, where", [
    ("num_calls", "many", "$.num_calls"),
    ("training_flags", "yes", "$.training_flags"),
    ("input_files", None, "$.input_files"),
    ("model", {"model_class": "x", "options": "n_layer=6"}, "$.model.options"),
    ("replay", {"device": "cpu"}, "$.replay"),
])
def test_wrong_types_are_one_line_naming_the_field(tmp_path, field, value, where):
    run = write_run(tmp_path / "r", [record("", 0)])
    raw = json.loads((run / "manifest.json").read_text())
    raw[field] = value
    (run / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(RunDirError) as e:
        read_manifest(run)
    msg = str(e.value)
    assert "\n" not in msg and str(run / "manifest.json") in msg and where in msg
    out = subprocess.run([sys.executable, "-m", "cbtrace", "replay", str(run)],
                         capture_output=True, text=True)
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 1 and len(lines) == 1 and where in lines[0], out.stderr


def test_unknown_fields_and_newer_schemas_are_refused(tmp_path):
    run = write_run(tmp_path / "r", [record("", 0)])
    raw = json.loads((run / "manifest.json").read_text())
    (run / "manifest.json").write_text(json.dumps({**raw, "surprise": 1}))
    with pytest.raises(RunDirError, match="unknown field `surprise`"):
        read_manifest(run)
    (run / "manifest.json").write_text(json.dumps({**raw, "schema_version": 99}))
    with pytest.raises(RunDirError, match="newer than this cbtrace reads"):
        read_manifest(run)


def test_schema_1_manifests_are_read(tmp_path):
    m = read_manifest(DATA / "h200_nanogpt_run")  # written by cbtrace before schema 2
    assert m.model.spec == "nanogpt" and m.model.options == {"batch_size": 8}
    assert m.step.device == "cuda" and m.step.dtype == "bf16" and m.step.step == "forward"
    assert m.environment.torch_version.startswith("2.11") and m.capture.trace is True
    assert m.replay.timer_requested == "auto" and m.replay.device_name == "NVIDIA H200"
    assert m.files_stat and all(isinstance(v, tuple) for v in m.files_stat.values())


def test_architecture_doc_names_every_column_and_manifest_field():
    text = (DATA.parent.parent / "docs" / "ARCHITECTURE.md").read_text()
    for stage in STAGES:
        row = next(ln for ln in text.splitlines() if ln.startswith(f"| `{stage}` "))
        assert [c.strip() for c in row.split("|")[2].split(",")] == list(stage_columns(stage))
    for field in ms.Manifest.__struct_fields__:
        assert f"`{field}`" in text, field
