"""A slow and overloaded Prefect server, for the tests of what the service
does then: an HTTP proxy in front of a real server that holds every request
`delay_s` before passing it on, and answers a share of the writes (POST,
PATCH, PUT, DELETE) `503 Service Unavailable` at once, as Prefect's server on
SQLite does in a burst ("database is locked"); Prefect's client retries
those with a growing backoff. A share `lost` of the writes reaches the
server and its answer is lost on the way back (the connection drops), as
when a loaded server answers after the client gave up: the client retries a
write that was made. It runs on its own thread and event loop, one
upstream connection per request (`Connection: close`)."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit, urlunsplit

WRITES = (b"POST", b"PATCH", b"PUT", b"DELETE")
UNAVAILABLE = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: keep-alive\r\n\r\n"


async def _request(reader: asyncio.StreamReader) -> tuple[bytes, bytes, bytes] | None:
    """(method, head, body) of the next request on a connection; None at its end."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
        return None
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip() or 0)
    body = await reader.readexactly(length) if length else b""
    return head.split(b" ", 1)[0], head, body


def _closing(head: bytes) -> bytes:
    """The request head, asking the server to close after its answer."""
    lines = [line for line in head.rstrip(b"\r\n").split(b"\r\n") if not line.lower().startswith(b"connection:")]
    return b"\r\n".join([*lines, b"connection: close"]) + b"\r\n\r\n"


@contextmanager
def slow_server(api_url: str, delay_s: float, unavailable: float = 0.0, seed: int = 0,
                lost: float = 0.0, down_s: float = 0.0, blink_s: float = 0.0) -> Iterator[str]:
    """The URL of `api_url` behind the proxy: each request `delay_s` slower,
    a share `unavailable` of the writes refused with a 503, a share `lost`
    made and their answers dropped; for the first `down_s` seconds nothing
    listens there (a server restarting: connections are refused); after the
    first connection, nothing listens for `blink_s` seconds (a server killed
    just after a client found it listening)."""
    target = urlsplit(api_url)
    rng = random.Random(seed)
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    port: list[int] = []

    async def tunnel(head: bytes, body: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A websocket (events): passed on both ways as it is."""
        up_reader, up_writer = await asyncio.open_connection(target.hostname, target.port)
        up_writer.write(head + body)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (OSError, asyncio.CancelledError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    async def answer(method: bytes, head: bytes, body: bytes, writer: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(delay_s)
        if method in WRITES and rng.random() < unavailable:
            writer.write(UNAVAILABLE)
            await writer.drain()
            return True
        up_reader, up_writer = await asyncio.open_connection(target.hostname, target.port)
        try:
            up_writer.write(_closing(head) + body)
            await up_writer.drain()
            drop = method in WRITES and rng.random() < lost
            while data := await up_reader.read(65536):
                if not drop:
                    writer.write(data)
            await writer.drain()
        finally:
            up_writer.close()
        return False  # the server closed after its answer: so does this connection (at once, if dropped)

    connected = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connected.set()
        try:
            while (request := await _request(reader)) is not None:
                if b"upgrade: websocket" in request[1].lower():
                    await tunnel(request[1], request[2], reader, writer)
                    return
                if not await answer(*request, writer):
                    return
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def serve() -> None:
        if down_s > 0:
            from scheduler_service.stack.local import free_port

            port.append(free_port())
            ready.set()
            await asyncio.sleep(down_s)
        server = await asyncio.start_server(handle, "127.0.0.1", port[0] if port else 0)
        if not port:
            port.append(server.sockets[0].getsockname()[1])
        ready.set()
        if blink_s > 0:
            await connected.wait()
            server.close()
            await asyncio.sleep(blink_s)
            server = await asyncio.start_server(handle, "127.0.0.1", port[0])
        async with server:
            try:
                await server.serve_forever()
            except asyncio.CancelledError:
                pass

    thread = threading.Thread(target=lambda: loop.run_until_complete(serve()), daemon=True)
    thread.start()
    ready.wait(10)
    try:
        yield urlunsplit((target.scheme, f"127.0.0.1:{port[0]}", target.path, "", ""))
    finally:
        for task in asyncio.all_tasks(loop):
            loop.call_soon_threadsafe(task.cancel)
        thread.join(5)
