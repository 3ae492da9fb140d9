"""The shared-memory step ring: order, wrap-around, slow and dead readers, a randomized stress."""

import multiprocessing as mp
import os
import random
import time

import numpy as np
import pytest

from deepinfer.runtime.shm_ring import RingTimeout, ShmRing

WORDS = 6


def record(step: int) -> np.ndarray:
    return np.arange(WORDS, dtype=np.int64) + step * 100


def reader(path, n_readers, reader_id, steps, n_slots, delay, seed, out):
    rng = random.Random(seed * 31 + reader_id)
    ring = ShmRing.attach(path, n_readers, WORDS, n_slots)
    got = []
    for step in range(steps):
        got.append(int(ring.read(reader_id, step, timeout=30)[1]))
        if delay:
            time.sleep(rng.random() * delay)
    out.put((reader_id, got))


def run(n_readers, steps, n_slots, delays, seed=0):
    ring = ShmRing.create(n_readers, WORDS, n_slots)
    out = mp.Queue()
    procs = [mp.Process(target=reader, args=(ring.path, n_readers, r, steps, n_slots, delays[r], seed, out)) for r in range(n_readers)]
    for p in procs:
        p.start()
    rng = random.Random(seed)
    try:
        for step in range(steps):
            ring.write(step, record(step), timeout=30)
            if seed and rng.random() < 0.1:
                time.sleep(rng.random() * 0.002)
        results = dict(out.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=10)
        ring.unlink()
    return results


def test_every_reader_sees_every_step_in_order_across_wrap_around():
    results = run(n_readers=3, steps=100, n_slots=4, delays=[0, 0, 0])  # 25 laps of the ring
    assert all(got == [s * 100 + 1 for s in range(100)] for got in results.values())


def test_a_slow_reader_holds_the_writer_back_without_losing_records():
    results = run(n_readers=2, steps=30, n_slots=2, delays=[0, 0.01])
    assert results[1] == [s * 100 + 1 for s in range(30)] == results[0]


def test_a_dead_reader_is_detected_instead_of_blocking_forever():
    ring = ShmRing.create(1, WORDS, 2)
    try:
        ring.write(0, record(0))
        ring.write(1, record(1))  # the ring is full now; nobody will ever read
        dead = mp.Process(target=time.sleep, args=(0,))
        dead.start()
        dead.join()

        def check():
            if not dead.is_alive():
                raise RuntimeError("reader 0 died")

        with pytest.raises(RuntimeError, match="reader 0 died"):
            ring.write(2, record(2), check=check, timeout=30)
        start = time.monotonic()
        with pytest.raises(RingTimeout):
            ring.write(2, record(2), timeout=0.2)
        assert time.monotonic() - start < 5
    finally:
        ring.unlink()


def test_reader_times_out_without_a_writer():
    ring = ShmRing.create(1, WORDS, 2)
    try:
        with pytest.raises(RingTimeout, match="step 0 from the writer"):
            ring.read(0, 0, timeout=0.2)
    finally:
        ring.unlink()


def test_randomized_stress():
    seed = int(os.environ.get("RING_SEED", random.randrange(1 << 30)))
    print(f"ring stress seed {seed} (rerun with RING_SEED={seed})")
    rng = random.Random(seed)
    n_readers, n_slots = rng.randint(1, 4), rng.randint(1, 6)
    delays = [rng.choice([0, 0, 0.0005, 0.002]) for _ in range(n_readers)]
    results = run(n_readers, steps=300, n_slots=n_slots, delays=delays, seed=seed)
    expected = [s * 100 + 1 for s in range(300)]
    assert all(got == expected for got in results.values()), f"seed {seed}"


def test_unlinked_after_use():
    ring = ShmRing.create(1, WORDS, 2)
    ring.unlink()
    assert not ring.path.exists()
    ring.write(0, record(0))  # the mapping stays usable by processes that attached
