"""The inductor backend's fused attention (compiler/backends/fused_attention.py): the model's decode
attention, exported, becomes one latent_attention call computing what the graph did, the cache
written as before; a prompt chunk's many query rows, an attention too small for a call, and the
expanded prefill form stay as they were. Inductor hands the kernel a context bucket's view of the
cache as it lies. The session's AOTInductor bundle calls the kernel."""

import json
import re
import zipfile

import pytest
import torch
import yaml

from deepinfer.compiler.backends import fused_attention
from deepinfer.models import build_model
from tests.compiler.test_gathered_matvec import compiled_code
from tests.conftest import TINY_RECIPE

CONFIG = yaml.safe_load(TINY_RECIPE.read_text())["model"]["config"]  # (4 heads, rows of 32 + 8: one sequence's 512 rows are past FROM_WORK)
FUSED = torch.ops.deepinfer.latent_attention.default


class Attention(torch.nn.Module):
    """A layer's attention as a region computes it: rope angles for the step's positions, the
    step's rows stored into the cache, the attention over what it read."""

    def __init__(self, dtype):
        super().__init__()
        model = build_model(config=CONFIG, seed=0).to(dtype)
        self.embed, self.attention = model.embed, model.layers[0].self_attn

    def forward(self, x, positions, write_slots, read_slots, kv):
        _, _, cos, sin = self.embed(torch.zeros_like(positions), positions)
        return self.attention(x, cos, sin, positions, write_slots, read_slots, kv)


def step(T, read_slots, positions, L=256, dtype=torch.float32):
    generator = torch.Generator().manual_seed(0)
    kv = torch.randn(4, L, 40, generator=generator).to(dtype)
    x = torch.randn(T, CONFIG["hidden_size"], generator=generator).to(dtype)
    positions = torch.tensor(positions)
    return x, positions, torch.tensor(read_slots), torch.tensor(read_slots), kv


def rewritten(module, args):
    program = torch.export.export(module, tuple(a.clone() for a in args))
    return fused_attention.apply(program)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, read_slots, positions, L", [(1, [2], [200], 512), (4, [0, 3, 1, 2], [7, 255, 100, 0], 256),
                                                       (4, [1] * 4, [50, 51, 52, 53], 256)],
                         ids=["one sequence", "a batch", "speculated rows of one"])
def test_a_decode_steps_attention_becomes_one_kernel_call_with_the_graphs_result(dtype, T, read_slots, positions, L):
    module = Attention(dtype)
    args = step(T, read_slots, positions, L=L, dtype=dtype)
    program = rewritten(module, args)
    targets = [node.target for node in program.graph.nodes]
    assert targets.count(FUSED) == 1 and torch.ops.aten.softmax.int not in targets, program.graph
    expected_kv, got_kv = args[-1].clone(), args[-1].clone()
    expected = module(*args[:-1], expected_kv)
    got = program.module()(*args[:-1], got_kv)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(got_kv, expected_kv, atol=0, rtol=0)  # (the step's rows stored, and read)


@pytest.mark.parametrize("T, positions, L", [(16, list(range(16)), 256), (1, [5], 16), (64, list(range(64)), 256)],
                         ids=["a prompt chunk's 64 query rows", "a small attention", "an expanded prompt chunk"])
def test_prompt_chunks_and_small_attentions_stay_as_they_were(T, positions, L):
    program = rewritten(Attention(torch.float32), step(T, [1], positions, L=L))
    assert FUSED not in [node.target for node in program.graph.nodes]


def test_the_sessions_aotinductor_bundle_calls_the_kernel(tiny_bundle):
    """The tiny recipe's decode batch of 4 over 256 positions: the fused form, run by
    test_executor's tokens-equal-eager test."""
    bundle = tiny_bundle("inductor")
    manifest = json.loads((bundle / "manifest.json").read_text())
    attention = manifest["programs"]["decode/4"]["steps"][1]["region"]
    (region,) = (bundle / "regions").glob(f"{attention}*")
    with zipfile.ZipFile(region) as archive:
        wrapper = next(archive.read(name).decode() for name in archive.namelist() if name.endswith(".wrapper.cpp"))
    assert wrapper.count("AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_cpu_latent_attention(") == 1


def stored_and_attended(queries, kv, slots, positions, rows):
    """A region's decode attention after fused_attention: the step's rows stored, then the kernel."""
    kv.index_put_((slots, positions), rows)
    visible = torch.arange(kv.shape[1])[None, :] <= positions[:, None]
    return FUSED(queries * 2, kv, slots, visible, 0.1, 32)


def test_a_context_buckets_view_of_the_cache_reaches_the_kernel_uncopied():
    """The op's needs_fixed_stride_order: inductor passes the bucket's view of the pool (the first
    256 of 512 positions a slot) where it lies, the step's rows stored into it, instead of copying
    every slot's rows into a buffer of the bucket's exact strides each step."""
    pool = torch.randn(4, 512, 40)
    args = (torch.randn(2, 4, 40), pool[:, :256], torch.tensor([3, 1]), torch.tensor([100, 7]), torch.randn(2, 40))
    expected_pool = pool.clone()
    expected = stored_and_attended(args[0], expected_pool[:, :256], *args[2:])
    got, code = compiled_code(stored_and_attended, *args)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool, expected_pool, atol=0, rtol=0)
    (call,) = re.findall(r"torch\.ops\.deepinfer\.latent_attention\.default\((\w+), (\w+),", code)
    assert re.fullmatch(r"arg\d+_1", call[1]), f"the cache argument is {call[1]}, a copy, not the region's input:\n{code}"
