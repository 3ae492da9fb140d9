"""Prefix caching is exact: tokens with the cache on equal tokens with it off (DeepSeek-V3, whose
state is all position-indexed, and V4, whose rings only let a prompt continue a whole cached
sequence; with and without an MTP module lagging behind), in place and copied from another
slot, and it reuses what it should; the hashed-block index finds what a full scan finds."""

import random

import pytest

from deepinfer.compiler.eager import eager_engine
from deepinfer.models import build_model
from deepinfer.runtime.engine import Request
from deepinfer.runtime.prefix_index import PrefixIndex
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


@pytest.mark.parametrize("arch", list(CONFIGS))
@pytest.mark.parametrize("k", [0, 3])
def test_sequences_sharing_a_running_prompt_copy_its_prefill(arch, k):
    """Three sequences of one prompt (what `n` = 3 submits) and two questions after one system
    prompt, all at once: each later prompt's prefix is copied from a running sequence's slot
    (V4 copies only the whole prompt: its rings hold a running sequence's last positions)."""
    model = mtp_model(k, arch) if k else build_model(arch, config=CONFIGS[arch], expert_overflow="always")
    prompt = list(range(100, 140))
    requests = [Request(prompt, 10)] * 3 + [Request(SYSTEM + [200 + i], 8) for i in range(2)]
    on, off = eager_engine(model, max_seqs=6), eager_engine(model, max_seqs=6, prefix_caching=False)
    results = on.generate(requests)
    assert [r.token_ids for r in results] == [r.token_ids for r in off.generate(requests)]
    copied = [r.cached_tokens for r in results]
    assert copied == ([0, 39, 39, 0, len(SYSTEM)] if arch == "deepseek_v3" else [0, 39, 39, 0, 0])
    assert on.prefix_copies == on.prefix_hits == (3 if arch == "deepseek_v3" else 2)


def test_the_block_index_finds_the_common_prefix_a_scan_finds():
    rng = random.Random(0)
    index, held = PrefixIndex(block=4), {}
    base = [rng.randrange(5) for _ in range(40)]
    for slot in range(6):  # prefixes of one sequence, then a few tokens of their own
        held[slot] = base[: rng.randrange(41)] + [rng.randrange(5) for _ in range(rng.randrange(6))]
        index.add(slot, held[slot])
    index.add(2, held[2] + [1, 2, 3])  # replaced, not added to
    held[2] = held[2] + [1, 2, 3]
    index.remove(5)
    del held[5]
    for _ in range(200):
        prompt = base[: rng.randrange(41)] + [rng.randrange(5) for _ in range(rng.randrange(6))]
        scan = {slot: next((i for i, (a, b) in enumerate(zip(tokens, prompt)) if a != b), min(len(tokens), len(prompt)))
                for slot, tokens in held.items()}
        assert index.matches(prompt) == scan
    salted = PrefixIndex(block=4)
    salted.add(0, base, "tenant-a")
    assert salted.matches(base, "tenant-a") == {0: len(base)} and salted.matches(base) == {} == salted.matches(base, "b")


def test_a_cache_salt_shares_state_only_within_itself():
    """Requests of one salt reuse each other's prefixes; of another, never (no cached tokens, no
    copies), and the tokens are the same either way."""
    model = build_model(config=CONFIGS["deepseek_v3"], expert_overflow="always")
    engine = eager_engine(model)
    prompt = SYSTEM + [5, 6, 7]
    first = engine.generate([Request(prompt, 8, cache_salt="alice")])[0]
    others = engine.generate([Request(prompt, 8, cache_salt="mallory"), Request(prompt, 8)])
    again = engine.generate([Request(prompt, 8, cache_salt="alice")])[0]
    assert [r.cached_tokens for r in others] == [0, 0] and engine.prefix_copies == 0
    assert again.cached_tokens == len(prompt) - 1  # (the last prompt token is prefilled: its logits give the next)
    assert first.token_ids == again.token_ids == others[0].token_ids == others[1].token_ids


def test_the_server_separates_cached_prompts_by_salt_and_by_key(tiny_bundle):
    """The probe's side channel: a guessed secret no longer shows in cached_tokens across clients
    with different keys (--prefix-cache-per-key) or different cache_salt values."""
    from tests.runtime.serving import Served, request

    served = Served(tiny_bundle("export"), "--api-key", "sk-alice", "--api-key", "sk-mallory", "--prefix-cache-per-key",
                    api_key=None)
    try:
        def cached(key, **extra):
            status, reply = request("POST", f"{served.url}/v1/completions", {"prompt": SYSTEM + [5, 6, 7], "max_tokens": 2,
                                                                             "temperature": 0, **extra},
                                    {"Authorization": f"Bearer {key}"})
            assert status == 200, reply
            return reply["usage"]["prompt_tokens_details"]["cached_tokens"], reply["choices"][0]["text"]

        alice = cached("sk-alice")
        assert cached("sk-mallory") == (0, alice[1])  # another key: nothing cached, the same text
        assert cached("sk-alice") == (len(SYSTEM) + 2, alice[1])  # (all but the last prompt token)
        assert cached("sk-alice", cache_salt="thread-2") == (0, alice[1])  # a salt within a key
        assert cached("sk-alice", cache_salt="thread-2") == (len(SYSTEM) + 2, alice[1])
        status, reply = request("POST", f"{served.url}/v1/completions", {"prompt": "x", "cache_salt": ""},
                                {"Authorization": "Bearer sk-alice"})
        assert status == 400 and reply["error"]["param"] == "cache_salt", reply
    finally:
        code, stderr = served.stop()
    assert code == 0, stderr
