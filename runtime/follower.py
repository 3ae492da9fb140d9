"""A follower rank: replays the leader's steps from the shared-memory ring until told to stop.

    python -m deepinfer.runtime.follower --bundle DIR [--verify-key FILE] [--native-regions refuse]   # started by deepinfer-run, or by torchrun

Reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, and DEEPINFER_RING_FD / DEEPINFER_LEADER_PID
(set by the leader that spawned it; under torchrun the ring is found by name).
"""

import os
import sys
import time
from pathlib import Path

import click
import torch
import torch.distributed as dist

from . import knobs
from .collectives import CollectiveFailed
from .errors import DeepinferError
from .executor import BundleExecutor
from .launch import IDLE_TIMEOUT_S, RING_SLOTS, create_host_ring, host_position, join, max_bucket, torchrun_ring_name
from .shm_ring import SHM_DIR, RingTimeout, ShmRing
from .step import decode, payload_words
from .trust import Trust, trust_options

LEADER_REPORTS_FIRST_S = 3.0  # how long a follower whose collective failed waits before exiting


def attach_ring(rank: int, n_readers: int, width: int) -> ShmRing:
    words = payload_words(width)
    if "DEEPINFER_RING_FD" in os.environ:  # spawned by deepinfer-run: an inherited descriptor
        return ShmRing.from_fd(int(os.environ["DEEPINFER_RING_FD"]), n_readers, words, RING_SLOTS)
    path = SHM_DIR / torchrun_ring_name()
    wait = knobs.startup_timeout_s()
    deadline = time.monotonic() + wait
    while not path.exists():  # under torchrun the leader creates it once it has admitted the bundle
        if time.monotonic() > deadline:
            raise DeepinferError(f"rank {rank}: no step ring at {path} after {wait:.0f} s (DEEPINFER_STARTUP_TIMEOUT); "
                                 "is rank 0 running?")
        time.sleep(0.05)
    return ShmRing.attach(path, n_readers, words, RING_SLOTS)


def follow(bundle: Path, trust: Trust):
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, local_rank, local_world_size = host_position(rank, world_size)
    leader_pid = int(os.environ.get("DEEPINFER_LEADER_PID", "0"))
    executor = BundleExecutor(bundle, rank, trust)
    width = max_bucket(executor.manifest)
    # The first rank of a host other than the leader's relays: it writes the host's ring.
    relay = local_rank == 0
    ring = create_host_ring(local_world_size - 1, width) if relay else attach_ring(rank, local_world_size - 1, width)
    try:
        relays = join(executor, rank, world_size, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    finally:
        if relay:
            ring.unlink()  # every rank of the host attached before join's all_gather returned

    def leader_alive():
        if leader_pid and os.getppid() != leader_pid:
            raise DeepinferError(f"rank {rank}: the leader (pid {leader_pid}) is gone")

    step_id = 0
    while True:
        if relay:
            record = receive_step(relays, rank, host, step_id, payload_words(width))
            ring.write(step_id, record, timeout=IDLE_TIMEOUT_S)
        else:
            try:
                record = ring.read(local_rank - 1, step_id, check=leader_alive, timeout=IDLE_TIMEOUT_S)
            except RingTimeout:
                raise DeepinferError(f"rank {rank}: no step {step_id} from the leader for {IDLE_TIMEOUT_S} s; the leader "
                                     "is stuck or gone, so this rank stops.") from None
        step = decode(record, width)
        step_id += 1
        if step is None:
            dist.destroy_process_group()
            return
        executor.run(step)


def receive_step(relays, rank: int, host: int, step_id: int, words: int):
    """The leader's next step record, as this host's relay (a broadcast from rank 0)."""
    record = torch.zeros(words, dtype=torch.int64)
    try:
        dist.broadcast(record, src=0, group=relays)
    except (RuntimeError, dist.DistError) as err:
        raise DeepinferError(f"rank {rank} (the first rank of host {host}): step {step_id} from rank 0 never came "
                             f"({str(err).strip().splitlines()[0]}): the leader's host died or stopped responding, so "
                             "this host's ranks stop.") from None
    return record.numpy()


def run_follower(bundle: Path, trust: Trust = Trust()):
    """follow(), with a DeepinferError printed as its one-paragraph message and exit 1."""
    try:
        follow(bundle, trust)
    except DeepinferError as err:
        click.echo(f"deepinfer follower: {err}", err=True)
        if isinstance(err, CollectiveFailed):
            # The leader sits in the same collective and reports the failure with the group's
            # hosts; under torchrun this rank's exit would have the agent stop it first. (Spawned
            # by deepinfer-run, this rank dies with the leader anyway.)
            time.sleep(LEADER_REPORTS_FIRST_S)
        sys.exit(1)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--bundle", required=True, type=click.Path(exists=True, file_okay=False))
@trust_options(default="allow")
def main(bundle, verify_key, native_regions):
    run_follower(Path(bundle), Trust.of_options(verify_key, native_regions))


if __name__ == "__main__":
    main()
