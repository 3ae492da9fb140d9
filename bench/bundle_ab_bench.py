"""Two bundles of the same model side by side in one process, taking turns: decode TPOT after a
32-token prompt and the 32-token prompt's TTFT (or others of cpu_decode_bench.py's measures), and
B's time over A's. On a shared box whose read rate moves by half within an hour, a compiler change
is measured this way, not by runs minutes apart.

    .venv/bin/python bench/bundle_ab_bench.py artifacts/old artifacts/new          # 7 rounds
    .venv/bin/python bench/bundle_ab_bench.py artifacts/old artifacts/new --rounds 15
    .venv/bin/python bench/bundle_ab_bench.py artifacts/old artifacts/new --measures "TPOT 512" "TTFT 512"

(Keep the old bundle by copying its directory before recompiling into the same output.)
"""

import argparse
import statistics
from pathlib import Path

import torch
from cpu_decode_bench import MEASURES

from deepinfer.runtime.executor import BundleExecutor


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", type=Path, help="bundle A (the baseline)")
    parser.add_argument("b", type=Path, help="bundle B")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--measures", nargs="+", default=["TPOT 32", "TTFT 32"], choices=list(MEASURES),
                        help="(the 512s need bundles whose context buckets hold 512 tokens and more)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    a, b = BundleExecutor(args.a), BundleExecutor(args.b)
    for name in args.measures:
        measure = MEASURES[name][0]
        measure(a), measure(b)  # (warm: first calls load and plan)
        times_a, times_b = [], []
        for _ in range(args.rounds):
            times_a.append(measure(a))
            times_b.append(measure(b))
        ratios = sorted(y / x for x, y in zip(times_a, times_b))
        print(f"{name}: A {statistics.median(times_a):.3f} ms, B {statistics.median(times_b):.3f} ms, "
              f"B / A {statistics.median(times_b) / statistics.median(times_a):.3f} (rounds {ratios[0]:.3f}-{ratios[-1]:.3f})")


if __name__ == "__main__":
    main()
