"""deepinfer-serve over a 2-rank bundle: the checkpoint's chat template travels in the bundle;
SIGTERM drains in-flight streams and exits 0; a follower killed mid-stream fails the stream
with a 503 error event and the server exits 1; /dev/shm is left as it was."""

import http.client
import json
import os
import signal
import time
from urllib.parse import urlparse

import pytest
import torch
import yaml

from deepinfer.compiler.build import compile_recipe
from deepinfer.compiler.recipe import load_recipe
from deepinfer.runtime.tokenizer import ByteTokenizer
from tests.conftest import TINY_RECIPE, write_recipe
from tests.runtime.serving import API_KEY, Served, request

transformers = pytest.importorskip("transformers")

TEMPLATE = "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, cache_dir):
    """The tiny model as a transformers checkpoint with a chat template, compiled for 2 ranks."""
    config = yaml.safe_load(TINY_RECIPE.read_text())["model"]["config"]
    torch.manual_seed(0)  # (the same weights every run)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**config, num_key_value_heads=4))
    work = tmp_path_factory.mktemp("serve-ws2")
    hf.save_pretrained(work / "checkpoint")
    (work / "checkpoint" / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE,
                                                                           "bos_token": {"content": "<s>"}}))
    recipe = write_recipe(work, "tiny-ws2", model={"checkpoint": str(work / "checkpoint"), "config": None},
                          parallel={"world_size": 2, "tp": 2, "ep": 2}, backend={"name": "export"})
    return compile_recipe(load_recipe(recipe), cache_dir=cache_dir, progress=False).bundle


def _stream(served: Served, max_tokens: int) -> tuple[http.client.HTTPResponse, dict]:
    """A long streaming completion (EOS ignored), and its first event once it arrived."""
    connection = http.client.HTTPConnection(urlparse(served.url).netloc, timeout=120)
    body = {"prompt": [5, 6, 7], "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "return_token_ids": True}
    connection.request("POST", "/v1/completions", json.dumps(body), {"Authorization": f"Bearer {API_KEY}",
                                                                      "Content-Type": "application/json"})
    reply = connection.getresponse()
    assert reply.status == 200
    line = reply.readline()
    assert line.startswith(b"data: ")
    return reply, json.loads(line[len(b"data: "):])


def _events(reply: http.client.HTTPResponse) -> list:
    """The rest of a stream's events (JSON objects, and "[DONE]")."""
    out = []
    for line in reply:
        if line.startswith(b"data: "):
            data = line[len(b"data: "):].strip()
            out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out


def test_the_checkpoints_chat_template_is_used(bundle, shm_unchanged):
    served = Served(bundle)
    try:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        status, reply = request("POST", f"{served.url}/v1/chat/completions",
                                {"messages": messages, "max_tokens": 4, "temperature": 0, "return_token_ids": True},
                                {"Authorization": f"Bearer {API_KEY}"})
        assert status == 200, reply
        rendered = "<s><|system|>Be brief.\n<|user|>Hi\n<|assistant|>"
        assert reply["choices"][0]["prompt_token_ids"] == ByteTokenizer(320).encode(rendered)
        assert len(reply["choices"][0]["token_ids"]) == 4
    finally:
        code, stderr = served.stop()
    assert code == 0, stderr


def test_sigterm_lets_the_stream_finish_then_exits_0(bundle, shm_unchanged):
    served = Served(bundle, "--grace", "120")
    signalled = False
    try:
        followers = served.children()
        assert len(followers) == 1
        reply, first = _stream(served, 150)
        served.process.send_signal(signal.SIGTERM)
        signalled = True
        deadline = time.monotonic() + 30
        while served.health()[0] != 503:  # draining
            assert time.monotonic() < deadline
            time.sleep(0.05)
        status, refused = request("POST", f"{served.url}/v1/completions", {"prompt": [1], "max_tokens": 1},
                                  {"Authorization": f"Bearer {API_KEY}"})
        assert status == 503 and "shutting down" in refused["error"]["message"]
        events = _events(reply)
    finally:
        code, stderr = served.stop(sig=None if signalled else signal.SIGTERM, timeout=60)
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    assert sum(len(e["choices"][0]["token_ids"]) for e in [first, *events[:-1]]) == 150
    assert code == 0, stderr
    assert not any(os.path.exists(f"/proc/{pid}") for pid in followers), [open(f"/proc/{p}/stat").read() for p in followers]


def test_a_follower_killed_mid_stream_fails_it_with_503_and_exits_1(bundle, shm_unchanged):
    served = Served(bundle)
    killed = False
    try:
        [follower] = served.children()
        reply, _ = _stream(served, 200)
        os.kill(follower, signal.SIGKILL)
        killed = True
        events = _events(reply)
    finally:
        code, stderr = served.stop(sig=None if killed else signal.SIGTERM, timeout=60)
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["type"] == "server_error" and "rank 1" in error["message"] and "SIGKILL" in error["message"]
    assert code == 1 and "rank 1" in stderr


def test_prefix_caching_at_world_size_2_gives_the_tokens_without_it(bundle):
    """A chat resending its history, then another question after the same first 40 tokens, then
    n = 3 sequences of one prompt (two copy the first one's prefill into their slots), on two
    servers of the same 2-rank bundle (followers replay the leader's steps: a reused slot is reused
    and a copy is copied on every rank). Every answer is 8 tokens (ignore_eos: the random model may
    end one early), so the tokens reused are known: 40 + 8 - 1, 40, and 30 - 1 for each copy."""
    auth = {"Authorization": f"Bearer {API_KEY}"}
    servers = {"on": Served(bundle), "off": Served(bundle, "--no-prefix-caching")}
    try:
        tokens = {}
        for name, served in servers.items():
            history, tokens[name] = [5 + i % 200 for i in range(40)], []
            for prompt_end in ([7, 8], [9, 10], None):
                prompt = history if prompt_end else history[:40] + [11, 12]
                status, body = request("POST", f"{served.url}/v1/completions",
                                       {"prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True,
                                        "ignore_eos": True}, auth)
                assert status == 200, body
                tokens[name].append(body["choices"][0]["token_ids"])
                history = history + tokens[name][-1] + (prompt_end or [])
            status, body = request("POST", f"{served.url}/v1/completions", {"prompt": list(range(60, 90)), "n": 3,
                                   "max_tokens": 8, "temperature": 0, "return_token_ids": True,
                                   "ignore_eos": True}, auth)
            assert status == 200, body
            tokens[name] += [choice["token_ids"] for choice in body["choices"]]
        assert tokens["on"] == tokens["off"]
        assert servers["on"].metric("deepinfer_prefix_cache_hits_total") == 4
        assert servers["on"].metric("deepinfer_prefix_cache_copies_total") == 2
        assert servers["on"].metric("deepinfer_prefix_cache_hit_tokens_total") == 47 + 40 + 2 * 29
        assert servers["off"].metric("deepinfer_prefix_cache_hits_total") == 0
    finally:
        for served in servers.values():
            assert served.stop()[0] == 0
