"""Inductor's mm decomposition on CPU against the BLAS call, by rows: ms per call of 6 chained
[N, 1024] x [1024, 4096] linears (96 MB of f32 weights, memory-bound), compiled with
cpu_max_first_dimension_decomposition 0 (never: BLAS), 1 (the inductor backend's default: only
single-row GEMVs) and 8 (GEMVs up to 8 rows).

    .venv/bin/python bench/mm_decomposition_bench.py      # ~2 minutes on 2 cores

Measured here (2 cores): BLAS 3.24 / 3.43 / 5.95 / 8.74 ms at N = 1 / 2 / 4 / 8; decomposed up to
8 rows 3.01 / 7.00 / 12.40 / 21.15 ms: the fused kernel re-reads every weight per row.
"""

import subprocess
import sys
import time

import torch

ROWS = (1, 2, 4, 8)


def measure(limit: int) -> str:
    import torch._inductor.config as config

    if limit:
        config.post_grad_fusion_options = {"decompose_mm_pass": {"cpu_max_first_dimension_decomposition": limit,
                                                                 "cpu_max_other_dimension_decomposition": 1 << 30}}
    torch.manual_seed(0)
    weights = [torch.randn(4096, 1024) for _ in range(6)]

    def chain(x, *ws):
        for w in ws:
            x = torch.nn.functional.linear(x, w)[:, :1024].tanh()
        return x

    cells = []
    for n in ROWS:
        compiled = torch.compile(chain, dynamic=False)
        x = torch.randn(n, 1024)
        for _ in range(3):
            compiled(x, *weights)
        start, calls = time.perf_counter(), 30
        for _ in range(calls):
            compiled(x, *weights)
        cells.append(f"{(time.perf_counter() - start) / calls * 1000:.2f}")
    return " | ".join(cells)


def main():
    if len(sys.argv) > 1:  # one setting, in a process of its own (inductor's config is global)
        print(measure(int(sys.argv[1])))
        return
    print("| decomposed up to | " + " | ".join(f"N={n} ms" for n in ROWS) + " |\n|---" * (len(ROWS) + 1) + "|")
    for limit, label in ((0, "never (BLAS)"), (1, "1 row (default)"), (8, "8 rows")):
        row = subprocess.run([sys.executable, __file__, str(limit)], capture_output=True, text=True, check=True).stdout.strip()
        print(f"| {label} | {row} |", flush=True)


if __name__ == "__main__":
    main()
