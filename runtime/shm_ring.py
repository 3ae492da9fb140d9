"""A lock-free single-writer, many-reader ring of fixed-size int64 records in shared memory.

The leader writes one record per step; every follower reads every record, in order. Each slot is

    [written, step_id, read_0 .. read_{R-1}, payload ...]      (int64 words)

Writer, for step s into slot s % n_slots: wait until the slot is free (never written, or every
reader's read flag is set), clear `written`, write the payload and the step id, clear the read
flags, and set `written` last. Reader r, for step s: wait until `written` is set and the slot's
step id is s, copy the payload, set its read flag. Aligned int64 stores are atomic and stay in
program order on x86-64 (TSO), so a reader that sees `written` also sees the payload.

Waits spin (sched_yield) and then back off up to 1 ms, and are bounded: past `timeout` they
raise, and every backoff round calls `check()`, which raises if the peer died — so a dead reader
never blocks the writer forever, nor a dead writer its readers (vLLM's MessageQueue lacks both).

The backing file lives in /dev/shm. A leader that spawns its readers unlinks it at once and hands
them its descriptor (`from_fd`), so nothing is left behind however any process ends; under
torchrun the readers find it by name, and the creator unlinks it once every reader has attached.
"""

import mmap
import os
import time
import uuid
from pathlib import Path

import numpy as np

from .errors import DeepinferError

SHM_DIR = Path("/dev/shm")


class RingTimeout(DeepinferError, TimeoutError):
    """A peer that neither wrote nor read within the timeout; the message says which step."""


class ShmRing:
    HEADER = 2  # written, step_id

    def __init__(self, path: Path, fd: int, n_readers: int, payload_words: int, n_slots: int, create: bool):
        """Maps `fd` (the ring's file, which `path` names or named); the caller keeps the fd."""
        self.path, self.n_readers, self.payload_words, self.n_slots = Path(path), n_readers, payload_words, n_slots
        self.fd = fd
        self.slot_words = self.HEADER + n_readers + payload_words
        size = self.slot_words * n_slots * 8
        if create:
            os.ftruncate(fd, size)
        elif os.fstat(fd).st_size != size:
            raise DeepinferError(f"step ring {path}: {os.fstat(fd).st_size} bytes, expected {size}; the ranks disagree on "
                                 "the bundle (every rank must run the same one).")
        self._mmap = mmap.mmap(fd, size)
        self.words = np.frombuffer(self._mmap, dtype=np.int64).reshape(n_slots, self.slot_words)

    @classmethod
    def create(cls, n_readers: int, payload_words: int, n_slots: int = 8, name: str | None = None) -> "ShmRing":
        path = SHM_DIR / (name or f"deepinfer-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        return cls(path, fd, n_readers, payload_words, n_slots, create=True)

    @classmethod
    def attach(cls, path: Path, n_readers: int, payload_words: int, n_slots: int = 8) -> "ShmRing":
        return cls(path, os.open(path, os.O_RDWR), n_readers, payload_words, n_slots, create=False)

    @classmethod
    def from_fd(cls, fd: int, n_readers: int, payload_words: int, n_slots: int = 8) -> "ShmRing":
        """A ring whose (already unlinked) file a parent handed down as an open descriptor."""
        return cls(Path(f"/proc/self/fd/{fd}"), fd, n_readers, payload_words, n_slots, create=False)

    def unlink(self):
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self):
        self.words = None
        self._mmap.close()
        os.close(self.fd)

    def write(self, step_id: int, payload: np.ndarray, check=None, timeout: float = 60.0):
        slot = self.words[step_id % self.n_slots]
        reads = slot[self.HEADER : self.HEADER + self.n_readers]
        wait_until(lambda: slot[0] == 0 or reads.all(), check, timeout, f"readers to free ring slot for step {step_id}")
        slot[0] = 0
        slot[self.HEADER + self.n_readers :][: len(payload)] = payload
        slot[1] = step_id
        reads[:] = 0
        slot[0] = 1

    def read(self, reader: int, step_id: int, check=None, timeout: float = 60.0) -> np.ndarray:
        slot = self.words[step_id % self.n_slots]
        wait_until(lambda: slot[0] == 1 and slot[1] == step_id, check, timeout, f"step {step_id} from the writer")
        payload = slot[self.HEADER + self.n_readers :].copy()
        slot[self.HEADER + reader] = 1
        return payload


def wait_until(ready, check, timeout: float, what: str):
    if ready():
        return
    for _ in range(2000):  # spin: a step record usually arrives within microseconds
        os.sched_yield()
        if ready():
            return
    deadline = time.monotonic() + timeout
    delay = 1e-5
    while not ready():
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise RingTimeout(f"waited {timeout:.0f} s for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 1e-3)
