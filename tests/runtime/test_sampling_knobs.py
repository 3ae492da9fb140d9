"""vLLM's and OpenAI's sampling knobs, each against the formula its documentation gives, and the
logprobs the engine reports (prompt and generated) against the eager model's own log-softmax."""

import math

import pytest
import torch

from deepinfer.compiler.eager import eager_engine
from deepinfer.models import TINY_CONFIG, build_model
from deepinfer.runtime.engine import Engine, Request
from deepinfer.runtime.errors import DeepinferError
from deepinfer.runtime.sampling import SamplingParams, adjust, probabilities, token_logprobs
from tests.models.conftest import MAX_LEN, MAX_SEQS, prefill

V = 50


@pytest.fixture(scope="module")
def model():
    return build_model(config=TINY_CONFIG, seed=0)


def test_penalties_bias_and_min_tokens_follow_vllms_formulas():
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(0))
    prompt, histories = [1, 2, 3], [[4, 4, 5], [4, 4, 5, 2]]
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.3,
                            logit_bias=((7, 5.0), (8, -100.0)), min_tokens=4)
    out = adjust(logits, params, prompt, histories, stop_ids=[9, 10])
    for row, history, got in zip(logits, histories, out):
        want = row.clone()
        want[7] += 5.0
        want[8] -= 100.0
        if len(history) < 4:
            want[[9, 10]] = -math.inf
        for t in set(prompt) | set(history):  # repetition: divide a positive logit, multiply a negative one
            want[t] = want[t] / 1.3 if want[t] > 0 else want[t] * 1.3
        for t in set(history):
            want[t] -= 0.25 * history.count(t) + 0.5
        assert torch.allclose(got, want, atol=1e-6)
    assert adjust(logits, SamplingParams(), prompt, histories, [9]) is logits  # nothing asked: untouched


def test_a_tiny_repetition_penalty_saturates_instead_of_overflowing():
    """repetition_penalty in (0, 2] divides a positive logit: by 1e-300 that is past float32, so
    it saturates at a logit still finite after the smallest sampling temperature."""
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1e-5, repetition_penalty=1e-300)
    out = adjust(logits, params, [1, 2, 3], [[4]], stop_ids=[])
    assert torch.isfinite(out).all() and torch.isfinite(probabilities(out, params)).all()
    positive = [t for t in (1, 2, 3, 4) if logits[0, t] > 0]
    assert positive and all(out[0, t] == 1e30 for t in positive)


def test_top_k_and_min_p_keep_what_the_formulas_keep():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    p = probabilities(logits, SamplingParams(temperature=0.7, top_k=5))
    for row, probs in zip(logits, p):
        kept = set(row.topk(5).indices.tolist())
        assert set(probs.nonzero()[:, 0].tolist()) == kept
        assert torch.allclose(probs[list(kept)], (row[list(kept)] / 0.7).softmax(-1), atol=1e-6)
    p = probabilities(logits, SamplingParams(temperature=0.7, min_p=0.2))
    for row, probs in zip(logits, p):
        full = (row / 0.7).softmax(-1)
        assert set(probs.nonzero()[:, 0].tolist()) == set((full >= 0.2 * full.max()).nonzero()[:, 0].tolist())


def test_engine_knobs_change_tokens_as_asked(model):
    engine = eager_engine(model)
    prompt = list(range(20, 40))
    plain = engine.generate([Request(prompt, 12)])[0].token_ids
    # logit_bias +100 on one token: greedy picks it every step
    biased = engine.generate([Request(prompt, 6, SamplingParams(logit_bias=((77, 100.0),)))])[0]
    assert biased.token_ids == [77] * 6
    # stop_token_ids: the sequence ends at the first one, which is kept
    stop = plain[4]
    stopped = engine.generate([Request(prompt, 12, SamplingParams(stop_token_ids=(stop,)))])[0]
    assert stopped.token_ids == plain[: plain.index(stop) + 1] and stopped.finish_reason == "stop_token"
    # min_tokens: EOS cannot end it before
    engine.eos_id = plain[1]
    assert engine.generate([Request(prompt, 12)])[0].token_ids == plain[:2]
    held = engine.generate([Request(prompt, 12, SamplingParams(min_tokens=5))])[0].token_ids
    assert len(held) >= 5 and plain[1] not in held[:5]
    engine.eos_id = None
    # repetition_penalty at 2: no greedy token repeats one the prompt or the output had ... where it changed anything
    repeated = engine.generate([Request([5] * 8, 12)])[0].token_ids
    penalized = engine.generate([Request([5] * 8, 12, SamplingParams(repetition_penalty=2.0, frequency_penalty=2.0))])[0]
    assert penalized.token_ids != repeated and len(set(penalized.token_ids)) > len(set(repeated))
    # a seed reproduces a sampled sequence; another seed does not
    sampled = [engine.generate([Request(prompt, 12, SamplingParams(temperature=1.0, top_k=20, min_p=0.01, seed=s))])[0].token_ids
               for s in (3, 3, 4)]
    assert sampled[0] == sampled[1] != sampled[2]


