"""The HTTP server's settings and the reasoning budgets it grants."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    shutdown_grace: float = 10.0  # seconds running requests get on SIGTERM
    # Seconds an idle connection is kept open: longer than clients' pools keep theirs, so that the
    # client closes first and never sends a request on a connection as the server closes it.
    keep_alive: float = 120.0
    log_level: str = "info"
    # Bytes a file uploaded to /v1/files may have (a Batch API input): OpenAI's limit, 200 MB.
    max_file_bytes: int = 200 * 1024 * 1024
    # An OTLP/HTTP collector for the requests' traces (wafer/tracing.py); None: the standard
    # OTEL_EXPORTER_OTLP_* variables decide, and without them tracing is off.
    otlp_endpoint: str | None = None


# Tokens of reasoning per effort level before the answer (wafer.toml's [reasoning] overrides them);
# `ultra` reasons as `max` does. Each level has about four times the budget of the one below it, from
# a short plan to a long derivation.
REASONING_BUDGETS = {"none": 0, "minimal": 64, "low": 256, "medium": 1024, "high": 4096, "xhigh": 8192,
                     "max": 16384}
