"""How serve and its workers log: ``--log-format text`` (the default) or
``json``.

* **text**: ``time LEVEL logger: message`` lines on stderr; transitions as
  one JSON line each on stdout (what ``events`` returns, without the id).
* **json**: one JSON object per line, the same two streams: ``time``
  (ISO 8601, UTC), ``level``, ``logger``, ``message``, and - for a
  transition - the record's own fields beside them (``kind``, ``project``,
  ``region``, ``name``, ``path``, ``from``, ``to``, ``reason``, for routes
  ``frontend`` and ``mode``; ``time`` is then the transition's own time),
  so a log shipper indexes them without parsing a message. An exception
  comes as ``exc_info`` text.

The JSON is written by python-json-logger, the logging library's usual
JSON formatter. Probe and data-plane workers inherit the format through
``HEALTHGATE_LOG_FORMAT`` (set here for the children serve starts).
"""

from __future__ import annotations

import logging
import os
import sys
from datetime import UTC, datetime
from typing import Any

from pythonjsonlogger.json import JsonFormatter

FORMATS = ("text", "json")
ENV = "HEALTHGATE_LOG_FORMAT"
TRANSITIONS = "healthgate.transitions"
TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonLines(JsonFormatter):
    """python-json-logger's formatter with healthgate's field names, and a
    transition's fields (``extra={"transition": record}``) at the top level."""

    def __init__(self, prefix: str = "") -> None:
        super().__init__(
            "%(levelname)s %(name)s %(message)s",
            rename_fields={"levelname": "level", "name": "logger"},
            static_fields={"worker": prefix} if prefix else None,
        )

    def add_fields(
        self, log_data: dict[str, Any], record: logging.LogRecord, message_dict: dict[str, Any]
    ) -> None:
        log_data["time"] = _iso(record.created)
        super().add_fields(log_data, record, message_dict)
        transition = log_data.pop("transition", None)
        if isinstance(transition, dict):
            log_data["message"] = _summary(transition)
            for key, value in transition.items():
                if key == "timestamp":
                    log_data["time"] = value  # (the transition's own time)
                elif key != "time" and key not in ("level", "logger", "message"):
                    log_data[key] = value


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _summary(d: dict[str, Any]) -> str:
    frm = str(d.get("from")).rsplit("/", 1)[-1]
    to = str(d.get("to")).rsplit("/", 1)[-1]
    return f"{d.get('kind')} {d.get('path')}: {frm} -> {to} ({d.get('reason')})"


def formatter(fmt: str, prefix: str = "") -> logging.Formatter:
    if fmt == "json":
        return JsonLines(prefix)
    return logging.Formatter(TEXT.replace("%(name)s", f"{prefix} %(name)s") if prefix else TEXT)


def configure(level: str, fmt: str = "text") -> None:
    """serve's logging (see the module doc); its workers will log alike."""
    if fmt not in FORMATS:
        raise ValueError(f"--log-format: expected one of {', '.join(FORMATS)}, not {fmt!r}")
    os.environ[ENV] = fmt  # (for the worker processes serve starts)
    root = logging.getLogger()
    root.setLevel(level.upper())
    err = logging.StreamHandler(sys.stderr)
    err.setFormatter(formatter(fmt))
    root.addHandler(err)
    transitions = logging.getLogger(TRANSITIONS)
    transitions.propagate = False
    transitions.setLevel(logging.INFO)
    out = logging.StreamHandler(sys.stdout)
    out.setFormatter(formatter(fmt) if fmt == "json" else logging.Formatter("%(message)s"))
    transitions.addHandler(out)


def configure_worker(level: str, name: str) -> None:
    """A worker process's logging: stderr, in the format its parent chose."""
    fmt = os.environ.get(ENV, "text")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(fmt if fmt in FORMATS else "text", prefix=name))
    root = logging.getLogger()
    root.setLevel(level.upper())
    root.addHandler(handler)
