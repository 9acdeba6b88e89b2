"""Checks on the operations files: alert rules, their tests, the Prometheus
config, the Grafana dashboard and the systemd unit.

* ``promtool check rules`` / ``test rules`` / ``check config`` must pass
  (skipped without promtool, except under CI, which installs it);
* every ``yieldproxy_*`` series named in those files must exist, with the
  labels used, in the exposition of a fresh :class:`yieldproxy.observe.metrics.Metrics`;
* every alert has unit tests that expect it to fire and not to fire;
* the dashboard is importable JSON whose panels all query something valid.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import types
from pathlib import Path

import pytest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]

from helpers import required_tool
from yieldproxy.observe.metrics import Metrics, hold_families, oldest_parked_family, pool_families

PROM_DIR = ROOT / "etc" / "prometheus"
RULES = PROM_DIR / "yieldproxy-rules.yml"
RULE_TESTS = PROM_DIR / "yieldproxy-rules.test.yml"
PROM_CONFIG = PROM_DIR / "prometheus.yml"
DASHBOARD = ROOT / "etc" / "grafana" / "yieldproxy-dashboard.json"
UNIT = ROOT / "etc" / "systemd" / "yieldproxy.service"

#: Labels Prometheus adds to every scraped series.
TARGET_LABELS = {"job", "instance"}


# --- helpers -------------------------------------------------------------------


def promtool() -> str:
    return required_tool("promtool", install="apt-get install prometheus, or promtool from a prometheus.io release")


def run(*argv: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (
        f"{' '.join(argv)} exited {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    )
    return proc


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def all_panels(panels: list[dict]) -> list[dict]:
    """Panels, with those nested in collapsed rows."""
    out = []
    for p in panels:
        out.append(p)
        out.extend(all_panels(p.get("panels", [])))
    return out


def query_panels(d: dict) -> list[dict]:
    return [p for p in all_panels(d["panels"]) if p.get("type") != "row"]


def dashboard_exprs(d: dict) -> list[str]:
    exprs = [t["expr"] for p in query_panels(d) for t in p.get("targets", []) if t.get("expr")]
    exprs += [a["expr"] for a in d.get("annotations", {}).get("list", []) if a.get("expr")]
    return exprs


def grafana_to_promql(expr: str) -> str:
    """Replace Grafana's variables so Prometheus can parse the expression."""
    for var in ("$__rate_interval", "$__interval", "$__range"):
        expr = expr.replace(var, "5m")
    return re.sub(r"\$\{?\w+\}?", ".*", expr)


# --- the exposition, and the names it allows ---------------------------------


def fresh_metrics() -> Metrics:
    m = Metrics()
    hold = types.SimpleNamespace(source="api", reason="test", since=100.0, expected_end=700.0, expires_at=None)
    # The live families service.build registers: holds, the oldest parked, the pool's members.
    m.watch(lambda: [
        *hold_families([hold], 160.0), oldest_parked_family({}), *pool_families([("default", True, 0, 1, 0, "yielded", ("api",))]),
    ])
    return m


SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
    "gauge": ("",),
    "unknown": ("",),
    "info": ("_info",),
    "stateset": ("",),
    "gaugehistogram": ("_bucket", "_gcount", "_gsum"),
}


def exposed_series() -> dict[str, set[str] | None]:
    """Series name -> label names it may carry (None when unknown).

    Names come from the text exposition itself; labels from the metric objects
    (a labelled counter with no children exposes no samples) and from the
    samples of the live families.
    """
    m = fresh_metrics()
    families = list(text_string_to_metric_families(m.render().decode("utf-8")))
    assert families, "a fresh Metrics() exposes nothing"

    labels_by_family: dict[str, set[str]] = {}
    for attr in dir(m):
        obj = getattr(m, attr, None)
        if isinstance(obj, MetricWrapperBase):
            labels_by_family[obj._name] = set(getattr(obj, "_labelnames", ()))
    for fam in families:
        for sample in fam.samples:
            labels_by_family.setdefault(fam.name, set()).update(k for k in sample.labels if k != "le")

    series: dict[str, set[str] | None] = {}
    for fam in families:
        known = labels_by_family.get(fam.name)
        for suffix in SUFFIXES.get(fam.type, ("",)):
            name = fam.name + suffix
            labels = None if known is None else known | TARGET_LABELS
            if labels is not None and suffix == "_bucket":
                labels = labels | {"le"}
            series[name] = labels
    return series


