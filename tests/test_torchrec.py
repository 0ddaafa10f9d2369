"""torchrec's own DeepFM on KeyedJaggedTensor: capture, load back, replay (needs torchrec 1.8)."""
import pytest
from helpers.settings import FAST_REPLAY

pytest.importorskip("torchrec.sparse.jagged_tensor")

import cbtrace  # noqa: E402
from cbtrace.rundir.read import read_modules  # noqa: E402
from cbtrace.capture.from_spec import capture_model  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return capture_model("torchrec:tiny", tmp_path_factory.mktemp("tr") / "run", device="cpu",
                         warmup=0).out


def test_kjt_inputs_round_trip(run):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    df = read_modules(run)
    assert "sparse_arch.embedding_bag_collection" in set(df["fqn"])
    (dense, kjt), _ = cbtrace.load_inputs(run, "")
    assert isinstance(kjt, KeyedJaggedTensor) and dense.shape == (8, 13)
    assert kjt.keys() == ["f_0", "f_1", "f_2", "f_3"]
    assert int(kjt.lengths().min()) >= 1 and int(kjt.lengths().max()) <= 3


def test_torchrec_replay(run):
    df = cbtrace.replay(run, **FAST_REPLAY)
    bad = df[df["status"] != "ok"][["fqn", "status_reason"]]
    assert bad.empty, bad
    ebc = df[df["fqn"] == "sparse_arch.embedding_bag_collection"].iloc[0]
    assert ebc["isolated_ms"] > 0 and ebc["bytes"] > 0
