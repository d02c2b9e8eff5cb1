"""The deployment files in deploy/ agree with the code they deploy.

Metric names come from live ``RelayMetrics()``, ``ConsumerMetrics()`` and
``JobsMetrics()`` registries, option names from ``relay.config.OPTIONS`` and the
commands quoted in runbooks from the CLIs' own parsers, so renaming a metric, an
option or a command fails here instead of silently breaking an alert, a panel, a
manifest or a runbook.  The promtool tests skip (with the install command) when
promtool is missing.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from relay import config
from tests.fixtures.deploy_names import (
    CLIS,
    METRICS_CLASSES,
    command_problems,
    exported_metric_names,
    is_relay_env,
    quoted_commands,
)

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
ALERTS_TEST = DEPLOY / "prometheus" / "alerts_test.yml"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
DASHBOARD = DEPLOY / "grafana" / "outbox-relay.json"
SDK_DASHBOARD = DEPLOY / "grafana" / "outbox-sdk.json"
DASHBOARDS = (DASHBOARD, SDK_DASHBOARD)
COMPOSE = DEPLOY / "docker-compose.yml"
K8S = DEPLOY / "k8s"
DOCKERFILE = DEPLOY / "Dockerfile"
RUNBOOKS = DEPLOY / "runbooks"

METRIC_NAME = re.compile(r"\boutbox_(?:relay|consumer|jobs)_[a-z0-9_]+")
ENV_NAME = re.compile(r"\bOUTBOX_RELAY_[A-Z0-9_]*")
RELAY_IMAGE = "outbox-relay"
PROMTOOL_MISSING = "promtool not installed: apt-get install prometheus"

#: Alert name prefix -> the metric prefix its expression uses and how its runbook says to check.
#: The relay has a status command; the SDK's runbooks name the metrics their alert is built on.
ALERT_FAMILIES = {
    "OutboxRelay": ("outbox_relay_", "outbox-relay status"),
    "OutboxConsumer": ("outbox_consumer_", None),
    "OutboxJobs": ("outbox_jobs_", None),
}

#: What the dashboard must show (the panels the SRE asked for).
DASHBOARD_REQUIRED = {
    "outbox_relay_oldest_pending_age_seconds",
    "outbox_relay_pending_rows",
    "outbox_relay_events_published_total",
    "outbox_relay_publish_errors_total",
    "outbox_relay_commit_to_ack_seconds_bucket",
    "outbox_relay_batch_size_rows_bucket",
    "outbox_relay_claim_duration_seconds_bucket",
    "outbox_relay_mark_duration_seconds_bucket",
    "outbox_relay_leases_held",
    "outbox_relay_leases_lost_total",
    "outbox_relay_fenced_writes_total",
    "outbox_relay_dead_lettered_total",
    "outbox_relay_retrying_rows",
    "outbox_relay_database_up",
    "outbox_relay_broker_up",
    "outbox_relay_in_flight_rows",
    "outbox_relay_build_info",
}

#: What the SDK dashboard must show: the consumers' and the jobs' main signals.
SDK_DASHBOARD_REQUIRED = {
    "outbox_consumer_lag_messages",
    "outbox_consumer_processed_total",
    "outbox_consumer_duplicates_dropped_total",
    "outbox_consumer_handler_errors_total",
    "outbox_consumer_dead_lettered_total",
    "outbox_consumer_invalid_messages_total",
    "outbox_consumer_payload_mismatches_total",
    "outbox_consumer_offset_commit_failures_total",
    "outbox_consumer_database_errors_total",
    "outbox_consumer_rebalances_total",
    "outbox_consumer_inbox_retention_unsafe",
    "outbox_consumer_batch_duration_seconds_bucket",
    "outbox_jobs_oldest_pending_age_seconds",
    "outbox_jobs_pending",
    "outbox_jobs_running",
    "outbox_jobs_waiting",
    "outbox_jobs_workers_busy",
    "outbox_jobs_workers_capacity",
    "outbox_jobs_runs_accepted_total",
    "outbox_jobs_admission_refused_total",
    "outbox_jobs_claimed_total",
    "outbox_jobs_finished_total",
    "outbox_jobs_accept_to_terminal_seconds_bucket",
    "outbox_jobs_handler_duration_seconds_bucket",
    "outbox_jobs_retries_total",
    "outbox_jobs_dead_lettered_total",
    "outbox_jobs_lease_expirations_total",
    "outbox_jobs_leases_lost_total",
    "outbox_jobs_heartbeat_failures_total",
}

#: Per dashboard: the metrics it must query, and the metric of its first (top-left) panel.
DASHBOARD_SPECS = {
    DASHBOARD: (DASHBOARD_REQUIRED, "outbox_relay_oldest_pending_age_seconds"),
    SDK_DASHBOARD: (SDK_DASHBOARD_REQUIRED, "outbox_consumer_lag_messages"),
}


# --- helpers -------------------------------------------------------------------------


def family_of(alert: str) -> tuple[str, str | None]:
    """(metric prefix, status command) of the alert's family, by its name's prefix."""
    for prefix, family in ALERT_FAMILIES.items():
        if alert.startswith(prefix):
            return family
    raise AssertionError(f"{alert}: alert names start with one of {sorted(ALERT_FAMILIES)}")


def base_metric(name: str) -> str:
    """The metric family of a sample name: outbox_x_total -> outbox_x."""
    return re.sub(r"_(total|created|bucket|sum|count)$", "", name)


def metric_names_in(text: str) -> set[str]:
    return set(METRIC_NAME.findall(text))


def deploy_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.is_file())


def load_yaml(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def k8s_objects() -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in sorted(K8S.glob("*.y*ml")):
        for doc in load_yaml(path):
            yield path, doc


def k8s_object(kind: str, path: Path | None = None) -> dict[str, Any]:
    found = [doc for p, doc in k8s_objects() if doc["kind"] == kind and (path is None or p == path)]
    assert len(found) == 1, f"expected one {kind} in {K8S}, found {len(found)}"
    return found[0]


def relay_containers() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(pod spec, container) of every container running the relay image, init or not."""
    found = []
    for _, doc in k8s_objects():
        pod = doc.get("spec", {}).get("template", {}).get("spec")
        if not pod:
            continue
        for container in pod.get("containers", []) + pod.get("initContainers", []):
            if RELAY_IMAGE in container["image"]:
                found.append((pod, container))
    assert found, "no container runs the outbox-relay image in deploy/k8s"
    return found


