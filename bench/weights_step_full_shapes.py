"""The weights step at the released models' real tensor shapes: a checkpoint generated in the
release's layout (DeepSeek-V3: transformers' names, fp8 e4m3 weights with float32 128x128 block
scales `weight_scale_inv`; V4-Flash: DeepSeek's own names, fp8 with e8m0 block scales `.scale`,
fp4 e2m1 experts two a byte with an e8m0 scale per 32 inputs, int64 hash-routing tables), every
tensor at its full size (the 1.85 GB embedding and LM head, 7168 x 18432 dense MLPs, 2048-wide
experts) but fewer layers and experts, so it fits this disk. Per model, at world size 2 (tp 2, ep 2):

1. the one-step compile (weights written by the compile) -> bundle A;
2. `--no-weights`, then `deepinfer-compile weights` killed (SIGKILL) once rank 0's file is recorded,
   then run again -> bundle B; rank 0's file must be left as it was (same inode and mtime);
3. A's and B's weight files must be byte-identical, and `deepinfer-run` must give the same greedy
   tokens from both;
4. peak RSS of the weights step (GNU time) against 2x the largest tensor plus a fixed overhead,
   measured as the peak of the same command on the finished bundle (it imports, checks the
   checkpoint, verifies every file and writes nothing).

    .venv/bin/python bench/weights_step_full_shapes.py          # both: ~15 minutes, ~25 GB under /tmp at once
    .venv/bin/python bench/weights_step_full_shapes.py deepseek-v3-671b
"""

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml
from safetensors import safe_open
from safetensors.torch import save_file

from deepinfer.models import ARCHS, build_model, stored_dtype
from deepinfer.models.quantization import BLOCK, FP4, FP4_GROUP, FP8, SCALE_SUFFIX

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
MODELS = {  # config changes: fewer layers and experts, every tensor at its real shape
    "deepseek-v3-671b": {"num_hidden_layers": 2, "first_k_dense_replace": 1, "n_routed_experts": 16, "n_group": 8,
                         "topk_group": 4, "num_nextn_predict_layers": 0},
    "deepseek-v4-flash": {"num_hidden_layers": 4, "n_routed_experts": 16},
}
SHARD_BYTES = 1 << 30  # a checkpoint shard's size, as releases split theirs


def write_checkpoint(model: str, directory: Path) -> int:
    """The release-layout checkpoint of the cut config; returns its largest tensor's bytes."""
    config = json.loads((ROOT / "recipes" / "full-size" / "configs" / model.removesuffix("-671b") / "config.json").read_text())
    config.update(MODELS[model])
    if config.get("layer_types"):
        config["layer_types"] = config["layer_types"][: config["num_hidden_layers"]]
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    arch = "deepseek_v4" if "v4" in model else "deepseek_v3"
    full = build_model(arch, checkpoint=directory, device="meta")
    upstream_names = arch == "deepseek_v4"  # V4 ships DeepSeek's own names, V3 transformers'
    generator = torch.Generator().manual_seed(0)
    shard, shard_bytes, index, largest = {}, 0, {}, 0
    for name, param in full.named_parameters():
        if name.endswith(SCALE_SUFFIX):
            continue  # written with its weight
        logical = (*param.shape[:-1], param.shape[-1] * 2) if param.dtype == FP4 else tuple(param.shape)
        for key, shape in ARCHS[arch].checkpoint_keys(name, full.config, logical, not upstream_names):
            for stored_key, tensor in released(name, key, shape, param.dtype, stored_dtype(full, name, torch.bfloat16),
                                               full.config, upstream_names, generator):
                shard[stored_key] = tensor
                size = tensor.numel() * tensor.element_size()
                shard_bytes, largest = shard_bytes + size, max(largest, size)
            if shard_bytes >= SHARD_BYTES:
                _save(shard, directory, index)
                shard, shard_bytes = {}, 0
    _save(shard, directory, index)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}, indent=1))
    return largest


