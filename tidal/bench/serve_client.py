"""The client side of ``tidal bench serve``: one process that sends its share of a burst of ``/generate`` requests.

Run by ``tidal.bench.serve`` as ``python -m tidal.bench.serve_client URL``, several at once, so that
the client's own work (building requests, HTTP framing, parsing replies) is spread over processes
the way a rollout fleet's clients are, instead of one event loop becoming the bottleneck. Each
process reads one JSON line from stdin, ``{"bodies": [...], "api_key": K or null}``, then one line
per burst: ``go`` sends every body at once and prints one JSON line ``{"sent": [...], "done": [...],
"tokens": T, "steps": [...], "errors": [...]}`` (``time.monotonic()`` per request when it was sent
and when its reply was read and parsed); ``quit`` ends it.

Each request has its own HTTP/1.1 keep-alive connection, framed by ``h11`` over asyncio streams.
A benchmark of the server should spend little of its time in the client, and a general client
spends a lot: httpx costs ~3 ms of CPU per request here (its pool scans every connection it holds
for each request it assigns, and each request passes several anyio cancel scopes), which for 512
requests is more than the server's own work. One connection per request needs no pool at all.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from urllib.parse import urlsplit

import h11


class _Connection:
    """One keep-alive connection that sends one request at a time and reads its whole reply."""

    def __init__(self, host: str, port: int, headers: list[tuple[str, str]]) -> None:
        self.host, self.port, self.headers = host, port, headers
        self.reader = self.writer = self.conn = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        reused = self.conn is not None and self.conn.our_state is h11.IDLE
        if not reused:
            await self._open()
        try:
            return await self._exchange(path, body)
        except (ConnectionError, h11.RemoteProtocolError):
            if not reused:
                raise
            await self._open()  # the server closed it while it was idle: once more on a new connection
            return await self._exchange(path, body)

    async def _open(self) -> None:
        self.close()
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        self.conn = h11.Connection(h11.CLIENT)

    async def _exchange(self, path: str, body: bytes) -> tuple[int, bytes]:
        headers = [("Host", self.host), ("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
        req = h11.Request(method="POST", target=path, headers=headers + self.headers)
        self.writer.write(
            self.conn.send(req) + self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage())
        )
        status, chunks = 0, []
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                data = await self.reader.read(1 << 16)
                if not data:
                    raise ConnectionError("the server closed the connection")
                self.conn.receive_data(data)
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                chunks.append(event.data)
            elif isinstance(event, h11.EndOfMessage):
                break
        if self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
            self.conn.start_next_cycle()
        else:
            self.close()
        return status, b"".join(chunks)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = self.conn = None


async def _one(conn: _Connection, body: bytes, out: dict, i: int) -> None:
    out["sent"][i] = time.monotonic()
    try:
        status, data = await conn.post("/generate", body)
    except (OSError, h11.ProtocolError, asyncio.IncompleteReadError) as e:
        out["errors"].append(f"{type(e).__name__}: {e}")
        return
    if status != 200:
        out["errors"].append(f"{status}: {data[:300].decode(errors='replace')}")
        return
    meta = json.loads(data)["meta_info"]
    out["done"][i] = time.monotonic()
    out["tokens"] += meta["completion_tokens"]
    out["steps"].add(meta["engine_step"])


async def _run(url: str, job: dict) -> None:
    parts = urlsplit(url)
    headers = [("Authorization", f"Bearer {job['api_key']}")] if job.get("api_key") else []
    bodies = [json.dumps(b).encode() for b in job["bodies"]]
    conns = [_Connection(parts.hostname, parts.port, headers) for _ in bodies]
    loop = asyncio.get_running_loop()
    try:
        while (await loop.run_in_executor(None, sys.stdin.readline)).strip() == "go":
            out = {"sent": [0.0] * len(bodies), "done": [0.0] * len(bodies), "tokens": 0, "steps": set(), "errors": []}
            await asyncio.gather(*(_one(c, b, out, i) for i, (c, b) in enumerate(zip(conns, bodies))))
            out["steps"] = sorted(out["steps"])
            print(json.dumps(out), flush=True)
    finally:
        for c in conns:
            c.close()


def main(argv: list[str]) -> int:
    job = json.loads(sys.stdin.readline())
    asyncio.run(_run(argv[0], job))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
