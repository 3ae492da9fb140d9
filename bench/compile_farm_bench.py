"""Compiling without one machine's limits: a Ray compile farm against local workers, and the plan
command on full-size models.

    .venv/bin/python bench/compile_farm_bench.py     # ~6 minutes on 2 cores

1. The ~100M recipe (context_bench's 100m config, decode bucket 1, prefill 16, regions per layer)
   compiled cold with the inductor backend: `--jobs 2` on this machine's workers, then
   `--executor ray` on a local Ray cluster of two workers (started by the command). Both bundles
   must be byte-identical. On one 2-core machine Ray cannot be faster, only show its overhead;
   its point is a cluster's cores.
2. `deepinfer-compile plan` of recipes/full-size/deepseek-v3-671b.yaml, deepseek-v4-flash.yaml and
   deepseek-v4-pro.yaml (64 ranks each): wall seconds and peak resident memory (/usr/bin/time).
"""

import json
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
    """One recipe, compiled into work/name with a cache of its own."""
    recipe = {"name": "v3-100m", "model": {"config": CONFIGS["100m"], "seed": 0}, "dtype": "float32",
              "methods": {"decode": {"buckets": [1]}, "prefill": {"buckets": [16]}}, "kv": {"max_seqs": 2, "max_len": 128},
              "backend": {"name": "inductor"}}
    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "deepinfer.compiler.cli", str(path), "--out", str(work / name),
                          "--cache-dir", str(work / f"cache-{name}"), "--jobs", "2", *flags], capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(run.stderr[-3000:])
    return time.perf_counter() - start, run.stdout.strip().splitlines()[-1]


def files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def plan_cost(recipe: str) -> dict:
    """Under /usr/bin/time (a process's peak RSS is inherited through fork and exec, so this
    benchmark's own would mask a child's measured with getrusage)."""
    start = time.perf_counter()
    run = subprocess.run(["/usr/bin/time", "-f", "%M", sys.executable, "-m", "deepinfer.compiler.cli", "plan",
                          f"recipes/full-size/{recipe}.yaml", "--json"], capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - start
    peak_kib = run.stderr.strip().splitlines()[-1]
    report = json.loads(run.stdout)
    rank = report["ranks"][0]
    return {"seconds": seconds, "peak_mib": int(peak_kib) / 1024, "fits": report["fits"],
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
        print(f"{recipe:>18} {r['seconds']:8.1f} {r['peak_mib']:9.0f} {r['unique_regions']:15d} {r['total_gib']:15.2f} "
              f"{str(r['fits']):>6}")


if __name__ == "__main__":
    main()
