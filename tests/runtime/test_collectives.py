"""Collectives on real gloo process groups: packed steps and the two-level all-reduce give the
results of plain per-tensor collectives."""

import socket

import torch
import torch.multiprocessing as mp

from deepinfer.runtime.collectives import run_collective


def worker(rank, world_size, port, results):
    import torch.distributed as dist

    from deepinfer.runtime.distributed import init_groups

    init_groups(rank, world_size, 2, "127.0.0.1", port, node_size=2)
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(3, 5, generator=gen), torch.randn(7, generator=gen)
    out = {}
    out["flat"] = run_collective({"op": "all_reduce", "group": "world"}, x.clone())[0]
    out["hier"] = run_collective({"op": "all_reduce", "group": "world", "hierarchical": True}, x.clone())[0]
    out["packed"] = run_collective({"op": "all_reduce", "group": "world", "packed": 2}, x.clone(), y.clone())
    out["single_y"] = run_collective({"op": "all_reduce", "group": "world"}, y.clone())[0]
    gather = {"op": "all_gather", "group": "tp", "dim": 1, "group_size": 2}
    out["gather_packed"] = run_collective({**gather, "packed": 2}, x.clone(), x[:, :2].clone())
    out["gather_single"] = (run_collective(gather, x.clone())[0], run_collective(gather, x[:, :2].clone())[0])
    results[rank] = out
    dist.destroy_process_group()


def test_packed_and_hierarchical_collectives_match_plain_ones():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(worker, args=(4, port, results), nprocs=4)
    expected = sum(torch.randn(3, 5, generator=torch.Generator().manual_seed(r)) for r in range(4))
    for rank in range(4):
        out = results[rank]
        torch.testing.assert_close(out["flat"], expected)
        torch.testing.assert_close(out["hier"], expected)
        torch.testing.assert_close(out["packed"][0], expected)
        torch.testing.assert_close(out["packed"][1], out["single_y"])
        torch.testing.assert_close(out["gather_packed"][0], out["gather_single"][0])
        torch.testing.assert_close(out["gather_packed"][1], out["gather_single"][1])
        assert out["gather_single"][0].shape == (3, 10)
