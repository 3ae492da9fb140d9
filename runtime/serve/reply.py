"""One HTTP request's answer, shaped as OpenAI's: built from its prompts' token events, as a whole
JSON object or as server-sent events."""

import asyncio
import json
import time
import uuid

from starlette.requests import Request as HTTPRequest
from starlette.responses import StreamingResponse

from ..engine import tokens_per_step
from .chat_output import ChatOutput, Shape
from .engine_thread import Failed, Handle
from .protocol import FINISH_REASONS, APIError, Generation
from .text import TextStream


class EventStream(StreamingResponse):
    """Server-sent events of a reply, which is closed however the response ends (a client that
    left before the first event never starts the generator, whose own cleanup would not run)."""

    def __init__(self, reply: "Reply"):
        super().__init__(reply.stream(), media_type="text/event-stream")
        self.reply = reply
        self.done = lambda: None  # called once the stream ended (the access log)

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.reply.close()
            self.done()


class Reply:
    """One HTTP request's answer, built from its prompts' token events."""

    def __init__(self, server, generation: Generation, handles: list[Handle], shape: Shape):
        self.server, self.generation, self.handles, self.shape = server, generation, handles, shape
        chat = self.chat = shape.chat
        self.outputs = [ChatOutput(shape) for _ in handles] if chat else []
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.object = "chat.completion" if chat else "text_completion"
        self.created = int(time.time())
        self.texts = [""] * len(handles)
        self.token_ids: list[list[int]] = [[] for _ in handles]
        self.logprobs: list[list] = [[] for _ in handles]  # per choice: (token, logprob, top) of what it reports
        self.offsets = [0] * len(handles)  # per choice: characters of text already reported (text_offset)
        self.finish: list[str | None] = [None] * len(handles)
        self.pending = set(range(len(handles)))  # prompts not finished
        self.closed = False
        self.echo_texts: list[str] | None = None  # completions' echo: each choice's prompt text
        self.echoed: set[int] = set()

    def close(self):
        """Cancel what still runs and release the reply's place in the server (once)."""
        if self.closed:
            return
        self.closed = True
        for i in self.pending:
            self.server.engine_thread.cancel(self.handles[i])
        for handle in self.handles:
            self.server.engine_thread.finished(handle)
        self.server.inflight -= len(self.handles)

    async def updates(self):
        """(index, new text, new token ids, new logprob entries, finish_reason or None) as the
        engine produces them; with echo a choice's first update starts with its prompt. Leaving
        early (a client gone, an error) cancels what is still running."""
        hidden = () if self.server.engine.eos_id is None else (self.server.engine.eos_id,)
        streams = [TextStream(self.server.tokenizer, self.generation.stop, self.generation.sampling.min_tokens,
                              self.shape.keeps_special_tokens, hidden) for _ in self.handles]
        pending = self.pending
        events = self.handles[0].events
        try:
            while pending:
                event = await events.get()
                if isinstance(event, Failed):
                    raise APIError(503, f"the engine is gone: {event.message}")
                if event.index not in pending:
                    continue  # (a prompt already ended by a stop string: its cancellation)
                i, stream = event.index, streams[event.index]
                text = "".join(stream.add(t) for t in event.token_ids)
                finish = event.finish_reason
                if stream.stopped:
                    finish = "stop"
                elif finish == "cancelled":
                    raise APIError(503, "the server is shutting down: this request was cancelled.")
                elif finish == "error":
                    raise APIError(500, f"generating prompt {i} failed ({event.error}); the server goes on.")
                new_ids = event.token_ids
                if finish:
                    text += stream.finish()
                    pending.discard(i)
                if stream.stopped:
                    self.server.engine_thread.cancel(self.handles[i])
                entries = [(t, lp, top) for t, (lp, top) in zip(new_ids, event.logprobs)]
                if self.echo_texts is not None and i not in self.echoed:  # the prompt first, once
                    self.echoed.add(i)
                    text, entries = self.echo_texts[i] + text, self._prompt_entries(i, event.prompt_logprobs) + entries
                self.texts[i] += text
                self.token_ids[i] += new_ids
                self.logprobs[i] += entries
                self.finish[i] = FINISH_REASONS[finish] if finish else None
                yield i, text, new_ids, entries, self.finish[i]
        finally:
            self.close()

    async def whole(self, http: HTTPRequest) -> dict:
        """The non-streaming answer; a client that disconnects meanwhile cancels it."""
        async def consume():
            async for _ in self.updates():
                pass

        work, gone = asyncio.ensure_future(consume()), asyncio.ensure_future(_disconnected(http))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
        if not work.done() or work.cancelled():
            return {}
        work.result()  # raises the APIError of a failed engine
        choices = [self._choice(i, self.texts[i], self.token_ids[i], self.logprobs[i], self.finish[i], whole=True)
                   for i in range(len(self.handles))]
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.server.model_name,
                "choices": choices, "usage": self.usage()}

    async def stream(self):
        """Server-sent events: chunks, then (stream_options.include_usage) usage, then [DONE]. With
        vLLM's continuous_usage_stats every chunk carries the usage so far."""
        def usage() -> dict:
            if not self.generation.include_usage:
                return {}
            return {"usage": self.usage() if self.generation.continuous_usage else None}

        if self.chat:
            yield _event(self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                       "finish_reason": None}], usage()))
        try:
            async for i, text, ids, entries, finish in self.updates():
                choice = self._choice(i, text, ids, entries, finish, whole=False)  # (a chat delta may hold text back)
                if choice.get("delta", text) or finish or (ids and (self.generation.return_token_ids or self.wants_logprobs)):
                    yield _event(self._chunk([choice], usage()))
        except APIError as err:
            yield _event(err.body())
        else:
            if self.generation.include_usage:
                yield _event(self._chunk([], {"usage": self.usage()}))
        yield "data: [DONE]\n\n"

    @property
    def wants_logprobs(self) -> bool:
        return self.generation.sampling.logprobs is not None

    def _choice(self, i: int, text: str, ids: list[int], entries: list, finish: str | None, whole: bool) -> dict:
        logprobs = self._logprobs(i, entries) if self.wants_logprobs else None
        if self.chat and whole:
            self.outputs[i].add(text)
            message, finish = self.outputs[i].message(finish)
            choice = {"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish}
        elif self.chat:
            delta = self.outputs[i].add(text)
            if finish:
                last, finish = self.outputs[i].finish(finish)
                delta = _joined(delta, last)
            choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if self.generation.return_token_ids:
            choice["token_ids"] = ids
            if whole:
                choice["prompt_token_ids"] = self.handles[i].request.prompt_ids
        return choice

    def _prompt_entries(self, i: int, scores: list | None) -> list:
        """Echo with logprobs: (token, logprob, top) of each prompt token (the first has none)."""
        if not scores:
            return []
        prompt = self.handles[i].request.prompt_ids
        return [(prompt[0], None, None)] + [(t, lp, top) for t, (lp, top) in zip(prompt[1:], scores)]

    def _logprobs(self, i: int, entries: list) -> dict:
        """OpenAI's logprobs object for `entries` [(token, logprob, [(token, logprob)] top)]:
        completions' token/token_logprobs/top_logprobs/text_offset (top_logprobs also holds the
        chosen token, as vLLM's), or chat's content list."""
        piece = self.server.tokenizer.decode_token
        if self.chat:
            def item(token, lp):
                text = piece(token)
                return {"token": text, "logprob": lp, "bytes": list(text.encode())}
            return {"content": [{**item(t, lp), "top_logprobs": [item(u, v) for u, v in top]} for t, lp, top in entries]}
        tokens = [piece(t) for t, _, _ in entries]
        offsets = []
        for text in tokens:
            offsets.append(self.offsets[i])
            self.offsets[i] += len(text)
        tops = [None if top is None else {piece(u): v for u, v in top} | {text: lp} for text, (_, lp, top) in zip(tokens, entries)]
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries], "top_logprobs": tops, "text_offset": offsets}

    def _chunk(self, choices: list, extra: dict) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.server.model_name,
                "choices": choices, **extra}

    def usage(self) -> dict:
        prompt = sum(len(h.request.prompt_ids) for h in self.handles[:: self.generation.n])  # (once per prompt)
        completion = sum(len(ids) for ids in self.token_ids)
        # OpenAI's prompt_tokens_details.cached_tokens: prompt tokens not prefilled (prefix caching), per prompt's first sequence.
        cached = sum(h.seq.result.cached_tokens for h in self.handles[:: self.generation.n] if h.seq is not None)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        if self.server.engine.speculative:  # tokens a decode step emitted (speculative decoding's gain)
            usage["tokens_per_step"] = tokens_per_step([h.seq.result for h in self.handles if h.seq is not None])
        return usage


def _joined(delta: dict, more: dict) -> dict:
    """Two stream deltas as one (their texts concatenated)."""
    joined = dict(delta)
    for key, value in more.items():
        joined[key] = joined[key] + value if isinstance(value, str) and key in joined else value
    return joined


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _disconnected(http: HTTPRequest):
    while (await http.receive())["type"] != "http.disconnect":
        pass