METRIC_NAME = re.compile(r"(?<![\w:])(yieldproxy_[A-Za-z0-9_]+)")
SELECTOR = re.compile(r"(?<![\w:])(yieldproxy_[A-Za-z0-9_]+)\s*\{([^}]*)\}")
MATCHER_LABEL = re.compile(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)")


def _ops_texts() -> dict[str, str]:
    return {
        RULES.name: RULES.read_text(encoding="utf-8"),
        RULE_TESTS.name: RULE_TESTS.read_text(encoding="utf-8"),
        DASHBOARD.name: "\n".join(dashboard_exprs(dashboard())),
    }


# --- (a) promtool: rules and their unit tests -----------------------------------


def test_promtool_check_rules():
    run(promtool(), "check", "rules", str(RULES))


def test_promtool_test_rules():
    proc = run(promtool(), "test", "rules", str(RULE_TESTS))
    assert "SUCCESS" in proc.stdout + proc.stderr


def test_every_alert_is_tested_both_ways():
    """Each alert needs a case that fires and one that must stay quiet."""
    rules = RULES.read_text(encoding="utf-8")
    tests = RULE_TESTS.read_text(encoding="utf-8")
    alerts = re.findall(r"^\s*-\s*alert:\s*(\S+)\s*$", rules, re.M)
    assert len(alerts) >= 7 and len(set(alerts)) == len(alerts), alerts
    cases = re.findall(r"alertname:\s*(\S+)\s*\n\s*exp_alerts:\s*(\[\s*\])?", tests)
    fires = {name for name, empty in cases if not empty}
    quiet = {name for name, empty in cases if empty}
    missing = [(a, what) for a in alerts for what, seen in (("fires", fires), ("stays quiet", quiet)) if a not in seen]
    assert not missing, f"alerts without a unit test that expects it to ...: {missing}"
    for alert in alerts:
        block = rules.split(f"alert: {alert}", 1)[1].split("- alert:", 1)[0]
        for key in ("expr:", "for:", "severity:", "summary:", "description:"):
            assert key in block, f"{alert} has no {key}"


# --- (b) metric names and labels exist ---------------------------------------


def test_live_collectors_are_exposed():
    series = exposed_series()
    for name in (
        "yieldproxy_hold_active",
        "yieldproxy_hold_age_seconds",
        "yieldproxy_hold_expected_seconds",
        "yieldproxy_oldest_parked_seconds",
        "yieldproxy_upstream_available",
        "yieldproxy_upstream_inflight_requests",
        "yieldproxy_upstream_holds",
        "yieldproxy_upstream_waiting_requests",
    ):
        assert name in series, f"{name} missing: a live family (the fake hold, the pool row) did not reach the exposition"


@pytest.mark.parametrize("filename", [RULES.name, RULE_TESTS.name, DASHBOARD.name])
def test_metric_names_exist(filename):
    text = _ops_texts()[filename]
    series = exposed_series()
    used = set(METRIC_NAME.findall(text))
    assert used, f"no yieldproxy_* metric found in {filename}"
    unknown = sorted(n for n in used if n not in series)
    assert not unknown, (
        f"{filename} uses metric names that Metrics() does not expose: {unknown}\n"
        f"(counters end in _total; histograms are read as _bucket/_sum/_count)\n"
        f"exposed: {sorted(series)}"
    )


@pytest.mark.parametrize("filename", [RULES.name, RULE_TESTS.name, DASHBOARD.name])
def test_selector_labels_exist(filename):
    text = _ops_texts()[filename]
    series = exposed_series()
    wrong = []
    for name, body in SELECTOR.findall(text):
        allowed = series.get(name)
        if allowed is None:
            continue  # unknown names are test_metric_names_exist's business
        for label in MATCHER_LABEL.findall(body):
            if label not in allowed:
                wrong.append(f"{name}{{{label}}} (has {sorted(allowed)})")
    assert not wrong, f"{filename} selects labels the metrics do not have: {wrong}"


