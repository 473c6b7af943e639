"""Shared test fixtures. The `../shared` folder (reference checkpoint, benchmark data) sits beside the
project in development and CI; a user who cloned the project alone does not have it, so tests that need
it skip with a reason instead of failing."""
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SHARED = Path(os.environ.get("MASKGRPO_SHARED", ROOT.parent / "shared"))


def shared_path(*parts: str) -> Path:
    """Path inside ../shared, or skip the calling test when it is absent."""
    p = SHARED.joinpath(*parts)
    if not p.exists():
        pytest.skip(f"{p} not found (the ../shared folder ships with the dev/CI checkout only)")
    return p
