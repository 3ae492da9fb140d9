"""The clients people point at an OpenAI endpoint, unmodified, against deepinfer-serve on the
trained tiny V3 (float32, export, speculative decoding on, score programs compiled): guidellm
benchmarks a stream; lm-eval's local-completions scores a multiple-choice task from a local JSON
file, and its loglikelihoods are transformers'; the openai client's logprobs, top_logprobs, echo
and n are the numbers transformers gives."""

import json
import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import torch
import yaml

from tests.conftest import ROOT
from tests.runtime.serving import Served

CHECKPOINT = ROOT / "checkpoints" / "tiny-v3-code"
MODEL = "tiny-code-eval"  # recipes/tiny-code-eval.yaml, as shipped
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "DO_NOT_TRACK": "1"}


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, cache_dir):
    from deepinfer.compiler.build import compile_recipe
    from deepinfer.compiler.recipe import load_recipe

    work = tmp_path_factory.mktemp("clients")
    recipe = yaml.safe_load((ROOT / "recipes" / f"{MODEL}.yaml").read_text())
    recipe.update(output=str(work / MODEL))
    recipe["model"]["checkpoint"] = str(CHECKPOINT)
    (work / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return compile_recipe(load_recipe(work / "recipe.yaml"), cache_dir=cache_dir, progress=False).bundle


@pytest.fixture(scope="module")
def server(bundle):
    served = Served(bundle, "--max-queue", "32", api_key=None)
    yield served
    code, stderr = served.stop()
    assert code == 0, stderr


@pytest.fixture(scope="module")
def transformers_model():
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(CHECKPOINT, dtype=torch.float32).eval()


def reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax after each token of ids [n, V]."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def test_guidellm_benchmarks_a_stream(server, tmp_path):
    """guidellm's synthetic prompt/output token counts, streamed, at concurrency 1 and 4."""
    scenario = {
        "spec": {"backend": {"kind": "openai_http", "target": server.url, "model": MODEL, "request_format": "/v1/completions"},
                 "profile": {"kind": "concurrent", "streams": 1},
                 "tokenizer": {"kind": "huggingface_auto", "model": str(CHECKPOINT)},
                 "data": [{"kind": "synthetic_text", "prompt_tokens": 48, "output_tokens": 24}],
                 "constraints": [{"kind": "max_requests", "count": 6}],
                 "outputs": [{"kind": "json", "path": str(tmp_path / "report.json")}]},
        "benchmarks": [{"profile.streams": 1}, {"profile.streams": 4}]}
    (tmp_path / "scenario.json").write_text(json.dumps(scenario))
    run = subprocess.run([str(Path(sys.executable).parent / "guidellm"), "run", "-c", str(tmp_path / "scenario.json"),
                          "--disable-console-interactive"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, **OFFLINE}, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert len(report["benchmarks"]) == 2
    for benchmark in report["benchmarks"]:
        metrics = benchmark["metrics"]
        totals = metrics["request_totals"]
        # Every request guidellm reports succeeded. It reports the 6 it ran, or, once seen on a loaded
        # machine, 5 of them (totals {successful: 5, errored: 0, incomplete: 0, total: 5}).
        assert totals["successful"] == totals["total"] in (5, 6) and totals["errored"] == totals["incomplete"] == 0
        assert metrics["time_to_first_token_ms"]["successful"]["mean"] > 0
        assert metrics["inter_token_latency_ms"]["successful"]["mean"] > 0
        assert metrics["output_token_count"]["successful"]["mean"] == 24


LM_EVAL_TASK = ROOT / "examples" / "lm-eval"  # the multiple-choice task docs/serving.md runs with lm_eval's CLI


def test_lm_eval_loglikelihoods_are_transformers(server, transformers_model, monkeypatch):
    """lm-eval's local-completions (echo, logprobs, max_tokens 1) on the shipped task (local JSON lines)."""
    import lm_eval
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    os.environ.update(OFFLINE)
    monkeypatch.chdir(ROOT)  # (the task names its data file from the repository's root)
    questions = [json.loads(line) for line in (LM_EVAL_TASK / "code_mc.jsonl").read_text().splitlines()]
    lm = LocalCompletionsAPI(base_url=f"{server.url}/v1/completions", model=MODEL, tokenizer=str(CHECKPOINT),
                             tokenizer_backend="huggingface", max_retries=1)
    results = lm_eval.simple_evaluate(model=lm, tasks=["deepinfer_code_mc"], task_manager=TaskManager(include_path=str(LM_EVAL_TASK)),
                                      log_samples=True)
    samples = results["samples"]["deepinfer_code_mc"]
    assert len(samples) == len(questions)
    compared = 0
    for sample in samples:
        for (context, continuation), [(loglikelihood, is_greedy)] in zip(sample["arguments"], sample["resps"]):
            context_ids, continuation_ids = lm._encode_pair(context, continuation)
            ids = context_ids + continuation_ids
            logprobs = reference_logprobs(transformers_model, ids)
            rows = logprobs[len(context_ids) - 1 : len(ids) - 1]
            want = rows.gather(1, torch.tensor(continuation_ids)[:, None]).sum().item()
            assert loglikelihood == pytest.approx(want, abs=1e-4)
            assert is_greedy == bool((rows.argmax(-1) == torch.tensor(continuation_ids)).all())
            compared += 1
    assert compared == sum(len(q["choices"]) for q in questions)
    assert 0 <= results["results"]["deepinfer_code_mc"]["acc,none"] <= 1


def test_openai_client_logprobs_echo_and_n(server, transformers_model):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    prompt = "def fibonacci(n):\n    if n < 2:\n"
    ids = client.post("/../tokenize", body={"prompt": prompt}, cast_to=object)["tokens"]
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=3, echo=True)
    choice = whole.choices[0]
    assert choice.text.startswith(prompt)
    logprobs = choice.logprobs
    generated = logprobs.tokens[len(ids):]
    assert len(logprobs.tokens) == len(ids) + 8 == len(generated) + len(ids)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    sequence = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                         extra_body={"return_token_ids": True}).choices[0].token_ids
    reference = reference_logprobs(transformers_model, ids + sequence)
    for i, (lp, top) in enumerate(zip(logprobs.token_logprobs[1:], logprobs.top_logprobs[1:])):
        token = (ids + sequence)[i + 1]
        assert lp == pytest.approx(reference[i, token].item(), abs=1e-4)
        assert max(top.values()) == pytest.approx(reference[i].max().item(), abs=1e-4)  # (holds the top 3 and the token)
    assert logprobs.text_offset[:2] == [0, len(logprobs.tokens[0])]

    scored = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=0)
    assert scored.choices[0].logprobs.token_logprobs[1:] == pytest.approx(logprobs.token_logprobs[1 : len(ids)], abs=1e-5)
    assert scored.usage.completion_tokens == 0 and scored.choices[0].finish_reason == "length"

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "sort a list"}], max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content

    several = client.completions.create(model=MODEL, prompt=[prompt, "import os\n"], max_tokens=12, temperature=1.0, n=3, seed=7)
    assert [c.index for c in several.choices] == list(range(6))
    assert len({c.text for c in several.choices[:3]}) > 1  # (three samples of one prompt, seeds 7, 8, 9)
    again = client.completions.create(model=MODEL, prompt=[prompt, "import os\n"], max_tokens=12, temperature=1.0, n=3, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in several.choices]
    assert several.usage.prompt_tokens == len(ids) + len(client.post("/../tokenize", body={"prompt": "import os\n"},
                                                                     cast_to=object)["tokens"])
