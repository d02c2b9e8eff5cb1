"""Bad input to the inbox consumer's configuration is refused at construction with a ConfigError
naming the option (never a TypeError/AttributeError or a librdkafka error later)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from consumer_sdk import InboxConfig, InboxConsumer, RetryPolicy, retention
from consumer_sdk.errors import ConfigError
from consumer_sdk.metrics import ConsumerMetrics

NAN, INF = math.nan, math.inf
BASE: dict[str, Any] = {"name": "billing", "dsn": "postgresql://svc@db/app", "bootstrap_servers": "k:9092",
                        "topics": ["orders"]}


def config(**overrides: Any) -> InboxConfig:
    return InboxConfig(**{**BASE, **overrides})


def refused(match: str, **overrides: Any) -> ConfigError:
    with pytest.raises(ConfigError, match=match) as caught:
        config(**overrides)
    return caught.value


def handler(conn: Any, message: Any) -> None:
    del conn, message


# -- 1. a dead-letter topic that is a consumed topic ---------------------------------------


@pytest.mark.parametrize(("template", "topics"), [("{topic}", ["orders"]), ("{topic}", ["a", "b"]),
                                                  ("{topic}.dlq", ["orders", "orders.dlq"]),
                                                  ("{topic}.dlq", ["orders.dlq", "orders"])])
def test_dead_letter_topic_filling_in_to_a_consumed_topic_is_refused(template: str, topics: list[str]) -> None:
    refused("dead_letter_topic must differ", dead_letter_topic=template, topics=topics)


def test_dead_letter_topic_filling_in_to_no_topic_name_is_refused() -> None:
    refused("dead_letter_topic", dead_letter_topic="{topic} dlq")
    refused("dead_letter_topic", topics=["x" * 249])
    refused("dead_letter_topic", dead_letter_topic=5)


# -- 2. names end at the end, not before a trailing newline --------------------------------


@pytest.mark.parametrize("name", ["billing\n", "x" * 200 + "\n"])
def test_name_with_a_trailing_newline_is_refused(name: str) -> None:
    error = refused("name must be", name=name)
    assert repr(name) in str(error)


@pytest.mark.parametrize("group_id", ["", "billing\n", "a\x00b", " billing", 5, "x" * 256])
def test_group_id_is_checked(group_id: Any) -> None:
    refused("group_id", group_id=group_id)
    assert config(group_id="billing-v2:eu.1").group == "billing-v2:eu.1"


# -- 3. inbox cleanup never deletes what redeliveries need -----------------------------------


class _Store:
    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def cleanup_batch(self, **kwargs: Any) -> int:
        self.calls.append(kwargs)
        return 0


@pytest.mark.parametrize(("retention_s", "batch"), [
    (0, 1000), (-1, 1000), (-1e9, 1000), (1.0, 1000), (NAN, 1000), (INF, 1000), (1e13, 1000), (True, 1000),
    (3600, 1.5), (3600, -1), (3600, 0), (3600, None), (3600, True), (3600, "10")])
def test_cleanup_refuses_bad_retention_or_batch_and_deletes_nothing(retention_s: Any, batch: Any) -> None:
    store = _Store()
    with pytest.raises(ConfigError, match="retention_s|batch"):
        retention.cleanup_inbox(store, consumer="mine", retention_s=retention_s,  # type: ignore[arg-type]
                                batch=batch)
    assert store.calls == []
    assert retention.cleanup_inbox(store, consumer="mine", retention_s=60, batch=2) == 0  # type: ignore[arg-type]
    assert store.calls == [{"consumer": "mine", "retention_s": 60, "limit": 2}]


@pytest.mark.parametrize("value", [1.0, 59.9, 1e13, INF, NAN])
def test_inbox_retention_outside_its_range_is_refused(value: float) -> None:
    refused("inbox_retention_s", inbox_retention_s=value)
    assert config(inbox_retention_s=60.0).inbox_retention_s == 60.0


# -- 4. the retry policy -----------------------------------------------------------------------


@pytest.mark.parametrize(("policy", "option"), [
    ({"max_attempts": NAN}, "max_attempts"), ({"max_attempts": INF}, "max_attempts"),
    ({"max_attempts": 1.5}, "max_attempts"), ({"max_attempts": True}, "max_attempts"),
    ({"backoff_max_s": NAN}, "backoff_max_s"), ({"backoff_initial_s": NAN}, "backoff_initial_s"),
    ({"backoff_initial_s": INF, "backoff_max_s": INF}, "backoff_initial_s"),
    ({"backoff_initial_s": 0}, "backoff_initial_s"), ({"backoff_multiplier": NAN}, "backoff_multiplier"),
    ({"backoff_multiplier": INF}, "backoff_multiplier")])
def test_retry_policy_values_the_consumer_cannot_use_are_refused(policy: dict[str, Any], option: str) -> None:
    # RetryPolicy refuses NaN and inf itself; InboxConfig what it cannot follow (a zero back-off).
    with pytest.raises(ConfigError, match=option) as caught:
        config(retry=RetryPolicy(**policy))
    assert isinstance(caught.value, ValueError)  # `except ValueError` still catches it


@pytest.mark.parametrize("retry", [None, {"max_attempts": 3}, 3])
def test_retry_that_is_no_policy_is_refused(retry: Any) -> None:
    refused("retry must be a consumer_sdk.RetryPolicy", retry=retry)


# -- 5. durations --------------------------------------------------------------------------------


@pytest.mark.parametrize(("option", "value"), [
    ("poll_timeout_s", NAN), ("poll_timeout_s", INF), ("poll_timeout_s", 3e6), ("poll_timeout_s", True),
    ("dead_letter_timeout_s", NAN), ("dead_letter_timeout_s", INF), ("cleanup_interval_s", NAN),
    ("cleanup_interval_s", INF), ("db_backoff_max_s", INF), ("poll_timeout_s", "1")])
def test_duration_outside_its_range_is_refused(option: str, value: Any) -> None:
    error = refused(option, **{option: value})
    assert repr(value) in str(error)


def test_db_backoff_may_not_be_infinite() -> None:
    refused("db_backoff_initial_s", db_backoff_initial_s=INF, db_backoff_max_s=INF)


# -- 6. integers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("option", ["batch_size", "prefetch_records", "cleanup_batch"])
@pytest.mark.parametrize("value", [1.5, NAN, INF, True, None, "5", 2_000_000])
def test_count_that_is_no_int_in_range_is_refused(option: str, value: Any) -> None:
    refused(f"{option} must be an integer from 1 to 1,000,000", **{option: value})


@pytest.mark.parametrize(("option", "value"), [("dead_letter_max_bytes", 1e6), ("dead_letter_max_bytes", None),
                                               ("db_spin_us", "5"), ("db_spin_us", True)])
def test_other_numbers_of_the_wrong_type_are_refused(option: str, value: Any) -> None:
    refused(option, **{option: value})


# -- 7. dsn --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dsn", [None, 5, b"postgresql://x", "   "])
def test_dsn_that_is_no_connection_string_is_refused(dsn: Any) -> None:
    refused("dsn", dsn=dsn)


@pytest.mark.parametrize("dsn", ["postgresql://svc:s3cret@db/app?sslmode=sometimes",
                                 "host=db sslmode=verify password=s3cret"])
def test_a_dsn_libpq_would_refuse_only_as_it_connects_is_refused_at_construction(dsn: str) -> None:
    """An unknown sslmode passed the SDK's check (the relay's alone knew libpq's values) and
    failed at the first connection; InboxConfig and WorkerConfig refuse it now, naming it."""
    from consumer_sdk.jobs import WorkerConfig

    error = refused(r"InboxConfig\.dsn is not a valid PostgreSQL connection string: sslmode", dsn=dsn)
    assert "s3cret" not in str(error)
    with pytest.raises(ConfigError, match=r"WorkerConfig\.dsn .* sslmode"):
        WorkerConfig(dsn=dsn)


def test_empty_dsn_without_a_connection_factory_is_refused() -> None:
    with pytest.raises(ConfigError, match="dsn is empty"):
        InboxConsumer(config(dsn=""), handler, metrics=ConsumerMetrics())
    InboxConsumer(config(dsn=""), handler, metrics=ConsumerMetrics(), connect=lambda: None)  # type: ignore[arg-type,return-value]


# -- 8. topics -----------------------------------------------------------------------------------


@pytest.mark.parametrize("topics", [5, [""], ["x" * 250], ["."], [".."], ["bad topic"], ["orders\n"], [5],
                                    {"orders"}, (t for t in ["orders"]), ["^ord.*"]])
def test_topics_that_are_no_list_of_kafka_topic_names_are_refused(topics: Any) -> None:
    refused("topics", topics=topics)


def test_regex_subscription_is_refused_explicitly() -> None:
    refused("regex subscriptions are not supported", topics=["^ord.*"])
    assert config(topics=("orders", "x" * 245, "a.b_c-1")).topics == ("orders", "x" * 245, "a.b_c-1")
    long_topic = config(topics=["x" * 249], on_invalid_event_id="skip", on_payload_mismatch="skip",
                        retry=RetryPolicy(then="stop"))  # never dead-letters: the template is not used
    assert long_topic.topics == ["x" * 249]


# -- 9. the handler --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["handler", "batch_handler", "statements"])
def test_handler_that_is_not_callable_is_refused(kind: str) -> None:
    args: dict[str, Any] = {kind: 5} if kind != "handler" else {}
    with pytest.raises(ConfigError, match=f"{kind} must be callable"):
        InboxConsumer(config(), 5 if kind == "handler" else None, metrics=ConsumerMetrics(), **args)


# -- 10. booleans and replay ids -------------------------------------------------------------------


@pytest.mark.parametrize("option", ["savepoint_per_message", "check_retention", "check_dead_letter_topics"])
@pytest.mark.parametrize("value", ["no", "false", 0, 1, None])
def test_bool_option_takes_only_a_bool(option: str, value: Any) -> None:
    refused(f"{option} must be True or False", **{option: value})


@pytest.mark.parametrize("replays", ["r-123", [5], [""], None, b"r-1"])
def test_apply_replays_is_a_list_of_replay_ids(replays: Any) -> None:
    refused("apply_replays", apply_replays=replays)
    assert config(apply_replays=["r-123"]).apply_replays == ["r-123"]


# -- 11. kafka_properties ----------------------------------------------------------------------------


def test_kafka_properties_may_not_override_a_field() -> None:
    refused("use InboxConfig.group_id", kafka_properties={"group.id": "other"})
    refused("use InboxConfig.bootstrap_servers", kafka_properties={"bootstrap.servers": "other:9092"})
    # bootstrap.servers alone (bootstrap_servers left empty) still names the cluster
    assert config(bootstrap_servers="", kafka_properties={"bootstrap.servers": "k:9092"})


@pytest.mark.parametrize("props", [{"enable.auto.commit": True}, {"enable.auto.commit": "true"},
                                   {"enable.auto.offset.store": "1"}, {"enable.auto.commit": "yes"}])
def test_kafka_properties_may_not_turn_on_automatic_offsets(props: dict[str, Any]) -> None:
    """The SDK sets both false whatever was given: a service that asked for auto-commit had
    its wish dropped in silence and believed it had it.  False is accepted (it is what the
    SDK sets)."""
    name = next(iter(props))
    refused(f"must not set {name}=", kafka_properties=props)
    assert config(kafka_properties={name: False, "session.timeout.ms": 6000}).consumer_kafka()[name] is False


@pytest.mark.parametrize("props", [None, [("fetch.wait.max.ms", 50)], "fetch.wait.max.ms=50", {5: "x"}])
def test_kafka_properties_that_are_no_mapping_are_refused(props: Any) -> None:
    refused("kafka_properties must be a mapping", kafka_properties=props)


# -- no secret in the messages ---------------------------------------------------------------------


def test_a_refused_config_never_shows_the_dsn_password() -> None:
    error = refused("poll_timeout_s", dsn="postgresql://svc:s3cret-pw@db/app", poll_timeout_s=NAN)
    assert "s3cret-pw" not in str(error)
    error = refused("dead_letter_topic must differ", dsn="postgresql://svc:s3cret-pw@db/app",
                    dead_letter_topic="{topic}")
    assert "s3cret-pw" not in str(error)


@pytest.mark.parametrize("options", [
    {"backoff_max_s": float("nan")}, {"backoff_initial_s": float("inf")}, {"backoff_multiplier": float("nan")},
    {"max_attempts": float("nan")}, {"max_attempts": 1.5}, {"max_attempts": True}, {"max_attempts": 0},
])
def test_a_retry_policy_the_consumer_cannot_follow_is_refused_on_its_own(options: dict[str, Any]) -> None:
    """RetryPolicy itself let NaN and inf through: NaN back-off retried without a pause, and
    max_attempts=nan dead-lettered at the first failure.  ConfigError is a ValueError."""
    from consumer_sdk import RetryPolicy
    from consumer_sdk.errors import ConfigError

    with pytest.raises(ConfigError):
        RetryPolicy(**options)


def test_the_exported_cleanup_inbox_is_the_checked_one() -> None:
    """consumer_sdk.cleanup_inbox(retention_s=0) deleted every dedup row of the consumer."""
    import consumer_sdk
    from consumer_sdk import retention

    assert consumer_sdk.cleanup_inbox is retention.cleanup_inbox


# -- a bootstrap list librdkafka would report only as a cluster that is down ---------------------


@pytest.mark.parametrize("servers", ["127.0.0.1:99999", "not a host,,", "127.0.0.1:abc"])
def test_a_malformed_bootstrap_list_is_refused_at_construction(servers: str) -> None:
    # start() reported it as a retriable KafkaUnavailable ("Broker transport failure") after
    # 10 s, as it reports a cluster that is down (found by an audit of the SDK's inputs).
    refused("^bootstrap_servers ", bootstrap_servers=servers)
    refused("^bootstrap_servers ", bootstrap_servers="", kafka_properties={"bootstrap.servers": servers})
