"""Is the Hugging Face hub reachable? A seconds-long answer before work that needs it, instead of
the libraries' own retries (a minute or more) deep inside a run."""

from __future__ import annotations

import os
import socket
import threading
from urllib.parse import urlsplit

OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
PROBE_SECONDS = 3.0


def hub_unreachable(timeout: float = PROBE_SECONDS) -> str | None:
    """None when the hub answers, else why not: an offline variable is set, or a TCP connection to
    the hub's endpoint ($HF_ENDPOINT, default huggingface.co:443) fails or does not open in `timeout`."""
    for var in OFFLINE_VARIABLES:
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"{var}={os.environ[var]}"
    url = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    outcome: list[str | None] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            outcome.append(None)
        except OSError as exc:
            outcome.append(f"cannot connect to {host}:{port}: {exc.strerror or exc}")

    # A thread, because name resolution has no timeout of its own.
    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    return outcome[0] if outcome else f"no answer from {host}:{port} within {timeout:g} s"
