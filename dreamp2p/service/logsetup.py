"""How a node daemon's process writes its log: one stderr handler, readable text lines or JSON objects.

Library modules only log to ``logging.getLogger(__name__)``; this module (called by the console script)
decides where records go; how they look is `dreamp2p.logformat`'s (shared with the comm process). Python
warnings are routed through logging too.
"""

from __future__ import annotations

import logging
from typing import TextIO

from dreamp2p.logformat import node_handler


def configure_logging(
    level: int, log_format: str, node_id: str, cluster_id: str, stream: TextIO | None = None
) -> logging.Handler:
    """Replace the root logger's handlers with one on ``stream`` (stderr) in ``log_format``; returns it."""
    handler = node_handler(log_format, node_id, cluster_id, stream)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(True)
    return handler