def sidecar() -> tuple[dict[str, Any], dict[str, Any]]:
    deployment = k8s_object("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    relays = [c for c in pod["containers"] if RELAY_IMAGE in c["image"]]
    assert len(relays) == 1, "the Deployment's pod must have exactly one relay container"
    assert len(pod["containers"]) >= 2, "the relay must be a sidecar next to the app container"
    return pod, relays[0]


def configmap_env() -> dict[str, str]:
    return {str(k): str(v) for k, v in k8s_object("ConfigMap")["data"].items()}


def container_env(container: dict[str, Any]) -> dict[str, str]:
    """The container's literal env on top of its ConfigMap envFrom (valueFrom ones skipped)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        name = source["configMapRef"]["name"]
        cm = k8s_object("ConfigMap")
        assert cm["metadata"]["name"] == name, f"envFrom names an unknown ConfigMap {name!r}"
        env.update(configmap_env())
    env.update({e["name"]: str(e["value"]) for e in container.get("env", []) if "value" in e})
    return env


def compose() -> dict[str, Any]:
    (doc,) = load_yaml(COMPOSE)
    return doc


def compose_env(service: str) -> dict[str, str]:
    env = compose()["services"][service]["environment"]
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}


def configured(env: dict[str, str], option: str) -> Any:
    """The value the relay would use for ``option`` given ``env`` (parsed, default applied)."""
    opt = config.OPTIONS_BY_NAME[option]
    return opt.parse(env[opt.env]) if opt.env in env else opt.default


def dashboard(path: Path = DASHBOARD) -> dict[str, Any]:
    return json.loads(path.read_text())


def dashboard_queries(node: Any) -> Iterator[str]:
    """Every PromQL string of the dashboard: panel targets and template variable queries."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "definition") and isinstance(value, str):
                yield value
            elif key == "query" and isinstance(value, str) and node.get("type") != "datasource":
                yield value
            else:
                yield from dashboard_queries(value)
    elif isinstance(node, list):
        for item in node:
            yield from dashboard_queries(item)


def alert_rules() -> list[dict[str, Any]]:
    (doc,) = load_yaml(ALERTS)
    return [rule for group in doc["groups"] for rule in group["rules"] if "alert" in rule]


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def run_promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip(PROMTOOL_MISSING)
    return subprocess.run([promtool, *args], cwd=cwd, capture_output=True, text=True, timeout=60)


# --- every file parses ---------------------------------------------------------------


def test_every_yaml_and_json_file_in_deploy_parses() -> None:
    parsed = 0
    for path in deploy_files():
        if path.suffix in (".yml", ".yaml"):
            assert load_yaml(path), f"{path} is empty"
            parsed += 1
        elif path.suffix == ".json":
            json.loads(path.read_text())
            parsed += 1
    assert parsed >= 10


def test_the_expected_files_exist() -> None:
    for rel in ("Dockerfile", "docker-compose.yml", "k8s/deployment.yaml", "k8s/configmap.yaml",
                "k8s/secret.example.yaml", "k8s/podmonitor.yaml", "prometheus/alerts.yml",
                "prometheus/alerts_test.yml", "prometheus/prometheus.yml",
                "grafana/outbox-relay.json", "grafana/outbox-sdk.json"):
        assert (DEPLOY / rel).is_file(), f"deploy/{rel} is missing"


# --- metric names --------------------------------------------------------------------


def test_exported_names_include_labelled_and_derived_series() -> None:
    names = exported_metric_names()
    for expected in ("outbox_relay_events_published_total", "outbox_relay_dead_lettered_created",
                     "outbox_relay_commit_to_ack_seconds_bucket", "outbox_relay_build_info",
                     "outbox_relay_pending_rows"):
        assert expected in names
    assert "outbox_relay_events_published" not in names  # a counter is only scraped as _total
    for expected in ("outbox_consumer_processed_total", "outbox_consumer_dead_lettered_created",
                     "outbox_consumer_batch_duration_seconds_bucket", "outbox_consumer_lag_messages",
                     "outbox_jobs_heartbeat_failures_total", "outbox_jobs_workers_capacity",
                     "outbox_jobs_accept_to_terminal_seconds_count", "outbox_jobs_dead_lettered_created"):
        assert expected in names
    assert "outbox_consumer_processed" not in names
    assert "outbox_jobs_pending_total" not in names  # a gauge has no _total


@pytest.mark.parametrize("path", [ALERTS, ALERTS_TEST, *DASHBOARDS], ids=lambda p: p.name)
def test_metric_names_exist_in_the_code(path: Path) -> None:
    used = metric_names_in(path.read_text())
    assert used, f"{path} uses no outbox metric"
    unknown = used - exported_metric_names()
    assert not unknown, (
        f"{path.name} uses metrics neither the relay nor the SDK exports: {sorted(unknown)}")


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_covers_the_required_signals(path: Path) -> None:
    required, _ = DASHBOARD_SPECS[path]
    used = set().union(*(metric_names_in(q) for q in dashboard_queries(dashboard(path))))
    missing = required - used
    assert not missing, f"no panel of {path.name} queries {sorted(missing)}"


def test_every_metric_is_on_a_dashboard() -> None:
    """An SRE finds every metric the relay and the SDK export on a panel: six of them were
    exported and shown nowhere (exactly-once transactions, replays, the producer's full queue,
    retention's deletes, the relay's statements, consumers' partitions paused for a dead
    letter)."""
    used = set().union(*(metric_names_in(q) for path in DASHBOARDS
                         for q in dashboard_queries(dashboard(path))))
    families = {base_metric(name).removesuffix("_info") for name in used}
    missing = sorted(family.name for metrics in METRICS_CLASSES for family in metrics().registry.collect()
                     if family.name not in families)
    assert not missing, f"exported and on no dashboard: {missing}"


def test_dashboards_have_distinct_uids_and_titles() -> None:
    boards = [dashboard(path) for path in DASHBOARDS]
    assert len({b["uid"] for b in boards}) == len(boards)
    assert len({b["title"] for b in boards}) == len(boards)


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_structure(path: Path) -> None:
    _, first_metric = DASHBOARD_SPECS[path]
    board = dashboard(path)
    assert board["schemaVersion"] >= 36 and board["uid"] and board["title"]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = [p for p in board["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
    # The main signal (the relay's SLO, the consumers' lag) comes first.
    first = min(panels, key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"]))
    assert first_metric in first["targets"][0]["expr"]
    # No two panels overlap on the grid.
    cells: dict[tuple[int, int], str] = {}
    for panel in board["panels"]:
        g = panel["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]
        assert g["x"] + g["w"] <= 24


# --- alerts and runbooks -------------------------------------------------------------


def test_alerts_have_severity_annotations_and_runbooks() -> None:
    rules = alert_rules()
    assert len({r["alert"] for r in rules}) >= 20
    for rule in rules:
        name = rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        for key in ("summary", "description", "runbook_url"):
            assert rule["annotations"].get(key), f"{name} has no {key}"
        url = rule["annotations"]["runbook_url"]
        assert url.endswith(f"/deploy/runbooks/{name}.md"), f"{name}: runbook_url {url}"
        assert (RUNBOOKS / f"{name}.md").is_file(), f"deploy/runbooks/{name}.md is missing"


def test_alerts_use_the_metrics_of_their_family() -> None:
    for rule in alert_rules():
        prefix, _ = family_of(rule["alert"])
        used = metric_names_in(rule["expr"])
        assert all(name.startswith(prefix) for name in used), (rule["alert"], sorted(used))


def test_runbooks_say_how_to_check() -> None:
    """Relay runbooks use `outbox-relay status`; SDK runbooks name the metric their alert uses."""
    for rule in alert_rules():
        name = rule["alert"]
        text = (RUNBOOKS / f"{name}.md").read_text()
        _, status = family_of(name)
        if status is not None:
            assert status in text, f"the {name} runbook does not say how to check with `{status}`"
        else:
            metrics = {base_metric(m) for m in metric_names_in(rule["expr"])}
            named = {base_metric(m) for m in metric_names_in(text)}
            assert metrics & named, f"the {name} runbook names none of {sorted(metrics)}"
        assert f"# {name}" in text.splitlines()[0], f"{name}.md must start with its alert's name"


def test_runbooks_index_every_alert() -> None:
    index = (RUNBOOKS / "README.md").read_text()
    for name in {r["alert"] for r in alert_rules()}:
        assert f"]({name}.md)" in index, f"deploy/runbooks/README.md does not list {name}"


def test_commands_quoted_in_runbooks_and_alerts_exist() -> None:
    problems: list[str] = []
    quoted: set[str] = set()
    for path in [ALERTS, *sorted(RUNBOOKS.glob("*.md"))]:
        for cli, args in quoted_commands(path.read_text()):
            quoted.add(cli)
            problems += [f"{path.name}: {p}" for p in command_problems(cli, args)]
    assert quoted == set(CLIS), f"no runbook quotes {sorted(set(CLIS) - quoted)}"
    assert not problems, "commands that do not exist:\n" + "\n".join(problems)


def test_command_check_catches_inventions() -> None:
    assert command_problems("python -m consumer_sdk.jobs", ["dead-letters", "list", "--queue", "x"]) == []
    assert command_problems("outbox-relay", ["dead-letters", "list|show|requeue|purge"]) == []
    assert command_problems("python -m consumer_sdk.jobs", ["dead-letters", "purge"])
    assert command_problems("python -m consumer_sdk.jobs", ["status"])
    assert command_problems("outbox-relay", ["status", "--queue"])


def test_required_alerts_exist() -> None:
    (doc,) = load_yaml(ALERTS)
    assert {"outbox-relay", "outbox-consumer", "outbox-jobs"} <= {g["name"] for g in doc["groups"]}
    exprs = {r["alert"]: r["expr"] for r in alert_rules()}
    joined = "\n".join(exprs.values())
    for needle in ("outbox_relay_oldest_pending_age_seconds", "outbox_relay_events_published_total",
                   "outbox_relay_pending_rows", "outbox_relay_dead_lettered_total",
                   "outbox_relay_leases_lost_total", 'up{job=~".*outbox-relay.*"}',
                   "absent(", "outbox_relay_publish_errors_total", "outbox_relay_database_up",
                   # the consumer SDK
                   "outbox_consumer_lag_messages", "outbox_consumer_handler_errors_total",
                   "outbox_consumer_dead_lettered_total", "outbox_consumer_payload_mismatches_total",
                   "outbox_consumer_offset_commit_failures_total",
                   "outbox_consumer_database_errors_total", "outbox_consumer_inbox_retention_unsafe",
                   # runs and jobs
                   "outbox_jobs_oldest_pending_age_seconds", "outbox_jobs_dead_lettered_total",
                   "outbox_jobs_lease_expirations_total", "outbox_jobs_heartbeat_failures_total",
                   "outbox_jobs_workers_busy", "outbox_jobs_workers_capacity",
                   "outbox_jobs_admission_refused_total",
                   # connections cut under running jobs; a pool held at its payload byte limit
                   "outbox_jobs_given_back_total", "outbox_jobs_payload_bytes_held",
                   "outbox_jobs_payload_bytes_limit",
                   # the relay's statements cancelled in a streak, its mark connection ended again and again
                   "outbox_relay_statements_cancelled_total", "outbox_relay_mark_statements_cancelled_total",
                   "outbox_relay_mark_connection_losses_total"):
        assert needle in joined, f"no alert uses {needle}"


def test_every_runbook_belongs_to_an_alert() -> None:
    alerts = {r["alert"] for r in alert_rules()}
    for path in RUNBOOKS.glob("*.md"):
        if path.name != "README.md":
            assert path.stem in alerts, f"{path.name} documents no alert of alerts.yml"


def test_every_alert_has_a_firing_and_a_quiet_unit_test() -> None:
    (doc,) = load_yaml(ALERTS_TEST)
    assert doc["rule_files"] == ["alerts.yml"]
    firing: set[str] = set()
    quiet: set[str] = set()
    for case in doc["tests"]:
        for check in case.get("alert_rule_test", []):
            (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    alerts = {r["alert"] for r in alert_rules()}
    assert alerts - firing == set(), f"alerts never tested firing: {sorted(alerts - firing)}"
    assert alerts - quiet == set(), f"alerts never tested quiet: {sorted(alerts - quiet)}"
    severities = {(c["alertname"], a["exp_labels"]["severity"])
                  for case in doc["tests"] for c in case.get("alert_rule_test", [])
                  for a in c.get("exp_alerts") or []}
    for rule in alert_rules():
        assert (rule["alert"], rule["labels"]["severity"]) in severities, rule["alert"]


def test_promtool_check_rules() -> None:
    result = run_promtool("check", "rules", str(ALERTS), cwd=ALERTS.parent)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_test_rules() -> None:
    result = run_promtool("test", "rules", ALERTS_TEST.name, cwd=ALERTS_TEST.parent)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_check_compose_prometheus_config(tmp_path: Path) -> None:
    """prometheus.yml is valid once its container path for the rules points at the real file."""
    cfg = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    assert cfg["rule_files"] == ["/etc/prometheus/alerts.yml"]
    shutil.copy(ALERTS, tmp_path / "alerts.yml")
    cfg["rule_files"] = [str(tmp_path / "alerts.yml")]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    result = run_promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_promtool_parses_every_dashboard_query(tmp_path: Path, path: Path) -> None:
    """Each panel's PromQL, with Grafana's variables filled in, is valid PromQL."""
    grafana_vars = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h",
                    "$job": ".*", "$instance": ".*", "$consumer": ".*", "$queue": ".*"}
    rules = []
    for i, query in enumerate(q for q in dashboard_queries(dashboard(path))
                              if not q.startswith("label_values(")):
        for var, value in grafana_vars.items():
            query = query.replace(var, value)
        assert "$" not in query, f"unknown Grafana variable in {query}"
        rules.append({"record": f"dashboard:query_{i}", "expr": query})
    groups = {"groups": [{"name": "dashboard", "rules": rules}]}
    (tmp_path / "queries.yml").write_text(yaml.safe_dump(groups))
    result = run_promtool("check", "rules", "queries.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


# --- environment variables -----------------------------------------------------------


def test_every_outbox_relay_variable_in_deploy_is_real() -> None:
    families = {config.ENV_PREFIX, config.KAFKA_ENV_PREFIX}  # prose: OUTBOX_RELAY_KAFKA_<PROPERTY>
    problems = []
    for path in deploy_files():
        for name in set(ENV_NAME.findall(path.read_text())):
            if name not in families and not is_relay_env(name):
                problems.append(f"{path.relative_to(ROOT)}: {name}")
    assert not problems, "unknown relay variables:\n" + "\n".join(sorted(problems))


def _check_env(env: dict[str, str], where: str) -> None:
    relay_vars = {k: v for k, v in env.items() if k.startswith(config.ENV_PREFIX)}
    unknown = sorted(k for k in relay_vars if not is_relay_env(k))
    assert not unknown, f"{where}: unknown relay variables {unknown}"
    # The values parse, and the librdkafka pass-through keeps the delivery guarantees.
    plain = {k: v for k, v in relay_vars.items() if not k.endswith("_FILE")}
    plain.setdefault(config.ENV_PREFIX + "DSN", "postgresql://relay@db/app")
    settings = config.build_settings(config.env_values(plain, "run"),
                                     kafka_properties=config.kafka_env_properties(plain))
    producer = config.producer_config(settings)
    assert producer["acks"] == "all" and producer["enable.idempotence"] == "true"


def test_k8s_env_is_valid() -> None:
    for name in configmap_env():
        assert is_relay_env(name), f"ConfigMap key {name} is no relay variable"
    for _, container in relay_containers():
        env = container_env(container)
        if container.get("args", ["run"])[0] == "run":
            _check_env(env, container["name"])
        else:
            unknown = sorted(k for k in env
                             if k.startswith(config.ENV_PREFIX) and not is_relay_env(k))
            assert not unknown, f"{container['name']}: unknown relay variables {unknown}"


def test_compose_env_is_valid() -> None:
    _check_env(compose_env("relay"), "compose relay")
    for name in compose_env("migrate"):
        assert is_relay_env(name), f"compose migrate: {name}"


def test_k8s_secrets_come_from_mounted_files() -> None:
    secret = k8s_object("Secret")
    keys = set(secret.get("stringData", {})) | set(secret.get("data", {}))
    for pod, container in relay_containers():
        names = {e["name"] for e in container.get("env", [])}
        assert config.ENV_PREFIX + "DSN" not in names, "the DSN must come from a file (_FILE)"
        assert config.ENV_PREFIX + "DSN_FILE" in names
        volumes = {v["name"]: v for v in pod["volumes"]}
        for entry in container["env"]:
            if not entry["name"].endswith("_FILE"):
                continue
            path = Path(entry["value"])
            mounts = [m for m in container["volumeMounts"] if path.parent == Path(m["mountPath"])]
            assert mounts, f"{entry['name']}={path} is not inside a mounted volume"
            source = volumes[mounts[0]["name"]]["secret"]
            assert source["secretName"] == secret["metadata"]["name"]
            items = {i["path"]: i["key"] for i in source.get("items", [])}
            key = items.get(path.name, path.name)
            assert key in keys, f"{entry['name']} reads secret key {key!r}, absent from the Secret"
    _, relay = sidecar()
    names = {e["name"] for e in relay["env"]}
    assert config.KAFKA_ENV_PREFIX + "SASL_PASSWORD_FILE" in names


ROLE_SCRIPT = ROOT / "outbox_core" / "sql" / "roles" / "outbox_relay_role.sql"


def login_roles_of_role_script() -> set[str]:
    """Roles the role script documents as LOGIN members of the NOLOGIN group role."""
    text = ROLE_SCRIPT.read_text()
    return set(re.findall(r"CREATE ROLE (\w+) LOGIN PASSWORD '\.\.\.' IN ROLE outbox_relay;", text))


def test_deploy_examples_log_in_with_a_role_that_can_log_in() -> None:
    """The relay's DSN in every deploy example names the login role of the role script,
    never the group role it creates NOLOGIN (issue 15, item 9)."""
    from psycopg.conninfo import conninfo_to_dict

    assert "CREATE ROLE outbox_relay NOLOGIN" in ROLE_SCRIPT.read_text()
    logins = login_roles_of_role_script()
    assert logins and "outbox_relay" not in logins
    secret = k8s_object("Secret")
    relay_user = conninfo_to_dict(secret["stringData"]["dsn"])["user"]
    assert relay_user in logins, f"secret.example.yaml logs in as {relay_user!r}, not one of {logins}"
    migrate_user = conninfo_to_dict(secret["stringData"]["migrate-dsn"])["user"]
    assert migrate_user != "outbox_relay", "migrate needs the schema owner"
    # compose: the relay logs in as the database's own (LOGIN) user.
    postgres_user = compose()["services"]["postgres"]["environment"]["POSTGRES_USER"]
    for service, svc in compose()["services"].items():
        dsn = (svc.get("environment") or {}).get("OUTBOX_RELAY_DSN")
        if dsn:
            assert conninfo_to_dict(dsn)["user"] == postgres_user, service


# --- ports, probes, shutdown, security -----------------------------------------------


def test_sidecar_ports_and_probes() -> None:
    _, relay = sidecar()
    port = configured(container_env(relay), "metrics_port")
    named = {p["name"]: p["containerPort"] for p in relay["ports"]}
    assert named.get("metrics") == port, "the relay's port named `metrics` must be its metrics port"
    assert relay["livenessProbe"]["httpGet"]["path"] == "/healthz"
    # A sidecar's startup waits for the database and the schema, never for Kafka: on /readyz,
    # a pod that started during a Kafka outage stayed out of its Service and its relay was
    # killed at the threshold.  No readinessProbe: it would do the same all the time.
    assert relay["startupProbe"]["httpGet"]["path"] == "/startupz"
    assert "readinessProbe" not in relay
    for kind in ("livenessProbe", "startupProbe", "readinessProbe"):
        if kind in relay:
            probe_port = relay[kind]["httpGet"]["port"]
            assert probe_port in ("metrics", port), f"{kind} probes port {probe_port}"


def test_podmonitor_scrapes_the_metrics_port() -> None:
    monitor = k8s_object("PodMonitor")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics" and endpoint.get("path", "/metrics") == "/metrics"
    pod_labels = k8s_object("Deployment")["spec"]["template"]["metadata"]["labels"]
    for key, value in monitor["spec"]["selector"]["matchLabels"].items():
        assert pod_labels.get(key) == value, f"the PodMonitor's selector {key} misses the pods"
    # The job label it builds must match the alerts' job=~".*outbox-relay.*".
    job = [r for r in endpoint.get("relabelings", []) if r.get("targetLabel") == "job"]
    assert not job or "outbox-relay" in job[0]["replacement"]


def test_termination_grace_outlasts_the_drain() -> None:
    pod, relay = sidecar()
    drain = configured(container_env(relay), "drain_timeout_s")
    assert pod["terminationGracePeriodSeconds"] > drain
    grace = compose()["services"]["relay"]["stop_grace_period"]
    assert float(grace.rstrip("s")) > configured(compose_env("relay"), "drain_timeout_s")


def test_relay_containers_are_locked_down() -> None:
    for pod, container in relay_containers():
        ctx = container.get("securityContext", {})
        pod_ctx = pod.get("securityContext", {})
        name = container["name"]
        assert ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot")) is True, name
        assert ctx.get("runAsUser", pod_ctx.get("runAsUser", 1)) != 0, name
        assert ctx.get("readOnlyRootFilesystem") is True, name
        assert ctx.get("allowPrivilegeEscalation") is False, name
        assert ctx.get("capabilities", {}).get("drop") == ["ALL"], name
        assert pod.get("enableServiceLinks") is False, f"{name}: Service env vars may collide"


def test_sidecar_resources() -> None:
    _, relay = sidecar()
    requests, limits = relay["resources"]["requests"], relay["resources"]["limits"]
    assert requests["cpu"] and requests["memory"] and limits["memory"]


def test_migration_runs_once_before_the_relay() -> None:
    pod, _ = sidecar()
    migrate_steps = [c for _, c in relay_containers() if c.get("args", [None])[0] == "migrate"]
    init_migrate = [c for c in pod.get("initContainers", [])
                    if c.get("args", [None])[0] == "migrate"]
    assert migrate_steps, "no `outbox-relay migrate` Job or initContainer"
    if not init_migrate:
        job = k8s_object("Job")
        assert job["spec"]["template"]["spec"]["containers"][0]["args"] == ["migrate"]


# --- compose -------------------------------------------------------------------------


def test_compose_services() -> None:
    services = compose()["services"]
    assert services["postgres"]["image"].startswith("postgres:16")
    assert services["kafka"]["image"].startswith("apache/kafka:3.8")
    assert services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert services["migrate"]["command"] == ["migrate"]
    assert services["relay"]["command"] == ["run"]
    deps = services["relay"]["depends_on"]
    assert deps["migrate"]["condition"] == "service_completed_successfully"
    port = configured(compose_env("relay"), "metrics_port")
    assert any(str(p).endswith(f":{port}") for p in services["relay"]["ports"])
    assert f":{port}/healthz" in " ".join(services["relay"]["healthcheck"]["test"])
    jobs = yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"]
    targets = [t for job in jobs if "outbox-relay" in job["job_name"]
               for sc in job["static_configs"] for t in sc["targets"]]
    assert targets == [f"relay:{port}"]


def test_compose_bind_mounts_exist() -> None:
    for name, service in compose()["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name} mounts missing {source}"


# --- Dockerfile ----------------------------------------------------------------------


def test_dockerfile() -> None:
    instructions = dockerfile_instructions()
    stages = [args for word, args in instructions if word == "FROM"]
    assert len(stages) >= 2, "multi-stage build expected"
    assert all(s.split()[0].startswith("python:3.11-slim") for s in stages), stages
    final = instructions[max(i for i, (w, _) in enumerate(instructions) if w == "FROM"):]
    users = [args for word, args in final if word == "USER"]
    assert users, "the runtime stage must set USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"USER must be a numeric non-root uid, got {users[-1]}"
    last = {word: args for word, args in final}
    assert json.loads(last["ENTRYPOINT"]) == ["outbox-relay"]
    assert json.loads(last["CMD"]) == ["run"]
    exposed = {p.split("/")[0] for word, args in final if word == "EXPOSE"
               for p in shlex.split(args)}
    assert str(config.DEFAULT_METRICS_PORT) in exposed
    runs = " ".join(args for word, args in instructions if word == "RUN")
    assert "pip wheel" in runs or "pip install ." in runs


def test_the_image_copies_only_what_its_build_context_lets_through_and_pins_its_dependencies() -> None:
    """Every source the build stage copies passes deploy/Dockerfile.dockerignore (a file
    filtered out fails `docker build`, which no test here runs), and the wheels are built
    at the releases of constraints.txt, the set CI passed with."""
    allowed = {line.strip()[1:] for line in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
               if line.strip().startswith("!")}
    copied = [src for word, args in dockerfile_instructions() if word == "COPY" and "--from" not in args
              for src in shlex.split(args)[:-1]]
    assert "constraints.txt" in copied
    for src in copied:
        assert src in allowed or f"{src}/**" in allowed, f"COPY {src}: not in the build context"
        assert (ROOT / src).exists(), src
    runs = [args for word, args in dockerfile_instructions() if word == "RUN" and "pip wheel" in args]
    assert runs and all("-c constraints.txt" in args for args in runs), runs
