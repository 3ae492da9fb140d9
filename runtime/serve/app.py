"""The HTTP front door on Starlette: OpenAI's /v1/completions, /v1/chat/completions and
/v1/models, vLLM's /tokenize, /detokenize and /version, plus /health and /metrics. It knows requests, text and tokens; the engine thread
knows steps. Every error is OpenAI's error object with the status it deserves."""

import asyncio
import contextlib
import dataclasses
import hmac
import json
import sys
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..engine import Request
from ..errors import DeepinferError
from ..grammar import Grammars
from ..grammar_text import GrammarError
from ..sampling import SamplingError
from ..tokenizer import bundle_tokenizer
from .chat import ChatTemplate
from .engine_thread import EngineThread, Handle
from .grammar_worker import GrammarCompiler
from .metrics import Metrics
from ..versions import toolchain_versions
from .protocol import (APIError, Generation, bad, message_text, not_unicode, parse_chat, parse_completion, parse_detokenize,
                       parse_tokenize)
from .template_worker import RENDER_SECONDS, TemplateRenderer
from .reasoning import END as END_OF_THINKING, thinking_prompt
from .chat_output import Shape
from .reply import EventStream, Reply
from .structured import OutputConstraint
from .tools import template_markup

MAX_BODY_BYTES = 4 << 20


