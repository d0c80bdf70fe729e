"""Serve the dashboard page on loopback and push metric events to it with server-sent events.

::

    feed (stream subscriber, or an events.jsonl followed as it grows) ─► Hub ─► GET /events (SSE)
                                                                         └─► page: uPlot charts

A page that connects gets the whole history first (``event: history``), then live batches
(``event: metrics``). Each client has a bounded queue: a page that stops reading loses
batches (counted in ``Hub.dropped``), never slows the feed. The page and uPlot are files of
this package; nothing is fetched from the network.
"""

from __future__ import annotations

import json
import queue
import threading
from collections import deque
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path

from asyncrl.metrics.events import MetricEvent

STATIC = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
    "uPlot.iife.min.js": "text/javascript; charset=utf-8",
    "uPlot.min.css": "text/css; charset=utf-8",
    "uPlot.LICENSE": "text/plain; charset=utf-8",
}
_KEEPALIVE_S = 10.0
_HISTORY_CHUNK = 5000


class Hub:
    """History of every event seen, and one bounded queue per connected page."""

    def __init__(self, history: int = 1_000_000, client_queue: int = 1000):
        self.history: deque[list] = deque(maxlen=history)
        self.received = 0
        self.dropped = 0
        """Batches not delivered to a page whose queue was full."""
        self._clients: list[queue.Queue] = []
        self._lock = threading.Lock()
        self._client_queue = client_queue

    def publish(self, events: Sequence[MetricEvent]) -> None:
        rows = [[e.name, e.value, e.step, e.version, e.time, e.source] for e in events]
        with self._lock:
            self.history.extend(rows)
            self.received += len(rows)
            for q in self._clients:
                try:
                    q.put_nowait(rows)
                except queue.Full:
                    self.dropped += 1

    def connect(self) -> tuple[list[list], queue.Queue]:
        q: queue.Queue = queue.Queue(self._client_queue)
        with self._lock:
            self._clients.append(q)
            return list(self.history), q

    def disconnect(self, q: queue.Queue) -> None:
        with self._lock:
            self._clients.remove(q)


class StreamFeed:
    """Subscribe to a run's metric stream (its ``subscribe`` endpoint)."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.description = f"stream {endpoint}"

    def run(self, hub: Hub, stop: threading.Event) -> None:
        from asyncrl.metrics.stream import MetricsSubscriber

        sub = MetricsSubscriber(self.endpoint)
        try:
            while not stop.is_set():
                events = sub.recv(timeout_s=0.2)
                if events:
                    hub.publish(events)
        finally:
            sub.close()


class FileFeed:
    """Read an events.jsonl, then follow it as the run appends (a finished run just stays put)."""

    def __init__(self, path: str | Path, follow: bool = True):
        self.path = Path(path)
        self.follow = follow
        self.description = f"file {self.path}"

    def run(self, hub: Hub, stop: threading.Event) -> None:
        with open(self.path) as f:
            partial = ""
            while not stop.is_set():
                chunk = f.read(1 << 20)
                if chunk:
                    lines = (partial + chunk).split("\n")
                    partial = lines.pop()  # a line the run has not finished writing
                    hub.publish([MetricEvent.from_json(json.loads(line)) for line in lines if line.strip()])
                    continue
                if not self.follow:
                    return
                stop.wait(0.5)  # no change notification for a plain file: look again shortly


class DashboardServer:
    """The HTTP server and its feed thread; `close` stops both."""

    def __init__(self, feed, *, host: str = "127.0.0.1", port: int = 0, title: str = "asyncrl"):
        self.hub = Hub()
        self.feed = feed
        self.title = title
        self._stop = threading.Event()
        self._httpd = ThreadingHTTPServer((host, port), _handler(self))
        self._httpd.daemon_threads = True
        self.url = f"http://{host}:{self._httpd.server_port}/"
        self._threads = [
            threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2},
                             name="dashboard-http", daemon=True),
            threading.Thread(target=feed.run, args=(self.hub, self._stop), name="dashboard-feed", daemon=True),
        ]
        for t in self._threads:
            t.start()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def close(self) -> None:
        self._stop.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        for t in self._threads:
            t.join(5)


def _handler(server: DashboardServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format, *args):  # keep the launcher's console for the run
            pass

        def do_GET(self):
            path = self.path.split("?", 1)[0]
            if path == "/events":
                return self._events()
            if path == "/info":
                return self._send(200, "application/json", json.dumps(
                    {"title": server.title, "feed": server.feed.description}).encode())
            name = "index.html" if path == "/" else path.removeprefix("/static/")
            if name not in STATIC:
                return self._send(404, "text/plain", b"not found")
            body = resources.files("asyncrl.dashboard").joinpath("static", name).read_bytes()
            self._send(200, STATIC[name], body)

        def _send(self, code: int, ctype: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def _events(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-store")
            self.send_header("Connection", "close")
            self.end_headers()
            history, q = server.hub.connect()
            try:
                chunks = [history[i:i + _HISTORY_CHUNK] for i in range(0, len(history), _HISTORY_CHUNK)] or [[]]
                for i, chunk in enumerate(chunks):
                    self._event("history" if i == 0 else "metrics", chunk)
                while not server.stopping:
                    try:
                        rows = q.get(timeout=_KEEPALIVE_S)
                    except queue.Empty:
                        self.wfile.write(b": keepalive\n\n")
                        self.wfile.flush()
                        continue
                    self._event("metrics", rows)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the page went away
            finally:
                server.hub.disconnect(q)
                self.close_connection = True

        def _event(self, kind: str, rows: list) -> None:
            self.wfile.write(f"event: {kind}\ndata: {json.dumps(rows)}\n\n".encode())
            self.wfile.flush()

    return Handler