# --- (c) the dashboard -------------------------------------------------------


def test_dashboard_is_importable():
    d = dashboard()
    inputs = {i["name"]: i for i in d.get("__inputs", [])}
    assert inputs.get("DS_PROMETHEUS", {}).get("pluginId") == "prometheus"
    assert 36 <= d["schemaVersion"] <= 41
    assert d.get("uid") and d.get("title")
    variables = {v["name"] for v in d["templating"]["list"]}
    assert variables & {"job", "instance"}, variables


def test_dashboard_panels():
    d = dashboard()
    panels = all_panels(d["panels"])
    ids = [p.get("id") for p in panels]
    assert all(isinstance(i, int) for i in ids), ids
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {ids}"
    cells: dict[tuple[int, int], int] = {}
    for p in query_panels(d):
        title = p.get("title")
        grid = p.get("gridPos", {})
        assert {"x", "y", "w", "h"} <= grid.keys(), f"{title}: gridPos {grid}"
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["h"] > 0 and grid["x"] + grid["w"] <= 24, title
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{title} overlaps panel {cells[(x, y)]}"
                cells[(x, y)] = p["id"]
        targets = p.get("targets") or []
        assert targets, f"panel {title!r} has no targets"
        for t in targets:
            assert t.get("expr", "").strip(), f"panel {title!r} has a target without expr"
            assert "$job" in t["expr"] or "$instance" in t["expr"], f"{title}: {t['expr']} ignores the variables"
        for ds in [p.get("datasource"), *(t.get("datasource") for t in targets)]:
            assert ds is None or ds.get("uid") == "${DS_PROMETHEUS}", f"{title}: datasource {ds}"


def test_dashboard_covers_the_essentials():
    exprs = "\n".join(dashboard_exprs(dashboard()))
    for needle in (
        "yieldproxy_parked_requests",
        "yieldproxy_hold_active",
        "histogram_quantile(0.99, sum by (le, class) (rate(yieldproxy_park_seconds_bucket",
        "yieldproxy_replay_total",
        "yieldproxy_rejected_total",
        "yieldproxy_upstream_seconds_bucket",
        "yieldproxy_inflight_requests",
        "yieldproxy_upstream_failures_total",
        # the upstreams of a pool
        "yieldproxy_upstream_available",
        "yieldproxy_upstream_inflight_requests",
        "yieldproxy_upstream_waiting_requests",
        "yieldproxy_upstream_holds",
        "sum by (upstream, outcome) (rate(yieldproxy_upstream_attempts_total",
        "histogram_quantile(0.99, sum by (le, upstream) (rate(yieldproxy_upstream_attempt_seconds_bucket",
    ):
        assert needle in exprs, f"the dashboard has no panel with {needle}"


def test_dashboard_upstream_panels_follow_the_upstream_variable():
    """Every query of a per-upstream series selects ``upstream=~"$upstream"``; rates use ``$__rate_interval``.

    (The failed-share panel keeps the 10m window of YieldproxyUpstreamAttemptsFailing, to read as the alert does.)
    """
    d = dashboard()
    variable = {v["name"]: v for v in d["templating"]["list"]}.get("upstream")
    assert variable and "yieldproxy_upstream_available" in variable["definition"], variable
    assert variable["includeAll"] and variable["multi"] and variable["allValue"] == ".*"
    per_upstream = {n for n, labels in exposed_series().items() if labels and "upstream" in labels}
    wrong = []
    for expr in dashboard_exprs(d):
        for name, body in SELECTOR.findall(expr):
            if name in per_upstream and 'upstream=~"$upstream"' not in body:
                wrong.append(f"{name}{{{body}}}")
    assert not wrong, f"per-upstream selectors that ignore $upstream: {wrong}"
    for p in query_panels(d):
        for t in p["targets"]:
            if "yieldproxy_upstream_attempt" in t["expr"] and "Failed attempts" not in p["title"]:
                assert "[$__rate_interval]" in t["expr"], f"{p['title']}: {t['expr']}"