def _save(shard: dict, directory: Path, index: dict):
    if shard:
        name = f"model-{len(set(index.values())) + 1:05d}.safetensors"
        save_file(shard, str(directory / name), metadata={"format": "pt"})
        index.update(dict.fromkeys(shard, name))


def released(name: str, key: str, shape: tuple, kept: torch.dtype, dtype: torch.dtype, config, upstream_names: bool, generator):
    """[(key, tensor)] as the release stores our parameter `name`'s checkpoint tensor `key`."""
    fan_in = shape[-1]
    if kept in (FP8, FP4):
        scale_key = key.removesuffix(".weight") + ".scale" if upstream_names else key + SCALE_SUFFIX
        e8m0 = upstream_names  # V4's scales are powers of two, stored as e8m0
        if kept == FP4:  # e2m1 codes two a byte, an e8m0 scale per 32 inputs
            codes = torch.randint(-128, 128, (*shape[:-1], shape[-1] // 2), generator=generator, dtype=torch.int8)
            return [(key, codes), (scale_key, _scales((shape[0], shape[1] // FP4_GROUP), fan_in, True, generator))]
        weight = torch.randn(shape, generator=generator).to(FP8)
        grid = (math.ceil(shape[0] / BLOCK), math.ceil(shape[1] / BLOCK))
        return [(key, weight), (scale_key, _scales(grid, fan_in, e8m0, generator))]
    leaf = name.rpartition(".")[2]
    if name.endswith("tid2eid"):  # hash routing: each token's distinct experts
        return [(key, torch.stack([torch.randperm(config.n_routed_experts, generator=generator)[: shape[1]]
                                   for _ in range(shape[0])]))]
    if name.endswith("norm.weight") or (leaf.startswith("hc_") and leaf.endswith("_scale")):
        value = torch.ones(shape)
    elif leaf.startswith("hc_") and leaf.endswith("_base"):
        value = torch.zeros(shape)
    elif name.endswith(("bias", ".attn_sink", ".ape")):
        value = torch.randn(shape, generator=generator) * 0.1
    else:
        value = torch.randn(shape, generator=generator) / math.sqrt(fan_in if name != "embed.weight" else 1)
    return [(key, value.to(dtype))]


def _scales(shape: tuple, fan_in: int, e8m0: bool, generator) -> torch.Tensor:
    """Block scales of about 1/sqrt(fan_in): float32, or e8m0 (powers of two)."""
    if e8m0:
        return torch.full(shape, 127 + round(math.log2(fan_in**-0.5)), dtype=torch.uint8).view(torch.float8_e8m0fnu)
    return (1 + 0.1 * torch.rand(shape, generator=generator)) * fan_in**-0.5


def write_recipe(model: str, checkpoint: Path, work: Path) -> Path:
    recipe = {"name": f"{model}-cut", "model": {"arch": "deepseek_v4" if "v4" in model else "deepseek_v3", "checkpoint": str(checkpoint)},
              "dtype": "bfloat16", "parallel": {"world_size": 2, "tp": 2, "ep": 2},
              "methods": {"decode": {"buckets": [1]}, "prefill": {"buckets": [16]}}, "kv": {"max_seqs": 2, "max_len": 128},
              "backend": {"name": "export"}, "output": str(work / "unused")}
    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def timed(command: list[str], env: dict | None = None) -> tuple[float, int, str]:
    """(seconds, peak RSS bytes, output) of a command that must succeed."""
    start = time.perf_counter()
    done = subprocess.run(["/usr/bin/time", "-f", "peak-rss-kib %M", *command], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    rss = int(re.search(r"peak-rss-kib (\d+)", done.stderr).group(1)) * 1024
    return time.perf_counter() - start, rss, done.stdout + done.stderr


def kill_when_recorded(command: list[str], bundle: Path, rel: str) -> float:
    """Start the weights step and SIGKILL it once the manifest records `rel`; returns the seconds."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    while process.poll() is None:
        manifest = bundle / "manifest.json"
        try:
            if rel in json.loads(manifest.read_text()).get("files", {}):
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                return time.perf_counter() - start
        except (OSError, ValueError):  # (the manifest mid-replace)
            pass
        time.sleep(0.2)
    raise SystemExit(f"the weights step ended ({process.returncode}) before it could be killed halfway")


def greedy(bundle: Path) -> list[int]:
    """The greedy token ids deepinfer-run generates from the bundle (a config-only checkpoint has no
    tokenizer: token ids past 255 print as nothing)."""
    done = subprocess.run([str(BIN / "deepinfer-run"), "--bundle", str(bundle), "--prompt-ids", "1,2,3,4,5", "--max-tokens", "8",
                           "--json"], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"deepinfer-run {bundle} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["results"][0]["token_ids"]


def check_model(model: str, work: Path):
    compile_cli = [str(BIN / "deepinfer-compile")]
    start = time.perf_counter()
    largest = write_checkpoint(model, work / "checkpoint")
    checkpoint_bytes = sum(f.stat().st_size for f in (work / "checkpoint").glob("*.safetensors"))
    print(f"\n{model}: checkpoint of {checkpoint_bytes / 2**30:.2f} GiB written in {time.perf_counter() - start:.0f} s "
          f"(largest tensor {largest / 2**30:.2f} GiB)", flush=True)
    recipe = write_recipe(model, work / "checkpoint", work)
    cache = ["--cache-dir", str(work / "cache")]
    one_step, one_step_rss, _ = timed([*compile_cli, str(recipe), "--out", str(work / "A"), *cache])
    timed([*compile_cli, str(recipe), "--no-weights", "--out", str(work / "B"), *cache])
    step = [*compile_cli, "weights", str(work / "B"), "--checkpoint", str(work / "checkpoint")]
    killed_after = kill_when_recorded(step, work / "B", "weights/rank-0.safetensors")
    rank0 = work / "B" / "weights" / "rank-0.safetensors"
    before = (rank0.stat().st_ino, rank0.stat().st_mtime_ns)
    rerun, rerun_rss, out = timed(step)
    assert (rank0.stat().st_ino, rank0.stat().st_mtime_ns) == before, "the rerun rewrote rank 0's finished file"
    assert "weights of 1 rank(s)" in out, out[-2000:]
    baseline, baseline_rss, _ = timed(step)  # nothing left to write: imports, checks, verifies
    files = [json.loads((work / b / "manifest.json").read_text())["files"] for b in "AB"]
    for rank in range(2):
        rel = f"weights/rank-{rank}.safetensors"
        assert files[0][rel] == files[1][rel], f"{rel} differs between the one-step compile and the weights step"
    tokens = [greedy(work / b) for b in "AB"]
    assert tokens[0] == tokens[1], tokens
    rank_bytes = (work / "B" / "weights" / "rank-1.safetensors").stat().st_size
    bound = 2 * largest + baseline_rss
    print(f"  one-step compile: {one_step:.0f} s, peak RSS {one_step_rss / 2**30:.2f} GiB")
    print(f"  weights step: killed after rank 0's file ({killed_after:.0f} s); the rerun wrote rank 1 only "
          f"({rank_bytes / 2**30:.2f} GiB) in {rerun:.0f} s, rank 0's file untouched; a rerun with nothing left: {baseline:.0f} s")
    print(f"  peak RSS {rerun_rss / 2**30:.2f} GiB <= 2 x largest tensor + fixed overhead = 2 x {largest / 2**30:.2f} + "
          f"{baseline_rss / 2**30:.2f} = {bound / 2**30:.2f} GiB: {'ok' if rerun_rss <= bound else 'OVER'}")
    print(f"  weight files identical to the one-step compile's; greedy tokens identical: {tokens[0]}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", default=list(MODELS), choices=list(MODELS))
    args = parser.parse_args()
    for model in args.models:
        with tempfile.TemporaryDirectory(prefix="deepinfer-weights-step-") as work:
            check_model(model, Path(work))


if __name__ == "__main__":
    main()
