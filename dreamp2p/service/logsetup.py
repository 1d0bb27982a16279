"""How a node daemon's process writes its log: one stderr handler, readable text lines or JSON objects.

Library modules only log to ``logging.getLogger(__name__)``; this module (called by the console script)
decides where records go and how they look. Every record carries the node id and the cluster id. In JSON
mode (python-json-logger) each record is one JSON object per line with ``time`` (ISO 8601, UTC), ``level``,
``logger``, ``message``, ``node_id``, ``cluster_id``, every ``extra={...}`` field the call passed, and the
formatted traceback under ``exc_info`` when there is one; Python warnings are routed through logging too.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

# the text layout of a node's lines: time, level, node, logger, message
TEXT_FORMAT = "%(asctime)s %(levelname)s [%(node_id)s] %(name)s: %(message)s"
# the fields every JSON record starts with, in this order (extras and exc_info follow)
JSON_FIELDS = "%(levelname)s %(name)s %(message)s %(node_id)s %(cluster_id)s"
JSON_RENAMES = {"levelname": "level", "name": "logger"}


class NodeFields(logging.Filter):
    """Stamps every record passing a handler with the node id and cluster id of this process."""

    def __init__(self, node_id: str, cluster_id: str) -> None:
        super().__init__()
        self.node_id = node_id
        self.cluster_id = cluster_id

    def filter(self, record: logging.LogRecord) -> bool:
        record.node_id = self.node_id
        record.cluster_id = self.cluster_id
        return True


def make_formatter(log_format: str) -> logging.Formatter:
    """The formatter for ``"text"`` or ``"json"`` records (those must carry ``node_id`` and ``cluster_id``)."""
    if log_format == "json":
        from pythonjsonlogger.json import JsonFormatter

        return JsonFormatter(JSON_FIELDS, rename_fields=JSON_RENAMES, timestamp="time")
    if log_format == "text":
        return logging.Formatter(TEXT_FORMAT)
    raise ValueError(f"log format must be 'text' or 'json', got {log_format!r}")


def configure_logging(
    level: int, log_format: str, node_id: str, cluster_id: str, stream: TextIO | None = None
) -> logging.Handler:
    """Replace the root logger's handlers with one on ``stream`` (stderr) in ``log_format``; returns it."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.addFilter(NodeFields(node_id, cluster_id))
    handler.setFormatter(make_formatter(log_format))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(True)
    return handler
