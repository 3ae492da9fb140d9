"""All-reduce and all-gather through shared memory, for a group whose ranks share a host.

gloo moves even a 2 KiB all-reduce through TCP sockets and its own I/O threads: 0.5 ms a call
between two idle processes on a 2-core host (p90 4 ms), more than a small model's decode step
spends in a layer; a shared segment does it in ~5 us. vLLM's and SGLang's CPU backends do the
same for the same reason. A group's segment is

    [rank 0's line: sequence number, pid] ... [rank n-1's line]      (a 64-byte line each)
    [buffer 0: rank 0's bytes .. rank n-1's bytes] [buffer 1: the same]

Collective s: a rank copies its bytes into buffer s % 2, then stores s as its sequence number;
once every rank's number is >= s, it reads every rank's bytes (summing them in rank order, so
every rank gets the same bits, or concatenating them). Double buffering is safe: a rank reaches
s only after every rank reached s - 1, which each did after reading s - 2's buffer. Payloads
larger than a slot go through in slot-sized pieces, one collective number each. Aligned int64
stores stay in program order on x86-64 (TSO), as the step ring relies on too; elsewhere the
groups stay on gloo.

Waits spin, then back off (`shm_ring.wait_until`), bounded by the collective timeout, and look
at the peers that have not arrived on every backoff round: a peer that died fails the collective
at once, as a closed gloo socket would.
"""

import mmap
import os
import platform
from pathlib import Path

import numpy as np
import torch

from .shm_ring import SHM_DIR, RingTimeout, wait_until

LINE = 64  # bytes of a rank's header line (one cache line: ranks never write the same one)
SLOT_BYTES = 1 << 20  # a rank's share of one buffer; larger payloads travel in pieces
WORKS_HERE = platform.machine() in ("x86_64", "AMD64")


class PeerLost(RuntimeError):
    """A peer that died or did not arrive within the timeout (the message says which)."""


class HostGroup:
    """One rank's end of a group's segment; `index` is its position in `ranks`, `pids` the
    processes behind them (for the liveness check)."""

    def __init__(self, fd: int, ranks: list[int], index: int, pids: list[int], timeout: float):
        self.ranks, self.index, self.pids, self.timeout = ranks, index, pids, timeout
        n = len(ranks)
        self._mmap = mmap.mmap(fd, segment_bytes(n))
        lines = np.frombuffer(self._mmap, dtype=np.int64, count=n * LINE // 8).reshape(n, LINE // 8)
        self.sequence = lines[:, 0]  # [n] the last collective each rank published
        self.buffers = np.frombuffer(self._mmap, dtype=np.uint8, offset=n * LINE).reshape(2, n, SLOT_BYTES)
        self.done = int(self.sequence[index])

    def all_reduce(self, flat: torch.Tensor) -> torch.Tensor:
        """The group's sum of flat [M] (any dtype), the same bits on every rank."""
        out = torch.empty_like(flat)
        for start, parts in self._pieces(flat):
            total = out[start : start + parts[0].numel()]  # (summed in place: no copy per piece)
            total.copy_(parts[0])
            for part in parts[1:]:
                total += part
        return out

    def all_gather(self, flat: torch.Tensor) -> torch.Tensor:
        """Every rank's flat [M], in group order: [n, M]."""
        out = flat.new_empty(len(self.ranks), flat.numel())
        for start, parts in self._pieces(flat):
            for row, part in zip(out, parts):
                row[start : start + part.numel()] = part
        return out

    def _pieces(self, flat: torch.Tensor):
        """(start, [every rank's piece]) for flat's slot-sized pieces: the views stay valid until
        the next collective on this group."""
        data = flat.contiguous().view(torch.uint8)  # (bytes, whatever the dtype)
        per_piece = SLOT_BYTES // flat.element_size()
        for start in range(0, max(flat.numel(), 1), per_piece):
            size = min(per_piece, flat.numel() - start) * flat.element_size()
            buffer = self.buffers[(self.done + 1) % 2]
            buffer[self.index, :size] = data[start * flat.element_size() :][:size].numpy()
            self._publish_and_wait()
            yield start, [torch.from_numpy(buffer[r, :size]).view(flat.dtype) for r in range(len(self.ranks))]

    def _publish_and_wait(self):
        self.done += 1
        s = self.done
        self.sequence[self.index] = s
        try:
            wait_until(lambda: self.sequence.min() >= s, self._check_peers, self.timeout, f"collective {s}")
        except RingTimeout:
            late = [self.ranks[i] for i in np.flatnonzero(self.sequence < s)]
            raise PeerLost(f"rank(s) {late} did not arrive within {self.timeout:.0f} s") from None

    def _check_peers(self):
        for i in np.flatnonzero(self.sequence < self.done):
            if not _alive(self.pids[i]):
                raise PeerLost(f"rank {self.ranks[i]} (pid {self.pids[i]}) is gone")

    def close(self):
        self.sequence = self.buffers = None
        self._mmap.close()


def segment_bytes(n: int) -> int:
    return n * LINE + 2 * n * SLOT_BYTES


def segment_path(group: str, creator_pid: int) -> Path:
    return SHM_DIR / f"deepinfer-{creator_pid}-collectives-{group}"


def create_segment(path: Path, n: int) -> int | None:
    """The segment's file, its memory reserved (so a full /dev/shm fails here, not as a SIGBUS
    mid-step); None where it has no room."""
    path.unlink(missing_ok=True)  # a stale file of a dead process whose pid came round again
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, segment_bytes(n))
    except OSError:
        os.close(fd)
        path.unlink(missing_ok=True)
        return None
    return fd


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False
