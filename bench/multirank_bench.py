"""Multi-rank figures: step-metadata delivery (shm ring vs gloo broadcast) and decode at world sizes 1/2/4.

    .venv/bin/python bench/multirank_bench.py                 # ring vs broadcast, then ws 1/2/4 on ~100M
    .venv/bin/python bench/multirank_bench.py --skip-decode   # only the delivery latencies

Delivery: rank 0 sends 2000 step records (paced 200 us apart) to 3 followers, each record stamped
with CLOCK_MONOTONIC (system-wide on Linux); followers report the one-way latency; p50/p99 over all.
Decode: the ~100M config of bench/decode_bench.py compiled with the inductor backend per layout,
run through deepinfer-run (leader + spawned followers), tpot from --json; plus the collective calls
in a decode step before and after packing adjacent collectives. This machine has 2 cores, so 4
ranks oversubscribe it: read the ws 2/4 times as overheads, not as speedups.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing as mp
import yaml

RECORDS, PACE_S, FOLLOWERS = 2000, 200e-6, 3
sys.path.insert(0, str(Path(__file__).parent))


def ring_follower(rank, path, words, out):
    from deepinfer.runtime.shm_ring import ShmRing

    ring = ShmRing.attach(path, FOLLOWERS, words, 8)
    lat = []
    for step in range(RECORDS):
        record = ring.read(rank, step)
        lat.append(time.monotonic_ns() - int(record[0]))
    out.put(lat)


def ring_latencies(words: int) -> list[int]:
    from deepinfer.runtime.shm_ring import ShmRing

    ring = ShmRing.create(FOLLOWERS, words, 8)
    out = mp.get_context("fork").Queue()
    procs = [mp.get_context("fork").Process(target=ring_follower, args=(r, ring.path, words, out)) for r in range(FOLLOWERS)]
    for p in procs:
        p.start()
    record = np.zeros(words, dtype=np.int64)
    time.sleep(0.5)
    for step in range(RECORDS):
        record[0] = time.monotonic_ns()
        ring.write(step, record)
        _pace()
    lat = [x for _ in procs for x in out.get()]
    for p in procs:
        p.join()
    ring.unlink()
    return lat


def broadcast_worker(rank, world, port, words, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    record = torch.zeros(words, dtype=torch.int64)
    lat = []
    dist.barrier()
    for _ in range(RECORDS):
        if rank == 0:
            record[0] = time.monotonic_ns()
        dist.broadcast(record, src=0)
        if rank:
            lat.append(time.monotonic_ns() - int(record[0]))
        else:
            _pace()
    if rank:
        out.put(lat)
    dist.destroy_process_group()


def broadcast_latencies(words: int) -> list[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=broadcast_worker, args=(r, FOLLOWERS + 1, port, words, out)) for r in range(FOLLOWERS + 1)]
    for p in procs:
        p.start()
    lat = [x for _ in range(FOLLOWERS) for x in out.get()]
    for p in procs:
        p.join()
    return lat


def _pace():
    end = time.perf_counter() + PACE_S
    while time.perf_counter() < end:
        pass


def pct(values, q):
    return float(np.percentile(np.array(values) / 1e3, q))


def decode_by_world_size(work: Path, jobs: int) -> list[dict]:
    import decode_bench

    from deepinfer.compiler.build import compile_recipe
    from deepinfer.compiler.recipe import load_recipe

    checkpoint = work / "100m-hf"
    decode_bench.save_hf_checkpoint(decode_bench.CONFIGS["100m"], checkpoint)
    rows = []
    for world, tp, ep in [(1, 1, 1), (2, 2, 2), (4, 4, 4)]:
        recipe = yaml.safe_load(decode_bench.write_recipe(work, checkpoint, f"ws{world}", True).read_text())
        recipe["parallel"] = {"world_size": world, "tp": tp, "ep": ep}
        path = work / f"ws{world}.yaml"
        path.write_text(yaml.safe_dump(recipe))
        summary = compile_recipe(load_recipe(path), jobs=jobs, cache_dir=work / "cache", progress=False)
        manifest = json.loads((summary.bundle / "manifest.json").read_text())
        steps = manifest["programs"]["decode/1"]["steps"]
        after = sum(1 for s in steps if s["collective"])
        before = sum(s["collective"].get("packed", 1) for s in steps if s["collective"])
        run = subprocess.run([sys.executable, "-m", "deepinfer.runtime.cli", "--bundle", str(summary.bundle),
                              "--prompt-ids", ",".join(str(i) for i in range(3, 35)), "--max-tokens", "48", "--json"],
                             capture_output=True, text=True, timeout=600)
        timing = json.loads(run.stdout)["timing"]
        rows.append({"world": world, "tp": tp, "ep": ep, "tpot_ms": timing["tpot"] * 1e3, "region_calls": len(steps) - after,
                     "collectives_before": before, "collectives_after": after})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    from deepinfer.runtime.step import payload_words

    words = payload_words(64)
    ring, bcast = ring_latencies(words), broadcast_latencies(words)
    print(f"\nstep record ({words * 8} bytes) to {FOLLOWERS} followers, {RECORDS} records, one-way latency in us")
    print(f"{'':>16} {'p50':>8} {'p99':>8}")
    for name, lat in (("shm ring", ring), ("gloo broadcast", bcast)):
        print(f"{name:>16} {pct(lat, 50):8.1f} {pct(lat, 99):8.1f}")
    print(f"ring is {pct(bcast, 50) / pct(ring, 50):.1f}x faster at p50, {pct(bcast, 99) / pct(ring, 99):.1f}x at p99")
    if args.skip_decode:
        return
    with tempfile.TemporaryDirectory(prefix="deepinfer-mr-bench-") as tmp:
        rows = decode_by_world_size(Path(tmp), args.jobs)
    print(f"\ndecode, ~100M config, batch 1, inductor bundles, torch {torch.__version__}, {os.cpu_count()} cores shared by the ranks")
    print(f"{'ws':>3} {'tp':>3} {'ep':>3} {'ms/token':>9} {'region calls':>13} {'collectives before/after packing':>34}")
    for r in rows:
        print(f"{r['world']:>3} {r['tp']:>3} {r['ep']:>3} {r['tpot_ms']:9.2f} {r['region_calls']:>13} "
              f"{r['collectives_before']:>17} / {r['collectives_after']}")


if __name__ == "__main__":
    main()
