"""``Daemon.shutdown``: the HTTP server's stop and the agent's close run side by side (each waits
on something of its own: the server for its next poll, the agent for the kernel to release its
uprobes), and shutdown returns only when both are done."""

from __future__ import annotations

import threading

from kvwatch.daemon.wiring import Daemon

GUARD_SECONDS = 60.0  # a deadlock guard only: the overlap needs none of it


class Server:
    def __init__(self, agent_closing: threading.Event) -> None:
        self.agent_closing = agent_closing
        self.stopped = False

    def stop(self) -> None:
        # returns only once the agent's close has begun: stopped first and alone, it never would
        assert self.agent_closing.wait(GUARD_SECONDS), "the server's stop waited for the agent's close"
        self.stopped = True


class Agent:
    def __init__(self) -> None:
        self.closing = threading.Event()
        self.closed = False

    def close(self) -> None:
        self.closing.set()
        self.closed = True


def test_shutdown_stops_the_server_while_the_agent_closes() -> None:
    agent = Agent()
    server = Server(agent.closing)
    d = object.__new__(Daemon)  # no probes, no port: only shutdown's order
    d.agent, d.server = agent, server  # type: ignore[assignment]
    d.shutdown()
    assert agent.closed and server.stopped
