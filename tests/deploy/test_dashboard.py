"""The Grafana dashboard, statically: a well-formed schema-39 dashboard whose panels cover what the
issue lists, on a grid without overlaps, querying only series the server really exports. (The
queries themselves run against a real Prometheus in test_dashboard_prometheus.py.)"""

from __future__ import annotations

import re

import pytest

PANEL_TYPES = {"row", "timeseries", "stat", "bargauge", "heatmap", "gauge", "table"}
GRID_WIDTH = 24
METRIC_NAME = re.compile(r"\bspecserve:[a-z0-9_:]+")
# what the issue asks the dashboard to show: a regex over panel titles for each
REQUIRED_PANELS = {
    "α": r"acceptance rate α", "τ": r"block efficiency τ", "per-position": r"per-position",
    "accepted-length histogram": r"accepted length per draft",
    "draft vs verify": r"draft vs verify", "TTFT": r"time to first token",
    "ITL": r"inter-token latency", "QPS": r"requests per second", "queue depth": r"queue depth",
    "KV usage": r"kv-cache usage", "prefix-cache hit rate": r"prefix-cache hit rate"}


def panels(dashboard: dict) -> list[dict]:
    return [inner for panel in dashboard["panels"] for inner in [panel, *panel.get("panels", [])]]


def test_dashboard_has_the_fields_grafana_needs(dashboard):
    assert dashboard["schemaVersion"] == 39
    assert dashboard["uid"] == "specserve" and dashboard["title"]
    assert isinstance(dashboard["templating"]["list"], list)
    ids = [panel["id"] for panel in panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels(dashboard):
        assert panel["type"] in PANEL_TYPES, panel["title"]
        if panel["type"] != "row":
            assert set(panel) >= {"datasource", "fieldConfig", "options", "targets"}, panel["title"]


@pytest.mark.parametrize("need", sorted(REQUIRED_PANELS))
def test_dashboard_shows_what_the_issue_lists(dashboard, need):
    titles = [panel["title"].lower() for panel in panels(dashboard) if panel["type"] != "row"]
    assert any(re.search(REQUIRED_PANELS[need], title) for title in titles), need


def test_panels_tile_the_grid_without_overlap(dashboard):
    occupied: dict[tuple[int, int], str] = {}
    for panel in panels(dashboard):
        grid = panel["gridPos"]
        assert grid["w"] > 0 and grid["h"] > 0, panel["title"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= GRID_WIDTH, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in occupied, f"{panel['title']} overlaps {occupied[(x, y)]}"
                occupied[(x, y)] = panel["title"]


def test_every_query_uses_the_datasource_variable(dashboard, dashboard_targets):
    [variable] = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    reference = {"type": "prometheus", "uid": "${" + variable["name"] + "}"}
    for panel in panels(dashboard):
        if panel["type"] != "row":
            assert panel["datasource"] == reference, panel["title"]
            ref_ids = [target["refId"] for target in panel["targets"]]
            assert len(ref_ids) == len(set(ref_ids)) and ref_ids, panel["title"]
    for title, target in dashboard_targets:
        assert target["datasource"] == reference, title
        assert target["expr"].strip(), title


def test_every_metric_name_is_one_the_server_exports(dashboard, dashboard_targets,
                                                     exported_metric_names):
    queries = [target["expr"] for _, target in dashboard_targets]
    queries += [v["definition"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    used = {name for query in queries for name in METRIC_NAME.findall(query)}
    assert len(used) >= 15
    assert used <= exported_metric_names, sorted(used - exported_metric_names)
