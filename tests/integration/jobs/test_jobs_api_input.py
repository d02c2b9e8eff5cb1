"""Bad input to the jobs API is refused with InvalidJob (a ValueError) naming the parameter, what
is allowed and the value received, before anything reaches the database: no
FatalError('jobs statement failed: ...'), no UnicodeEncodeError, no row blamed for the caller's
argument, nothing written, nothing that shows only in a pool's error or its logs.

The first part needs no database (WorkerConfig, Limits, Backoff, AdmissionPolicy, WaitFor,
NewJob at construction); the second calls accept, enqueue, run_status, cancel_run and activate
on a real one.  (One file: a tests/unit/jobs module of the same basename would clash with this
one, the test directories having no __init__.py.)"""

from __future__ import annotations

import asyncio
import math
import re
import uuid
from typing import Any

import psycopg
import pytest

from consumer_sdk.errors import ConfigError, DatabaseUnavailable
from consumer_sdk.jobs import (
    AdmissionPolicy,
    Backoff,
    InvalidJob,
    NewJob,
    WaitFor,
    WorkerConfig,
    WorkerPool,
    accept,
    activate,
    aio,
    cancel_run,
    enqueue,
    results,
    resume_job,
    run_status,
)
from consumer_sdk.jobs.fairness import Limits
from consumer_sdk.jobs.model import QUEUE_NAME
from tests.integration.jobs._support import scalar

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
DSN = "postgresql://x"


# == without a database: construction ==========================================================


def refused(make: Any, *words: str) -> InvalidJob:
    with pytest.raises(InvalidJob) as info:
        make()
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    return info.value


# -- 1: queues ---------------------------------------------------------------------------


@pytest.mark.parametrize("queues", ["bulk", "interactive"])
def test_a_str_is_not_a_list_of_queues(queues: str) -> None:
    refused(lambda: WorkerConfig(dsn=DSN, queues=queues), "queues", "list or tuple", repr(queues))
    assert WorkerConfig(dsn=DSN, queues=[queues]).queues == [queues]
    assert WorkerConfig(dsn=DSN, queues=("interactive", "bulk")).queues == ("interactive", "bulk")


# -- 2 and 11: events topic ---------------------------------------------------------------


@pytest.mark.parametrize("topic", ["bad topic", 5, "", ".", "..", "orders\n", "x" * 250])
def test_the_events_topic_is_a_kafka_topic_name(topic: Any) -> None:
    refused(lambda: WorkerConfig(dsn=DSN, events_topic=topic), "events_topic", "1-249", repr(topic)[:20])
    assert WorkerConfig(dsn=DSN, events_topic="jobs.events_v1-x").events_topic == "jobs.events_v1-x"
    assert WorkerConfig(dsn=DSN, events_topic=None).events_topic is None


# -- 3: lease and heartbeat bounds --------------------------------------------------------


@pytest.mark.parametrize("lease", [0.001, 0.5, math.inf, 1e12, math.nan, 86_401])
def test_the_lease_is_one_second_to_a_day(lease: float) -> None:
    refused(lambda: WorkerConfig(dsn=DSN, lease_duration_s=lease), "lease_duration_s", "1 to 86400")
    config = WorkerConfig(dsn=DSN, lease_duration_s=1, heartbeat_interval_s=0.1, poll_interval_s=0.05,
                          drain_timeout_s=0)  # the bounds themselves are accepted
    assert config.idle_in_transaction_ms == 1000
    assert WorkerConfig(dsn=DSN, lease_duration_s=86_400).idle_in_transaction_ms == 86_400_000


@pytest.mark.parametrize("heartbeat", [1e-9, 0.05, math.nan, math.inf])
def test_the_heartbeat_is_at_least_a_tenth_of_a_second(heartbeat: float) -> None:
    refused(lambda: WorkerConfig(dsn=DSN, lease_duration_s=10, heartbeat_interval_s=heartbeat),
            "heartbeat_interval_s", "0.1 to 5")


def test_the_deprecated_aliases_are_checked_too() -> None:
    with pytest.warns(DeprecationWarning):
        refused(lambda: WorkerConfig(dsn=DSN, lease_s=0.001), "lease_duration_s")


