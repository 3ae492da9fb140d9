import os
import time

import pytest


@pytest.fixture
def shm_unchanged():
    """Fails the test if it leaves a deepinfer segment in /dev/shm. (Another test process's rings
    come and go within its start-up: a new one is given 10 s to go; a leaked one stays.)"""
    before = set(os.listdir("/dev/shm"))
    yield
    deadline = time.monotonic() + 10
    while (left := {n for n in os.listdir("/dev/shm") if n.startswith("deepinfer-")} - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left