class OpenAIServer:
    """State the routes share. `open_executor()` loads the bundle on the engine thread;
    `request_exit()` asks the HTTP server to stop (set by the command line)."""

    def __init__(self, open_executor, model_name: str, max_queue: int, api_keys: tuple[str, ...] = (),
                 render_seconds: float = RENDER_SECONDS, body_seconds: float = 30.0, prefix_caching: bool = True,
                 prefix_cache_per_key: bool = False, url: str = "", access_log: bool = True,
                 allowed_origins: tuple[str, ...] = (), reasoning: bool = False):
        """`api_keys`: the keys a client may send (none: no key asked); `prefix_cache_per_key`: each
        key's requests share cached prompts only among themselves (the key salts them); `url`: where
        it listens (for the ready line); `access_log`: a line on stderr per request; `allowed_origins`:
        the browser origins CORS lets call it ("*": any); `reasoning`: split chat outputs' thinking
        into reasoning_content (reasoning.py)."""
        self.open_executor, self.model_name, self.max_queue, self.api_keys = open_executor, model_name, max_queue, api_keys
        self.prefix_caching, self.prefix_cache_per_key = prefix_caching, prefix_cache_per_key
        self.url, self.access_log, self.reasoning = url, access_log, reasoning
        self.load_started = time.perf_counter()
        self.render_seconds, self.body_seconds = render_seconds, body_seconds
        self.metrics = Metrics(model_name)
        self.engine_thread: EngineThread | None = None
        self.engine = None  # once loaded
        self.tokenizer = self.renderer = self.grammars = self.compiler = None
        self.markup: str | None = None  # the chat template's tool-call markup (tools.MARKUPS), if it has one
        self.inflight = 0  # prompts admitted and not yet answered
        self.draining = False
        self.failure: str | None = None
        self.created = int(time.time())
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's, once started
        self.request_exit = lambda: None
        self.app = Starlette(
            routes=[Route("/v1/completions", self._counted("completions", self.completions), methods=["POST"]),
                    Route("/v1/chat/completions", self._counted("chat", self.chat), methods=["POST"]),
                    Route("/v1/models", self._counted("models", self.models)),
                    Route("/v1/models/{model:path}", self._counted("models", self.model_card)),
                    Route("/health", self.health), Route("/metrics", self.metrics_page),
                    Route("/tokenize", self._counted("tokenize", self.tokenize), methods=["POST"]),
                    Route("/detokenize", self._counted("detokenize", self.detokenize), methods=["POST"]),
                    Route("/version", self.version)],
            exception_handlers={APIError: _api_error, HTTPException: _http_error},
            middleware=[Middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                                   allow_headers=["*"])] if allowed_origins else [],
            lifespan=self._lifespan)

    # --- lifecycle ---------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        self.loop = asyncio.get_running_loop()
        self.engine_thread = EngineThread(self._load, asyncio.get_running_loop(), self.metrics,
                                          on_ready=self._ready, on_fatal=self._fatal, prefix_caching=self.prefix_caching)
        self.engine_thread.start()
        yield
        self.engine_thread.stop(timeout=60)
        for worker in (self.renderer, self.compiler):
            if worker is not None:
                await worker.close()

    def _load(self):
        """On the engine thread: the executor, the tokenizer and the chat template."""
        executor = self.open_executor()
        self.tokenizer = bundle_tokenizer(executor)
        template = ChatTemplate.of_bundle(executor)
        self.renderer = TemplateRenderer(template, self.render_seconds)
        self.markup = template_markup(template.source)
        m = executor.manifest
        self.grammars = Grammars(self.tokenizer, m.vocab_size, m.eos_token_id)
        self.compiler = GrammarCompiler(self.grammars)
        return executor

    def _ready(self, engine):
        self.engine = engine
        _say(f"ready: {self.url} serving {self.model_name!r} ({len(engine.executor.manifest.regions)} regions, loaded in "
             f"{time.perf_counter() - self.load_started:.1f} s)")

    def _fatal(self, message: str):
        self.failure = message
        self.request_exit()  # (the command line prints the message)

    async def drain(self, grace: float):
        """Stop admitting (503), give in-flight requests `grace` seconds, cancel the rest, exit."""
        self.draining = True
        deadline = time.monotonic() + grace
        while self.inflight and time.monotonic() < deadline and self.failure is None:
            await asyncio.sleep(0.05)
        for handle in list(self.engine_thread.live):
            self.engine_thread.cancel(handle)  # their clients get a 503 error event
        while self.inflight and time.monotonic() < deadline + 5:
            await asyncio.sleep(0.05)
        self.request_exit()

    # --- endpoints ---------------------------------------------------------------------------

    async def completions(self, request: HTTPRequest) -> Response:
        generation = await self._accept(request, parse_completion)
        prompts = [p if isinstance(p, list) else self.tokenizer.encode(p) for p in generation.prompts]
        return await self._respond(request, generation, prompts, Shape(chat=False))

    async def chat(self, request: HTTPRequest) -> Response:
        generation = await self._accept(request, parse_chat)
        tools = generation.tools.tools if generation.tools is not None else None
        text = await self._render(generation.prompts[0], tools, generation.template_kwargs)
        shape = Shape(chat=True, tools=generation.tools, markup=self.markup,
                      reasoning=self.reasoning, thinking=self.reasoning and thinking_prompt(text))
        return await self._respond(request, generation, [self.tokenizer.encode(text, add_special_tokens=False)], shape)

    async def _render(self, messages: list[dict], tools: list[dict] | None = None, kwargs: dict | None = None) -> str:
        try:
            return await self.renderer.render([message_text(m) for m in messages], tools, kwargs)
        except ValueError as err:
            raise bad("messages", f"{self.renderer.template.where} failed on these messages: {err}") from None

    async def _grammar(self, constraint: OutputConstraint) -> str:
        """The constraint compiled (grammar_worker.py: bounded, cached across requests)."""
        try:
            return await self.compiler.compile(constraint.kind, constraint.spec)
        except GrammarError as err:
            raise bad(constraint.param, f"not a grammar this server can follow (llguidance: {err}); fix or simplify "
                                        "it.") from None

    async def models(self, request: HTTPRequest) -> Response:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [self._card()]})

    async def model_card(self, request: HTTPRequest) -> Response:
        """OpenAI's GET /v1/models/{model}."""
        self._authorize(request)
        model = request.path_params["model"]
        if model != self.model_name:
            raise APIError(404, f"The model {model!r} does not exist: this server serves {self.model_name!r}.",
                           param="model", code="model_not_found")
        return JSONResponse(self._card())

    def _card(self) -> dict:
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "deepinfer"}
        if self.engine is not None:
            card["max_model_len"] = self.engine.max_len
        return card

    async def tokenize(self, request: HTTPRequest) -> Response:
        """vLLM's: a prompt's (or a chat's, rendered by the template) token ids."""
        _, body = await self._body(request)
        prompt, messages, add_special_tokens = parse_tokenize(body)
        self._check_model(body)
        self._check_available()
        if messages is None:
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        else:
            text = await self._render(messages)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        return JSONResponse({"count": len(ids), "max_model_len": self.engine.max_len, "tokens": ids, "token_strs": None})

    async def detokenize(self, request: HTTPRequest) -> Response:
        """vLLM's: token ids back to text."""
        _, body = await self._body(request)
        self._check_model(body)
        self._check_available()
        return JSONResponse({"prompt": self.tokenizer.decode(parse_detokenize(body, self.engine.vocab_size))})

    async def version(self, request: HTTPRequest) -> Response:
        return JSONResponse({"version": toolchain_versions()["deepinfer"]})

    async def health(self, request: HTTPRequest) -> Response:
        if self.failure is not None:
            return JSONResponse({"status": "failed", "message": self.failure}, status_code=503)
        if self.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if self.engine is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics_page(self, request: HTTPRequest) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    # --- requests ----------------------------------------------------------------------------

    def _counted(self, name: str, endpoint):
        async def counted(request: HTTPRequest) -> Response:
            start = time.perf_counter()
            try:
                response = await endpoint(request)
            except APIError as err:
                self.metrics.requests.labels(name, str(err.status)).inc()
                self._log_access(request, err.status, start)
                raise
            self.metrics.requests.labels(name, str(response.status_code)).inc()
            reply = getattr(response, "reply", None)
            if isinstance(response, EventStream):  # (logged once the stream ends: its tokens are known then)
                response.done = lambda: self._log_access(request, response.status_code, start, reply)
            else:
                self._log_access(request, response.status_code, start, reply)
            return response
        return counted

    def _log_access(self, request: HTTPRequest, status: int, start: float, reply: "Reply | None" = None):
        """One line a request, as vLLM's users read uvicorn's: client, request line, status, then
        the latency and, for a generation, its tokens."""
        if not self.access_log:
            return
        client = f"{request.client.host}:{request.client.port}" if request.client else "-"
        tokens = ""
        if reply is not None:
            usage = reply.usage()
            tokens = f" prompt_tokens={usage['prompt_tokens']} completion_tokens={usage['completion_tokens']}"
        _say(f'{client} "{request.method} {request.url.path}" {status} {(time.perf_counter() - start) * 1000:.0f} ms{tokens}')

    async def _accept(self, request: HTTPRequest, parse) -> Generation:
        """The checks every generation request passes, in the order a client should hear of them:
        key, body, parameters, model, then whether the engine can take it."""
        key, body = await self._body(request)
        generation = parse(body)
        if self.prefix_cache_per_key:  # (the key's index: salts of different keys never coincide)
            generation.cache_salt = f"{key}\0{generation.cache_salt}"
        self._check_model(body)
        self._check_available()
        return generation

    async def _body(self, request: HTTPRequest) -> tuple[int | None, dict]:
        """(the index of the API key it sent, the JSON body), the key checked first."""
        key = self._authorize(request)
        return key, await _json_body(request, self.body_seconds)

    def _authorize(self, request: HTTPRequest) -> int | None:
        """The index of the API key the request sent (None: the server asks for none)."""
        if not self.api_keys:
            return None
        given = request.headers.get("authorization", "").encode()
        matches = [hmac.compare_digest(given, f"Bearer {key}".encode()) for key in self.api_keys]  # (each compared)
        if not any(matches):
            raise APIError(401, "Incorrect API key provided: send it as the header 'Authorization: Bearer <key>' "
                                "(one of the server's --api-key).", code="invalid_api_key")
        return matches.index(True)

    def _check_model(self, body: dict):
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise bad("model", f"{str(model)[:40]!r}: give the model's name as a string.")
        # (A request without `model` is served: this server has one model, and curl users expect it.)
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model {model!r} does not exist: this server serves {self.model_name!r}.",
                           param="model", code="model_not_found")

    def _check_available(self):
        if self.failure is not None:
            raise APIError(503, f"the engine is gone ({self.failure}); the server is stopping.")
        if self.draining:
            raise APIError(503, "the server is shutting down and takes no new requests.")
        if self.engine is None:
            raise APIError(503, "the model is still loading; retry when GET /health answers 200.",
                           headers={"Retry-After": "1"})

    def _requests(self, generation: Generation, prompts: list[list[int]], param: str) -> list[Request]:
        requests = []
        max_len = self.engine.max_len
        for ids in prompts:
            # The last token sampled needs no cache position: up to max_len - n + 1 tokens fit.
            room = max_len - len(ids) + 1
            max_tokens = room if generation.max_tokens is None else generation.max_tokens
            request = Request(ids, max_tokens, generation.sampling, generation.ignore_eos, generation.cache_salt)
            try:
                self.engine.check(request)
            except SamplingError as err:  # (prompt_logprobs: what echo with logprobs asks for)
                if err.param == "prompt_logprobs":
                    raise bad("echo", f"with logprobs it returns the prompt's logprobs, but {err}") from None
                raise APIError(400, str(err), param=err.param) from None
            except DeepinferError as err:
                code = "context_length_exceeded" if len(ids) >= max_len else None
                raise APIError(400, str(err), param=param, code=code) from None
            if max_tokens > room:
                name = generation.max_tokens_param
                raise APIError(400, f"{name}={max_tokens} does not fit: a prompt of {len(ids)} tokens leaves room for "
                                    f"at most {room} in this model's context of {max_len} positions.",
                               param=name, code="context_length_exceeded")
            requests.append(request)
        return requests

    async def _respond(self, http: HTTPRequest, generation: Generation, prompts: list[list[int]], shape: Shape) -> Response:
        """Choice i is prompt i // n's (i % n)-th sample, seeded seed + i, with its own grammar matcher."""
        requests = self._requests(generation, prompts, "messages" if shape.chat else "prompt")
        capacity = self.engine.max_seqs + self.max_queue
        choices = len(requests) * generation.n
        if choices > capacity:
            raise bad("prompt", f"{choices} choices (prompts x n) in one request can never be taken: this server "
                                f"runs {self.engine.max_seqs} and queues {self.max_queue}; ask for at most {capacity}.")
        if self.inflight + choices > capacity:
            raise APIError(429, f"the server is at capacity ({self.engine.max_seqs} running and {self.max_queue} queued "
                                "requests); retry later.", headers={"Retry-After": "1"})
        if generation.constraint is not None:
            grammar = await self._grammar(generation.constraint)
            after = END_OF_THINKING if shape.thinking else ""
            requests = [dataclasses.replace(r, constraint=self.grammars.matcher(grammar, after))
                        for r in requests for _ in range(generation.n)]
        else:
            requests = [r for r in requests for _ in range(generation.n)]
        events: asyncio.Queue = asyncio.Queue()
        handles = [Handle(r, generation.sampling.seed + i, events, i) for i, r in enumerate(requests)]
        self.inflight += len(handles)
        for handle in handles:
            self.engine_thread.submit(handle)
        reply = Reply(self, generation, handles, shape)
        if generation.echo:
            texts = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in generation.prompts]
            reply.echo_texts = [t for t in texts for _ in range(generation.n)]
        if generation.stream:
            return EventStream(reply)
        response = JSONResponse(await reply.whole(http))
        response.reply = reply  # (for the access log)
        return response


