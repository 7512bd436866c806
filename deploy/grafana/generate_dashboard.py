#!/usr/bin/env python3
"""Generate ``dashboards/rlsup.json``, the Grafana dashboard for rlsup's metrics.

    python deploy/grafana/generate_dashboard.py           # rewrite the JSON
    python deploy/grafana/generate_dashboard.py --check   # exit 1 if the JSON is out of date

Panels use only series rlsup exports (tests/deploy/test_deploy_grafana.py checks every name against a real
scrape and every expression with promtool). Template variables: ``datasource``, ``job`` (Prometheus'
scrape job, from ``label_values(rlsup_info, job)``) and ``node`` (rlsup's own node name, from
``label_values(rlsup_info{job=~"$job"}, node)``). Only ``rlsup_info`` carries ``node``, so every panel
joins it in: ``<expr> * on (job, instance) group_left (node) rlsup_info{...}``, which both filters by
``$node`` and puts the node name in the legend.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "dashboards" / "rlsup.json"
UID = "rlsup-overview"
DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'job=~"$job"'
INFO = f'rlsup_info{{{SEL}, node=~"$node"}}'


def by_node(expr: str) -> str:
    """``expr`` restricted to the selected nodes, with a ``node`` label (rlsup_info has value 1)."""
    return f"({expr}) * on (job, instance) group_left (node) {INFO}"


def over(func: str, name: str, window: str) -> str:
    """``func(name[window])`` per node: the range function first, then the join (no subquery)."""
    return by_node(f"{func}({m(name)}[{window}])")


def m(name: str, extra: str = "") -> str:
    """A selector of ``name`` in the selected Prometheus jobs."""
    return f"{name}{{{SEL}{', ' + extra if extra else ''}}}"


class Builder:
    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self.next_id = 1
        self.y = 0
        self.x = 0
        self.row_h = 0

    def _place(self, w: int, h: int) -> dict[str, int]:
        if self.x + w > 24:
            self.x, self.y, self.row_h = 0, self.y + self.row_h, 0
        pos = {"h": h, "w": w, "x": self.x, "y": self.y}
        self.x += w
        self.row_h = max(self.row_h, h)
        return pos

    def row(self, title: str) -> None:
        if self.x:
            self.x, self.y, self.row_h = 0, self.y + self.row_h, 0
        self.panels.append({"id": self._id(), "type": "row", "title": title, "collapsed": False, "panels": [],
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}})
        self.y += 1

    def _id(self) -> int:
        i = self.next_id
        self.next_id += 1
        return i

    def panel(self, kind: str, title: str, description: str, targets: list[tuple[str, str]], *, unit: str = "short",
              w: int = 8, h: int = 8, options: dict[str, Any] | None = None,
              custom: dict[str, Any] | None = None, thresholds: list[tuple[float | None, str]] | None = None,
              extra_field: dict[str, Any] | None = None, instant: bool = False) -> None:
        defaults: dict[str, Any] = {"unit": unit}
        if thresholds:
            defaults["thresholds"] = {"mode": "absolute",
                                      "steps": [{"color": c, "value": v} for v, c in thresholds]}
        if custom:
            defaults["custom"] = custom
        if extra_field:
            defaults.update(extra_field)
        self.panels.append({
            "id": self._id(),
            "type": kind,
            "title": title,
            "description": description,
            "datasource": DS,
            "gridPos": self._place(w, h),
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": options or {},
            "targets": [{"datasource": DS, "refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend,
                         "range": not instant, "instant": instant}
                        for i, (expr, legend) in enumerate(targets)],
        })


def stat_options(text_mode: str = "auto") -> dict[str, Any]:
    return {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}, "colorMode": "value",
            "graphMode": "none", "textMode": text_mode, "justifyMode": "auto", "orientation": "auto"}


def build() -> dict[str, Any]:
    b = Builder()
    ts = {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
          "tooltip": {"mode": "multi", "sort": "desc"}}

    b.row("Job")
    b.panel("stat", "Job state", "Current state of each node's supervised job (rlsup_job_state).",
            [(f"max by (node, rlsup_job_state) ({by_node(m('rlsup_job_state'))}) == 1", "{{node}}: {{rlsup_job_state}}")],
            w=6, h=5, options=stat_options("name"), instant=True)
    b.panel("stat", "Last step", "Newest step any rank heartbeated (rlsup_last_step).",
            [(f"max by (node) ({by_node(m('rlsup_last_step'))})", "{{node}}")], w=6, h=5, options=stat_options())
    b.panel("stat", "Goodput", "Productive training time over wall time since rlsup started (rlsup_goodput_ratio).",
            [(f"min by (node) ({by_node(m('rlsup_goodput_ratio'))})", "{{node}}")], unit="percentunit", w=6, h=5,
            options=stat_options(), thresholds=[(None, "red"), (0.8, "orange"), (0.95, "green")],
            extra_field={"min": 0, "max": 1})
    b.panel("stat", "Restarts in range", "Failed attempts over the dashboard's time range (rlsup_restarts_total).",
            [(f"sum by (node) ({over('increase', 'rlsup_restarts_total', '$__range')})", "{{node}}")],
            w=6, h=5, options=stat_options(), thresholds=[(None, "green"), (1, "orange"), (3, "red")],
            extra_field={"decimals": 0})
    b.panel("timeseries", "Restarts by reason", "Failed attempts per reason (exit_code, signal, oom, hang, "
            "startup_timeout, save_timeout, peer_failure) from rlsup_restarts_total.",
            [(f"sum by (node, reason) ({over('increase', 'rlsup_restarts_total', '$__rate_interval')}) > 0",
              "{{node}} {{reason}}")],
            w=8, options=ts, custom={"drawStyle": "bars", "fillOpacity": 60})
    b.panel("timeseries", "Attempts launched", "Attempts started (rlsup_attempts_total).",
            [(f"sum by (node) ({over('increase', 'rlsup_attempts_total', '$__rate_interval')})", "{{node}}")],
            w=8, options=ts, custom={"drawStyle": "bars", "fillOpacity": 60})
    b.panel("timeseries", "Training step", "Heartbeat step (rlsup_last_step) and newest valid checkpoint step "
            "(rlsup_checkpoint_latest_step); the gap is what a failure now would redo.",
            [(f"max by (node) ({by_node(m('rlsup_last_step'))})", "{{node}} step"),
             (f"max by (node) ({by_node(m('rlsup_checkpoint_latest_step'))})", "{{node}} checkpoint")],
            w=8, options=ts)
    b.panel("timeseries", "Heartbeat age vs timeout", "Seconds since each local rank's last heartbeat "
            "(rlsup_heartbeat_age_seconds) against the timeout in force (rlsup_heartbeat_timeout_seconds).",
            [(f"max by (node, local_rank) ({by_node(m('rlsup_heartbeat_age_seconds'))})", "{{node}} rank {{local_rank}}"),
             (f"max by (node) ({by_node(m('rlsup_heartbeat_timeout_seconds'))})", "{{node}} timeout")],
            unit="s", w=12, options=ts)
    b.panel("timeseries", "How the heartbeat timeout was reached", "Step intervals the timeout is learned from "
            "(rlsup_heartbeat_timeout_intervals), stalls survived and not learned (rlsup_heartbeat_stalls), and 1 "
            "where the timeout is learned (rlsup_heartbeat_timeout_source: initial, learned or explicit).",
            [(f"max by (node) ({by_node(m('rlsup_heartbeat_timeout_intervals'))})", "{{node}} intervals"),
             (f"max by (node) ({by_node(m('rlsup_heartbeat_stalls'))})", "{{node}} stalls"),
             (f"max by (node, rlsup_heartbeat_timeout_source) ({by_node(m('rlsup_heartbeat_timeout_source'))}) == 1",
              "{{node}} {{rlsup_heartbeat_timeout_source}}")],
            w=12, options=ts)
    b.panel("timeseries", "Goodput over time", "rlsup_goodput_ratio over time.",
            [(f"min by (node) ({by_node(m('rlsup_goodput_ratio'))})", "{{node}}")], unit="percentunit", w=12,
            options=ts, extra_field={"min": 0, "max": 1})

    b.row("Checkpoints")
    b.panel("timeseries", "Checkpoint age", "Age of the newest valid checkpoint (rlsup_checkpoint_age_seconds).",
            [(f"max by (node) ({by_node(m('rlsup_checkpoint_age_seconds'))})", "{{node}}")], unit="s", w=8,
            options=ts)
    b.panel("stat", "Newest checkpoint written", "When the newest valid checkpoint was written "
            "(rlsup_checkpoint_latest_timestamp_seconds).",
            [(f"max by (node) ({by_node(m('rlsup_checkpoint_latest_timestamp_seconds'))}) * 1000", "{{node}}")],
            unit="dateTimeFromNow", w=8, options=stat_options())
    b.panel("timeseries", "Checkpoint save duration", "p50 and p90 of save sections "
            "(rlsup_checkpoint_save_duration_seconds histogram) and saves per minute (rlsup_checkpoint_saves_total).",
            [(f"histogram_quantile(0.5, sum by (node, le) ({over('rate', 'rlsup_checkpoint_save_duration_seconds_bucket', '$__rate_interval')}))", "{{node}} p50"),
             (f"histogram_quantile(0.9, sum by (node, le) ({over('rate', 'rlsup_checkpoint_save_duration_seconds_bucket', '$__rate_interval')}))", "{{node}} p90"),
             (f"sum by (node) ({over('rate', 'rlsup_checkpoint_save_duration_seconds_sum', '$__rate_interval')}) / "
              f"sum by (node) ({over('rate', 'rlsup_checkpoint_save_duration_seconds_count', '$__rate_interval')})", "{{node}} mean")],
            unit="s", w=8, options=ts)
    b.panel("timeseries", "Checkpoint saves", "Saves seen per minute (rlsup_checkpoint_saves_total).",
            [(f"sum by (node) ({over('rate', 'rlsup_checkpoint_saves_total', '$__rate_interval')}) * 60", "{{node}}")],
            unit="short", w=24, h=6, options=ts)

    b.row("Recovery")
    b.panel("timeseries", "Resume duration", "Last restart: failure to the first heartbeat of the new attempt "
            "(rlsup_resume_duration_seconds).",
            [(f"max by (node) ({by_node(m('rlsup_resume_duration_seconds'))})", "{{node}}")], unit="s", w=6,
            options=ts)
    b.panel("timeseries", "Steps lost per failure", "Steps redone after failures: mean and p90 "
            "(rlsup_steps_lost histogram).",
            [(f"sum by (node) ({over('increase', 'rlsup_steps_lost_sum', '$__range')}) / "
              f"sum by (node) ({over('increase', 'rlsup_steps_lost_count', '$__range')})", "{{node}} mean"),
             (f"histogram_quantile(0.9, sum by (node, le) ({over('increase', 'rlsup_steps_lost_bucket', '$__range')}))", "{{node}} p90")],
            w=6, options=ts)
    b.panel("timeseries", "Downtime", "Seconds between failures and the next attempt's launch, per interval "
            "(rlsup_downtime_seconds_total).",
            [(f"sum by (node) ({over('increase', 'rlsup_downtime_seconds_total', '$__rate_interval')})", "{{node}}")],
            unit="s", w=6, options=ts, custom={"drawStyle": "bars", "fillOpacity": 60})
    b.panel("timeseries", "Resumes by tier", "Where each resumed checkpoint came from: local disk, a peer's "
            "replica, persistent storage (rlsup_resumes_total).",
            [(f"sum by (node, tier) ({over('increase', 'rlsup_resumes_total', '$__rate_interval')}) > 0", "{{node}} {{tier}}")],
            w=6, options=ts, custom={"drawStyle": "bars", "fillOpacity": 60})

    b.panel("timeseries", "Stragglers", "Ranks flagged as stragglers per node (rlsup_stragglers), and each rank's "
            "own work per step over its peers' median (rlsup_straggler_ratio; 1 is in step).",
            [(f"max by (node) ({by_node(m('rlsup_stragglers'))})", "{{node}} flagged"),
             (f"max by (node, local_rank) ({by_node(m('rlsup_straggler_ratio'))})", "{{node}} rank {{local_rank}}")],
            w=12, options=ts)
    b.panel("timeseries", "Suspect nodes", "Times each node was named the likely culprit: stacks, health check, "
            "repeated failures, straggler, Flight Recorder (rlsup_suspect_total).",
            [(f"sum by (node, why) ({over('increase', 'rlsup_suspect_total', '$__rate_interval')}) > 0", "{{node}} {{why}}")],
            w=12, options=ts, custom={"drawStyle": "bars", "fillOpacity": 60})
    b.panel("stat", "Flight Recorder suspect rank", "The rank the last hung collective's Flight Recorder verdict "
            "named, per node; -1: none named (rlsup_flight_recorder_suspect_rank).",
            [(f"max by (node) ({by_node(m('rlsup_flight_recorder_suspect_rank'))})", "{{node}}")], w=6)
    b.panel("stat", "Tier stalled", "1 while a checkpoint tier's copy or read on this node is named stalled: a hung "
            "or slow store; training goes on without it (rlsup_tier_stalled).",
            [(f"max by (node, tier) ({by_node(m('rlsup_tier_stalled'))})", "{{node}} {{tier}}")], w=6,
            options=stat_options())

    b.panel("stat", "Spares left", "The job's spare nodes not yet used, per node's view (rlsup_spares_left).",
            [(f"min by (node) ({by_node(m('rlsup_spares_left'))})", "{{node}}")], w=6, options=stat_options())
    b.panel("table", "Node roles", "What each node process does: worker (holds a node rank) or spare "
            "(rlsup_node_role).",
            [(f"max by (node, rlsup_node_role) ({by_node(m('rlsup_node_role'))}) == 1", "{{node}} {{rlsup_node_role}}")],
            w=6)
    b.panel("stat", "Spare takeover", "A spare's last takeover: from the end of the attempt its node was lost in to "
            "its claim of the rank (rlsup_spare_takeover_seconds).",
            [(f"max by (node) ({by_node(m('rlsup_spare_takeover_seconds'))})", "{{node}}")], w=6, unit="s",
            options=stat_options())
    b.panel("timeseries", "Nodes running", "The nodes the job runs on (rlsup_world_nodes) against the node count its "
            "launch line asked for (rlsup_job_nodes): fewer after a shrink (min_nodes), until it grows back.",
            [(f"max({by_node(m('rlsup_world_nodes'))})", "running"), (f"max({by_node(m('rlsup_job_nodes'))})", "job")],
            w=6)

    b.row("Replication")
    b.panel("timeseries", "Replication throughput", "Checkpoint bytes sent to each peer (rlsup_replication_bytes_total).",
            [(f"sum by (node, peer) ({over('rate', 'rlsup_replication_bytes_total', '$__rate_interval')})", "{{node}} -> peer {{peer}}")],
            unit="Bps", w=8, options=ts)
    b.panel("timeseries", "Replication lag", "Age of the newest local checkpoint not yet on each peer; 0 is caught up "
            "(rlsup_replication_lag_seconds).",
            [(f"max by (node, peer) ({by_node(m('rlsup_replication_lag_seconds'))})", "{{node}} -> peer {{peer}}")],
            unit="s", w=8, options=ts)
    b.panel("timeseries", "Replication failures", "Failed transfers per peer (rlsup_replication_failures_total).",
            [(f"sum by (node, peer) ({over('increase', 'rlsup_replication_failures_total', '$__rate_interval')})", "{{node}} -> peer {{peer}}")],
            w=8, options=ts, custom={"drawStyle": "bars", "fillOpacity": 60})

    b.row("Nodes")
    b.panel("table", "Supervisors", "rlsup version and identity per node (rlsup_info).",
            [(INFO, "")], w=24, h=6, instant=True,
            options={"showHeader": True},
            extra_field={"custom": {"align": "auto"}})
    b.panels[-1]["targets"][0]["format"] = "table"
    b.panels[-1]["transformations"] = [{"id": "organize", "options": {
        "excludeByName": {"Time": True, "Value": True, "__name__": True}, "indexByName": {}, "renameByName": {}}}]

    variable_common = {"current": {}, "hide": 0, "includeAll": True, "multi": True, "refresh": 2, "sort": 1,
                       "datasource": DS, "allValue": ".*"}
    return {
        "uid": UID,
        "title": "rlsup — training supervisor",
        "description": "Job state, restarts, hangs, checkpoints, recovery and replication of rlsup-supervised training jobs.",
        "tags": ["rlsup", "training"],
        "timezone": "",
        "editable": True,
        "graphTooltip": 1,
        "refresh": "30s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-6h", "to": "now"},
        "timepicker": {},
        "links": [],
        "annotations": {"list": [
            {"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True, "hide": True,
             "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts", "type": "dashboard"},
            {"datasource": DS, "enable": True, "iconColor": "red", "name": "Restarts",
             "expr": f"sum by (node, reason) ({over('changes', 'rlsup_restarts_total', '2m')}) > 0",
             "step": "1m", "titleFormat": "restart", "textFormat": "{{node}}: {{reason}}"},
        ]},
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0, "includeAll": False, "multi": False, "regex": "", "refresh": 1},
            {**variable_common, "name": "job", "label": "Job", "type": "query",
             "definition": "label_values(rlsup_info, job)",
             "query": {"query": "label_values(rlsup_info, job)", "refId": "PrometheusVariableQueryEditor-VariableQuery"}},
            {**variable_common, "name": "node", "label": "Node", "type": "query",
             "definition": 'label_values(rlsup_info{job=~"$job"}, node)',
             "query": {"query": 'label_values(rlsup_info{job=~"$job"}, node)',
                       "refId": "PrometheusVariableQueryEditor-VariableQuery"}},
        ]},
        "panels": b.panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2, ensure_ascii=False) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if the JSON differs from what would be generated")
    args = p.parse_args()
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is out of date; run {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
