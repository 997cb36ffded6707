"""Prometheus exposition of kvlink engines' counters.

``render(engines)`` returns the text format (version 0.0.4) of every counter ``Engine.stats()``
reports, one sample per engine labelled with its engine id and TP rank, and its gauges (sessions,
connections and RDMA queue pairs open now, reads and holds in flight). ``serve(engines, port)``
answers ``GET /metrics`` with it from a daemon
thread, for deployments that scrape workers directly; an engine's own exporter can call
``render`` instead.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ._kvlink import Engine

# name in stats() -> (metric name, help). Every one is a monotonic counter.
_COUNTERS: dict[str, tuple[str, str]] = {
    "reads_done": ("kvlink_reads_done_total", "Reads (decode side) completed."),
    "reads_failed": ("kvlink_reads_failed_total", "Reads failed, expired and cancelled ones included."),
    "reads_expired": ("kvlink_reads_expired_total", "Reads that ran past the request timeout."),
    "reads_cancelled": ("kvlink_reads_cancelled_total", "Reads cancelled by the caller."),
    "bytes_read": ("kvlink_read_bytes_total", "Bytes of completed reads."),
    "sends_done": ("kvlink_sends_done_total", "Held requests confirmed by their reader."),
    "sends_failed": ("kvlink_sends_failed_total", "Held requests aborted by their reader or expired."),
    "sends_expired": (
        "kvlink_sends_expired_total",
        "Held requests no reader confirmed within the abort timeout or the lease.",
    ),
    "sends_lease_expired": (
        "kvlink_sends_lease_expired_total",
        "Held requests whose reader was gone (no control connection) for the whole lease.",
    ),
    "handshakes_accepted": ("kvlink_handshakes_accepted_total", "Handshakes answered."),
    "handshakes_refused": ("kvlink_handshakes_refused_total", "Handshakes refused (bad frame, key, version, layout)."),
    "data_requests_served": ("kvlink_data_requests_served_total", "TCP data requests served."),
    "data_requests_refused": (
        "kvlink_data_requests_refused_total",
        "TCP data requests refused (not granted, out of range).",
    ),
    "bytes_served": ("kvlink_served_bytes_total", "Bytes served over TCP."),
    "bytes_staged_out": ("kvlink_staged_out_bytes_total", "GPU bytes copied to staging buffers to be sent."),
    "bytes_staged_in": ("kvlink_staged_in_bytes_total", "Received bytes copied from staging buffers into GPU memory."),
    "notices_refused": (
        "kvlink_notices_refused_total",
        "Done/abort notices and pins refused (request not held for that reader).",
    ),
    "reads_pinned": ("kvlink_reads_pinned_total", "RDMA reads whose hold was pinned as they were posted."),
    "messages_received": ("kvlink_messages_received_total", "Peers' application messages queued."),
    "messages_refused": (
        "kvlink_messages_refused_total",
        "Peers' application messages refused (too large, inbox full).",
    ),
    "messages_sent": ("kvlink_messages_sent_total", "Application messages handed to a peer's control connection."),
    "messages_unsent": ("kvlink_messages_unsent_total", "Application messages that could not be sent."),
    "sessions_opened": ("kvlink_sessions_opened_total", "Sessions to peers made (one handshake each)."),
    "sessions_closed_idle": (
        "kvlink_sessions_closed_idle_total",
        "Sessions to peers closed after session_idle unused.",
    ),
}

# name in stats() -> (metric name, help). Each is a gauge: what is open now.
_GAUGES: dict[str, tuple[str, str]] = {
    "sessions": ("kvlink_sessions", "Sessions open to peers now."),
    "queue_pairs": ("kvlink_queue_pairs", "RDMA queue pairs held now (own sessions' and readers')."),
    "control_connections": ("kvlink_control_connections", "Readers' control connections served now."),
    "data_connections": ("kvlink_data_connections", "Readers' TCP data connections served now."),
}


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render(engines: Engine | Iterable[Engine]) -> str:
    """The Prometheus text format of ``engines``' counters (one engine or several)."""
    if isinstance(engines, Engine):
        engines = [engines]
    rows: list[tuple[str, dict[str, int], tuple[int, int]]] = []
    for e in engines:
        labels = f'engine_id="{_escape(e.engine_id)}"'
        rows.append((labels, e.stats(), e.in_flight()))
    out: list[str] = []
    for key, (name, text) in _COUNTERS.items():
        out.append(f"# HELP {name} {text}")
        out.append(f"# TYPE {name} counter")
        for labels, stats, _ in rows:
            out.append(f"{name}{{{labels}}} {int(stats.get(key, 0))}")
    for key, (name, text) in _GAUGES.items():
        out.append(f"# HELP {name} {text}")
        out.append(f"# TYPE {name} gauge")
        for labels, stats, _ in rows:
            out.append(f"{name}{{{labels}}} {int(stats.get(key, 0))}")
    for index, (name, text) in enumerate(
        [
            ("kvlink_reads_in_flight", "Reads being received now."),
            ("kvlink_holds_in_flight", "Requests held for a reader now."),
        ]
    ):
        out.append(f"# HELP {name} {text}")
        out.append(f"# TYPE {name} gauge")
        for labels, _, in_flight in rows:
            out.append(f"{name}{{{labels}}} {in_flight[index]}")
    return "\n".join(out) + "\n"


def serve(
    engines: Engine | Iterable[Engine] | Callable[[], Iterable[Engine]],
    port: int,
    host: str = "127.0.0.1",
) -> ThreadingHTTPServer:
    """Serves ``GET /metrics`` on ``host:port`` (port 0 picks one: see ``server_address``)
    from a daemon thread. ``engines`` may be a callable returning the engines to report, for
    a set that changes. Stop it with ``shutdown()``."""
    source = engines if callable(engines) else (lambda: engines)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path.split("?", 1)[0] != "/metrics":
                self.send_error(404, "only /metrics is served")
                return
            body = render(source()).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # scrapes are not worth a log line each
            return

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="kvlink-metrics", daemon=True).start()
    return server
