"""Shared-memory collectives between real processes: every rank gets the same sum (bit for bit)
and the group's rows in order, payloads larger than a slot travel in pieces, and a peer that
died or never arrives fails the collective naming it instead of hanging."""

import multiprocessing
import os
import socket
import time

import pytest
import torch

from deepinfer.runtime.shm_collectives import SHM_DIR, SLOT_BYTES, WORKS_HERE, HostGroup, PeerLost, create_segment

pytestmark = pytest.mark.skipif(not WORKS_HERE, reason="shared-memory collectives are x86-64 only (TSO)")

N = 3
SIZES = [5, SLOT_BYTES // 4 * 2 + 7]  # a few values; 2 slots and a bit of float32


def values(rank: int, size: int, dtype) -> torch.Tensor:
    return (torch.arange(size, dtype=torch.float64).sin() * (rank + 1) / 3).to(dtype)


RANKS = [10, 11, 12]


def member(path: str, index: int, shared_pids, go, results, fail: str | None, timeout: float):
    go.wait()  # (the pids are filled in)
    fd = os.open(path, os.O_RDWR)
    group = HostGroup(fd, RANKS, index, list(shared_pids), timeout)
    os.close(fd)
    if fail == "exit":
        os._exit(3)
    if fail == "stall":
        time.sleep(600)
    try:
        out = []
        for dtype in (torch.float32, torch.bfloat16):
            for size in SIZES:
                mine = values(index, size, dtype)
                out.append((group.all_reduce(mine.clone()).tolist(), group.all_gather(mine).tolist()))
        results.put((index, out))
    except PeerLost as err:
        results.put((index, str(err)))


def run_group(name: str, fail: str | None = None, timeout: float = 20.0) -> dict:
    """N member processes on a fresh segment, the second one failing as `fail` says (exit at
    once, or stall) -> {index: their results or their error}."""
    path = SHM_DIR / name
    fd = create_segment(path, N)
    assert fd is not None
    os.close(fd)
    ctx = multiprocessing.get_context("spawn")
    go, results, pids = ctx.Event(), ctx.Queue(), ctx.Array("i", N)
    procs = [ctx.Process(target=member, args=(str(path), i, pids, go, results, fail if i == 1 else None, timeout)) for i in range(N)]
    try:
        for i, p in enumerate(procs):
            p.start()
            pids[i] = p.pid
        go.set()
        return dict(results.get(timeout=120) for _ in range(N - (fail is not None)))
    finally:
        for p in procs:
            p.kill()
            p.join()
        path.unlink()


def test_every_rank_gets_the_same_sum_and_the_group_rows_in_order():
    out = run_group(f"deepinfer-test-{os.getpid()}-collectives")
    assert sorted(out) == [0, 1, 2]
    k = 0
    for dtype in (torch.float32, torch.bfloat16):
        for size in SIZES:
            parts = [values(r, size, dtype) for r in range(N)]
            expected_sum = parts[0] + parts[1] + parts[2]  # (in rank order: the same rounding)
            for index in range(N):
                got_sum, got_rows = out[index][k]
                assert torch.tensor(got_sum, dtype=dtype).equal(expected_sum)
                assert torch.tensor(got_rows, dtype=dtype).equal(torch.stack(parts))
            k += 1


def test_a_dead_peer_fails_the_collective_naming_it_within_seconds():
    started = time.monotonic()
    out = run_group(f"deepinfer-test-{os.getpid()}-collectives-dead", fail="exit")
    assert sorted(out) == [0, 2]
    for index in (0, 2):
        assert "rank 11 (pid" in out[index] and "is gone" in out[index], out[index]
    assert time.monotonic() - started < 20  # (before the 20 s timeout: the liveness check)


def test_a_peer_that_never_arrives_fails_the_collective_after_the_timeout():
    out = run_group(f"deepinfer-test-{os.getpid()}-collectives-stalled", fail="stall", timeout=2.0)
    assert sorted(out) == [0, 2]
    for index in (0, 2):
        assert out[index] == "rank(s) [11] did not arrive within 2 s", out[index]


def rank_main(rank: int, port: int, shm: str, results):
    import torch.distributed as dist

    from deepinfer.runtime import collectives

    os.environ["DEEPINFER_SHM_COLLECTIVES"] = shm
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    collectives.set_groups({"world": dist.group.WORLD})
    pids = [torch.zeros(1, dtype=torch.int64) for _ in range(2)]
    dist.all_gather(pids, torch.tensor([os.getpid()]))
    collectives.share_memory_on_hosts({r: int(pid) for r, pid in enumerate(pids)}, {0: 0, 1: 0})
    x = values(rank, 1000, torch.float32).view(10, 100)
    summed, = collectives.run_collective({"op": "all_reduce", "group": "world"}, x.clone())
    gathered, = collectives.run_collective({"op": "all_gather", "group": "world", "group_size": 2, "dim": 1}, x)
    results.put((rank, sorted(collectives._on_host), summed.tolist(), gathered.tolist()))  # (lists: plain pickles)
    dist.destroy_process_group()


@pytest.mark.parametrize("shm", ["1", "0"])
def test_the_runtime_puts_a_one_host_group_on_shared_memory_unless_told_not_to(shm):
    """Two ranks joined by gloo, as the runtime joins them: the group goes on shared memory (or
    stays on gloo with DEEPINFER_SHM_COLLECTIVES=0), with the same results either way."""
    from tests.runtime.conftest import left_since, leftovers

    before = leftovers()
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=rank_main, args=(r, port, shm, results)) for r in range(2)]
    for p in procs:
        p.start()
    out = dict((r, rest) for r, *rest in (results.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(timeout=60)
    x = [values(r, 1000, torch.float32).view(10, 100) for r in range(2)]
    for rank in range(2):
        on_host, summed, gathered = out[rank]
        assert on_host == (["world"] if shm == "1" else [])
        assert summed == (x[0] + x[1]).tolist() and gathered == torch.cat(x, dim=1).tolist()
    assert not left_since(before)  # the segment was unlinked once both ranks had it open
