"""How the inductor backend multiplies a few rows by a big weight on CPU, by rows: ms per call of 6
chained [N, 1024] x [1024, 4096] linears (96 MB of f32 weights, memory-bound), compiled three ways:
the plain BLAS call; inductor's mm decomposition up to 8 rows (a fused multiply-reduce); and the
backend's defaults (decomposition for one row, compiler/backends/blocked_matmul.py for 4-8 rows).

    .venv/bin/python bench/mm_decomposition_bench.py      # ~3 minutes on 2 cores

Measured here (2 cores), ms:

| compiled as | N=1 | N=2 | N=4 | N=8 | N=16 |
|---|---|---|---|---|---|
| plain BLAS | 3.67 | 3.31 | 5.98 | 8.92 | 8.80 |
| decomposed up to 8 rows | 3.09 | 6.31 | 10.90 | 18.98 | 9.68 |
| backend defaults | 3.11 | 3.09 | 4.01 | 4.97 | 8.99 |
"""

import subprocess
import sys
import time

import torch

ROWS = (1, 2, 4, 8, 16)
SETTINGS = {"blas": "plain BLAS", "decompose8": "decomposed up to 8 rows", "defaults": "backend defaults"}


def configure(setting: str):
    import torch._inductor.config as config

    from deepinfer.compiler.backends import inductor

    limit = {"blas": 0, "decompose8": 8, "defaults": 1}[setting]
    if limit:
        config.post_grad_fusion_options = {"decompose_mm_pass": {"cpu_max_first_dimension_decomposition": limit,
                                                                 "cpu_max_other_dimension_decomposition": 1 << 30}}
    if setting == "defaults":
        config.post_grad_custom_pre_pass = inductor.graph_passes()


def measure(setting: str) -> str:
    configure(setting)
    torch.manual_seed(0)
    weights = [torch.randn(4096, 1024) / 32 for _ in range(6)]  # outputs ~N(0, 1): tanh not saturated

    def chain(x, *ws):
        for w in ws:
            x = torch.nn.functional.linear(x, w)[:, :1024].tanh()
        return x

    cells = []
    for n in ROWS:
        compiled = torch.compile(chain, dynamic=False)
        x = torch.randn(n, 1024)
        expected = chain(x, *weights)
        assert (compiled(x, *weights) - expected).abs().max() < 1e-4, "compiled differs from eager"
        for _ in range(3):
            compiled(x, *weights)
        start, calls = time.perf_counter(), 30
        for _ in range(calls):
            compiled(x, *weights)
        cells.append(f"{(time.perf_counter() - start) / calls * 1000:.2f}")
    return " | ".join(cells)


def main():
    if len(sys.argv) > 1:  # one setting, in a process of its own (inductor's config is global)
        print(measure(sys.argv[1]))
        return
    print("| compiled as | " + " | ".join(f"N={n} ms" for n in ROWS) + " |\n" + "|---" * (len(ROWS) + 1) + "|")
    for setting, label in SETTINGS.items():
        row = subprocess.run([sys.executable, __file__, setting], capture_output=True, text=True, check=True).stdout.strip()
        print(f"| {label} | {row} |", flush=True)


if __name__ == "__main__":
    main()