@pytest.mark.parametrize("option", ["poll_interval_s", "reconcile_interval_s", "drain_timeout_s"])
@pytest.mark.parametrize("value", [math.inf, math.nan, 1e12])
def test_other_durations_are_finite_and_at_most_a_day(option: str, value: float) -> None:
    refused(lambda: WorkerConfig(dsn=DSN, **{option: value}), option, "86400")


# -- 4: regular expressions do not accept a trailing newline --------------------------------


def test_a_queue_name_with_a_trailing_newline_is_refused() -> None:
    assert QUEUE_NAME.match("bulk\n") is None
    refused(lambda: WorkerConfig(dsn=DSN, queues=["bulk\n"]), "queues", "'bulk\\n'")
    refused(lambda: NewJob(owner_id="o", queue="bulk\n", kind="k", payload={}), "queue", "'bulk\\n'")


def test_a_traceparent_with_a_trailing_newline_is_dropped() -> None:
    job = NewJob(owner_id="o", queue="bulk", kind="k", payload={}, traceparent=TRACEPARENT + "\n",
                 tracestate="a=b")
    assert (job.traceparent, job.tracestate) == (None, None)
    kept = NewJob(owner_id="o", queue="bulk", kind="k", payload={}, traceparent=TRACEPARENT, tracestate="a=b")
    assert (kept.traceparent, kept.tracestate) == (TRACEPARENT, "a=b")


# -- 5: limits ------------------------------------------------------------------------------


@pytest.mark.parametrize(("options", "words"), [
    ({"queue_limits": {"buk": 0}}, ("queue_limits", "'buk'")),
    ({"queues": ["interactive"], "queue_limits": {"bulk": 1}}, ("queue_limits", "'bulk'")),
    ({"owner_limits": {5: 1}}, ("owner_limits", "5")),
    ({"owner_limits": {"a": 0}}, ("owner_limits['a']", "from 1", "0")),
    ({"owner_limits": {"a": 1.5}}, ("owner_limits['a']", "1.5")),
    ({"queue_limits": {"bulk": math.nan}}, ("queue_limits['bulk']", "nan")),
    ({"queue_limits": {"bulk": 1.5}}, ("queue_limits['bulk']", "from 0", "1.5")),
    ({"queue_limits": {"bulk": -1}}, ("queue_limits['bulk']", "-1")),
    ({"owner_limit": True}, ("owner_limit", "True")),
    ({"owner_limit": math.nan}, ("owner_limit", "nan")),
    ({"owner_limit": 1.5}, ("owner_limit", "1.5")),
    ({"owner_limit": 2**31}, ("owner_limit", "2,147,483,647")),
])
def test_limits_are_ints_of_served_queues_and_str_owners(options: dict[str, Any], words: tuple[str, ...]) -> None:
    refused(lambda: WorkerConfig(dsn=DSN, **options), *words)


def test_limits_raise_the_packages_error() -> None:
    refused(lambda: Limits(max_concurrency=0), "max_concurrency", "0")
    refused(lambda: Limits(max_concurrency=2, owner_limits={"a": 0}), "owner_limits")
    assert Limits(max_concurrency=2, queue_limits={"bulk": 0}, owner_limits={"a": 1}).for_queue("bulk") == 0


# -- 6: every other option ---------------------------------------------------------------------


@pytest.mark.parametrize(("options", "words"), [
    ({"max_concurrency": 1.5}, ("max_concurrency", "1.5")),
    ({"max_concurrency": math.nan}, ("max_concurrency", "nan")),
    ({"max_concurrency": math.inf}, ("max_concurrency", "inf")),
    ({"max_concurrency": True}, ("max_concurrency", "True")),
    ({"worker_id": 5}, ("worker_id", "5")),
    ({"worker_id": ""}, ("worker_id", "''")),
    ({"worker_id": "w\x00"}, ("worker_id", "NUL")),
    ({"application_name": 5}, ("application_name", "5")),
    ({"application_name": "x" * 64}, ("application_name", "63")),
    ({"backoff": None}, ("backoff", "None")),
    ({"listen": "no"}, ("listen", "'no'")),
    ({"max_owners_per_round": 0}, ("max_owners_per_round", "0")),
    ({"db_spin_us": "5"}, ("db_spin_us", "'5'")),
])
def test_every_option_is_checked_at_construction(options: dict[str, Any], words: tuple[str, ...]) -> None:
    refused(lambda: WorkerConfig(dsn=DSN, **options), *words)


