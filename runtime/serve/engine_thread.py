"""The engine on its own thread, and the bridge to the server's event loop.

Steps are blocking torch calls (and, multi-rank, collectives), so the engine runs on one thread
that owns it outright: the event loop never touches it, it only posts commands (submit, cancel,
stop) to an inbox the thread drains between steps, and receives each sequence's new tokens as
events on that request's asyncio queue. So a request joins, and a cancel (a client gone, a stop
string seen) takes effect, at the next step boundary.
"""

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field

from ..engine import Engine, Request, Sequence
from ..errors import DeepinferError


@dataclass
class Tokens:
    """New tokens of one prompt (`index` within its HTTP request); `finish_reason` once it ended."""

    index: int
    token_ids: list[int]
    finish_reason: str | None
    error: str = ""  # with finish_reason "error": why this prompt failed
    logprobs: list = field(default_factory=list)  # per new token (Result.logprobs), when asked
    prompt_logprobs: list | None = None  # with the first event, when asked (Result.prompt_logprobs)


@dataclass
class Failed:
    """The engine is gone (a rank died, a step raised): no more tokens for anyone."""

    message: str


@dataclass(eq=False)
class Handle:
    """One submitted prompt as the event loop sees it."""

    request: Request
    seed: int
    events: asyncio.Queue
    index: int
    seq: Sequence | None = None  # set on the engine thread
    posted: int = -1  # tokens already posted (-1: no event yet)


class EngineThread:
    def __init__(self, load, loop: asyncio.AbstractEventLoop, metrics, on_ready, on_fatal, prefix_caching: bool = True):
        """`load()` opens the bundle's executor (on the engine thread, so the server answers
        /health meanwhile); then `on_ready(engine)` is called on the event loop, or once the
        engine is gone, `on_fatal(message)`."""
        self.load, self.loop, self.metrics, self.on_ready, self.on_fatal = load, loop, metrics, on_ready, on_fatal
        self.prefix_caching = prefix_caching
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.engine: Engine | None = None  # set once loaded
        self.executor = None
        self.failed: str | None = None
        self.handles: list[Handle] = []  # submitted and not finished, as the engine thread knows them
        self.live: set[Handle] = set()  # submitted and not yet seen to finish, as the event loop knows them
        self.thread = threading.Thread(target=self._run, name="deepinfer-engine", daemon=True)

    # --- the event loop's side -------------------------------------------------------------

    def start(self):
        self.thread.start()

    def submit(self, handle: Handle):
        self.live.add(handle)
        self.inbox.put(("submit", handle))

    def cancel(self, handle: Handle):
        """Stop a prompt that is still live (a finished one is left alone)."""
        if handle in self.live:
            self.live.discard(handle)
            self.inbox.put(("cancel", handle))

    def finished(self, handle: Handle):
        """The event loop saw `handle`'s last event."""
        self.live.discard(handle)

    def stop(self, timeout: float):
        """Finish the current step, stop the followers, end the thread (waits up to `timeout`)."""
        self.inbox.put(("stop", None))
        self.thread.join(timeout)

    def fail(self, message: str):
        """Called from any thread when the engine cannot go on (e.g. the leader saw a rank die)."""
        self.loop.call_soon_threadsafe(self._failed, message)

    # --- the engine thread -----------------------------------------------------------------

    def _run(self):
        try:
            self.executor = self.load()
            self.engine = Engine.for_bundle(self.executor, self.prefix_caching)
        except DeepinferError as err:
            self.fail(str(err))
            return
        except Exception as err:  # anything else must end the server too, not leave it loading forever
            self.fail(f"loading the bundle failed: {type(err).__name__}: {err}")
            return
        self.loop.call_soon_threadsafe(self.on_ready, self.engine)
        self.metrics.scheduler(0, 0, self.engine.max_seqs, self.engine.max_seqs)
        try:
            while self._take_commands():
                if self.engine.busy:
                    self._post(self.engine.step())
                self._publish()
        except Exception as err:  # a step that raised: every request fails, the server stops
            if hasattr(self.executor, "check_followers"):
                self.executor.check_followers()  # a dead rank, if that is why, is the message
            self.fail(f"the engine stopped: {err}")
            if hasattr(self.executor, "shutdown"):
                self.executor.shutdown(kill=True)  # followers may wait in a collective this rank left
            return
        if hasattr(self.executor, "shutdown"):  # a multi-rank leader: stop the followers
            self.executor.shutdown()

    def _take_commands(self) -> bool:
        """Apply every waiting command (waiting for one while idle); False once told to stop."""
        block = not self.engine.busy
        while True:
            try:
                command, handle = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
            except queue.Empty:
                if block and self.failed is None:
                    continue
                return self.failed is None
            block = False
            if command == "stop":
                return False
            if command == "submit":
                handle.seq = self.engine.submit(handle.request, handle.seed)
                self.handles.append(handle)
                self.metrics.submitted(len(handle.request.prompt_ids))
            elif handle.seq is not None:
                self.engine.cancel(handle.seq)
                self._post([handle.seq])

    def _post(self, updated: list[Sequence]):
        for handle in [h for h in self.handles if h.seq in updated]:
            result = handle.seq.result
            first, start = handle.posted < 0, max(handle.posted, 0)
            new = result.token_ids[start:]
            if start == 0 and new:
                self.metrics.first_token(result.ttft)
            handle.posted = len(result.token_ids)
            self.metrics.generated(len(new))
            finish = result.finish_reason or None
            if finish:
                self.handles.remove(handle)
                self.metrics.finished(result, time.perf_counter() - handle.seq.submitted)
            event = Tokens(handle.index, new, finish, result.error, result.logprobs[start:],
                           result.prompt_logprobs if first else None)
            self.loop.call_soon_threadsafe(handle.events.put_nowait, event)

    def _publish(self):
        self.metrics.scheduler(len(self.engine.running), len(self.engine.waiting), len(self.engine.free_slots),
                               self.engine.max_seqs)
        if self.engine.speculative:
            self.metrics.speculation(self.engine.drafted, self.engine.accepted)
        engine = self.engine
        self.metrics.prefix_cache({"hits": engine.prefix_hits, "hit_tokens": engine.prefix_hit_tokens,
                                   "copies": engine.prefix_copies, "evictions": engine.prefix_evictions})

    # --- back on the event loop --------------------------------------------------------------

    def _failed(self, message: str):
        if self.failed is not None:
            return
        self.failed = message
        for handle in self.live:
            handle.events.put_nowait(Failed(message))
        self.live.clear()
        self.on_fatal(message)