DOCUMENTED_NAME = re.compile(r"^\| `(yieldproxy_[a-z0-9_]+)` \| (counter|gauge|histogram) \|", re.M)


@pytest.mark.parametrize("filename", [RULES.name, RULE_TESTS.name, DASHBOARD.name])
def test_metric_names_are_documented(filename):
    """What the rules, their tests and the dashboard read is in docs/metrics.md's tables."""
    documented: set[str] = set()
    for name, kind in DOCUMENTED_NAME.findall((ROOT / "docs" / "metrics.md").read_text(encoding="utf-8")):
        base = name.removesuffix("_total") if kind == "counter" else name  # counters are listed as NAME_total
        documented |= {base + suffix for suffix in SUFFIXES[kind] if suffix != "_created"}
    assert "yieldproxy_upstream_attempts_total" in documented and "yieldproxy_upstream_available" in documented
    used = set(METRIC_NAME.findall(_ops_texts()[filename]))
    undocumented = sorted(used - documented)
    assert not undocumented, f"{filename} reads metrics docs/metrics.md does not list: {undocumented}"


def test_dashboard_exprs_parse(tmp_path):
    """Every panel query is valid PromQL: promtool parses it as a recording rule."""
    exprs = dashboard_exprs(dashboard())
    rules = {
        "groups": [
            {
                "name": "dashboard-exprs",
                "rules": [{"record": f"dashboard:expr_{i}", "expr": grafana_to_promql(e)} for i, e in enumerate(exprs)],
            }
        ]
    }
    path = tmp_path / "dashboard-exprs.yml"
    path.write_text(json.dumps(rules), encoding="utf-8")  # JSON is YAML
    run(promtool(), "check", "rules", str(path))


# --- (d) the Prometheus config and the systemd unit ------------------------------


def test_promtool_check_config():
    run(promtool(), "check", "config", str(PROM_CONFIG))


