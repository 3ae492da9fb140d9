"""Chat templates rendered in a child process, bounded in time, memory and output.

A chat template is code that came with the bundle. jinja2's sandbox keeps it from reaching Python
objects, but not from looping 10^10 times or doubling a string sixty times; rendered on the event
loop, such a template froze /health and even SIGTERM. So the server renders in one worker process
(JSON lines over its stdin/stdout), one render at a time: a render that passes RENDER_SECONDS is
killed with its worker (the next render starts a new one), memory is capped by RLIMIT_AS, and a
result over MAX_RENDERED_CHARS is refused. Each failure is the request's 400, naming the template.

    python -m deepinfer.runtime.serve.template_worker    # started by deepinfer-serve: first line the
                                                         # template spec, then {"messages"} per line
"""

import asyncio
import json
import resource
import sys

from ..lifetime import die_with_parent
from .chat import ChatTemplate

RENDER_SECONDS = 5.0
WORKER_MEMORY_BYTES = 1 << 30
MAX_RENDERED_CHARS = 4 << 20  # the request body's own limit: no prompt that fits a context is longer


class TemplateRenderer:
    """The event loop's side: `await render(messages)` -> text, or ValueError saying why not."""

    def __init__(self, template: ChatTemplate, seconds: float = RENDER_SECONDS):
        self.template, self.seconds = template, seconds
        self.process: asyncio.subprocess.Process | None = None
        self.lock = asyncio.Lock()

    async def render(self, messages: list[dict]) -> str:
        async with self.lock:
            if self.process is None:
                await self._start()
            self.process.stdin.write(json.dumps({"messages": messages}).encode() + b"\n")
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
                raise ValueError(f"its renderer stopped (over its {WORKER_MEMORY_BYTES >> 20} MiB memory cap?)")
            reply = json.loads(line)
            if "error" in reply:
                raise ValueError(reply["error"])
            return reply["text"]

    async def _start(self):
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", __name__, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            limit=8 * MAX_RENDERED_CHARS, start_new_session=True, preexec_fn=die_with_parent)
        self.process.stdin.write(json.dumps(self.template.spec()).encode() + b"\n")

    async def close(self):
        """Kill the worker and reap it (a later render starts another)."""
        process, self.process = self.process, None
        if process is not None:
            process.stdin.close()
            if process.returncode is None:
                process.kill()
            await process.wait()


def main():
    resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))
    spec = json.loads(sys.stdin.readline())
    template = ChatTemplate(spec["template"], spec["bos_token"], spec["eos_token"])
    for line in sys.stdin:
        try:
            text = template.render(json.loads(line)["messages"])
            reply = {"text": text} if len(text) <= MAX_RENDERED_CHARS else {
                "error": f"it rendered {len(text)} characters, over the {MAX_RENDERED_CHARS} a prompt may have"}
        except (ValueError, MemoryError) as err:
            reply = {"error": str(err) or type(err).__name__}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