@pytest.mark.parametrize(("options", "words"), [
    ({"initial_s": 1e300, "max_s": math.inf}, ("initial_s", "1e+300")),
    ({"initial_s": 1, "max_s": math.inf}, ("max_s", "inf")),
    ({"initial_s": math.nan}, ("initial_s", "nan")),
    ({"initial_s": 5, "max_s": 1}, ("initial_s <= max_s",)),
    ({"multiplier": math.inf}, ("multiplier", "inf")),
    ({"multiplier": 0.5}, ("multiplier", "0.5")),
    ({"jitter": math.nan}, ("jitter", "nan")),
    ({"jitter": 2}, ("jitter", "2")),
])
def test_backoff_is_finite_and_raises_the_packages_error(options: dict[str, Any], words: tuple[str, ...]) -> None:
    error = refused(lambda: Backoff(**options), *words)
    assert isinstance(error, ValueError)  # still a ValueError, as before


@pytest.mark.parametrize(("options", "words"), [
    ({"capacity_per_s": math.inf, "horizon_s": 1}, ("capacity_per_s", "inf")),
    ({"capacity_per_s": 0, "horizon_s": 1}, ("capacity_per_s", "0")),
    ({"capacity_per_s": 1, "horizon_s": math.nan}, ("horizon_s", "nan")),
    ({"capacity_per_s": 1, "horizon_s": math.inf}, ("horizon_s", "inf")),
    ({"capacity_per_s": 1e6, "horizon_s": 86_400}, ("capacity_per_s * horizon_s",)),
])
def test_admission_policy_is_finite_and_raises_the_packages_error(options: dict[str, Any],
                                                                   words: tuple[str, ...]) -> None:
    refused(lambda: AdmissionPolicy(**options), *words)


# -- 7 and 8: NewJob follows accept's rules ------------------------------------------------------


def new_job(**overrides: Any) -> NewJob:
    options: dict[str, Any] = {"owner_id": "o", "queue": "bulk", "kind": "k", "payload": {}}
    options.update(overrides)
    return NewJob(**options)


@pytest.mark.parametrize(("options", "words"), [
    ({"delay_s": -3600}, ("delay_s", "from 0", "-3600")),
    ({"delay_s": math.nan}, ("delay_s", "nan")),
    ({"delay_s": math.inf}, ("delay_s", "inf")),
    ({"delay_s": 1e300}, ("delay_s", "1e+300")),
    ({"delay_s": "5"}, ("delay_s", "'5'")),
    ({"max_attempts": 1.5}, ("max_attempts", "1.5")),
    ({"max_attempts": "3"}, ("max_attempts", "'3'")),
    ({"max_attempts": True}, ("max_attempts", "True")),
    ({"max_attempts": 0}, ("max_attempts", "from 1", "0")),
    ({"max_attempts": 2**31}, ("max_attempts", "2,147,483,647", "2147483648")),
    ({"owner_id": ""}, ("owner_id", "200", "''")),
    ({"owner_id": "o" * 10_000}, ("owner_id", "200")),
    ({"owner_id": 5}, ("owner_id", "5")),
    ({"kind": ""}, ("kind", "''")),
    ({"traceparent": 5}, ("traceparent", "5")),
    ({"owner_id": "a\x00b"}, ("owner_id", "NUL")),
    ({"kind": "\ud800"}, ("kind", "surrogate")),
])
def test_new_jobs_are_checked_like_accepted_runs(options: dict[str, Any], words: tuple[str, ...]) -> None:
    refused(lambda: new_job(**options), *words)


def test_a_garbage_traceparent_is_dropped_as_accept_drops_it() -> None:
    assert new_job(traceparent="garbage", tracestate="a=b").traceparent is None
    assert new_job(delay_s=100 * 365 * 86400, max_attempts=2**31 - 1).max_attempts == 2**31 - 1


# -- 9 and 12: WaitFor -----------------------------------------------------------------------


