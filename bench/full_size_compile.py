"""The released DeepSeek models at full size through the compiler, from their config.json alone
(--no-weights): DeepSeek-V3 671B, V4-Flash and V4-Pro at 64 ranks (tp 8, ep 64) through the
Neuron path's StableHLO, compiled by XLA's CPU client (`backend: neuron` with `platform: cpu`),
cold (an empty compile cache) and warm (the same command again: the trace cache and the region
cache), each in its own process.

    .venv/bin/python bench/full_size_compile.py                  # all three: ~15 minutes on 2 cores
    .venv/bin/python bench/full_size_compile.py deepseek-v4-flash
    .venv/bin/python bench/full_size_compile.py --backend inductor   # AOTInductor instead (the CPU path)

Per model: unique regions, cold and warm wall seconds, the peak RSS of any process of the compile
(the compiler or a worker), where the cold time went (plan = tracing, export, backend compile
summed over regions, writing the bundle; the slowest region), and the bytes of StableHLO and of
executables in the bundle. The recipes are recipes/full-size/ with the backend replaced and the
per-rank memory check left out (so that a layout under study compiles too; `deepinfer-compile plan`
says whether it fits: V4-Pro's shipped tp 8 x cp 8 does).
"""

import argparse
import json
import re
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("deepseek-v3-671b", "deepseek-v4-flash", "deepseek-v4-pro")
BACKENDS = {"neuron": {"name": "neuron", "options": {"platform": "cpu"}}, "inductor": {"name": "inductor"}}


def recipe(model: str, backend: str, work: Path) -> Path:
    raw = yaml.safe_load((ROOT / "recipes" / "full-size" / f"{model}.yaml").read_text())
    raw["model"]["checkpoint"] = str(ROOT / raw["model"]["checkpoint"])
    raw["parallel"].pop("device_memory_gib", None)
    raw.update(backend=BACKENDS[backend], output=str(work / model))
    path = work / f"{model}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def compile_once(path: Path, cache: Path) -> tuple[float, int, str]:
    """(wall seconds, peak RSS bytes of the compile's processes, its output). GNU time's %M is the
    largest RSS of the process and the workers it reaped."""
    start = time.perf_counter()
    done = subprocess.run(["/usr/bin/time", "-f", "peak-rss-kib %M", sys.executable, "-m", "deepinfer.compiler.cli", str(path),
                           "--no-weights", "--cache-dir", str(cache)], capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{path.name}: the compile failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return seconds, int(re.search(r"peak-rss-kib (\d+)", done.stderr).group(1)) * 1024, done.stdout


def bundle_bytes(bundle: Path) -> dict[str, int]:
    """Bytes of each tensor kind (executable, stablehlo, ...) over the bundle's region files."""
    found = {}
    for region in (bundle / "regions").iterdir():
        with open(region, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0])) if region.suffix == ".pjrt" else {}
        for name, entry in header.items():
            if name != "__metadata__":
                found[name] = found.get(name, 0) + entry["data_offsets"][1] - entry["data_offsets"][0]
        found["files"] = found.get("files", 0) + region.stat().st_size
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", default=MODELS, choices=MODELS)
    parser.add_argument("--backend", default="neuron", choices=sorted(BACKENDS))
    args = parser.parse_args()
    print(f"{'model':20s} {'regions':>7s} {'cold s':>7s} {'warm s':>7s} {'warm/cold':>9s} {'peak RSS':>9s} "
          f"{'StableHLO':>10s} {'executables':>11s}  where the cold time went")
    for model in args.models:
        with tempfile.TemporaryDirectory(prefix="deepinfer-full-size-") as work:
            work = Path(work)
            path, cache = recipe(model, args.backend, work), work / "cache"
            cold, peak, out = compile_once(path, cache)
            warm, _, warm_out = compile_once(path, cache)
            assert "plan from the trace cache" in warm_out, warm_out
            regions = re.search(r"(\d+) unique regions", out).group(1)
            phases = re.search(r"^time: (.*)$", out, re.M).group(1)
            sizes = bundle_bytes(work / model)
            print(f"{model:20s} {regions:>7s} {cold:7.1f} {warm:7.1f} {warm / cold:9.3f} {peak / 2**30:7.2f} GiB "
                  f"{sizes.get('stablehlo', 0) / 2**20:6.2f} MiB {sizes.get('executable', sizes['files']) / 2**20:7.2f} MiB  {phases}",
                  flush=True)


if __name__ == "__main__":
    main()
