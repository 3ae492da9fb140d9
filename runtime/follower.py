"""A follower rank: replays the leader's steps from the shared-memory ring until told to stop.

    python -m deepinfer.runtime.follower --bundle DIR      # started by deepinfer-run, or by torchrun

Reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, and DEEPINFER_RING / DEEPINFER_LEADER_PID
(set by the leader that spawned it; under torchrun the ring is found by name).
"""

import os
import sys
import time
from pathlib import Path

import click
import torch.distributed as dist

from .errors import DeepinferError
from .launch import RING_SLOTS, join, max_bucket_of, torchrun_ring_name
from .shm_ring import SHM_DIR, ShmRing
from .step import decode, payload_words


def follow(bundle: Path):
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    leader_pid = int(os.environ.get("DEEPINFER_LEADER_PID", "0"))
    ring_path = os.environ.get("DEEPINFER_RING") or str(SHM_DIR / torchrun_ring_name())
    width = max_bucket_of(bundle)
    deadline = time.monotonic() + 60
    while not Path(ring_path).exists():  # under torchrun the leader may create it a moment later
        if time.monotonic() > deadline:
            raise DeepinferError(f"rank {rank}: no step ring at {ring_path} after 60 s; is rank 0 running?")
        time.sleep(0.05)
    ring = ShmRing.attach(Path(ring_path), world_size - 1, payload_words(width), RING_SLOTS)
    executor = join(bundle, rank, world_size, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))

    def leader_alive():
        if leader_pid and os.getppid() != leader_pid:
            raise DeepinferError(f"rank {rank}: the leader (pid {leader_pid}) is gone")

    step_id = 0
    while True:
        step = decode(ring.read(rank - 1, step_id, check=leader_alive, timeout=3600), width)
        step_id += 1
        if step is None:
            dist.destroy_process_group()
            return
        executor.run(step)


def run_follower(bundle: Path):
    """follow(), with a DeepinferError printed as its one-paragraph message and exit 1."""
    try:
        follow(bundle)
    except DeepinferError as err:
        click.echo(f"deepinfer follower: {err}", err=True)
        sys.exit(1)


@click.command()
@click.option("--bundle", required=True, type=click.Path(exists=True, file_okay=False))
def main(bundle):
    run_follower(Path(bundle))


if __name__ == "__main__":
    main()