@pytest.mark.parametrize(("args", "words"), [
    (("k", "c", math.inf), ("timeout_s", "inf")),
    (("k", "c", math.nan), ("timeout_s", "nan")),
    (("k", "c", -1), ("timeout_s", "-1")),
    (("", "c"), ("key", "''")),
    ((5, "c"), ("key", "5")),
    (("k" * 501, "c"), ("key", "500")),
    (("k\x00", "c"), ("key", "NUL")),
    (("k", 5), ("cause", "5")),
    ((None, "c"), ("key", "timeout_s")),
])
def test_wait_conditions_are_checked_at_construction(args: tuple[Any, ...], words: tuple[str, ...]) -> None:
    refused(lambda: WaitFor(*args), *words)
    assert WaitFor("k", "c", 0).timeout_s == 0
    assert WaitFor(None, "", 3.5).timeout_s == 3.5


def test_messages_name_the_range() -> None:
    error = refused(lambda: WorkerConfig(dsn=DSN, lease_duration_s=0.001))
    assert re.search(r"lease_duration_s must be .* from 1 to 86400, got 0\.001", str(error))


# == with a database ============================================================================



def counts(dsn: str) -> tuple[int, int, int]:
    return (scalar(dsn, "SELECT count(*) FROM runs"), scalar(dsn, "SELECT count(*) FROM jobs"),
            scalar(dsn, "SELECT count(*) FROM job_activations"))


def good_accept(**overrides: Any) -> dict[str, Any]:
    options: dict[str, Any] = {"owner_id": "u1", "request_key": "k1", "kind": "report", "body": {"a": 1}}
    options.update(overrides)
    return options


# -- 10: run ids -----------------------------------------------------------------------------


@pytest.mark.parametrize("run_id", ["not-a-uuid", None, 5, "", "6802ca8b-db27-41d2-9955-ed1884f2bd28\n",
                                    "urn:uuid:6802ca8b-db27-41d2-9955-ed1884f2bd28",
                                    "{6802ca8b-db27-41d2-9955-ed1884f2bd28"])
def test_run_status_refuses_a_malformed_run_id(conn, run_id: Any) -> None:
    with pytest.raises(InvalidJob, match="run_id must be a UUID"):
        run_status(conn, run_id)
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    # a well-formed id of no run is still None; the UUID and its text in any case still work
    assert run_status(conn, str(uuid.uuid4())) is None
    assert run_status(conn, uuid.uuid4(), owner_id="u1") is None
    run = accept(conn, **good_accept())
    assert run_status(conn, run.run_id).run_id == run.run_id  # type: ignore[union-attr]
    assert run_status(conn, str(run.run_id).upper(), owner_id="u1") is not None
    # As an event_id is read (consumer_sdk.outbox): in braces and without hyphens too.
    assert run_status(conn, "{" + str(run.run_id) + "}").run_id == run.run_id  # type: ignore[union-attr]
    assert run_status(conn, run.run_id.hex).run_id == run.run_id  # type: ignore[union-attr]


@pytest.mark.parametrize("owner_id", [5, "", "u\x00"])
def test_run_status_refuses_a_malformed_owner_id(conn, owner_id: Any) -> None:
    with pytest.raises(InvalidJob, match="owner_id"):
        run_status(conn, uuid.uuid4(), owner_id=owner_id)


@pytest.mark.parametrize("run_id", ["not-a-uuid", None])
def test_cancel_run_refuses_a_malformed_run_id(conn, run_id: Any) -> None:
    with pytest.raises(InvalidJob, match="run_id must be a UUID"):
        cancel_run(conn, owner_id="u1", run_id=run_id)


def test_the_asyncio_run_status_refuses_a_malformed_run_id(jobs_db) -> None:
    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(jobs_db, autocommit=True) as conn:
            with pytest.raises(InvalidJob, match="run_id must be a UUID"):
                await aio.run_status(conn, "not-a-uuid")

    asyncio.run(main())


# -- 11: accept's events topic ----------------------------------------------------------------


@pytest.mark.parametrize("topic", ["orders\n", "bad topic", 5, ".."])
def test_accept_refuses_a_bad_events_topic_before_writing(conn, jobs_db, topic: Any) -> None:
    with pytest.raises(InvalidJob, match="events_topic must be None or a Kafka topic name") as info:
        accept(conn, **good_accept(), events_topic=topic)
    assert "outbox_topic_valid" not in str(info.value)
    assert counts(jobs_db) == (0, 0, 0)


def test_cancel_run_refuses_a_bad_events_topic(conn) -> None:
    run = accept(conn, **good_accept())
    with pytest.raises(InvalidJob, match="events_topic"):
        cancel_run(conn, owner_id="u1", run_id=run.run_id, events_topic="orders\n")
    assert run_status(conn, run.run_id).status == "queued"  # type: ignore[union-attr]


