"""Where the tests find the repository and the shared traces beside it."""
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"
