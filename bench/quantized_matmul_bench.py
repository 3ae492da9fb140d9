"""Decode's matmuls from 8- and 4-bit weights on this CPU: ATen's maintained kernels against f32 and
bf16 weights and against the memory-bandwidth floor, eager and through AOTInductor -- what #44's
`model.quantize: int8 | int4` would build on, measured before building it.

    .venv/bin/python bench/quantized_matmul_bench.py          # ~30 s (two AOTInductor compiles)
    .venv/bin/python bench/quantized_matmul_bench.py --rows 32 128 512    # prompt chunks' products

For each weight shape of the ~100M DeepSeek-V3 of the benches (BASE_100M: its LM head 32000 x 768,
a dense MLP's 2048 x 768 and 768 x 2048), one activation row and four (`--rows`): f32 and bf16 weights
(`x @ w.T`), per-output-channel symmetric int8 by ATen's `_weight_int8pack_mm` and by ours,
`deepinfer::int8_matmul`, and group-wise int4 (groups of 32 and 128) by ATen's
`_weight_int4pack_mm_for_cpu` and by ours, `deepinfer::int4_matmul` (runtime/int_matmul.py: 8-bit
activations, integer dot products), ATen's kernels with bf16 activations (with f32 ones they take
a slow path: shown once) -- in alternating rounds,
median ms per call; each against the floor: the weight's bytes over the read bandwidth of this
box's 2 threads (a float32 sum over 512 MiB, measured in the same run). The MLP weights (3-6 MB)
stay in cache across the repeated calls and beat that floor; in a decode step every layer reads
other weights, so only the LM head's row is what DRAM gives. Then the LM head's int8
and int4 calls (ours) compiled by AOTInductor (torch.export of a module calling the op), to check
that the compiled call costs what the eager one does.
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from context_bench import BASE_100M, take_turns

from deepinfer.models.int_weights import int4_codes, int8_codes
from deepinfer.runtime import huge_pages, int_matmul

V, D, I = BASE_100M["vocab_size"], BASE_100M["hidden_size"], BASE_100M["intermediate_size"]
SHAPES = {f"lm head {V}x{D}": (V, D), f"mlp up {I}x{D}": (I, D), f"mlp down {D}x{I}": (D, I)}


def read_bandwidth() -> float:
    """GB/s two threads read: a float32 sum over 512 MiB (median of 7), on huge pages as the
    runtime's weights are (runtime/huge_pages.py; on 4 KiB pages an Intel Xeon read 0.68x as fast)."""
    data = huge_pages.empty((128 << 20,), torch.float32).fill_(1)
    data.sum()
    seconds = []
    for _ in range(7):
        start = time.perf_counter()
        data.sum()
        seconds.append(time.perf_counter() - start)
    return data.numel() * 4 / statistics.median(seconds) / 1e9


def kernels(n: int, k: int, rows: int) -> tuple[dict, dict]:
    """name -> call, and name -> (weight bytes read, relative error against f32)."""
    torch.manual_seed(0)
    w, x = torch.randn(n, k) / k ** 0.5, torch.randn(rows, k)
    xb, reference = x.bfloat16(), x @ w.T
    wb = w.bfloat16()
    codes, scale = int8_codes(w)  # (the formats model.quantize stores: models/int_weights.py)
    runs = {"f32": lambda: x @ w.T, "bf16": lambda: xb @ wb.T,
            "int8 ATen": lambda: torch.ops.aten._weight_int8pack_mm(xb, codes, scale.bfloat16()),
            "int8 ours": lambda c=int_matmul.pack_int8(codes): torch.ops.deepinfer.int8_matmul(x, c, scale, None).squeeze(1)}
    sizes = {"f32": w.numel() * 4, "bf16": w.numel() * 2, "int8 ATen": w.numel() + n * 2, "int8 ours": w.numel() + n * 2}
    for group in (32, 128):
        q, scale_zero = int4_codes(w, group)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)  # (ATen's layout)
        aten_scales, ours = scale_zero.transpose(0, 1).contiguous(), int_matmul.pack_int4(q, scale_zero)
        runs[f"int4 g{group} ATen"] = lambda p=packed, g=group, s=aten_scales: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, p, g, s)
        runs[f"int4 g{group} ours"] = lambda c=ours: torch.ops.deepinfer.int4_matmul(x, *c, None).squeeze(1)
        sizes[f"int4 g{group} ATen"] = sizes[f"int4 g{group} ours"] = w.numel() // 2 + scale_zero.numel() * 2
    errors = {name: float((fn().float() - reference).abs().max() / reference.abs().max()) for name, fn in runs.items()}
    return runs, {name: (sizes[name], errors[name]) for name in runs}


def aot_inductor(n: int, k: int):
    """The LM head's int8 and int4 (ours, group 32) calls through torch.export + AOTInductor vs eager."""
    torch.manual_seed(0)
    w, x = torch.randn(n, k) / k ** 0.5, torch.randn(1, k).bfloat16()
    codes, scale = int8_codes(w)
    q, scale_zero = int4_codes(w, 32)

    class Int8(torch.nn.Module):
        def forward(self, x, codes, scale):
            return torch.ops.deepinfer.int8_matmul(x.float(), codes, scale, None)

    class Int4(torch.nn.Module):
        def forward(self, x, codes, scale_zero):
            return torch.ops.deepinfer.int4_matmul(x.float(), codes, scale_zero, None)

    runs = {}
    work = Path(tempfile.mkdtemp(prefix="quantized-bench-"))
    for name, module, args in (("int8", Int8(), (x, int_matmul.pack_int8(codes), scale)),
                               ("int4 g32", Int4(), (x, *int_matmul.pack_int4(q, scale_zero)))):
        start = time.perf_counter()
        package = torch._inductor.aoti_compile_and_package(torch.export.export(module, args), package_path=str(work / f"{name}.pt2"))
        compiled = torch._inductor.aoti_load_package(package)
        print(f"AOTInductor compiled {name} in {time.perf_counter() - start:.0f} s", flush=True)
        runs[f"{name} eager"] = lambda m=module, a=args: m(*a)
        runs[f"{name} AOTInductor"] = lambda c=compiled, a=args: c(*a)
    for name, ms in take_turns(runs).items():
        print(f"| {name} | {ms:.3f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4], help="activation rows of each product")
    args = parser.parse_args()
    torch.set_num_threads(2)
    bandwidth = read_bandwidth()
    print(f"torch {torch.__version__}, 2 threads; read bandwidth {bandwidth:.1f} GB/s (float32 sum over 512 MiB)\n")
    print("| shape | rows | weights | ms | floor (ms) | / floor | max error / max |f32 result| |")
    print("|---|---|---|---|---|---|---|")
    for shape, (n, k) in SHAPES.items():
        for rows in args.rows:
            runs, facts = kernels(n, k, rows)
            for name, ms in take_turns(runs).items():
                size, error = facts[name]
                floor = size / bandwidth / 1e6
                print(f"| {shape} | {rows} | {name} | {ms:.3f} | {floor:.3f} | {ms / floor:.2f} | {error:.1e} |", flush=True)
    n, k = V, D
    w, x = torch.randn(n, k), torch.randn(1, k)
    codes, scale = int8_codes(w)
    print(f"\nThe slow path: int8 with f32 activations {take_turns({'': lambda: torch.ops.aten._weight_int8pack_mm(x, codes, scale.float())})['']:.2f} ms "
          "(the LM head, one row)\n")
    print("| LM head, one row | ms |")
    print("|---|---|")
    aot_inductor(n, k)


if __name__ == "__main__":
    main()
