"""Compiling without one machine's limits: a Ray compile farm against local workers, and the plan
command on full-size models.

    .venv/bin/python bench/compile_farm_bench.py     # ~6 minutes on 2 cores

1. The ~100M recipe (context_bench's 100m config, decode bucket 1, prefill 16, regions per layer)
   compiled cold with the inductor backend: `--jobs 2` on this machine's workers, then
   `--executor ray` on a local Ray cluster of two workers (started by the command). Both bundles
   must be byte-identical. On one 2-core machine Ray cannot be faster, only show its overhead;
   its point is a cluster's cores.
2. `deepinfer-compile plan` of recipes/full-size/deepseek-v3-671b.yaml, deepseek-v4-flash.yaml and
   deepseek-v4-pro.yaml (64 ranks each): wall seconds and peak resident memory, as /usr/bin/time
   would measure (getrusage of the child).
"""

import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from context_bench import CONFIGS

ROOT = Path(__file__).resolve().parent.parent
FULL_SIZE = ["deepseek-v3-671b", "deepseek-v4-flash", "deepseek-v4-pro"]


def compile_100m(work: Path, name: str, *flags: str) -> tuple[float, str]:
    recipe = {"name": name, "model": {"config": CONFIGS["100m"], "seed": 0}, "dtype": "float32",
              "methods": {"decode": {"buckets": [1]}, "prefill": {"buckets": [16]}}, "kv": {"max_seqs": 2, "max_len": 128},
              "backend": {"name": "inductor"}, "output": str(work / name)}
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "deepinfer.compiler.cli", str(path), "--cache-dir", str(work / f"cache-{name}"),
                          "--jobs", "2", *flags], capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(run.stderr[-3000:])
    return time.perf_counter() - start, run.stdout.strip().splitlines()[-1]


def files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def plan_cost(recipe: str) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "deepinfer.compiler.cli", "plan", f"recipes/full-size/{recipe}.yaml", "--json"],
                         capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # the largest child so far
    report = json.loads(run.stdout)
    rank = report["ranks"][0]
    return {"seconds": seconds, "peak_mib": peak / 1024, "peak_is_this_run": peak > before, "fits": report["fits"],
            "total_gib": rank["total_bytes"] / 2**30, "unique_regions": report["unique_regions"]}


def main():
    with tempfile.TemporaryDirectory(prefix="deepinfer-farm-bench-") as tmp:
        work = Path(tmp)
        local_s, local_summary = compile_100m(work, "local")
        ray_s, ray_summary = compile_100m(work, "ray", "--executor", "ray")
        identical = files(work / "local") == files(work / "ray")
    print(f"\n~100M recipe, inductor, cold cache, 2 cores:\n  local --jobs 2: {local_s:6.1f} s  ({local_summary})\n"
          f"  ray, 2 workers: {ray_s:6.1f} s  ({ray_summary})\n  ray / local: {ray_s / local_s:.2f}x; bundles "
          f"{'byte-identical' if identical else 'DIFFER'}")
    print("\ndeepinfer-compile plan, 64 ranks (tp 8, ep 64):")
    print(f"{'recipe':>18} {'seconds':>8} {'peak MiB':>9} {'unique regions':>15} {'total GiB/rank':>15} {'fits':>6}")
    for recipe in FULL_SIZE:
        r = plan_cost(recipe)
        peak = f"{r['peak_mib']:9.0f}" if r["peak_is_this_run"] else f"{'<=' + format(r['peak_mib'], '.0f'):>9}"
        print(f"{recipe:>18} {r['seconds']:8.1f} {peak} {r['unique_regions']:15d} {r['total_gib']:15.2f} {str(r['fits']):>6}")


if __name__ == "__main__":
    main()