# -- 4 and 7: accept's traceparent and max_attempts ------------------------------------------------


def test_accept_and_enqueue_drop_a_traceparent_with_a_trailing_newline(conn, jobs_db) -> None:
    accept(conn, **good_accept(), traceparent=TRACEPARENT + "\n", tracestate="a=b")
    assert scalar(jobs_db, "SELECT traceparent FROM runs") is None
    enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="k", payload={},
                          traceparent=TRACEPARENT + "\n", tracestate="a=b")])
    assert scalar(jobs_db, "SELECT count(*) FROM jobs WHERE traceparent IS NOT NULL") == 0


@pytest.mark.parametrize("max_attempts", [1.5, "3", True, 0, 2**31])
def test_accept_refuses_a_max_attempts_that_is_not_an_int_in_range(conn, jobs_db, max_attempts: Any) -> None:
    with pytest.raises(InvalidJob, match="max_attempts must be an integer from 1 to 2,147,483,647"):
        accept(conn, **good_accept(), max_attempts=max_attempts)
    assert counts(jobs_db) == (0, 0, 0)


def test_accept_refuses_a_traceparent_that_is_not_a_str(conn, jobs_db) -> None:
    with pytest.raises(InvalidJob, match="traceparent"):
        accept(conn, **good_accept(), traceparent=5)


# -- 8: NUL characters and lone surrogates --------------------------------------------------------


@pytest.mark.parametrize(("options", "word"), [
    ({"owner_id": "u\x00"}, "owner_id"),
    ({"request_key": "k\x00"}, "request_key"),
    ({"kind": "r\x00"}, "kind"),
    ({"body": {"a": "x\x00y"}}, "body"),
    ({"body": {"a\x00": 1}}, "body"),
    ({"owner_id": "u\udc80"}, "owner_id"),
    ({"body": {"a": "\ud800"}}, "body"),
])
def test_accept_refuses_text_postgresql_cannot_store(conn, jobs_db, options: dict[str, Any], word: str) -> None:
    with pytest.raises(InvalidJob, match=word):
        accept(conn, **good_accept(**options))
    assert counts(jobs_db) == (0, 0, 0)
    # a backslash followed by u0000 is text, not a NUL: it is stored
    run = accept(conn, **good_accept(body={"a": "\\u0000"}))
    assert run_status(conn, run.run_id).goal == {"a": "\\u0000"}  # type: ignore[union-attr]


@pytest.mark.parametrize(("key", "payload"), [("k\x00", None), ("k", {"a": "\x00"}), ("k\ud800", None)])
def test_activate_refuses_text_postgresql_cannot_store(conn, jobs_db, key: str, payload: Any) -> None:
    with pytest.raises(InvalidJob):
        activate(conn, key, payload)
    assert counts(jobs_db) == (0, 0, 0)


def test_activate_refuses_a_bad_events_topic(conn, jobs_db) -> None:
    with pytest.raises(InvalidJob, match="events_topic"):
        activate(conn, "k", events_topic="bad topic")
    assert counts(jobs_db) == (0, 0, 0)


# -- 7: enqueue ----------------------------------------------------------------------------------


@pytest.mark.parametrize("options", [
    {"delay_s": -3600}, {"delay_s": math.nan}, {"delay_s": math.inf}, {"delay_s": 1e300},
    {"max_attempts": 1.5}, {"max_attempts": "3"}, {"max_attempts": True}, {"max_attempts": 0},
    {"max_attempts": 2**31}, {"owner_id": ""}, {"owner_id": "o" * 10_000}, {"kind": ""},
    {"owner_id": "o\x00"}, {"traceparent": 5},
])
def test_enqueue_refuses_bad_jobs_before_writing(conn, jobs_db, options: dict[str, Any]) -> None:
    fields: dict[str, Any] = {"owner_id": "o", "queue": "bulk", "kind": "k", "payload": {}}
    fields.update(options)
    (name,) = options
    with pytest.raises(InvalidJob, match=rf"^{name} must "):
        enqueue(conn, [NewJob(**fields)])
    assert counts(jobs_db) == (0, 0, 0)


