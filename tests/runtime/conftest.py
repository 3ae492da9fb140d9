import os

import pytest


@pytest.fixture
def shm_unchanged():
    """Fails the test if it leaves anything new in /dev/shm."""
    before = set(os.listdir("/dev/shm"))
    yield
    assert set(os.listdir("/dev/shm")) <= before
