import atexit
import os
import shutil
import tempfile

import pytest
from helpers.paths import SHARED
from helpers.settings import FAST_REPLAY

os.environ.setdefault("OMP_NUM_THREADS", "2")
# tests see only the plugins they register (tests/test_plugins.py unsets it for its subprocesses)
os.environ["CBTRACE_DISABLE_PLUGIN_AUTOLOAD"] = "1"
# runs are signed with a key of the suite's own, never the user's ~/.config/cbtrace/key
if "CBTRACE_CONFIG_DIR" not in os.environ:
    _config = tempfile.mkdtemp(prefix="cbtrace-config-")
    os.environ["CBTRACE_CONFIG_DIR"] = _config
    atexit.register(shutil.rmtree, _config, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def shared_traces():
    d = SHARED / "traces"
    if not d.is_dir():
        pytest.skip(f"shared traces not found at {d}")
    return d


@pytest.fixture
def fast_replay() -> dict:
    """A copy of FAST_REPLAY: ``cbtrace.replay(run, **fast_replay)``."""
    return dict(FAST_REPLAY)