def test_systemd_unit_verifies(tmp_path):
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed")
    text = UNIT.read_text(encoding="utf-8")
    exec_start = re.search(r"^ExecStart=(\S+) (.*)$", text, re.M)
    assert exec_start, "no ExecStart"
    assert exec_start.group(1).endswith("/twistd") and "-n --pidfile= yieldproxy" in exec_start.group(2)
    stop = re.search(r"^TimeoutStopSec=(\d+)s?$", text, re.M)
    assert stop and int(stop.group(1)) > 30, "TimeoutStopSec must exceed the 30 s in-flight grace"
    # systemctl reload hands everything over (docs/operating.md): through the admin API, so a refused config fails it.
    exec_reload = re.search(r"^ExecReload=(\S+) (.*)$", text, re.M)
    assert exec_reload and exec_reload.group(1).endswith("/yieldproxy") and exec_reload.group(2).startswith("reload ")
    assert re.search(r"^NotifyAccess=(main|all)$", text, re.M), "the new process's MAINPID= needs the notify socket"
    # The venv is not installed here: verify everything else.
    unit = tmp_path / UNIT.name
    text = text.replace(exec_start.group(1), "/bin/true", 1).replace(exec_reload.group(1), "/bin/true", 1)
    unit.write_text(text, encoding="utf-8")
    proc = subprocess.run([tool, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_systemd_unit_is_notify_with_a_watchdog_and_keeps_holds_in_its_state_directory():
    """Type=notify (READY=1 from lifecycle/sdnotify.py), a watchdog the reactor feeds, restarts on failure, holds in StateDirectory=."""
    settings = dict(
        line.split("=", 1) for line in UNIT.read_text(encoding="utf-8").splitlines()
        if "=" in line and not line.startswith("#")
    )
    assert settings["Type"] == "notify"
    # A reload hands over to a successor process: the old (main) one sends MAINPID= and READY=1 for it.
    assert settings["NotifyAccess"] == "main"
    assert settings["Restart"] == "on-failure"
    assert settings["StateDirectory"] == "yieldproxy"
    watchdog = re.fullmatch(r"(\d+)s", settings["WatchdogSec"])
    assert watchdog and int(watchdog.group(1)) >= 10


# --- (e) yieldproxy ops-files: the same files for a pip user ---------------------


def _ops_files(capsys, *args: str) -> tuple[int, str, str]:
    """``yieldproxy ops-files ARGS`` in this process: exit status, stdout, stderr."""
    from yieldproxy.tools import cli

    with pytest.raises(SystemExit) as exit:
        cli.main(["ops-files", *args])
    out, err = capsys.readouterr()
    return exit.value.code, out, err


def _etc_files() -> dict[str, bytes]:
    etc = ROOT / "etc"
    return {p.relative_to(etc).as_posix(): p.read_bytes() for p in sorted(etc.rglob("*")) if p.is_file()}


def _tree(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_ops_files_lists_every_file_of_etc():
    """A new file in etc/ must be written out too (and shipped: tests/test_packaging.py checks the wheel)."""
    from yieldproxy.tools.opsfiles import OPS_FILES

    assert sorted(OPS_FILES) == sorted(_etc_files())


def test_ops_files_writes_etc_and_promtool_accepts_the_copy(tmp_path, capsys):
    out_dir = tmp_path / "etc"
    code, out, err = _ops_files(capsys, str(out_dir))
    assert (code, err) == (0, "")
    assert _tree(out_dir) == _etc_files()
    assert sorted(out.splitlines()) == sorted(f"wrote {out_dir / name}" for name in _etc_files())
    probe = out_dir / "probes" / "nvidia-game-probe.sh"
    assert probe.stat().st_mode & 0o777 == 0o755
    assert (out_dir / "systemd" / "yieldproxy.service").stat().st_mode & 0o777 == 0o644
    # Where they were written, they work: the rules' unit tests and the example config load.
    proc = run(promtool(), "test", "rules", "prometheus/yieldproxy-rules.test.yml", cwd=out_dir)
    assert "SUCCESS" in proc.stdout + proc.stderr
    run(promtool(), "check", "config", "prometheus/prometheus.yml", cwd=out_dir)
    # Again: nothing differs, nothing to force.
    code, out, err = _ops_files(capsys, str(out_dir))
    assert (code, err) == (0, "")
    assert sorted(out.splitlines()) == sorted(f"unchanged {out_dir / name}" for name in _etc_files())


def test_ops_files_does_not_overwrite_an_edited_file_without_force(tmp_path, capsys):
    out_dir = tmp_path / "ops"
    assert _ops_files(capsys, str(out_dir))[0] == 0
    unit = out_dir / "systemd" / "yieldproxy.service"
    unit.write_text("# the operator's own unit\n", encoding="utf-8")
    (out_dir / "grafana" / "yieldproxy-dashboard.json").unlink()
    code, out, err = _ops_files(capsys, str(out_dir))
    assert code == 1 and out == ""
    assert f"not overwriting {unit}: it differs" in err and "--force" in err and "nothing was written" in err
    # Nothing was written: the edit stays, the missing file is still missing.
    assert unit.read_text(encoding="utf-8") == "# the operator's own unit\n"
    assert not (out_dir / "grafana" / "yieldproxy-dashboard.json").exists()
    code, out, err = _ops_files(capsys, "--force", str(out_dir))
    assert (code, err) == (0, "")
    assert f"wrote {unit}" in out.splitlines()
    assert f"wrote {out_dir / 'grafana' / 'yieldproxy-dashboard.json'}" in out.splitlines()
    assert _tree(out_dir) == _etc_files()


def test_ops_files_into_a_place_it_cannot_write_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("", encoding="utf-8")
    code, out, err = _ops_files(capsys, str(blocker / "etc"))
    assert code == 1 and out == ""
    assert err.startswith(f"yieldproxy: cannot write the ops files into {blocker / 'etc'}: ") and err.count("\n") == 1
