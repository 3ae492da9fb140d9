"""deepinfer-serve against requests (and a chat template) that try to stop it: each gets its own
answer, and the server keeps serving everyone else.

A template that loops 10^10 times, divides by zero, adds a number to a list, or doubles a string
past memory; sampling parameters that underflow in float32; lone surrogates; more prompts than
the server can ever hold; a client that never sends its headers or hangs up mid-body."""

import json
import shutil
import socket
import threading
import time
from urllib.parse import urlparse

import pytest

from tests.runtime.serving import API_KEY, Served, request
from tests.runtime.test_bundle_trust import edit_manifest

HOSTILE_TEMPLATE = (
    "{% set what = messages[0]['content'] %}"
    "{% if what == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{% elif what == 'divide' %}{{ 1/0 }}"
    "{% elif what == 'add' %}{{ messages + 1 }}"
    "{% elif what == 'double' %}{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}{{ ns.s }}"
    "{% else %}{% for m in messages %}{{ m['content'] }}{% endfor %}{% endif %}"
)
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(tiny_bundle, tmp_path_factory):
    bundle = tmp_path_factory.mktemp("hostile") / "bundle"
    shutil.copytree(tiny_bundle("export"), bundle)
    (bundle / "chat_template.json").write_text(json.dumps({"template": HOSTILE_TEMPLATE}))
    edit_manifest(bundle, lambda body: (body.update(chat_template="chat_template.json"),
                                        body["files"].update({"chat_template.json": ""})))
    served = Served(bundle, "--max-queue", "2", "--request-timeout", "2")
    yield served
    threading.Thread(target=chat, args=(served, "loop"), daemon=True).start()
    time.sleep(0.5)
    start = time.monotonic()
    code, stderr = served.stop()  # SIGTERM with a template looping
    assert code == 0 and time.monotonic() - start < 30, stderr
    assert "Traceback" not in stderr, stderr


