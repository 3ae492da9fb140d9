import os
import tempfile
import time

import pytest


def leftovers() -> set[str]:
    """deepinfer files in /dev/shm and the temp dir (only ours: another test process makes others)."""
    return {p for p in os.listdir("/dev/shm") if p.startswith("deepinfer")} | \
        {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("deepinfer-ranks")}


def left_since(before: set[str]) -> set[str]:
    """The deepinfer files not in `before` that stay. (Another test process's rings come and go
    within its start-up: a new one is given 10 s to go; a leaked one stays.)"""
    deadline = time.monotonic() + 10
    while (left := leftovers() - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.fixture
def shm_unchanged():
    """Fails the test if it leaves a deepinfer file in /dev/shm or the temp dir."""
    before = leftovers()
    yield
    assert not left_since(before)
