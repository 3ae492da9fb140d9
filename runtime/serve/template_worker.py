"""Chat templates rendered in a bounded child process (bounded_worker.py): a render past
RENDER_SECONDS, over the memory cap, or longer than a request body may be is the request's 400,
naming the template.

    python -m deepinfer.runtime.serve.template_worker    # started by deepinfer-serve: first line the
                                                         # template spec, then {"messages", "tools", "kwargs"} per line
"""

from .bounded_worker import BoundedWorker, serve
from .chat import ChatTemplate

RENDER_SECONDS = 5.0


class TemplateRenderer:
    """The event loop's side: `await render(messages)` -> text, or ValueError saying why not."""

    def __init__(self, template: ChatTemplate, seconds: float = RENDER_SECONDS):
        self.template = template
        self.worker = BoundedWorker(__name__, template.spec(), seconds)

    async def render(self, messages: list[dict], tools: list[dict] | None = None, kwargs: dict | None = None) -> str:
        return (await self.worker.call({"messages": messages, "tools": tools, "kwargs": kwargs}))["text"]

    async def close(self):
        await self.worker.close()


def _renderer(spec: dict):
    template = ChatTemplate(spec["template"], spec["bos_token"], spec["eos_token"])
    return lambda job: {"text": template.render(job["messages"], job.get("tools"), job.get("kwargs"))}


if __name__ == "__main__":
    serve(_renderer)
