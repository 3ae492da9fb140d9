"""MTP speculative decoding is lossless: with drafts verified by the model, greedy tokens are those
of decoding without speculation (DeepSeek-V3 and V4, eager and compiled, k = 1, 3, 5, world sizes
1 and 2), whatever the drafter proposes; sampled tokens keep the model's distribution (rejection
sampling)."""

import json
import subprocess
import sys

import pytest
import torch

from deepinfer.compiler.build import compile_recipe
from deepinfer.compiler.eager import EagerExecutor, eager_engine
from deepinfer.compiler.recipe import RecipeError, load_recipe
from deepinfer.models import TINY_CONFIG, build_model
from deepinfer.models.speculative import blocks
from deepinfer.runtime.engine import Engine, Request
from deepinfer.runtime.executor import BundleExecutor
from deepinfer.runtime.sampling import SamplingParams, probabilities, verify_drafts
from tests.conftest import tiny_v4_config, write_recipe
from tests.runtime.test_multirank import MAX_TOKENS as RUN_TOKENS, PROMPTS as RUN_PROMPTS, run_bundle

# Prompts over one and two prefill chunks (16, 64), and a one-token prompt.
PROMPTS = [[5, 6, 7], list(range(20, 56)), list(range(100, 180)), [9]]
MAX_TOKENS = 20
MTP_CONFIG = {**TINY_CONFIG, "num_nextn_predict_layers": 1}
CONFIGS = {"deepseek_v3": MTP_CONFIG, "deepseek_v4": {**tiny_v4_config(), "num_nextn_predict_layers": 1}}


