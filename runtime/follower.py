"""A follower rank: replays the leader's steps from the shared-memory ring until told to stop.

    python -m deepinfer.runtime.follower --bundle DIR [--verify-key FILE]   # started by deepinfer-run, or by torchrun

Reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, and DEEPINFER_RING_FD / DEEPINFER_LEADER_PID
(set by the leader that spawned it; under torchrun the ring is found by name).
"""

import os
import sys
import time
from pathlib import Path

import click
import torch.distributed as dist

from . import knobs
from .errors import DeepinferError
from .executor import BundleExecutor
from .launch import RING_SLOTS, join, max_bucket, torchrun_ring_name
from .shm_ring import SHM_DIR, RingTimeout, ShmRing
from .step import decode, payload_words

IDLE_TIMEOUT_S = 3600  # a leader with no step for this long is stuck


def attach_ring(rank: int, world_size: int, width: int) -> ShmRing:
    words = payload_words(width)
    if "DEEPINFER_RING_FD" in os.environ:  # spawned by deepinfer-run: an inherited descriptor
        return ShmRing.from_fd(int(os.environ["DEEPINFER_RING_FD"]), world_size - 1, words, RING_SLOTS)
    path = SHM_DIR / torchrun_ring_name()
    wait = knobs.startup_timeout_s()
    deadline = time.monotonic() + wait
    while not path.exists():  # under torchrun the leader creates it once it has loaded its shard
        if time.monotonic() > deadline:
            raise DeepinferError(f"rank {rank}: no step ring at {path} after {wait:.0f} s (DEEPINFER_STARTUP_TIMEOUT); "
                                 "is rank 0 running?")
        time.sleep(0.05)
    return ShmRing.attach(path, world_size - 1, words, RING_SLOTS)


def follow(bundle: Path, verify_key_file: Path | None):
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    leader_pid = int(os.environ.get("DEEPINFER_LEADER_PID", "0"))
    executor = BundleExecutor(bundle, rank, verify_key_file)
    width = max_bucket(executor.manifest)
    ring = attach_ring(rank, world_size, width)
    join(executor, rank, world_size, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))

    def leader_alive():
        if leader_pid and os.getppid() != leader_pid:
            raise DeepinferError(f"rank {rank}: the leader (pid {leader_pid}) is gone")

    step_id = 0
    while True:
        try:
            record = ring.read(rank - 1, step_id, check=leader_alive, timeout=IDLE_TIMEOUT_S)
        except RingTimeout:
            raise DeepinferError(f"rank {rank}: no step {step_id} from the leader for {IDLE_TIMEOUT_S} s; the leader is "
                                 "stuck or gone, so this rank stops.") from None
        step = decode(record, width)
        step_id += 1
        if step is None:
            dist.destroy_process_group()
            return
        executor.run(step)


def run_follower(bundle: Path, verify_key_file: Path | None = None):
    """follow(), with a DeepinferError printed as its one-paragraph message and exit 1."""
    try:
        follow(bundle, verify_key_file)
    except DeepinferError as err:
        click.echo(f"deepinfer follower: {err}", err=True)
        sys.exit(1)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--bundle", required=True, type=click.Path(exists=True, file_okay=False))
@click.option("--verify-key", type=click.Path(dir_okay=False), help="deploy key the bundle's signature must match")
def main(bundle, verify_key):
    run_follower(Path(bundle), Path(verify_key) if verify_key else None)


if __name__ == "__main__":
    main()
