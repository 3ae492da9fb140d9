"""Collectives as opaque custom ops, so one traced graph holds them and the compiler splits there.

    torch.ops.deepinfer.all_reduce(x, "tp")          # sum over the group
    torch.ops.deepinfer.all_gather(x, "tp", dim)     # concatenate the group's x along dim

Groups are named, not passed: "world" is every rank, "tp" the tensor-parallel group this rank
belongs to (consecutive ranks). Their fake impls give tracing the output shapes; their eager
impls run torch.distributed on the process groups `set_groups` registered.
"""

import torch
import torch.distributed as dist

from . import knobs
from .errors import DeepinferError

_groups: dict[str, "dist.ProcessGroup"] = {}
_host_of: dict[int, int] = {}  # rank -> host index, when the ranks span several hosts


def set_groups(groups: dict):
    _groups.clear()
    _groups.update(groups)


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


@torch.library.custom_op("deepinfer::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    out = x.clone()
    dist.all_reduce(out, group=_group(group))
    return out


@all_reduce.register_fake
def _(x, group):
    return torch.empty_like(x)


@torch.library.custom_op("deepinfer::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, group: str, dim: int, group_size: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(group_size)]
    dist.all_gather(parts, x.contiguous(), group=_group(group))
    return torch.cat(parts, dim=dim)


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
    except RuntimeError as err:  # gloo: "Timed out waiting ...", "Connection closed by peer", ...
        ranks = dist.get_process_group_ranks(_group(spec["group"]))
        cause = str(err).strip().splitlines()[0]
        raise CollectiveFailed(
            f"rank {dist.get_rank()}: {spec['op']} over group {spec['group']!r} ({where(ranks)}) failed: {cause}. "
            "Another rank of that group stopped responding (stuck, stopped, or gone; its own output says why), "
            f"so the job stops. If a step may take longer than {knobs.collective_timeout_s():.0f} s, "
            "raise DEEPINFER_COLLECTIVE_TIMEOUT.") from None


def _run_collective(spec: dict, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    group = _group(spec["group"])
    flat = xs[0].reshape(-1) if len(xs) == 1 else torch.cat([x.reshape(-1) for x in xs])
    sizes = [x.numel() for x in xs]
    if spec["op"] == "all_reduce":
        if spec.get("hierarchical"):
            flat = hierarchical_all_reduce(flat, spec["group"])
        else:
            dist.all_reduce(flat, group=group)
        return tuple(part.view_as(x) for part, x in zip(flat.split(sizes), xs))
    if spec["op"] == "all_gather":
        ranks = [torch.empty_like(flat) for _ in range(spec["group_size"])]
        dist.all_gather(ranks, flat, group=group)
        per_rank = [r.split(sizes) for r in ranks]  # [rank][input]
        return tuple(torch.cat([per_rank[r][i].view_as(x) for r in range(len(ranks))], dim=spec["dim"])
                     for i, x in enumerate(xs))
    raise ValueError(f"unknown collective {spec['op']!r}")


def hierarchical_all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """Two-level all-reduce: reduce-scatter inside the node group, all-reduce of each shard across
    node groups, all-gather inside the node group. Same sum as a flat all-reduce; on hardware where
    a world collective costs a fixed ~ms, it trades one wide collective for three narrow ones."""
    inner, outer = _group(f"{group}.inner"), _group(f"{group}.outer")
    n = dist.get_world_size(inner)
    flat = x.reshape(-1)
    pad = (-flat.numel()) % n
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    shards = list(flat.chunk(n))
    mine = torch.empty_like(shards[0])
    dist.reduce_scatter(mine, shards, group=inner)
    dist.all_reduce(mine, group=outer)
    dist.all_gather(shards, mine, group=inner)
    return torch.cat(shards)[: x.numel()].view_as(x)
