"""store.ref_format owns the inputs_ref format: capture builds it, the loader, the read-ahead
and replay's reuse key read it, and nothing else in the package parses it."""
import ast
import json
from pathlib import Path

import pytest

from cbtrace.errors import SerializationError
from cbtrace.store import ref_format

REPO = Path(__file__).resolve().parent.parent
TENSOR = {"t": "tensor", "dtype": "float32", "shape": [2, 3], "stride": [3, 1], "off": 0,
          "dev": "cpu", "rg": 0, "c": 0}


def test_build_and_parse():
    text = ref_format.build([TENSOR, {"t": "int", "v": 3}], {"mask": dict(TENSOR, c=1)},
                            {0: [0, 0, 1, 0, 24, "d"], 1: [0, 1, 1, 0, 6, "s"]})
    assert " " not in text  # compact
    doc = ref_format.parse(text, "RUN")
    assert doc["v"] == ref_format.FORMAT_VERSION and set(doc["chunks"]) == {"0", "1"}
    assert [ref_format.is_data_chunk(e) for e in doc["chunks"].values()] == [True, False]
    assert [n["c"] for n in ref_format.tensor_nodes(doc)] == [0, 1]
    bare = ref_format.without_data([doc["args"], doc["kwargs"]])
    assert "c" not in bare[0][0] and bare[0][0]["shape"] == [2, 3] and bare[0][1]["v"] == 3


@pytest.mark.parametrize("text, says", [("not json", "is not a cbtrace inputs reference"),
                                        (None, "is not a cbtrace inputs reference"),
                                        ('{"v": 9, "chunks": {}}', "format v9 is not supported")])
def test_parse_errors_are_one_line_naming_the_run(text, says):
    with pytest.raises(SerializationError) as e:
        ref_format.parse(text, "runs/r1")
    assert str(e.value).startswith("runs/r1: inputs_ref") and says in str(e.value)
    assert "\n" not in str(e.value)


def test_merge_keeps_order_and_missing_gradients():
    one = ref_format.build([TENSOR], {}, {0: [0, 0, 1, 0, 24, "d"]})
    two = ref_format.build([dict(TENSOR, c=5)], {}, {5: [1, 0, 1, 0, 24, "d"]})
    doc = ref_format.parse(ref_format.merge([one, None, two]))
    assert [n["t"] for n in doc["args"]] == ["tensor", "none", "tensor"]
    assert sorted(doc["chunks"]) == ["0", "5"] and doc["kwargs"] == {}


def test_capture_builds_what_the_loader_reads(tmp_path):
    import torch

    import cbtrace
    from cbtrace.rundir.read import read_modules
    from cbtrace.store.load import host_bytes, load_call_inputs

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
    x = torch.randn(2, 4)
    with cbtrace.capture(model, tmp_path / "run"):
        model(x)
    df = read_modules(tmp_path / "run")
    row = df[df.fqn == "0"].iloc[0]
    doc = ref_format.parse(row.inputs_ref)
    assert [n["shape"] for n in ref_format.tensor_nodes(doc)] == [[2, 4]]
    assert json.loads(row.input_shapes) == [[2, 4]]
    assert host_bytes(tmp_path / "run", row.inputs_ref) >= 2 * 4 * 4
    args, kwargs = load_call_inputs(tmp_path / "run", row.inputs_ref)
    assert torch.equal(args[0], x) and kwargs == {}


def test_no_other_module_parses_an_inputs_ref():
    """json.loads of an ``*_ref`` value only in store/ref_format.py."""
    found = []
    for path in [*REPO.glob("cbtrace/**/*.py"), *REPO.glob("replay/**/*.py"),
                 *REPO.glob("plugins/**/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "loads" and node.args
                    and "_ref" in ast.unparse(node.args[0])):
                found.append(str(path.relative_to(REPO)))
    assert found == ["cbtrace/store/ref_format.py"], found
