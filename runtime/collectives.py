"""Collectives as opaque custom ops, so one traced graph holds them and the compiler splits there.

    torch.ops.deepinfer.all_reduce(x, "tp")          # sum over the group
    torch.ops.deepinfer.all_gather(x, "tp", dim)     # concatenate the group's x along dim

Groups are named, not passed: "world" is every rank, "tp" the tensor-parallel group this rank
belongs to (consecutive ranks). Their fake impls give tracing the output shapes; their eager
impls run torch.distributed on the process groups `set_groups` registered, or, for a group whose
ranks share a host, shared memory (`shm_collectives`: ~100x faster than gloo's sockets).
"""

import os
import sys

import torch
import torch.distributed as dist

from . import knobs
from .errors import DeepinferError
from .shm_collectives import WORKS_HERE, HostGroup, create_segment, segment_path

_groups: dict[str, "dist.ProcessGroup"] = {}
_host_of: dict[int, int] = {}  # rank -> host index, when the ranks span several hosts
_on_host: dict[str, HostGroup] = {}  # the groups that exchange through shared memory
_segment_files: set = set()  # segment files this process created and has not unlinked yet


def set_groups(groups: dict):
    for group in _on_host.values():
        group.close()
    _on_host.clear()
    _groups.clear()
    _groups.update(groups)


def share_memory_on_hosts(pids: dict[int, int], host_of: dict[int, int]):
    """Give every group whose ranks share a host a shared-memory segment (every rank calls this,
    after `set_groups`; `pids` and `host_of` are every rank's process and host). The group's first
    rank creates the file; once every rank of the group has opened it, it is unlinked, so nothing
    is left in /dev/shm however the job ends. Where /dev/shm has no room, or the first rank's
    DEEPINFER_SHM_COLLECTIVES is 0, the group stays on gloo (the first rank decides for all)."""
    rank, timeout = dist.get_rank(), knobs.collective_timeout_s()
    for name, group in _groups.items():
        ranks = dist.get_process_group_ranks(group)
        if not WORKS_HERE or len(ranks) < 2 or len({host_of[r] for r in ranks}) > 1:
            continue
        first, path = ranks[0], segment_path(name, pids[ranks[0]])
        fd = create_segment(path, len(ranks)) if rank == first and knobs.shared_memory_collectives() else None
        if fd is not None:
            _segment_files.add(path)
        created = torch.tensor([fd is not None])
        dist.broadcast(created, src=first, group=group)
        if not created.item():
            if rank == first and knobs.shared_memory_collectives():
                print(f"deepinfer: /dev/shm has no room for group {name!r}'s collectives; they go through gloo "
                      "(slower; give the container more /dev/shm, e.g. docker --shm-size).", file=sys.stderr)
            continue
        try:
            if rank != first:
                fd = os.open(path, os.O_RDWR)
            dist.barrier(group=group)  # every rank of the group has it open
        finally:
            if rank == first:
                path.unlink(missing_ok=True)
                _segment_files.discard(path)
        _on_host[name] = HostGroup(fd, ranks, ranks.index(rank), [pids[r] for r in ranks], timeout)
        os.close(fd)  # (the mapping stays)


def remove_segment_files():
    """Unlink the segment files this process created whose ranks had not all opened them yet: for
    an exit at once (Ctrl-C) in the middle of start-up, which runs no `finally`."""
    for path in list(_segment_files):
        path.unlink(missing_ok=True)
        _segment_files.discard(path)


def set_hosts(host_of: dict[int, int]):
    _host_of.clear()
    if len(set(host_of.values())) > 1:
        _host_of.update(host_of)


def where(ranks: list[int]) -> str:
    """'ranks [0, 1]', with the hosts they are on when the job spans several."""
    if not _host_of:
        return f"ranks {ranks}"
    hosts = sorted({_host_of[r] for r in ranks})
    return f"ranks {ranks}: " + "; ".join(f"host {h} has {[r for r in ranks if _host_of[r] == h]}" for h in hosts)


def _group(name: str):
    if name not in _groups:
        raise RuntimeError(f"collective over group {name!r} outside a multi-rank runtime (no process group registered)")
    return _groups[name]


