"""deploy/monitoring: the alert rules are valid Prometheus rule YAML with the promised alerts, and the alert
rules and the Grafana dashboard query only metric names a node exports (#13 deliver 3).

What a node exports is read from a real `NodeMetrics` registry, fed a step and a peer status with a link,
so a renamed metric breaks this test instead of leaving a dashboard panel empty.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from dreamp2p.messages import LinkSnapshot, PeerStatus
from dreamp2p.service.metrics import NodeMetrics
from dreamp2p.sync.strategies.base import StepStats

MONITORING = Path(__file__).resolve().parents[2] / "deploy" / "monitoring"
# metric names in dreamp2p's namespace and the collectors' (process_*, python_*)
NAME = re.compile(r"\b(?:dreamp2p|process|python)_[a-z0-9_]+\b")
# Prometheus' own series about a scrape target: not exported by the node, but there for every target
SCRAPE_SERIES = {"up"}


def exported_names() -> set[str]:
    m = NodeMetrics("eu-west")
    try:
        m.step_stats(StepStats(step=0, exposed_s=0.1, comm_s=1.0, syncs=1))
        link = LinkSnapshot("us-east", 0.08, 2.5e6, 1000, 900, 4, 1 << 16)
        m.peer_status(PeerStatus("eu-west", "c", 2, ("eu-west", "us-east"), (link,), 1, 0, 0))
        return {s.name for fam in m.registry.collect() for s in fam.samples}
    finally:
        m.close()


def dashboard_exprs(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return exprs


def test_alert_rules_are_prometheus_rule_yaml_with_the_promised_alerts() -> None:
    doc = yaml.safe_load((MONITORING / "alerts.yaml").read_text())
    (group,) = doc["groups"]
    rules = group["rules"]
    assert [r["alert"] for r in rules] == [
        "DreamP2PNodeDown",
        "DreamP2PPeerDown",
        "DreamP2PRoundsFailing",
        "DreamP2PHiddenFractionFalling",
    ]
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations", "keep_firing_for"}, rule["alert"]
        assert isinstance(rule["expr"], str) and rule["expr"].strip()
        assert re.fullmatch(r"\d+[smh]", rule["for"])
        assert rule["labels"]["severity"] in {"critical", "warning"}
        assert rule["annotations"]["summary"]
        # balanced brackets: a cheap guard against a truncated expression (promtool is not on PyPI)
        for left, right in ("()", "[]", "{}"):
            assert rule["expr"].count(left) == rule["expr"].count(right), rule["alert"]
    assert "up" in rules[0]["expr"]


def test_alerts_and_dashboard_query_only_exported_metrics() -> None:
    exported = exported_names()
    alerts = yaml.safe_load((MONITORING / "alerts.yaml").read_text())
    alert_names = {n for r in alerts["groups"][0]["rules"] for n in NAME.findall(r["expr"])}
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    exprs = dashboard_exprs(dashboard)
    dash_names = {n for e in exprs for n in NAME.findall(e)}

    assert alert_names - exported == set()
    assert dash_names - exported == set()
    # the dashboard shows what deliver 3 added: counters, a histogram, liveness, process metrics
    assert {
        "dreamp2p_rounds_failed_total",
        "dreamp2p_round_duration_seconds_bucket",
        "dreamp2p_step_exposed_wait_seconds_bucket",
        "dreamp2p_peer_up",
        "dreamp2p_frames_rejected_total",
        "dreamp2p_contributions_withheld_total",
        "process_cpu_seconds_total",
    } <= dash_names
    assert SCRAPE_SERIES.isdisjoint(exported)
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