def test_enqueue_refuses_a_payload_postgresql_cannot_store(conn, jobs_db) -> None:
    with pytest.raises(InvalidJob, match="job payload"):
        enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="k", payload={"a": "\x00"})])
    assert counts(jobs_db) == (0, 0, 0)


def test_enqueue_stores_a_garbage_traceparent_as_none(conn, jobs_db) -> None:
    (job_id,) = enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="k", payload={},
                                      traceparent="garbage", tracestate="a=b")])
    assert scalar(jobs_db, "SELECT traceparent IS NULL AND tracestate IS NULL FROM jobs WHERE id = %s",
                  (job_id,)) is True


# -- 12: found by an audit of the SDK's inputs (2026-12-06); each failed on the code before -----


def test_enqueue_writes_every_job_of_a_generator(conn, jobs_db) -> None:
    # all() read the generator to check it and the insert found it empty: [] and no row.
    ids = enqueue(conn, (NewJob(owner_id="o", queue="bulk", kind="k", payload=i) for i in range(3)))
    assert len(ids) == 3 and counts(jobs_db) == (0, 3, 0)
    assert scalar(jobs_db, "SELECT array_agg(payload::text ORDER BY id)::text FROM jobs") == '{0,1,2}'
    with pytest.raises(InvalidJob, match="iterable of NewJob"):
        enqueue(conn, (x for x in ["not a job"]))
    with pytest.raises(InvalidJob, match="iterable of NewJob"):
        enqueue(conn, 5)  # type: ignore[arg-type]


@pytest.mark.parametrize("payload", [{1: "int", "1": "str"}, [{"a": {True: 1, "true": 2}}]])
def test_job_payloads_whose_keys_collide_as_strings_are_refused(conn, jobs_db, payload: Any) -> None:
    # jsonb keeps one of them: write_event refused it, enqueue, activate and accept stored the last.
    with pytest.raises(InvalidJob, match="collide"):
        enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="k", payload=payload)])
    with pytest.raises(InvalidJob, match="collide"):
        activate(conn, "key", payload)
    with pytest.raises(InvalidJob, match="collide"):
        accept(conn, **good_accept(body=payload))
    assert counts(jobs_db) == (0, 0, 0)


def test_a_job_payload_nested_too_deeply_is_refused_not_a_recursion_error(conn, jobs_db) -> None:
    deep: list[Any] = []
    node = deep
    for _ in range(50_000):
        node.append([])
        node = node[0]
    with pytest.raises(InvalidJob, match="nested too deeply"):
        enqueue(conn, [NewJob(owner_id="o", queue="bulk", kind="k", payload=deep)])
    with pytest.raises(InvalidJob, match="nested too deeply"):
        accept(conn, **good_accept(body=deep))
    assert counts(jobs_db) == (0, 0, 0)


def test_accept_takes_a_body_with_keys_of_several_types(conn, jobs_db) -> None:
    # The request key's digest sorted the keys: 1 and "x" do not compare, and a body json.dumps
    # writes as {"1": "a", "x": "b"} was refused as "not JSON-encodable".
    first = accept(conn, **good_accept(body={1: "a", "x": "b"}))
    again = accept(conn, **good_accept(body={"x": "b", 1: "a"}))  # the same request, retried
    assert first.created and not again.created and again.run_id == first.run_id
    # Every other body keeps the digest it had: stored runs still match their retries.
    assert accept(conn, **good_accept(request_key="k2", body={"b": [1, 2.5], "a": None})).created


@pytest.mark.parametrize(("option", "value"), [("metrics", object()), ("on_accept", 1)])
def test_accept_refuses_a_bad_metrics_or_hook_before_committing(conn, jobs_db, option: str, value: Any) -> None:
    # A bad metrics raised AttributeError after the run was committed: the caller saw a
    # failure for a run that existed.
    with pytest.raises(InvalidJob, match=f"^{option} must be None or a"):
        accept(conn, **good_accept(), **{option: value})
    assert counts(jobs_db) == (0, 0, 0)

    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(jobs_db, autocommit=True) as aconn:
            with pytest.raises(InvalidJob, match=f"^{option} must be None or a"):
                await aio.accept(aconn, **good_accept(), **{option: value})

    asyncio.run(main())
    assert counts(jobs_db) == (0, 0, 0)


