"""Work a request brings that may not end, run in a child process bounded in time, memory and
output: a chat template (code that came with the bundle: jinja2's sandbox keeps it from Python
objects, not from looping 10^10 times) and a grammar compile (a JSON schema whose alternatives
multiply 2^40 ways). Run on the event loop or a thread of the server, either froze it or ate its
memory. One child per kind, one job at a time, JSON lines over its stdin/stdout: a job past its
seconds is killed with the child (the next job starts a new one), memory is capped by RLIMIT_AS,
and a reply over the line limit is refused. Each failure is a ValueError saying which.

A worker module's main() calls `serve(handle)`: its first line is the worker's setup, then one job
per line.
"""

import asyncio
import json
import resource
import sys

from ..lifetime import die_with_parent

WORKER_MEMORY_BYTES = 1 << 30
MAX_REPLY_CHARS = 4 << 20  # the request body's own limit: no prompt or grammar we take is longer


class BoundedWorker:
    """The event loop's side: `await call(job)` -> the worker's reply (a dict), or ValueError."""

    def __init__(self, module: str, setup: dict, seconds: float):
        self.module, self.setup, self.seconds = module, setup, seconds
        self.process: asyncio.subprocess.Process | None = None
        self.lock = asyncio.Lock()

    async def call(self, job: dict) -> dict:
        async with self.lock:
            if self.process is None:
                await self._start()
            self.process.stdin.write(json.dumps(job).encode() + b"\n")
            try:
                await self.process.stdin.drain()
                line = await asyncio.wait_for(self.process.stdout.readline(), self.seconds)
            except asyncio.TimeoutError:
                await self.close()
                raise ValueError(f"it did not finish within {self.seconds:g} s") from None
            except (ConnectionError, ValueError):  # the worker died (its memory cap), or a line past the limit
                line = b""
            if not line:
                await self.close()
                raise ValueError(f"its worker stopped (over its {WORKER_MEMORY_BYTES >> 20} MiB memory cap?)")
            reply = json.loads(line)
            if "error" in reply:
                raise ValueError(reply["error"])
            return reply

    async def _start(self):
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", self.module, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            limit=8 * MAX_REPLY_CHARS, start_new_session=True, preexec_fn=die_with_parent)
        self.process.stdin.write(json.dumps(self.setup).encode() + b"\n")

    async def close(self):
        """Kill the worker and reap it (a later job starts another)."""
        process, self.process = self.process, None
        if process is not None:
            process.stdin.close()
            if process.returncode is None:
                process.kill()
            await process.wait()


def serve(handle):
    """The child's loop: `handle(setup)` returns the function that answers a job (a dict -> a dict);
    a job's ValueError or MemoryError is its error reply."""
    resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))
    answer = handle(json.loads(sys.stdin.readline()))
    for line in sys.stdin:
        try:
            reply = answer(json.loads(line))
            size = len(json.dumps(reply))
            if size > MAX_REPLY_CHARS:
                reply = {"error": f"its result has {size} characters, over the {MAX_REPLY_CHARS} allowed"}
        except (ValueError, MemoryError) as err:
            reply = {"error": str(err) or type(err).__name__}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
