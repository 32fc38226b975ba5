"""What every HTTP server of the package shares (``serve-model``, the OpenAI endpoint).

:func:`guard_connections`: one client connection's failure never ends a hypercorn server.
"""

from __future__ import annotations

import structlog

log = structlog.get_logger()


def guard_connections() -> None:
    """Keep one client connection from killing the server.

    hypercorn (0.17) runs every connection in the server's nursery and lets any exception a
    connection raises end the whole server. Its HTTP/2 code raises ``KeyError`` for a frame
    on a stream it already closed (a client that sends the rest of a body after the
    response, or a router that resets an aborted request): one such client, e.g. the
    sglang-router, took a serve-model process down. Each connection's failure is logged
    and confined to that connection. (``tests/inference/test_server_resilience.py``)
    """
    from hypercorn.trio.tcp_server import TCPServer

    if getattr(TCPServer.run, "_streamrl_guarded", False):
        return
    run = TCPServer.run

    async def guarded(self: TCPServer) -> None:
        try:
            await run(self)
        except Exception as exc:  # an ExceptionGroup from its task group, a KeyError, ...
            log.warning("connection failed", error=repr(exc)[:500])

    guarded._streamrl_guarded = True  # type: ignore[attr-defined]
    TCPServer.run = guarded  # type: ignore[method-assign]
