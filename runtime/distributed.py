"""Process groups for a bundle's layout: gloo, since bundles run on the CPU (a CUDA bundle would
take nccl; those are not built yet). Every rank creates every group in the same order
(torch.distributed requires it), then keeps its own."""

import os
from datetime import timedelta

import torch.distributed as dist

from . import knobs
from .collectives import set_groups
from .errors import DeepinferError


def init_groups(rank: int, world_size: int, tp: int, master_addr: str, master_port: int,
                node_size: int | None = None, cp: int = 1):
    """`node_size` (ranks per node group) also makes the world.inner / world.outer groups of the
    hierarchical all-reduce; `cp` > 1 the context-parallel groups: cp ranks of one tp index in
    consecutive replicas (rank % tp + tp k)."""
    timeout = timedelta(seconds=knobs.collective_timeout_s())
    startup = knobs.startup_timeout_s()
    try:
        # Start-up (ranks loading their shards at different speeds) has its own, longer bound than
        # a collective: the store's timeout bounds the rendezvous, the group's every collective.
        # Under torchrun its agent already serves the store on MASTER_PORT: every rank is a client
        # (rank 0 trying to serve it too fails to bind, and has aborted the process doing so).
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = dist.TCPStore(master_addr, master_port, world_size, is_master=rank == 0 and not agent_store,
                              timeout=timedelta(seconds=startup))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    except (RuntimeError, dist.DistError) as err:
        raise DeepinferError(
            f"rank {rank}: the {world_size} ranks did not all meet at {master_addr}:{master_port} within "
            f"{startup:.0f} s ({str(err).strip().splitlines()[0]}). A rank failed to start or is still loading; its own "
            "output says which. On a slow or busy host raise DEEPINFER_STARTUP_TIMEOUT.") from None
    groups = {"world": dist.group.WORLD}
    groups["tp"] = _own_group([list(range(s, s + tp)) for s in range(0, world_size, tp)], rank, timeout)
    if cp > 1:
        groups["cp"] = _own_group([list(range(s + i, s + tp * cp, tp)) for s in range(0, world_size, tp * cp) for i in range(tp)],
                                  rank, timeout)
    if node_size:
        groups["world.inner"] = _own_group([list(range(s, s + node_size)) for s in range(0, world_size, node_size)], rank, timeout)
        groups["world.outer"] = _own_group([list(range(i, world_size, node_size)) for i in range(node_size)], rank, timeout)
    set_groups(groups)
    return groups


def _own_group(partition: list[list[int]], rank: int, timeout: timedelta):
    mine = None
    for ranks in partition:
        group = dist.new_group(ranks, timeout=timeout)  # (new groups do not inherit the default group's)
        if rank in ranks:
            mine = group
    return mine
