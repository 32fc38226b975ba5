"""One misbehaving client connection must not take a serve-model process down.

Found through the sglang-router (tests/inference/test_sglang_router.py failed now and then):
hypercorn's HTTP/2 code raised ``KeyError`` for a frame on a stream it had closed, and the
exception ended the whole server. Here an HTTP/2 client does that on purpose: it sends the
body of a ``GET /health`` after the response came back.
"""

from __future__ import annotations

import socket

import h2.config
import h2.connection
import h2.events
import httpx

from streamrl.testing.serve_model import ServeModel


def _late_body_over_http2(port: int) -> list[str]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    sock.sendall(conn.data_to_send())
    headers = [(":method", "GET"), (":path", "/health"), (":scheme", "http"),
               (":authority", f"127.0.0.1:{port}")]
    conn.send_headers(1, headers, end_stream=False)  # a body follows...
    sock.sendall(conn.data_to_send())
    seen: list[str] = []
    while "StreamEnded" not in seen:  # ...after the whole response
        data = sock.recv(65535)
        assert data, f"connection closed after {seen}"
        seen += [type(e).__name__ for e in conn.receive_data(data)]
        sock.sendall(conn.data_to_send())
    conn.send_data(1, b"late body", end_stream=True)
    sock.sendall(conn.data_to_send())
    try:  # the server drops this connection (or not); either way, read until it is done
        while sock.recv(65535):
            pass
    except (TimeoutError, ConnectionResetError):
        pass
    finally:
        sock.close()
    return seen


def test_a_broken_http2_stream_does_not_kill_the_server(one_server: ServeModel) -> None:
    seen = _late_body_over_http2(one_server.port)
    assert "ResponseReceived" in seen  # the server spoke HTTP/2 and answered
    # Then the server is still up and serving everyone else
    assert one_server.process.poll() is None, one_server.log.read_text()[-2000:]
    assert httpx.get(one_server.url + "/health", timeout=10).status_code == 200
    assert "connection failed" in one_server.log.read_text()