def _all_reduce(flat: torch.Tensor, group: str) -> torch.Tensor:
    """The group's sum of flat (which may be overwritten)."""
    if group in _on_host:
        return _on_host[group].all_reduce(flat)
    dist.all_reduce(flat, group=_group(group))
    return flat


def _all_gather(flat: torch.Tensor, group: str, group_size: int) -> list[torch.Tensor]:
    """Every rank's flat, in group order."""
    if group in _on_host:
        return list(_on_host[group].all_gather(flat))
    ranks = [torch.empty_like(flat) for _ in range(group_size)]
    dist.all_gather(ranks, flat, group=_group(group))
    return ranks


@torch.library.custom_op("deepinfer::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    return _all_reduce(x.clone(), group)


@all_reduce.register_fake
def _(x, group):
    return torch.empty_like(x)


@torch.library.custom_op("deepinfer::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, group: str, dim: int, group_size: int) -> torch.Tensor:
    parts = _all_gather(x.contiguous().reshape(-1), group, group_size)
    return torch.cat([part.view_as(x) for part in parts], dim=dim)


@all_gather.register_fake
def _(x, group, dim, group_size):
    shape = list(x.shape)
    shape[dim] *= group_size
    return x.new_empty(shape)


COLLECTIVE_OPS = {"deepinfer.all_reduce.default": "all_reduce", "deepinfer.all_gather.default": "all_gather"}


class CollectiveFailed(DeepinferError):
    """A collective that timed out or lost a peer: another rank of its group stopped responding."""


def run_collective(spec: dict, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Execute one schedule step's collective on region outputs (ours to overwrite). Several inputs
    (a packed step) travel flattened in one collective and are unpacked after."""
    try:
        return _run_collective(spec, *xs)
    except RuntimeError as err:  # gloo: "Timed out waiting ...", "Connection closed by peer", ...; PeerLost
        ranks = dist.get_process_group_ranks(_group(spec["group"]))
        cause = str(err).strip().splitlines()[0]
        raise CollectiveFailed(
            f"rank {dist.get_rank()}: {spec['op']} over group {spec['group']!r} ({where(ranks)}) failed: {cause}. "
            "Another rank of that group stopped responding (stuck, stopped, or gone; its own output says why), "
            f"so the job stops. If a step may take longer than {knobs.collective_timeout_s():.0f} s, "
            "raise DEEPINFER_COLLECTIVE_TIMEOUT.") from None


def _run_collective(spec: dict, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    flat = xs[0].reshape(-1) if len(xs) == 1 else torch.cat([x.reshape(-1) for x in xs])
    sizes = [x.numel() for x in xs]
    if spec["op"] == "all_reduce":
        if spec.get("hierarchical"):
            flat = hierarchical_all_reduce(flat, spec["group"])
        else:
            flat = _all_reduce(flat, spec["group"])
        return tuple(part.view_as(x) for part, x in zip(flat.split(sizes), xs))
    if spec["op"] == "all_gather":
        ranks = _all_gather(flat, spec["group"], spec["group_size"])
        per_rank = [r.split(sizes) for r in ranks]  # [rank][input]
        return tuple(torch.cat([per_rank[r][i].view_as(x) for r in range(len(ranks))], dim=spec["dim"])
                     for i, x in enumerate(xs))
    raise ValueError(f"unknown collective {spec['op']!r}")


def hierarchical_all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """Two-level all-reduce: reduce-scatter inside the node group, all-reduce of each shard across
    node groups, all-gather inside the node group. Same sum as a flat all-reduce; on hardware where
    a world collective costs a fixed ~ms, it trades one wide collective for three narrow ones."""
    inner = _group(f"{group}.inner")
    n = dist.get_world_size(inner)
    flat = x.reshape(-1)
    pad = (-flat.numel()) % n
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    shards = list(flat.chunk(n))
    if f"{group}.inner" in _on_host:  # (its shard of the inner sum: all of it, then this rank's part)
        mine = _on_host[f"{group}.inner"].all_reduce(flat).chunk(n)[dist.get_group_rank(inner, dist.get_rank())].clone()
    else:
        mine = torch.empty_like(shards[0])
        dist.reduce_scatter(mine, shards, group=inner)
    mine = _all_reduce(mine, f"{group}.outer")
    return torch.cat(_all_gather(mine, f"{group}.inner", n))[: x.numel()].view_as(x)
