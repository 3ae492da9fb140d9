"""uvicorn's server, with SIGTERM and Ctrl-C starting the OpenAIServer's drain rather than an
immediate stop (a second signal stops at once), and a deadline for each request's head."""

import asyncio

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol


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


def head_deadline_protocol(seconds: float) -> type:
    """uvicorn's h11 protocol, closing a connection whose request line and headers have not all
    arrived `seconds` after it opened or after its last response (a half-open or trickling
    client). uvicorn bounds only idle keep-alive connections, and any byte re-arms that; the
    body has its own deadline in the app (408)."""

    class HeadDeadlineProtocol(H11Protocol):
        deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes):
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE and self.deadline is not None:
                self.deadline.cancel()  # the head is in
                self.deadline = None

        def on_response_complete(self):
            super().on_response_complete()
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self._arm()  # the next request on this connection

        def connection_lost(self, exc):
            if self.deadline is not None:
                self.deadline.cancel()
            super().connection_lost(exc)

        def _arm(self):
            if self.deadline is not None:
                self.deadline.cancel()
            self.deadline = self.loop.call_later(seconds, self._expired)

        def _expired(self):
            self.deadline = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeadDeadlineProtocol
