"""Serving on a CPU against llama.cpp's server at the same bit width, on the same weights:
deepinfer-serve (float32, int8 and int4 bundles of cpu_decode_bench.py's ~190M DeepSeek-V3)
against llama-server (f32, q8_0 and q4_0 GGUFs, `-np 4`: four parallel slots), output tokens/s at
concurrency 1 and 4.

    .venv/bin/python bench/cpu_serve_bench.py                   # ~30 minutes cold (llama.cpp's build aside)
    .venv/bin/python bench/cpu_serve_bench.py --formats int4    # one pair

Each request: a PROMPT_LEN-token prompt of random ids and OUTPUT_LEN tokens (EOS ignored), through
the official openai client's completions call, not streamed; output tokens/s = the completion
tokens of all requests over the level's wall time. Both servers use 2 threads and serve one
after the other (never side by side), a level at a time. Target (#44): >= 1.0x llama-server's at
concurrency 1 and 4.
"""

import argparse
import asyncio
import json
import random
import subprocess
import time
from pathlib import Path

import openai
import torch
from cpu_decode_bench import compile_bundle, random_checkpoint
from llama_cpp_reference import LlamaCpp
from serve_bench import start_server, wait_until_ready

from deepinfer.runtime.launch import free_port

PROMPT_LEN, OUTPUT_LEN, REQUESTS = 128, 64, 12
PAIRS = {"float32": (None, "f32"), "int8": ("int8", "q8_0"), "int4": ("int4", "q4_0")}  # ours (model.quantize) -> llama.cpp's type
CONCURRENCY = (1, 4)
METHODS = {"decode": {"buckets": [1, 2, 4], "context": [256]}, "prefill": {"buckets": [128], "context": [256]}}


def llama_server(llama: LlamaCpp, gguf: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    # (--no-jinja: completions only, and its template parser fails on the tiny tokenizer's chat template)
    server = subprocess.Popen([str(llama.bin / "llama-server"), "-m", str(gguf), "-t", "2", "-np", "4", "-c", "2048",
                               "--no-jinja", "--port", str(port), *([] if llama.repacks(gguf) else ["--no-repack"])], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return server, f"http://127.0.0.1:{port}"


async def output_tokens_per_second(url: str, model: str, vocab: int, concurrency: int) -> float:
    rng = random.Random(concurrency)
    queue = [[rng.randrange(3, vocab) for _ in range(PROMPT_LEN)] for _ in range(REQUESTS)]
    tokens = 0
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600) as client:

        async def worker():
            nonlocal tokens
            while queue:
                reply = await client.completions.create(model=model, prompt=queue.pop(), max_tokens=OUTPUT_LEN,
                                                        temperature=0, extra_body={"ignore_eos": True})
                tokens += reply.usage.completion_tokens

        await client.completions.create(model=model, prompt=[5] * PROMPT_LEN, max_tokens=4, temperature=0)  # warm
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return tokens / (time.perf_counter() - start)


def measure(server: subprocess.Popen, url: str, model: str, vocab: int) -> dict[int, float]:
    try:
        wait_until_ready(server, url)
        return {c: asyncio.run(output_tokens_per_second(url, model, vocab, c)) for c in CONCURRENCY}
    finally:
        server.terminate()
        server.wait(60)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", nargs="+", default=list(PAIRS), choices=list(PAIRS), help="our weights, each against llama.cpp's at its width")
    parser.add_argument("--work", type=Path, default=Path.home() / ".cache" / "deepinfer-bench" / "cpu-decode")
    parser.add_argument("--llama-cpp", type=Path, default=Path.home() / ".cache" / "deepinfer-bench" / "llama.cpp")
    args = parser.parse_args()
    llama = LlamaCpp.build(args.llama_cpp)
    checkpoint = random_checkpoint(args.work / "hf-190m")
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    print(f"torch {torch.__version__}; {PROMPT_LEN}-token prompts, {OUTPUT_LEN} output tokens, {REQUESTS} requests a level")
    print("\n| weights | concurrency | deepinfer tok/s | llama-server tok/s | ratio |\n|---|---|---|---|---|")
    for ours, (quantize, theirs) in ((f, PAIRS[f]) for f in args.formats):
        bundle = compile_bundle(checkpoint, f"190m-serve-{ours}", "float32", quantize, args.work, METHODS, max_seqs=4).bundle
        gguf = llama.convert(checkpoint, args.work / f"190m-{theirs}.gguf", theirs)
        mine = measure(*start_server(bundle), f"190m-serve-{ours}", vocab)
        theirs_tok_s = measure(*llama_server(llama, gguf), "model", vocab)
        for c in CONCURRENCY:
            print(f"| {ours} / {PAIRS[ours][1]} | {c} | {mine[c]:.1f} | {theirs_tok_s[c]:.1f} | "
                  f"{mine[c] / theirs_tok_s[c]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
