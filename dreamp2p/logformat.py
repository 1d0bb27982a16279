"""How a node's log records look, text lines or JSON objects, and which of the two this process writes.

The node daemon's console script picks the format (`dreamp2p.service.logsetup`); a comm process
(`dreamp2p.sync.comm.child`) must write the same, so both build their handler from here, and the parent tells
the child what its own root handler writes (:func:`root_format`). Every record carries the node id and the
cluster id. In JSON mode (python-json-logger) each record is one JSON object per line with ``time`` (ISO 8601,
UTC), ``level``, ``logger``, ``message``, ``node_id``, ``cluster_id``, every ``extra={...}`` field the call
passed, and the formatted traceback under ``exc_info`` when there is one.
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


def node_handler(log_format: str, node_id: str, cluster_id: str, stream: TextIO | None = None) -> logging.Handler:
    """A handler on ``stream`` (stderr) writing ``log_format`` records stamped with the node's ids."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.addFilter(NodeFields(node_id, cluster_id))
    handler.setFormatter(make_formatter(log_format))
    return handler


def root_format() -> tuple[str, str, str] | None:
    """(format, node id, cluster id) of the node handler on the root logger, or None where none was set up
    (a library user's own logging: a comm process then keeps its plain default)."""
    for handler in logging.getLogger().handlers:
        fields = next((f for f in handler.filters if isinstance(f, NodeFields)), None)
        if fields is None:
            continue
        kind = "text" if type(handler.formatter) is logging.Formatter else "json"
        return kind, fields.node_id, fields.cluster_id
    return None
