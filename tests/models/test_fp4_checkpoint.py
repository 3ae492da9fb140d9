"""DeepSeek-V4 in its release format: fp8 weights with power-of-two (e8m0) block scales and routed
experts in fp4 e2m1 (two a byte, an e8m0 scale per 32 inputs). The decoders against a table of
every code, and the greedy tokens against transformers on the weights those bytes decode to."""

import math

import pytest
import torch

from deepinfer.models import build_model
from deepinfer.models.quantization import e2m1_values, e8m0_values
from tests.conftest import tiny_v4_config
from tests.models.fp8_release import reference_tokens, write_v4_release
from tests.models.test_fp8_checkpoint import PROMPTS, assert_prefill_logits_match, compile_fp8, run_tokens

transformers = pytest.importorskip("transformers")

# OCP Microscaling e2m1: codes 0-7 are +0, 0.5, 1, 1.5, 2, 3, 4, 6; codes 8-15 the same negated.
E2M1_TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def test_e2m1_decodes_every_code():
    got = e2m1_values(torch.arange(16, dtype=torch.uint8)).tolist()
    assert got == E2M1_TABLE and [math.copysign(1, v) for v in got] == [math.copysign(1, v) for v in E2M1_TABLE]


def test_e8m0_decodes_every_code():
    got = e8m0_values(torch.arange(256, dtype=torch.uint8))
    assert got[:255].tolist() == [2.0 ** (code - 127) for code in range(255)] and math.isnan(got[255])
    assert torch.equal(got[:255], torch.arange(255, dtype=torch.uint8).view(torch.float8_e8m0fnu).float())  # torch's own


@pytest.fixture(scope="module")
def v4_release(tmp_path_factory):
    from tests.models.test_hf_parity import decisive_init

    hf = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**tiny_v4_config())).eval()
    decisive_init(hf, seed=3)
    release, dequantized = tmp_path_factory.mktemp("v4-release"), tmp_path_factory.mktemp("v4-dequantized")
    write_v4_release(hf, release, dequantized)
    return release, *reference_tokens(transformers.DeepseekV4ForCausalLM, dequantized, PROMPTS, 8)


def test_v4_experts_stay_fp4_and_match_transformers_in_eager(v4_release):
    release, hf, _ = v4_release
    kept = build_model("deepseek_v4", checkpoint=release)
    ffn = kept.layers[3].ffn
    assert ffn.experts_w13.dtype == torch.uint8 and ffn.experts_w13.shape == (8, 64, 32)  # [E, 2I, D/2]: two codes a byte
    assert ffn.experts_w13_scale_inv.shape == (8, 64, 2)  # one e8m0 byte per 32 inputs
    assert kept.layers[3].attn.wq_a.weight.dtype == torch.float8_e4m3fn and kept.layers[3].attn.compressor.wkv.weight.dtype == torch.float32
    assert_prefill_logits_match(hf, kept, build_model("deepseek_v4", checkpoint=release, quantized_weights="dequantize"))


def test_v4_compiled_at_world_size_2_gives_the_tokens_of_transformers(v4_release, tmp_path, cache_dir):
    """Kept fp4 experts split over ep=2, every region through StableHLO and XLA (the pjrt backend:
    V4's state rings, compressors, indexer, hash routing; the fp4 and e8m0 decoders' shifts and
    unsigned compares, which torch-mlir lacks or gets wrong, rewritten). The export backend and
    world size 1 pass too: left out of CI for their minutes; dequantize-at-compile reads through
    the same code as the eager test's dequantized model. Compiled without weights, then the weights
    step streams the release's fp8 and fp4 tensors (names, dtypes, scale layouts as released) in."""
    from deepinfer.compiler.add_weights import add_weights

    release, _, expected = v4_release
    bundle = compile_fp8(release, tmp_path, cache_dir, "pjrt", "keep", 2, arch="deepseek_v4", weights=False).bundle
    assert add_weights(bundle, release, progress=False) == [0, 1]
    assert run_tokens(bundle, PROMPTS) == expected


def test_a_v4_release_requantized_to_int8_gives_the_tokens_of_transformers(v4_release):
    """model.quantize on the fp4 / fp8 release: its weights dequantized as read, then quantized
    (eager: the bundles' path is the fp8 V3 release's, tested there). int8 keeps transformers'
    first tokens (later ones drift on this random model); int4's experts are codes too (its
    tokens drift from the first or second)."""
    from deepinfer.compiler.eager import eager_engine
    from deepinfer.runtime.engine import Request

    release, _, expected = v4_release
    tokens = {}
    for quantize in ("int8", "int4"):
        model = build_model("deepseek_v4", checkpoint=release, quantize=quantize)
        engine = eager_engine(model, prefill_buckets=(16,), decode_buckets=(1,))
        tokens[quantize] = [engine.generate([Request(p, 8)])[0].token_ids for p in PROMPTS]
    assert [t[:4] for t in tokens["int8"]] == [t[:4] for t in expected], (tokens, expected)
    ffn = model.layers[3].ffn
    assert ffn.experts_w13.dtype == torch.uint8 and ffn.experts_w13.shape == (8, 64, 32) and ffn.experts_w13_qscale.shape == (8, 64, 2, 2)
    assert all(len(t) == 8 for t in tokens["int4"])