def greedy(engine: Engine, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    return [r.token_ids for r in engine.generate([Request(p, max_tokens) for p in PROMPTS])]


def mtp_model(k: int, arch: str = "deepseek_v3"):
    """The tiny model with its MTP module drafting k tokens a step (its main weights are the same
    as without: init_random draws the MTP module's last)."""
    return build_model(arch, config=CONFIGS[arch], draft_tokens=k, expert_overflow="always")


@pytest.fixture(scope="module")
def references():
    return {arch: greedy(eager_engine(build_model(arch, config=config, expert_overflow="always")))
            for arch, config in CONFIGS.items()}


@pytest.fixture(scope="module")
def reference(references):
    return references["deepseek_v3"]


class Drafter(EagerExecutor):
    """The eager model whose draft steps propose what `propose(slot, position)` says: the
    sequence's true next tokens (an oracle: every draft passes) or wrong ones (none does)."""

    def __init__(self, model, propose):
        super().__init__(model, 4, 256)
        self.propose = propose

    def run(self, step):
        out = super().run(step)  # (the draft step runs: the module's state is written as always)
        if step.method != "draft":
            return out
        k = out.shape[1]
        slots, first, last = blocks(step.positions, step.slots, k + 1)
        return torch.tensor([[self.propose(slot, position + 1 + j) for j in range(k)]
                             for slot, position in zip(slots.tolist(), (first + last).tolist())])


@pytest.mark.parametrize("arch", list(CONFIGS))
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_speculation_gives_the_tokens_of_plain_decoding(references, arch, k):
    reference = references[arch]
    model = mtp_model(k, arch)
    engine = eager_engine(model)
    assert greedy(engine) == reference  # (the tiny model's random MTP module: drafts mostly rejected)
    assert engine.drafted[0] > 0

    # Slots are given in order: sequence i holds slot i. An oracle drafter's drafts all pass...
    texts = [p + r for p, r in zip(PROMPTS, reference)]

    def truth(slot, position):  # (padding rows: the scratch slot)
        return texts[slot][position] if slot < len(texts) and position < len(texts[slot]) else 0

    oracle = Engine(Drafter(model, truth), engine.prefill_buckets, engine.decode_buckets, 4, 256,
                    model.config.eos_token_id, model.config.vocab_size, speculative=k)
    results = oracle.generate([Request(p, MAX_TOKENS) for p in PROMPTS])
    assert [r.token_ids for r in results] == reference
    assert oracle.accepted == oracle.drafted
    # (the first token comes from the prompt, and a step emits at most k + 1)
    assert all(r.tokens_per_step == pytest.approx((MAX_TOKENS - 1) / -(-(MAX_TOKENS - 1) // (k + 1))) for r in results)

    # ... and a drafter that is always wrong changes nothing but the speed: no draft is emitted unverified.
    vocab = model.config.vocab_size
    liar = Engine(Drafter(model, lambda slot, position: (truth(slot, position) + 1) % vocab), engine.prefill_buckets,
                  engine.decode_buckets, 4, 256, model.config.eos_token_id, vocab, speculative=k)
    results = liar.generate([Request(p, MAX_TOKENS) for p in PROMPTS])
    assert [r.token_ids for r in results] == reference
    assert sum(liar.accepted) == 0 and all(r.tokens_per_step == 1.0 for r in results)
    # A drafter gone wrong (tokens outside the vocabulary) is never fed to the model: no drafts at all.
    wild = Engine(Drafter(model, lambda slot, position: vocab + position), engine.prefill_buckets, engine.decode_buckets,
                  4, 256, model.config.eos_token_id, vocab, speculative=k)
    assert greedy(wild) == reference and sum(wild.drafted) == 0


def test_rejection_sampling_keeps_the_models_distribution():
    """The first token emitted after a draft d (the drafter's argmax: q is one-hot) is distributed
    as the model's p (after temperature and top-p), whether p(d) is large, small or 0: a
    chi-square test over 12 tokens, 4,000 draws a case, fixed seed."""
    generator = torch.Generator().manual_seed(0)
    vocab, draws = 12, 4_000
    logits = torch.randn(2, vocab, generator=generator) * 2  # the model's rows at the last token and at the draft
    # critical values of chi-square at p = 0.001 by degrees of freedom (scipy-free table)
    table = dict(zip(range(1, 12), (10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88, 29.59, 31.26)))
    for params in (SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_p=0.7)):
        p = probabilities(logits[:1], params)[0]
        order = p.argsort(descending=True).tolist()
        for draft in (order[0], order[2], order[-1]):  # likely, less likely, least (0 under top-p)
            counts = torch.zeros(vocab)
            for _ in range(draws):
                counts[verify_drafts(logits, [draft], params, generator)[0]] += 1
            assert counts[p == 0].sum() == 0  # never a token the nucleus leaves out
            kept = p > 0
            expected = p[kept] * draws
            chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
            assert chi2 < table[int(kept.sum()) - 1], (params, draft, chi2, counts, expected)


@pytest.fixture(scope="module")
def spec_bundles(tmp_path_factory, cache_dir):
    """The tiny models with their MTP modules, compiled with k draft tokens (export): V3 with context
    buckets on the decode side, and at world size 2 context-parallel (cp 2); V4 at world size 4
    (tp 2 x cp 2) with context buckets."""
    work = tmp_path_factory.mktemp("speculative")
    contexts = {"methods": {"decode": {"buckets": [1, 4], "context": [64]}, "prefill": {"buckets": [16, 64]}}}
    ws4 = {"parallel": {"world_size": 4, "tp": 2, "ep": 2, "cp": 2}}
    cp2 = {"parallel": {"world_size": 2, "tp": 1, "ep": 2, "cp": 2}}
    out = {}
    for name, arch, k, changes in (("k3-contexts", "deepseek_v3", 3, contexts), ("k3-cp2-contexts", "deepseek_v3", 3, {**contexts, **cp2}),
                                   ("v4-k3-ws4-cp2-contexts", "deepseek_v4", 3, {**contexts, **ws4})):
        model = {"arch": arch, "config": CONFIGS[arch], "expert_overflow": "always"}
        recipe = write_recipe(work, name, model=model, backend={"name": "export"}, **changes,
                              speculative={"method": "mtp", "num_tokens": k})
        out[name] = compile_recipe(load_recipe(recipe), cache_dir=cache_dir, progress=False).bundle
    return out


def test_compiled_speculation_gives_the_tokens_of_plain_decoding(spec_bundles, reference):
    executor = BundleExecutor(spec_bundles["k3-contexts"])
    assert executor.manifest.speculative == 3 and executor.manifest.buckets["decode"] == [4, 16]
    engine = Engine.for_bundle(executor)
    assert greedy(engine) == reference and engine.drafted[2] > 0
    # Sampling: runs, stays in the vocabulary, and is reproducible from the seed.
    sampled = [engine.generate([Request(PROMPTS[1], 12, SamplingParams(temperature=0.9, top_p=0.9, seed=5))])[0].token_ids
               for _ in range(2)]
    assert sampled[0] == sampled[1] and len(sampled[0]) == 12


def test_an_aotinductor_bundle_speculates_losslessly(tmp_path_factory, cache_dir, reference):
    """AOTInductor regions (the main model's at decode 4 = 1 sequence x (k + 1) rows and prefill 16
    are the session's own inductor bundle's, from the cache; the head and MTP regions are new)."""
    from tests.conftest import INDUCTOR_METHODS

    work = tmp_path_factory.mktemp("speculative-inductor")
    recipe = write_recipe(work, "k3-inductor", model={"config": MTP_CONFIG},
                          methods={"decode": {"buckets": [1]}, "prefill": INDUCTOR_METHODS["prefill"]},
                          backend={"name": "inductor"}, speculative={"method": "mtp", "num_tokens": 3})
    engine = Engine.for_bundle(BundleExecutor(compile_recipe(load_recipe(recipe), cache_dir=cache_dir, progress=False).bundle))
    assert greedy(engine) == reference and engine.drafted[0] > 0


@pytest.mark.parametrize("bundle, arch", [("k3-cp2-contexts", "deepseek_v3"), ("v4-k3-ws4-cp2-contexts", "deepseek_v4")])
def test_speculation_over_ranks(spec_bundles, bundle, arch):
    """V3 over a context-parallel group of 2 (its cache striped, prompt chunks split); V4 over 4
    ranks, tp 2 (query heads, shared expert and LM head split; ep 2) x cp 2 (compressed entries
    striped by entry, the indexer's top-k merged over the group, prompt chunks split). Decode under
    context buckets 64 and 256 (V4: the compressed entries the indexer scores and HCA attends are
    read up to the context), the leader telling the follower which context each step runs, and a
    prefix copied from a running sequence on both ranks. One run: its third prompt repeats the
    second, and the fifth waits for a free slot."""
    prompts = [RUN_PROMPTS[0], RUN_PROMPTS[1], RUN_PROMPTS[1], *RUN_PROMPTS[2:]]
    result = run_bundle(spec_bundles[bundle], prompts=prompts)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(result.stdout)["results"]
    assert [r["token_ids"] for r in results] == greedy_for(prompts, RUN_TOKENS, arch)
    assert all(r["tokens_per_step"] >= 1.0 for r in results)
    manifest = json.loads((spec_bundles[bundle] / "manifest.json").read_text())
    ratios = {t["name"]: t["positions_per_entry"] for layer in manifest["state"] for t in layer}
    assert {key.split("/")[-1] for key in manifest["programs"] if key.startswith("decode/")} == {"64", "256"}
    if arch == "deepseek_v4":
        assert ratios["window"] is None and ratios["buffer"] is None and ratios["index_entries"] == 4 * 2
        entries = [t["positions_per_entry"] for layer in manifest["state"] for t in layer if t["name"] == "entries"]
        assert entries == [4 * 2, 16, 4 * 2] and ratios["hidden"] == 1  # CSA striped over cp 2, HCA whole
    else:  # a rank keeps every 2nd position; the MTP module's hidden states stay whole
        assert ratios == {"latent": 2, "hidden": 1}
    # Prefix caching on both ranks: the repeated prompt copies the first one's state (V4: its rings
    # whole, the MTP module's too) from the running sequence's slot, and prefills its last token.
    reused = len(RUN_PROMPTS[1]) - 1  # all but the last token; under cp 2 whole stripes of 2 positions
    assert [r["cached_tokens"] for r in results] == [0, 0, reused if arch == "deepseek_v4" else reused // 2 * 2, 0, 0]


def test_the_server_speculates_under_continuous_batching(spec_bundles, reference):
    """8 concurrent clients (the official openai client) on the k = 3 bundle get the plain greedy
    tokens; usage reports tokens per step and /metrics the acceptance by draft position."""
    import asyncio

    import openai

    from tests.runtime.serving import API_KEY, Served

    served = Served(spec_bundles["k3-contexts"])
    try:
        async def one(client, i):
            reply = await client.completions.create(model="k3-contexts", prompt=PROMPTS[i % 4], max_tokens=MAX_TOKENS, temperature=0,
                                                    extra_body={"return_token_ids": True})
            return reply.choices[0].token_ids, reply.usage

        async def everyone():
            client = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
            return await asyncio.gather(*(one(client, i) for i in range(8)))

        replies = asyncio.run(asyncio.wait_for(everyone(), timeout=300))
        assert [tokens for tokens, _ in replies] == [reference[i % 4] for i in range(8)]
        assert all(usage.model_extra["tokens_per_step"] >= 1.0 for _, usage in replies)
        drafted = served.metric('deepinfer_spec_decode_draft_tokens_total{position="0"}')
        accepted = served.metric('deepinfer_spec_decode_accepted_tokens_total{position="0"}')
        assert drafted > 0 and served.metric('deepinfer_spec_decode_acceptance_rate{position="0"}') == accepted / drafted
    finally:
        code, stderr = served.stop()
    assert code == 0, stderr


def greedy_for(prompts, max_tokens, arch="deepseek_v3"):
    model = build_model(arch, config=CONFIGS[arch], expert_overflow="always")
    return [r.token_ids for r in eager_engine(model).generate([Request(p, max_tokens) for p in prompts])]


def test_a_recipe_without_an_mtp_module_is_refused(tmp_path):
    recipe = write_recipe(tmp_path, speculative={"method": "mtp", "num_tokens": 3})
    with pytest.raises(RecipeError, match="speculative.method: the model has no MTP module.*num_nextn_predict_layers"):
        load_recipe(recipe)
    recipe = write_recipe(tmp_path, model={"config": MTP_CONFIG}, speculative={"method": "mtp", "num_tokens": 6})
    with pytest.raises(RecipeError, match="speculative.num_tokens: 6: draft tokens per step, 1 to 5"):
        load_recipe(recipe)


def test_a_checkpoint_without_its_mtp_weights_is_refused_naming_the_tensor(tmp_path):
    from deepinfer.models import CheckpointError
    from tests.models.hf_tiny import tiny_hf_checkpoint

    _, directory = tiny_hf_checkpoint(tmp_path / "hf", seed=1)  # (transformers saves no MTP layer)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    recipe = write_recipe(tmp_path, model={"checkpoint": str(directory), "config": None},
                          speculative={"method": "mtp", "num_tokens": 2}, backend={"name": "export"})
    with pytest.raises(CheckpointError, match="weight 'model.layers.3.enorm.weight' is missing"):
        compile_recipe(load_recipe(recipe), cache_dir=tmp_path / "cache", progress=False)
