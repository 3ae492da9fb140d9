"""uvicorn's server, with SIGTERM and Ctrl-C starting the OpenAIServer's drain rather than an
immediate stop (a second signal stops at once)."""

import asyncio

import uvicorn


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, api, grace: float):
        super().__init__(config)
        self.api, self.grace = api, grace
        api.request_exit = self.exit

    def handle_exit(self, sig, frame):
        loop = self.api.loop
        if self.api.draining or loop is None:  # a second signal, or not started yet
            self.force_exit = self.api.draining
            self.should_exit = True
            return
        self.api.draining = True
        loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.api.drain(self.grace)))

    def exit(self):
        self.should_exit = True
