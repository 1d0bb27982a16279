"""A node's log records: text lines or JSON objects, each with the node and cluster id, extras and tracebacks."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from dreamp2p.service.logsetup import configure_logging


@pytest.fixture
def restore_root() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)
    logging.captureWarnings(False)


def test_json_records_carry_ids_extras_and_tracebacks(restore_root: None) -> None:
    out = io.StringIO()
    configure_logging(logging.INFO, "json", "eu-west", "demo", stream=out)
    log = logging.getLogger("dreamp2p.test")
    log.debug("not at INFO")
    log.info("step %d done", 7, extra={"step": 7, "loss": 1.5})
    try:
        raise RuntimeError("injected")
    except RuntimeError:
        log.exception("it failed")
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert first["message"] == "step 7 done" and first["level"] == "INFO" and first["logger"] == "dreamp2p.test"
    assert first["node_id"] == "eu-west" and first["cluster_id"] == "demo"
    assert first["step"] == 7 and first["loss"] == 1.5 and "time" in first
    assert second["level"] == "ERROR" and "RuntimeError: injected" in second["exc_info"]
    assert "Traceback (most recent call last)" in second["exc_info"]


def test_text_lines_name_the_node(restore_root: None) -> None:
    out = io.StringIO()
    configure_logging(logging.INFO, "text", "us-east", "demo", stream=out)
    logging.getLogger("dreamp2p.test").info("hello")
    (line,) = out.getvalue().splitlines()
    assert line.endswith(" INFO [us-east] dreamp2p.test: hello")


def test_an_unknown_format_is_refused(restore_root: None) -> None:
    with pytest.raises(ValueError, match="xml"):
        configure_logging(logging.INFO, "xml", "a", "b", stream=io.StringIO())
