"""deepinfer-serve on the tiny bundle, driven by real clients (the official openai client, raw
HTTP): the same greedy tokens as deepinfer-run under concurrency, OpenAI's shapes and errors,
stop strings, cancellation on disconnect, a full queue."""

import asyncio
import http.client
import json
import re
import socket
import subprocess
import sys
import threading
import time
from urllib.parse import urlparse

import openai
import pytest

from deepinfer.runtime.tokenizer import ByteTokenizer
from tests.runtime.serving import API_KEY, Served, request

MAX_TOKENS = 40
# 32 prompts: 1 to 150 tokens (several prefill chunks of 64), asking 1 to 40 tokens.
PROMPTS = [[(7 * i + j) % 300 + 3 for j in range(1 + (i * 37) % 150)] for i in range(32)]
ASKED = [1 + (i * 13) % MAX_TOKENS for i in range(32)]


@pytest.fixture(scope="module")
def bundle(tiny_bundle):
    return tiny_bundle("export")


@pytest.fixture(scope="module")
def reference(bundle):
    """deepinfer-run's greedy tokens for every prompt (MAX_TOKENS of them, or up to EOS)."""
    args = [a for p in PROMPTS for a in ("--prompt-ids", ",".join(map(str, p)))]
    out = subprocess.run([sys.executable, "-m", "deepinfer.runtime.cli", "--bundle", str(bundle), *args, "--max-tokens",
                          str(MAX_TOKENS), "--json"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return [r["token_ids"] for r in json.loads(out.stdout)["results"]]


@pytest.fixture(scope="module")
def server(bundle):
    served = Served(bundle, "--max-queue", "64", "--allowed-origins", "http://app.example")
    yield served
    code, stderr = served.stop()
    assert code == 0, stderr


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def test_openai_client_completions_and_chat(client, reference):
    ids = PROMPTS[3]
    whole = client.completions.create(model="tiny", prompt=ids, max_tokens=10, temperature=0,
                                      extra_body={"return_token_ids": True})
    choice = whole.choices[0]
    assert choice.token_ids == reference[3][:10] and choice.finish_reason == "length"
    assert whole.usage.prompt_tokens == len(ids) and whole.usage.completion_tokens == 10
    pieces = list(client.completions.create(model="tiny", prompt=ids, max_tokens=10, temperature=0, stream=True,
                                            extra_body={"return_token_ids": True}))
    assert "".join(p.choices[0].text for p in pieces) == choice.text
    assert sum((p.choices[0].token_ids for p in pieces), []) == choice.token_ids
    assert pieces[-1].choices[0].finish_reason == "length"

    text = client.completions.create(model="tiny", prompt=["Hello", "DeepSeek"], max_tokens=5, temperature=0)
    assert [c.index for c in text.choices] == [0, 1] and all(c.text is not None for c in text.choices)
    assert text.usage.prompt_tokens == len("Hello") + len("DeepSeek")  # the byte tokenizer: a token a byte

    messages = [{"role": "user", "content": "Hi there"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 8
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].usage.total_tokens == chat.usage.total_tokens

    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_vllm_extensions_that_clients_send(client, server):
    """guidellm's stream_options.continuous_usage_stats (usage in every chunk), /tokenize,
    /detokenize, /version; unknown fields stay 400s naming them."""
    ids = PROMPTS[3]
    chunks = list(client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(c.usage is not None and c.usage.prompt_tokens == len(ids) for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 6  # (tokens may arrive together: fast steps)

    auth = {"Authorization": f"Bearer {API_KEY}"}
    status, body = request("POST", f"{server.url}/tokenize", {"model": "tiny", "prompt": "Hello"}, auth)
    assert status == 200 and body["tokens"] == ByteTokenizer(320).encode("Hello") and body["count"] == 5
    assert body["max_model_len"] == 256
    status, back = request("POST", f"{server.url}/detokenize", {"tokens": body["tokens"]}, auth)
    assert status == 200 and back["prompt"] == "Hello"
    status, chat = request("POST", f"{server.url}/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}, auth)
    assert status == 200 and chat["count"] > len("Hi")  # (rendered by the chat template)
    status, version = request("GET", f"{server.url}/version", None)
    assert status == 200 and version["version"]
    for path, body, param in (("/tokenize", {"prompt": "x", "bogus": 1}, "bogus"), ("/tokenize", {}, "prompt"),
                              ("/detokenize", {"tokens": [5, 320]}, "tokens"),
                              ("/v1/completions", {"prompt": "x", "stream_options": {"continuous_usage_stats": 1}},
                               "stream_options.continuous_usage_stats")):
        status, reply = request("POST", f"{server.url}{path}", body, auth)
        assert status == 400 and reply["error"]["param"] == param, (path, body, reply)
    assert request("POST", f"{server.url}/tokenize", {"prompt": "x"})[0] == 401  # (the key is asked, as everywhere)


def test_32_concurrent_clients_get_deepinfer_runs_tokens(server, reference):
    async def one(client, i):
        kwargs = dict(model="tiny", prompt=PROMPTS[i], max_tokens=ASKED[i], temperature=0,
                      extra_body={"return_token_ids": True})
        if i % 2:
            tokens = []
            async for chunk in await client.completions.create(stream=True, **kwargs):
                tokens += chunk.choices[0].token_ids or []
            return tokens
        return (await client.completions.create(**kwargs)).choices[0].token_ids

    async def everyone():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
        return await asyncio.gather(*(one(client, i) for i in range(32)))

    start = time.monotonic()
    got = asyncio.run(asyncio.wait_for(everyone(), timeout=300))
    print(f"32 concurrent requests in {time.monotonic() - start:.1f} s")
    for i, tokens in enumerate(got):
        expected = reference[i][: ASKED[i]]
        assert tokens == expected, f"request {i}"
    assert server.metric("deepinfer_free_kv_slots") == 4


def test_stop_strings_split_across_tokens(client, reference):
    # A 2-character stop string (2 tokens with the byte tokenizer) from the middle of an output.
    texts = [ByteTokenizer(320).decode(tokens) for tokens in reference]
    i, start = next((i, k) for i, text in enumerate(texts) for k in range(3, len(text) - 2)
                    if text[k : k + 2].isascii() and text[k : k + 2].isprintable())
    stop = texts[i][start : start + 2]
    cut = texts[i][: texts[i].index(stop)]
    stopped = client.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=MAX_TOKENS, temperature=0,
                                        stop=[stop, "never"])
    assert stopped.choices[0].text == cut and stopped.choices[0].finish_reason == "stop"
    pieces = list(client.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=MAX_TOKENS, temperature=0,
                                            stop=stop, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == cut and pieces[-1].choices[0].finish_reason == "stop"


def test_bad_requests_get_openai_errors(server):
    url = f"{server.url}/v1/completions"
    auth = {"Authorization": f"Bearer {API_KEY}"}
    cases = [
        ({"prompt": "hi", "temperature": "hot"}, "temperature"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, 2, 320]}, "prompt"),  # outside the vocabulary
        ({"prompt": "hi", "n": 17}, "n"),
        ({"prompt": "hi", "logprobs": 21}, "logprobs"),
        ({"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
        ({"prompt": "hi", "logit_bias": {"320": 1}}, "logit_bias"),  # outside the vocabulary
        ({"prompt": "hi", "stop_token_ids": [5, 400]}, "stop_token_ids"),
        ({"prompt": "hi", "top_k": -2}, "top_k"),
        ({"prompt": "hi", "min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"prompt": "hi", "echo": True, "logprobs": 1}, "echo"),  # this bundle has no score programs
        ({"prompt": "hi", "best_of": 2}, "best_of"),
        ({"prompt": "hi", "best_of_all": 1}, "best_of_all"),
        ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"prompt": list(range(3, 260))}, "prompt"),  # 257 tokens: past kv.max_len 256
        ({"prompt": list(range(3, 200)), "max_tokens": 100}, "max_tokens"),
    ]
    for body, param in cases:
        status, reply = request("POST", url, body, auth)
        assert status == 400 and reply["error"]["param"] == param, (body, reply)
        assert reply["error"]["type"] == "invalid_request_error" and param in reply["error"]["message"]
    status, reply = request("POST", url, {"prompt": list(range(3, 260))}, auth)
    assert reply["error"]["code"] == "context_length_exceeded" and "kv.max_len=256" in reply["error"]["message"]
    status, reply = request("POST", f"{server.url}/v1/chat/completions", {"messages": [{"role": "user"}]}, auth)
    assert status == 400 and reply["error"]["param"] == "messages[0].content"

    assert request("POST", url, {"prompt": "hi"}, {"Authorization": "Bearer wrong"})[0] == 401
    status, reply = request("POST", url, {"prompt": "hi"})
    assert status == 401 and reply["error"]["code"] == "invalid_api_key"
    status, reply = request("POST", url, {"prompt": "hi", "model": "gpt-4"}, auth)
    assert status == 404 and reply["error"]["code"] == "model_not_found"
    assert request("GET", f"{server.url}/v1/nothing", None, auth)[0] == 404
    assert request("POST", url, b"{not json", auth)[0] == 400
    # A body announced as 5 MiB is refused before it is sent.
    with socket.create_connection(urlparse(server.url).netloc.split(":")) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {5 << 20}\r\n\r\n".encode())
        answer = http.client.HTTPResponse(sock)
        answer.begin()
        assert answer.status == 413 and "over this server's limit" in json.loads(answer.read())["error"]["message"]
    assert server.health()[0] == 200


def _open_stream(server, max_tokens: int) -> socket.socket:
    """A streaming completion that runs long (EOS ignored); returns its socket once the first token arrived."""
    connection = http.client.HTTPConnection(urlparse(server.url).netloc, timeout=120)
    body = {"prompt": [5, 6, 7], "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    connection.request("POST", "/v1/completions", json.dumps(body), {"Authorization": f"Bearer {API_KEY}",
                                                                      "Content-Type": "application/json"})
    sock = connection.sock
    reply = connection.getresponse()
    assert reply.status == 200
    assert reply.readline().startswith(b"data: ")
    return sock


def _hang_up(sock: socket.socket):
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def _wait_for(server, metric: str, value: float, what: str):
    deadline = time.monotonic() + 30
    while server.metric(metric) != value:
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_disconnected_client_frees_its_slot(server, client):
    streams = [_open_stream(server, 240) for _ in range(4)]  # every slot, for ~240 steps
    _wait_for(server, "deepinfer_free_kv_slots", 0, "4 streams did not take the 4 slots")
    for sock in streams:
        _hang_up(sock)
    steps_before = server.metric("deepinfer_generation_tokens_total")
    _wait_for(server, "deepinfer_free_kv_slots", 4, "the slots of disconnected clients were not freed")
    assert server.metric("deepinfer_running_sequences") == 0
    # Cancelled within a step or so of the hang-up, not after their 240 tokens.
    assert server.metric("deepinfer_generation_tokens_total") - steps_before < 4 * 20
    assert client.completions.create(model="tiny", prompt=[5, 6], max_tokens=3, temperature=0).usage.completion_tokens == 3


def test_a_full_queue_answers_429(bundle):
    served = Served(bundle, "--max-queue", "1")
    try:
        streams = [_open_stream(served, 240) for _ in range(4)]  # the 4 slots
        queued = threading.Thread(target=request, args=("POST", f"{served.url}/v1/completions",
                                                        {"prompt": [1], "max_tokens": 1}, {"Authorization": f"Bearer {API_KEY}"}))
        queued.start()  # the one queued place
        _wait_for(served, "deepinfer_queue_length", 1, "the fifth request did not queue")
        status, reply = request("POST", f"{served.url}/v1/completions", {"prompt": [1, 2], "max_tokens": 1},
                                {"Authorization": f"Bearer {API_KEY}"})
        assert status == 429 and reply["_headers"]["retry-after"] == "1" and reply["error"]["type"] == "rate_limit_error"
        for sock in streams:
            _hang_up(sock)
        queued.join(60)
        assert not queued.is_alive()
    finally:
        code, stderr = served.stop()
    assert code == 0, stderr


# Every series vLLM's own Grafana dashboard queries (examples/observability/prometheus_grafana/grafana.json:
# its panels' expressions, each filtered by model_name), and the label the dashboard's variable reads.
VLLM_DASHBOARD_SERIES = [
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum", "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:inter_token_latency_seconds_bucket", "vllm:inter_token_latency_seconds_sum", "vllm:inter_token_latency_seconds_count",
    "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count",
    "vllm:kv_cache_usage_perc", "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total", "vllm:request_queue_time_seconds_sum", "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum", "vllm:request_max_num_generation_tokens_sum",
]


def test_vllms_dashboard_finds_every_series_it_queries(server, client):
    """After a few requests every series of vLLM's dashboard exists with model_name (the served
    name), so the dashboard works unmodified; finish reasons are vLLM's."""
    import urllib.request

    client.completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0)
    client.completions.create(model="tiny", prompt="hello", max_tokens=2, temperature=0, stream=True).close()
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    found = {m.group(1) for m in re.finditer(r'^(vllm:\w+)\{[^}]*model_name="tiny"', text, re.M)}
    assert set(VLLM_DASHBOARD_SERIES) <= found, sorted(set(VLLM_DASHBOARD_SERIES) - found)
    reasons = set(re.findall(r'^vllm:request_success_total\{finished_reason="(\w+)"', text.replace('model_name="tiny",', ""), re.M))
    assert reasons and reasons <= {"stop", "length", "abort"}, reasons


def test_the_server_shows_its_load_says_when_it_is_ready_and_logs_each_request(server, client):
    client.completions.create(model="tiny", prompt="hi", max_tokens=2, temperature=0)
    request("POST", f"{server.url}/v1/completions", {"prompt": "hi", "temperature": 7}, {"Authorization": f"Bearer {API_KEY}"})
    time.sleep(0.5)  # (the log is read from its stderr as it comes)
    log = "".join(server.log)
    loading, ready = log.index("loading tiny: weights and "), log.index("deepinfer-serve: ready")
    assert loading < log.index("100%", loading) < ready, log  # a progress bar over the load, then ready
    assert re.search(rf"deepinfer-serve: ready: {re.escape(server.url)} serving 'tiny' \(\d+ regions, loaded in [\d.]+ s\)", log), log
    assert re.search(r'"POST /v1/completions" 200 \d+ ms prompt_tokens=2 completion_tokens=2', log), log
    assert re.search(r'"POST /v1/completions" 400 \d+ ms', log), log


def test_a_model_card_by_its_id(server):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    status, card = request("GET", f"{server.url}/v1/models/tiny", None, auth)
    assert status == 200 and card["id"] == "tiny" and card["object"] == "model", card
    status, reply = request("GET", f"{server.url}/v1/models/gpt-4", None, auth)
    assert status == 404 and reply["error"]["code"] == "model_not_found", reply


def test_cors_lets_only_the_allowed_origins_call(server):
    """The browser's preflight exchange: an allowed origin may POST with an Authorization header,
    another origin is refused, and the actual reply names the allowed origin."""
    preflight = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    status, reply = request("OPTIONS", f"{server.url}/v1/completions", None, preflight)
    assert status == 200 and reply["_headers"]["access-control-allow-origin"] == "http://app.example", reply
    assert "authorization" in reply["_headers"]["access-control-allow-headers"].lower()
    status, reply = request("OPTIONS", f"{server.url}/v1/completions", None, {**preflight, "Origin": "http://evil.example"})
    assert status == 400 and "access-control-allow-origin" not in reply["_headers"], reply
    status, reply = request("POST", f"{server.url}/v1/completions", {"prompt": "hi", "max_tokens": 1},
                            {"Origin": "http://app.example", "Authorization": f"Bearer {API_KEY}"})
    assert status == 200 and reply["_headers"]["access-control-allow-origin"] == "http://app.example", reply


def test_what_a_vllm_user_types_first_gets_the_right_hint(tmp_path):
    cli = [sys.executable, "-m", "deepinfer.runtime.serve.cli"]
    out = subprocess.run([*cli, "--model", "deepseek-ai/DeepSeek-V3"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "that is vLLM's flag" in out.stderr and "--served-model-name" in out.stderr, out.stderr
    out = subprocess.run([*cli, "--bundle", str(tmp_path / "nothing")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "no bundle here" in out.stderr, out.stderr
    assert f"deepinfer-compile recipes/tiny.yaml --out {tmp_path / 'nothing'}" in out.stderr