def test_accept_on_a_closed_connection_says_so(jobs_db) -> None:
    # It said "call it on a connection that is not inside one" (TransactionActive).
    closed = psycopg.connect(jobs_db, autocommit=True)
    closed.close()
    with pytest.raises(DatabaseUnavailable, match="closed"):
        accept(closed, **good_accept())

    async def main() -> None:
        aclosed = await psycopg.AsyncConnection.connect(jobs_db, autocommit=True)
        await aclosed.close()
        with pytest.raises(DatabaseUnavailable, match="closed"):
            await aio.accept(aclosed, **good_accept())

    asyncio.run(main())


@pytest.mark.parametrize(("config", "handlers", "words"), [
    (WorkerConfig(dsn=DSN), {"kx": 1}, ("handler of kind 'kx' must be callable",)),
    (WorkerConfig(dsn=DSN), None, ("handlers must be a mapping",)),
    (WorkerConfig(dsn=DSN), [lambda job: None], ("handlers must be a mapping",)),
    (WorkerConfig(dsn=DSN), {5: lambda job: None}, ("job kinds",)),
    (DSN, {"k": lambda job: None}, ("config must be a WorkerConfig",)),
])
def test_a_worker_pool_refuses_what_it_could_not_run(config: Any, handlers: Any, words: tuple[str, ...]) -> None:
    # {"kx": 1} failed every kx job's attempts with a TypeError; handlers=None crashed the
    # executor and left the job running; a str config raised AttributeError.
    refused(lambda: WorkerPool(config, handlers), *words)


@pytest.mark.parametrize(("dsn", "words"), [
    (None, ("WorkerConfig.dsn must be a PostgreSQL connection string (str), not NoneType",)),
    (b"host=db", ("not bytes",)),
    ("   ", ("WorkerConfig.dsn is empty",)),
])
def test_a_worker_config_names_a_dsn_that_is_not_one(dsn: Any, words: tuple[str, ...]) -> None:
    # None raised "argument of type 'NoneType' is not iterable"; a blank one was accepted.
    with pytest.raises(ConfigError) as info:
        WorkerConfig(dsn=dsn)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("job_id", ["x", "1", 0, True, 2**63, 1.5, None])
def test_a_job_id_that_is_no_job_id_is_refused_before_the_database(conn, job_id: Any) -> None:
    # It reached PostgreSQL's bigint input: FatalError('jobs statement failed: invalid input
    # syntax for type bigint'), or "operator does not exist" for a UUID.
    with pytest.raises(InvalidJob, match="^job_id must be"):
        results(conn, job_id)
    with pytest.raises(InvalidJob, match="^job_id must be"):
        resume_job(conn, job_id)
    assert results(conn, 1) == {} and resume_job(conn, 1) is False  # no such job: nothing, no error


def test_each_api_function_refuses_the_other_kind_of_connection(conn, jobs_db) -> None:
    # A sync function given an AsyncConnection raised TypeError or AttributeError (with "coroutine
    # never awaited" warnings); jobs.aio given a sync one ran its statement, then failed to await
    # the cursor (an audit of the SDK's inputs).
    run = accept(conn, **good_accept())

    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(jobs_db, autocommit=True) as aconn:
            for call in (lambda: accept(aconn, **good_accept(request_key="k2")),
                         lambda: run_status(aconn, run.run_id),
                         lambda: cancel_run(aconn, owner_id="u1", run_id=run.run_id),
                         lambda: activate(aconn, "key"), lambda: resume_job(aconn, 1),
                         lambda: results(aconn, 1),
                         lambda: enqueue(aconn, [NewJob(owner_id="o", queue="bulk", kind="k", payload={})])):
                refused(call, "conn must be a psycopg.Connection, not AsyncConnection", "consumer_sdk.jobs.aio")
        for coroutine in (aio.accept(conn, **good_accept(request_key="k3")),  # type: ignore[arg-type]
                          aio.run_status(conn, run.run_id),  # type: ignore[arg-type]
                          aio.activate(conn, "key")):  # type: ignore[arg-type]
            with pytest.raises(InvalidJob, match="conn must be a psycopg.AsyncConnection, not Connection"):
                await coroutine
        with pytest.raises(InvalidJob, match="conn must be a psycopg.AsyncConnection, not NoneType$"):
            await aio.accept(None, **good_accept())  # type: ignore[arg-type]

    asyncio.run(main())
    assert counts(jobs_db) == (1, 1, 0)  # the first run only: nothing else was written