async def _json_body(request: HTTPRequest, seconds: float) -> dict:
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise APIError(413, f"the request body of {int(length)} bytes is over this server's limit of {MAX_BODY_BYTES}.")

    async def read() -> bytearray:
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_BODY_BYTES:
                raise APIError(413, f"the request body is over this server's limit of {MAX_BODY_BYTES} bytes.")
        return raw

    try:
        raw = await asyncio.wait_for(read(), seconds)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {seconds:g} s.") from None
    except ClientDisconnect:  # (nobody is left to read the answer)
        raise APIError(400, "the client disconnected before the whole body arrived.") from None
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise APIError(400, "the request body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object.")
    where = not_unicode(body)
    if where is not None:
        raise APIError(400, f"{where}: not valid Unicode text (a lone surrogate such as \\ud800).",
                       param=where.split(".")[0].split("[")[0])
    return body


async def _api_error(request: HTTPRequest, err: APIError) -> Response:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


async def _http_error(request: HTTPRequest, err: HTTPException) -> Response:
    what = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
    return JSONResponse(APIError(err.status_code, what.get(err.status_code, err.detail)).body(), status_code=err.status_code,
                        headers=err.headers)


def _say(line: str):
    """A line of the server's log, on stderr (the command line's own lines are there too)."""
    print(f"deepinfer-serve: {line}", file=sys.stderr, flush=True)