def test_knobs_out_of_range_are_refused(model):
    engine = eager_engine(model)
    for params, match in ((SamplingParams(top_k=-1), "top_k"), (SamplingParams(min_p=1.5), "min_p"),
                          (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
                          (SamplingParams(logit_bias=((10**6, 1.0),)), "outside the model's vocabulary"),
                          (SamplingParams(logprobs=21), "logprobs=21")):
        with pytest.raises(DeepinferError, match=match):
            engine.check(Request([1, 2], 4, params))
    with pytest.raises(DeepinferError, match="max_tokens=0"):
        engine.check(Request([1, 2], 0))


def test_logprobs_are_the_models_log_softmax(model):
    """Prompt logprobs (score steps over three prefill chunks) and generated ones, against the
    eager model's decode steps fed the sequence one token at a time."""
    engine = eager_engine(model, prefill_buckets=(16,))
    prompt = list(range(30, 70))  # 40 tokens: three chunks of 16
    [result] = engine.generate([Request(prompt, 5, SamplingParams(logprobs=3, prompt_logprobs=4))])
    sequence = prompt + result.token_ids
    logprobs = teacher_forced(model, sequence).log_softmax(-1)
    assert len(result.prompt_logprobs) == len(prompt) - 1 and len(result.logprobs) == 5
    for i, (lp, top) in enumerate(result.prompt_logprobs + result.logprobs):
        row = logprobs[i]
        assert lp == pytest.approx(row[sequence[i + 1]].item(), abs=1e-4)
        assert [t for t, _ in top] == row.topk(len(top)).indices.tolist()
        assert [v for _, v in top] == pytest.approx(row.topk(len(top)).values.tolist(), abs=1e-4)
    assert [len(top) for _, top in result.prompt_logprobs] == [4] * 39 and len(result.logprobs[0][1]) == 3
    scored_only = engine.generate([Request(prompt, 0, SamplingParams(prompt_logprobs=0))])[0]
    assert scored_only.token_ids == [] and scored_only.finish_reason == "max_tokens"
    assert [lp for lp, _ in scored_only.prompt_logprobs] == [lp for lp, _ in result.prompt_logprobs]
    assert token_logprobs(torch.zeros(1, 4), [2], 0) == [(pytest.approx(math.log(0.25)), [])]


def teacher_forced(model, sequence: list[int]) -> torch.Tensor:
    """The model's logits after each token of `sequence` but the last [n - 1, V], one decode step a token."""
    kv = model.new_state(MAX_SEQS, MAX_LEN)
    rows = [prefill(model, kv, 0, sequence[:1])]
    with torch.inference_mode():
        for position, token in enumerate(sequence[1:-1], start=1):
            rows.append(model.decode(torch.tensor([token]), torch.tensor([position]), torch.tensor([0]), kv)[0])
    return torch.stack(rows)


def test_knobs_and_logprobs_are_unchanged_by_speculative_decoding():
    """Penalties and min_tokens depend on the tokens before each row: a verify step adjusts row j
    as if drafts[:j] were emitted, so greedy tokens and logprobs are those of plain decoding (an
    oracle drafter proposing them: every draft is verified under the knobs, and accepted)."""
    from tests.runtime.test_speculative import CONFIGS, PROMPTS, Drafter, mtp_model

    plain = eager_engine(build_model(config=CONFIGS["deepseek_v3"], expert_overflow="always"))
    params = SamplingParams(repetition_penalty=1.4, presence_penalty=0.5, frequency_penalty=0.3, min_tokens=3,
                            logit_bias=((11, 2.0),), logprobs=2)
    want = plain.generate([Request(p, 16, params) for p in PROMPTS])
    texts = [p + r.token_ids for p, r in zip(PROMPTS, want)]

    def truth(slot, position):
        return texts[slot][position] if slot < len(texts) and position < len(texts[slot]) else 0

    model = mtp_model(3)
    reference = eager_engine(model)
    oracle = Engine(Drafter(model, truth), reference.prefill_buckets, reference.decode_buckets, 4, 256,
                    model.config.eos_token_id, model.config.vocab_size, speculative=3)
    got = oracle.generate([Request(p, 16, params) for p in PROMPTS])
    for a, b in zip(want, got):
        assert a.token_ids == b.token_ids
        assert [lp for lp, _ in a.logprobs] == pytest.approx([lp for lp, _ in b.logprobs], abs=1e-4)
    assert oracle.accepted == oracle.drafted and oracle.drafted[0] > 0