def chat(server, content, **extra):
    return request("POST", f"{server.url}/v1/chat/completions",
                   {"messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}, AUTH)


@pytest.mark.parametrize("content, message", [
    ("divide", "ZeroDivisionError"), ("add", "TypeError"),
    # a doubling string meets whichever bound comes first: memory, output size, or (on a busy machine) time
    ("double", "memory|characters|stopped|did not finish")])
def test_a_failing_template_is_the_requests_400(server, content, message):
    status, reply = chat(server, content)
    assert status == 400 and reply["error"]["param"] == "messages", reply
    assert "chat_template.json failed on these messages" in reply["error"]["message"]
    assert any(word in reply["error"]["message"].lower() for word in message.lower().split("|")), reply
    assert chat(server, "hello")[0] == 200


def test_a_template_that_never_ends_is_cut_off_while_the_server_answers(server):
    answers = {}
    worker = threading.Thread(target=lambda: answers.update(loop=chat(server, "loop")))
    start = time.monotonic()
    worker.start()
    time.sleep(0.5)
    assert server.health()[0] == 200  # the event loop is free meanwhile
    worker.join(60)
    status, reply = answers["loop"]
    assert status == 400 and "did not finish within 5 s" in reply["error"]["message"], reply
    assert time.monotonic() - start < 30
    assert chat(server, "hello")[0] == 200  # a new renderer took over


@pytest.mark.parametrize("extra", [{"temperature": 1e-300}, {"top_p": 1e-300}, {"temperature": 1e-300, "top_p": 1e-300},
                                   {"repetition_penalty": 1e-300}, {"repetition_penalty": 1e-300, "temperature": 1e-5}])
def test_sampling_parameters_that_underflow_are_served(server, extra):
    status, reply = request("POST", f"{server.url}/v1/completions", {"prompt": [5, 6], "max_tokens": 3, **extra}, AUTH)
    assert status == 200 and reply["usage"]["completion_tokens"] == 3, reply


@pytest.mark.parametrize("param, value", [("temperature", 10**400), ("top_p", 10**400), ("min_p", -(10**400)),
                                          ("presence_penalty", 10**400), ("repetition_penalty", 10**400)])
def test_numbers_past_any_float_are_a_400(server, param, value):
    status, reply = request("POST", f"{server.url}/v1/completions", {"prompt": [5, 6], "max_tokens": 2, param: value}, AUTH)
    assert status == 400 and reply["error"]["param"] == param and "give a finite number" in reply["error"]["message"], reply


def test_a_token_named_twice_in_logit_bias_is_a_400(server):
    body = {"prompt": [5, 6], "max_tokens": 2, "logit_bias": {"5": 100, "05": 100}}
    status, reply = request("POST", f"{server.url}/v1/completions", body, AUTH)
    assert status == 400 and reply["error"]["param"] == "logit_bias" and "leading zeros" in reply["error"]["message"], reply


@pytest.mark.parametrize("raw, param", [
    (b'{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    (b'{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt"),
    (b'{"prompt": "a", "stop": ["\\ud800"]}', "stop"),
])
def test_lone_surrogates_are_a_400(server, raw, param):
    status, reply = request("POST", f"{server.url}/v1/completions", raw, AUTH)
    assert status == 400 and reply["error"]["param"] == param and "lone surrogate" in reply["error"]["message"], reply
    status, reply = request("POST", f"{server.url}/v1/chat/completions",
                            b'{"messages": [{"role": "user", "content": "\\ud800"}]}', AUTH)
    assert status == 400 and reply["error"]["param"] == "messages", reply
    status, reply = request("POST", f"{server.url}/v1/completions", b'{"prompt": "a", "\\ud800": 1}', AUTH)
    assert status == 400 and "not valid Unicode" in reply["error"]["message"], reply


def test_small_request_errors_name_what_the_client_sent(server):
    url = f"{server.url}/v1/completions"
    status, reply = request("POST", url, {"prompt": [[5]] * 7, "max_tokens": 1}, AUTH)  # 4 slots + 2 queued < 7
    assert status == 400 and "can never be taken" in reply["error"]["message"], reply
    status, reply = request("POST", url, {"prompt": "hi", "model": 5}, AUTH)
    assert status == 400 and reply["error"]["param"] == "model", reply
    chat_url = f"{server.url}/v1/chat/completions"
    messages = [{"role": "user", "content": "hi"}]
    for value in (0, 10**6):
        status, reply = request("POST", chat_url, {"messages": messages, "max_completion_tokens": value}, AUTH)
        assert status == 400 and reply["error"]["param"] == "max_completion_tokens", reply
        assert "max_completion_tokens" in reply["error"]["message"] and "max_tokens=" not in reply["error"]["message"]


def test_clients_that_stall_or_leave_mid_request_are_let_go(server):
    host, port = urlparse(server.url).netloc.split(":")
    stalled = [socket.create_connection((host, int(port))) for _ in range(20)]  # never send their headers
    trickle = socket.create_connection((host, int(port)))
    trickle.sendall(b"POST /v1/completions HTTP/1.1\r\n")  # ... and no more
    body_stall = socket.create_connection((host, int(port)))
    body_stall.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
                       "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"".encode())
    leaver = socket.create_connection((host, int(port)))
    leaver.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{{".encode())
    leaver.close()
    time.sleep(4)  # twice the server's --request-timeout of 2 s
    for sock in stalled + [trickle]:
        sock.settimeout(5)
        assert sock.recv(100) == b""  # closed by the server
    body_stall.settimeout(5)
    assert b"408" in body_stall.recv(1000).split(b"\r\n")[0]
    assert server.health()[0] == 200


TALLY = {"bodies": 0, "answered 200": 0, "clean errors": 0}


def test_mutated_request_bodies_get_an_answer_never_a_500(server):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from tests.compiler.test_recipe_fuzz import apply_edits, paths

    bases = {"completions": {"model": "tiny", "prompt": ["hi", [5, 6]], "max_tokens": 3, "temperature": 0.5, "top_p": 0.9,
                             "stop": ["x"], "seed": 1, "stream": False, "stream_options": {"include_usage": True}},
             "chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                                  "max_completion_tokens": 3, "ignore_eos": True, "return_token_ids": True}}
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 40), st.sampled_from([2**63, 10**400, 1e-300, -0.0]),
                        st.floats(allow_nan=False), st.text(max_size=6), st.sampled_from(["\ud800", "loop", "divide", "tiny"]))
    values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=2),
                          max_leaves=4)

    @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(sorted(bases)), st.data())
    def check(endpoint, data):
        base = bases[endpoint]
        edits = data.draw(st.lists(st.tuples(st.sampled_from(list(paths(base))), st.sampled_from(["set", "set", "delete"]),
                                             values), min_size=1, max_size=3))
        body = apply_edits(base, edits)
        if "loop" in json.dumps(body):  # (the looping template has its own test: 5 s each)
            return
        raw = json.dumps(body).encode("utf-8", "surrogatepass")
        status, reply = request("POST", f"{server.url}/v1/{endpoint}", raw, AUTH)
        TALLY["bodies"] += 1
        assert status in (200, 400, 404), (status, body, reply)
        if status == 200:
            TALLY["answered 200"] += 1
        else:
            TALLY["clean errors"] += 1
            assert set(reply["error"]) == {"message", "type", "param", "code"}, reply

    check()
    assert server.health()[0] == 200
    print(f"\nHTTP body fuzz: {TALLY}; server exits 0, 500s 0 (any would have failed this test)")
