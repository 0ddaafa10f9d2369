import os
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "2")
# tests see only the plugins they register (tests/test_plugins.py unsets it for its subprocesses)
os.environ["CBTRACE_DISABLE_PLUGIN_AUTOLOAD"] = "1"
# runs are signed with a key of the suite's own, never the user's ~/.config/cbtrace/key
os.environ.setdefault("CBTRACE_CONFIG_DIR", tempfile.mkdtemp(prefix="cbtrace-config-"))

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
sys.path.insert(0, str(REPO / "benchmarks"))  # doc tools the tests drive (screenshot.py)


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
