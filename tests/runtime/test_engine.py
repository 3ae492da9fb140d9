"""The engine's scheduling (queue, chunked prefill, batched decode, padding) must not change tokens."""

import pytest
import torch

from deepinfer.compiler.eager import eager_engine
from deepinfer.models import TINY_CONFIG, build_model
from deepinfer.runtime.engine import Request
from deepinfer.runtime.errors import DeepinferError
from deepinfer.runtime.sampling import SamplingParams, sample
from tests.models.conftest import greedy

PROMPTS = [[5, 6, 7], list(range(20, 60)), [100] * 17, [9, 8], list(range(200, 230)), [1, 2, 3, 4, 5, 6]]


@pytest.fixture(scope="module")
def model():
    return build_model(config=TINY_CONFIG, seed=0)


def test_batched_queued_generation_equals_each_prompt_alone(model):
    # 6 prompts, 4 slots (a queue and slot reuse), decode buckets up to 2 (several steps a token).
    engine = eager_engine(model, prefill_buckets=(8, 16), decode_buckets=(1, 2), max_seqs=4, max_len=128)
    results = engine.generate([Request(p, max_tokens=10) for p in PROMPTS])
    for prompt, result in zip(PROMPTS, results):
        alone, _ = greedy(model, prompt, 10)
        eos = model.config.eos_token_id
        expected = alone[: alone.index(eos) + 1] if eos in alone else alone
        assert result.token_ids == expected
        assert result.finish_reason == ("eos" if eos in alone else "max_tokens") and result.ttft > 0


def test_prompt_past_context_limit_is_a_clear_error(model):
    engine = eager_engine(model, max_len=32)
    with pytest.raises(DeepinferError, match=r"32 tokens is past the context limit.*kv.max_len=32"):
        engine.generate([Request(list(range(32)))])


def test_generation_stops_at_context_limit_and_eos(model):
    engine = eager_engine(model, max_len=24)
    [result] = engine.generate([Request(list(range(20)), max_tokens=50)])
    assert result.finish_reason == "context" and len(result.prompt_ids) + len(result.token_ids) == 25
    first = eager_engine(model).generate([Request([5, 6, 7], max_tokens=8)])[0].token_ids
    engine = eager_engine(model)
    engine.eos_id = first[2]
    [result] = engine.generate([Request([5, 6, 7], max_tokens=8)])
    assert result.token_ids == first[:3] and result.finish_reason == "eos"


def test_sampling_is_seeded_and_top_p_narrows_to_greedy():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=0)
    a = sample(logits, params, torch.Generator().manual_seed(1))
    b = sample(logits, params, torch.Generator().manual_seed(1))
    assert torch.equal(a, b)
    tiny_p = sample(logits, SamplingParams(temperature=1.0, top_p=1e-6), torch.Generator().manual_seed(1))
    assert torch.equal(tiny_p, logits.argmax(-1))
    draws = torch.stack([sample(logits, SamplingParams(temperature=2.0), torch.Generator().manual_seed(s)) for s in range(20)])
    assert len(set(draws[:, 0].tolist())) > 1  # real sampling, not argmax


def test_max_tokens_1_and_a_first_token_eos_give_exactly_one_token(model):
    first = eager_engine(model).generate([Request([5, 6, 7], max_tokens=8)])[0].token_ids
    [result] = eager_engine(model).generate([Request([5, 6, 7], max_tokens=1)])
    assert result.token_ids == first[:1] and result.finish_reason == "max_tokens"
    engine = eager_engine(model)
    engine.eos_id = first[0]
    [result, other] = engine.generate([Request([5, 6, 7], max_tokens=8), Request([9, 8], max_tokens=3)])
    assert result.token_ids == first[:1] and result.finish_reason == "eos" and len(other.token_ids) <= 3


@pytest.mark.parametrize("request_, message", [
    (Request([1, 320, 3]), r"token id 320 is outside the model's vocabulary \[0, 320\)"),
    (Request([-1]), r"token id -1 is outside"),
    (Request([1], max_tokens=0), r"max_tokens=0: give at least 1"),
    (Request([1], sampling=SamplingParams(top_p=0.0)), r"top_p=0.0: give a number in \(0, 1\]"),
    (Request([1], sampling=SamplingParams(temperature=float("nan"))), r"temperature=nan: give a finite number"),
    (Request([1], sampling=SamplingParams(temperature=-1.0)), r"temperature=-1.0"),
])
def test_bad_requests_are_refused_at_the_door(model, request_, message):
    engine = eager_engine(model)
    engine.vocab_size = model.config.vocab_size
    with pytest.raises(DeepinferError, match=message):
        engine.generate([request_])


def test_a_long_prompt_is_prefilled_in_chunks_while_others_decode(model):
    engine = eager_engine(model, prefill_buckets=(8, 16), decode_buckets=(1, 2), max_seqs=2, max_len=128)
    running = engine.submit(Request([5, 6, 7], max_tokens=20))
    assert engine.step() == [running]  # its prompt fits one chunk: first token
    long = engine.submit(Request(list(range(20, 60)), max_tokens=5))  # 40 tokens: chunks of 16, 16, 8
    for _ in range(2):
        assert engine.step() == [running] and long.prefilled in (16, 32)  # a token every iteration meanwhile
    assert engine.step() == [long, running] and long.result.token_ids  # the last chunk, then both decode
    engine.cancel(running)
    assert running.result.finish_reason == "cancelled" and engine.free_slots == [running.slot]
    while engine.busy:
        engine.step()
    alone, _ = greedy(model, list(range(20, 60)), 5)
    assert long.result.token_ids == alone[: len(long.result.token_ids)] and long.result.finish_reason in ("max_tokens", "eos")


@pytest.mark.parametrize("params", [SamplingParams(temperature=1e-300), SamplingParams(temperature=1e-6),
                                    SamplingParams(temperature=1.0, top_p=1e-300), SamplingParams(temperature=1e-300, top_p=1e-300)])
def test_parameters_that_underflow_in_float32_still_sample(params):
    """In range, yet 0 in float32: a tiny temperature is greedy, a tiny top_p keeps the top token."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample(logits, params, torch.Generator().manual_seed(1)), logits.argmax(-1))


def test_a_sampling_failure_fails_its_request_only(model):
    engine = eager_engine(model)
    run = engine.executor.run

    def run_with_one_bad_row(step):  # the model gives NaN logits for slot 0 only
        logits = run(step)
        rows = (step.read_slot if step.method == "prefill" else step.slots)[: logits.shape[0]]
        return logits.masked_fill((rows == 0)[:, None], float("nan"))

    engine.executor.run = run_with_one_bad_row
    sampled = SamplingParams(temperature=1.0, seed=3)
    bad, good = engine.generate([Request([5, 6, 7], max_tokens=4, sampling=sampled), Request([9, 8], max_tokens=4, sampling=sampled)])
    assert bad.finish_reason == "error" and "sampling failed" in bad.error and not bad.token_ids
    assert good.finish_reason == "max_tokens" and len(good.token_ids) == 4
