"""Prefix caching is exact: tokens with the cache on equal tokens with it off (DeepSeek-V3, whose
state is all position-indexed, and V4, whose rings only let a prompt continue a whole cached
sequence; with and without an MTP module lagging behind), and it reuses what it should."""

import pytest

from deepinfer.compiler.eager import eager_engine
from deepinfer.models import build_model
from deepinfer.runtime.engine import Request
from tests.runtime.test_speculative import CONFIGS, mtp_model

SYSTEM = list(range(30, 75))  # a shared "system prompt" of 45 tokens


def conversation(engine) -> list[list[int]]:
    """Three chat turns resending their history, a prompt sharing only SYSTEM, and one resending a
    whole finished sequence (prompt + output but its last token) -- each after the last finished."""
    out, history = [], SYSTEM + [5, 6, 7]
    for turn in range(3):
        tokens = engine.generate([Request(history, 12)])[0].token_ids
        out.append(tokens)
        history = history + tokens + [9, 10 + turn]
    out.append(engine.generate([Request(SYSTEM + [200, 201], 8)])[0].token_ids)
    first = engine.generate([Request(list(range(100, 150)), 10)])[0].token_ids
    out.append(engine.generate([Request(list(range(100, 150)) + first[:-1], 10)])[0].token_ids)
    return out


@pytest.mark.parametrize("arch", list(CONFIGS))
@pytest.mark.parametrize("k", [0, 3])
def test_tokens_with_the_prefix_cache_equal_tokens_without(arch, k):
    model = mtp_model(k, arch) if k else build_model(arch, config=CONFIGS[arch], expert_overflow="always")
    on, off = eager_engine(model), eager_engine(model, prefix_caching=False)
    assert conversation(on) == conversation(off)
    assert off.prefix_hits == 0
    # Turns 2 and 3 and the resent sequence reuse their slot; V3 also reuses SYSTEM for another question.
    assert on.prefix_hits == (4 if arch == "deepseek_v3" else 3)
    assert on.prefix_hit_tokens > 3 * len(SYSTEM)


def test_the_least_recently_used_prefix_is_evicted_first():
    model = build_model(config=CONFIGS["deepseek_v3"], expert_overflow="always")
    engine = eager_engine(model, max_seqs=2)
    prompts = [[50 + i] * 20 for i in range(3)]
    for prompt in prompts:  # the third takes the first one's slot (least recently used)
        engine.generate([Request(prompt, 4)])
    assert engine.prefix_evictions == 1
    engine.generate([Request(prompts[2] + [7], 4)])  # still cached
    engine.generate([Request(prompts[0] + [7], 4)])  # evicted: prefilled whole (taking the second's slot)
    assert engine.prefix_hits == 1 and engine.prefix_hit_tokens == 20 and engine.prefix_evictions == 2
