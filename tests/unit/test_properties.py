"""Property-based tests (hypothesis): hostile input gets clean errors, never a crash,
never a leaked secret and never SQL built from it (issue 9).

Covered: the configuration parser (options, librdkafka pass-through, ``--kafka-property``,
``_FILE`` secrets), DSN masking, the row-to-message encoding (Kafka headers), the
named-query loader, and the store's statements.  The "column mapping" of issue 9 does
not exist yet, so it has no property here.
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from relay import queries
from relay.config import (
    KAFKA_ENV_PREFIX,
    OPTIONS,
    build_settings,
    env_values,
    is_secret,
    kafka_env_properties,
    mask_dsn,
    parse_kafka_property,
    producer_config,
)
from relay.errors import ConfigError
from relay.model import Cursor, Lease, OutboxRow, RowId, ShardId, Token
from relay.publisher import BadRow, Publisher, encode_headers
from relay.store import Store
from relay.wire import Prepared

PROPERTIES = settings(max_examples=200, deadline=None,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
FEW = settings(PROPERTIES, max_examples=40)  # examples that build a librdkafka client

GOOD_DSN = "postgresql://relay@db:5432/app"

# --- strategies ----------------------------------------------------------------------

NASTY = [
    "", " ", "0", "-1", "+1", "00", "1e309", "-1e309", "nan", "inf", "-inf", "1_000", "0x10",
    "\u0663", "\uff11", "9" * 5000, "1.5", "0.0001", "65535", "65536", "true", "None", "null",
    "'; DROP TABLE outbox; --", "%(now)s", "%s", "$1", "{}", "\n", "\t1", "1 ", "\x00", "\udcff",
    "auto", "json", "console", "DEBUG", "debug ", "localhost", "::1", "0.0.0.0", "[::]",
]
MARK = "\u00a7"  # "§": in every generated secret, nowhere else; a leaked piece shows it
MARK_ENCODED = quote(MARK)  # "%C2%A7", as it appears in a percent-encoded URI
any_char = st.characters(exclude_characters=MARK)
nasty_text = st.one_of(
    st.sampled_from(NASTY),
    st.text(alphabet=any_char, max_size=30),
    st.from_regex(r"\A[-+]?\d{1,6}(\.\d{0,3})?([eE][-+]?\d{1,3})?\Z"),
)
option_values = st.dictionaries(st.sampled_from([o.name for o in OPTIONS if o.name != "dsn"]),
                                nasty_text, max_size=8)

# Password characters: the ones that break DSN syntax, and anything else UTF-8 holds.
pw_chars = st.one_of(st.sampled_from(list("'\" @:/%?&=\\#;,+[]")),
                     st.characters(codec="utf-8", exclude_characters="\x00" + MARK))
passwords = st.text(alphabet=pw_chars, min_size=1, max_size=20)
marked_passwords = st.lists(st.text(alphabet=pw_chars, max_size=5), min_size=2, max_size=5).map(
    MARK.join)
users = st.sampled_from(["", "relay", "u_1"])
hosts = st.sampled_from(["db", "127.0.0.1", "db.example.com", "[::1]", ""])
ports = st.sampled_from(["", ":5432", ":notaport", ":0", ":5432,5433"])
queries_ = st.sampled_from(["", "?sslmode=require", "?sslmode=sometimes", "?application_name=a@b",
                            "?bogus=1", "?connect_timeout=5&sslmode=disable"])


def kv_quote(value: str) -> str:
    """A libpq key=value literal: quoted, with backslash and quote escaped."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


@st.composite
def dsns(draw: st.DrawFn, password: st.SearchStrategy[str]) -> tuple[str, str, str]:
    """(dsn, the same DSN with the password "X", the password) in one of six forms.

    An unquoted key=value password has no white space and does not start with a
    quote: libpq would read anything else as more options, and so would anyone.
    """
    form = draw(st.sampled_from(["uri-raw", "uri-encoded", "query", "query-key", "kv-quoted", "kv-raw"]))
    if form == "kv-raw":
        password = password.filter(lambda p: p[:1] != "'" and not any(c.isspace() for c in p))
    pw = draw(password)
    user, host, port, query = draw(users), draw(hosts), draw(ports), draw(queries_)
    if form == "uri-raw":
        make = lambda p: f"postgresql://{user}:{p}@{host}{port}/app{query}"  # noqa: E731
    elif form == "uri-encoded":
        make = lambda p: f"postgresql://{user}:{quote(p, safe='')}@{host}{port}/app{query}"  # noqa: E731
    elif form == "query":
        sep = "&" if query else "?"
        make = lambda p: f"postgresql://{host}{port}/app{query}{sep}password={quote(p, safe='')}"  # noqa: E731
    elif form == "query-key":  # libpq decodes a key's %-escapes too: "pass%77ord" is "password"
        sep = "&" if query else "?"
        key = draw(st.sampled_from(["pass%77ord", "%70assword", "%70%61%73%73%77%6F%72%64", "sslpass%77ord"]))
        make = lambda p: f"postgresql://{host}{port}/app{query}{sep}{key}={quote(p, safe='')}"  # noqa: E731
    elif form == "kv-quoted":
        make = lambda p: f"host={host or 'db'} user={user or 'u'} password={kv_quote(p)} dbname=app"  # noqa: E731
    else:
        make = lambda p: f"host={host or 'db'} password={p} port={port[1:] or '5432'}"  # noqa: E731
    return make(pw), make("X"), pw


# --- the configuration parser --------------------------------------------------------


def check_settings(s: Any) -> None:
    assert s.batch_size > 0 and s.pipeline_depth > 0 and s.max_attempts > 0
    assert 0 <= s.metrics_port <= 65535
    assert 0 < s.heartbeat_interval_s < s.lease_duration_s < float("inf")
    assert s.poll_interval_s > 0 and s.drain_timeout_s > 0 and s.backoff_max_s > 0
    assert s.log_format in ("auto", "json", "console")
    assert s.log_level in ("debug", "info", "warning", "error")
    assert s.owner
    repr(s)


@PROPERTIES
@given(values=option_values, dsn=st.one_of(st.just(GOOD_DSN), nasty_text),
       require_broker=st.booleans(),
       kafka=st.dictionaries(st.text(max_size=20), st.text(max_size=20), max_size=3))
@example(values={"metrics_port": "9" * 5000}, dsn=GOOD_DSN, require_broker=False, kafka={})
@example(values={}, dsn="host=\udcff", require_broker=False, kafka={})
@example(values={}, dsn="postgresql://u:p\x00w@h/d", require_broker=False, kafka={})
@example(values={"lease_duration_s": "1e-300"}, dsn=GOOD_DSN, require_broker=False, kafka={})
def test_build_settings_gives_settings_or_one_config_error_line(
        values: dict[str, str], dsn: str, require_broker: bool, kafka: dict[str, str]) -> None:
    try:
        s = build_settings({**values, "dsn": dsn}, kafka_properties=kafka,
                           require_broker=require_broker)
    except ConfigError as exc:
        message = str(exc)
        assert message and "\n" not in message, message
        return
    check_settings(s)


@PROPERTIES
@given(dsn=dsns(marked_passwords), values=option_values)
def test_config_errors_and_repr_never_show_a_dsn_password(
        dsn: tuple[str, str, str], values: dict[str, str]) -> None:
    text, _, pw = dsn
    try:
        s = build_settings({**values, "dsn": text}, require_broker=False)
    except ConfigError as exc:
        shown = str(exc)
    else:
        shown = repr(s) + str(s)
    assert MARK not in shown and MARK_ENCODED not in shown, (shown, pw)


@PROPERTIES
@given(dsn=dsns(passwords))
@example(dsn=("postgresql://u:hun@ter2@db/x", "postgresql://u:X@db/x", "hun@ter2"))
@example(dsn=("postgresql://:s3cret@db/x", "postgresql://:X@db/x", "s3cret"))
@example(dsn=("host=db password='s3 cret' dbname=x", "host=db password='X' dbname=x", "s3 cret"))
def test_mask_dsn_hides_exactly_the_password(dsn: tuple[str, str, str]) -> None:
    """Masking a DSN gives the same text whatever its password: nothing of it is left."""
    text, placeholder, _ = dsn
    assert mask_dsn(text) == mask_dsn(placeholder)
    assert "***" in mask_dsn(text)


@PROPERTIES
@given(dsn=dsns(marked_passwords))
def test_mask_dsn_leaves_no_piece_of_a_password(dsn: tuple[str, str, str]) -> None:
    masked = mask_dsn(dsn[0])
    assert MARK not in masked and MARK_ENCODED not in masked


# librdkafka property names: real ones, near misses and hostile ones.
prop_names = st.one_of(
    st.sampled_from(["security.protocol", "sasl.password", "ssl.key.password", "linger.ms",
                     "acks", "enable.idempotence", "bootstrap.servers", "error_cb", "on_delivery",
                     "stats_cb", "logger", "default.topic.config", "sasl.oauthbearer.config",
                     "ssl.key.pem", "ssl.keystore.password", "message.max.bytes"]),
    st.from_regex(r"\A[a-z0-9_]{1,8}(\.[a-z0-9_]{1,8}){0,3}\Z"),
    st.text(max_size=20),
)


@PROPERTIES
@given(text=st.one_of(st.text(max_size=40),
                      st.tuples(prop_names, st.text(max_size=20)).map("=".join)))
@example(text="Bad Name=1")
@example(text=" linger.ms =5")
def test_kafka_property_flag_is_a_pair_or_a_config_error(text: str) -> None:
    try:
        name, value = parse_kafka_property(text)
    except ConfigError as exc:
        assert "\n" not in str(exc)
        return
    given_name, _, given_value = text.partition("=")
    assert (name, value) == (given_name.strip(), given_value)
    assert re.fullmatch(r"[a-z0-9_]+(\.[a-z0-9_]+)*", name)


@PROPERTIES
@given(name=prop_names, secret=marked_passwords)
@example(name="Bad Name", secret=f"hunter{MARK}2")
@example(name="sasl.password", secret=f"{MARK}")
def test_kafka_property_flag_errors_never_show_the_value(name: str, secret: str) -> None:
    assume(MARK not in name and "=" not in name)
    for text in (f"{name}={secret}", secret.split("=", 1)[0]):
        try:
            parse_kafka_property(text)
        except ConfigError as exc:
            assert MARK not in str(exc), str(exc)


env_suffixes = st.one_of(
    st.sampled_from(["SASL_PASSWORD", "SSL_KEY_PASSWORD", "SECURITY_PROTOCOL", "LINGER_MS",
                     "ACKS", "", "_", "FILE", "_FILE", "SASL_PASSWORD_FILE", "A__B", "ÄÖ"]),
    st.text(alphabet=string.ascii_uppercase + string.digits + "_", max_size=16),
    # Any printable name: a line break in a variable's name takes more than a shell.
    st.text(alphabet=st.characters(exclude_characters=MARK, exclude_categories=("Cc", "Cs")),
            max_size=10),
)


@st.composite
def kafka_envs(draw: st.DrawFn, secret_file: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    for suffix in draw(st.lists(env_suffixes, max_size=5)):
        if suffix.upper().endswith("_FILE"):  # a path: echoed in errors, never the content
            env[KAFKA_ENV_PREFIX + suffix] = draw(st.sampled_from(
                [str(secret_file), "/nonexistent/secret", str(secret_file.parent), "", "a\x00b",
                 str(secret_file.with_name("binary"))]))
        elif is_secret(suffix):
            env[KAFKA_ENV_PREFIX + suffix] = draw(marked_passwords)
        else:  # line breaks: see test_a_line_break_in_a_guarded_property_stays_on_one_line
            env[KAFKA_ENV_PREFIX + suffix] = draw(nasty_text.filter(
                lambda v: "\n" not in v and "\r" not in v))
    env.update(draw(st.dictionaries(st.text(alphabet=any_char, max_size=12),
                                    st.text(alphabet=any_char, max_size=12), max_size=3)))
    return env


@pytest.fixture(scope="module")
def secret_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("secrets")
    (d / "binary").write_bytes(b"\xff\xfe\x00not text")
    path = d / "sasl_password"
    path.write_text(f"from-a-file{MARK}secret\n")
    return path


@FEW
@given(data=st.data())
def test_kafka_env_pass_through_gives_a_client_or_one_config_error(
        data: st.DataObject, secret_file: Path) -> None:
    """Env vars -> properties -> producer config -> a real librdkafka client (not connected)."""
    env = data.draw(kafka_envs(secret_file))
    try:
        props = kafka_env_properties(env)
    except ConfigError as exc:
        assert "\n" not in str(exc) and MARK not in str(exc)
        return
    for name in props:  # each comes from one OUTBOX_RELAY_KAFKA_<NAME>[_FILE] variable
        assert any(k.startswith(KAFKA_ENV_PREFIX)
                   and k[len(KAFKA_ENV_PREFIX):].lower().replace("_", ".") in (name, name + ".file")
                   for k in env)
    assert props == kafka_env_properties({k: v for k, v in env.items()
                                          if k.startswith(KAFKA_ENV_PREFIX)})
    try:
        s = build_settings({"dsn": GOOD_DSN, "bootstrap_servers": "127.0.0.1:1"},
                           kafka_properties=props)
        publisher = Publisher(producer_config(s), on_client_error=lambda *a: None)
    except ConfigError as exc:
        message = str(exc)
        assert "\n" not in message and MARK not in message, message
        return
    publisher.close(0)


@pytest.mark.parametrize("path", ["binary", "directory", "missing", "nul"])
def test_unreadable_secret_files_are_one_config_error_without_content(
        path: str, secret_file: Path) -> None:
    named = {"binary": str(secret_file.with_name("binary")), "directory": str(secret_file.parent),
             "missing": str(secret_file.with_name("missing")), "nul": "a\x00b"}[path]
    env = {"OUTBOX_RELAY_KAFKA_SASL_PASSWORD_FILE": named, "OUTBOX_RELAY_DSN_FILE": named}
    for read in (kafka_env_properties, lambda e: env_values(e, "run")):
        with pytest.raises(ConfigError) as info:
            read(env)
        assert "_FILE" in str(info.value) and "not text" not in str(info.value)


def test_a_line_break_in_a_guarded_property_stays_on_one_line() -> None:
    s = build_settings({"dsn": GOOD_DSN, "bootstrap_servers": "k:1"},
                       kafka_properties={"acks": "1\nall"})
    with pytest.raises(ConfigError) as info:
        producer_config(s)
    assert "\n" not in str(info.value)


# --- the row-to-message encoding -----------------------------------------------------

# What a jsonb column can hold: UTF-8 text without NUL (and so without lone surrogates).
jsonb_text = st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\x00"), max_size=12)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | jsonb_text,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(jsonb_text, children, max_size=3),
    max_leaves=10,
)
header_objects = st.dictionaries(st.one_of(jsonb_text, st.just("event_id")),
                                 st.one_of(st.none(), jsonb_text, json_values), max_size=6)
headers_json = st.one_of(
    header_objects.map(json.dumps),
    header_objects.map(lambda h: json.dumps(h, ensure_ascii=False)),
    json_values.map(json.dumps),
    st.text(max_size=30),
    st.sampled_from(["", "{", "[]", "null", '"x"', "1", '{"a": 1}', '{"a": "1", "a": null}',
                     '{"event_id": "forged"}', '{"a": NaN}', "{}" * 3]),
)


def row(headers: str, event_id: str = "0b7c7e4e-64a2-4a4e-9f0e-2f8a6f3c2b11") -> OutboxRow:
    return OutboxRow(id=RowId(1), event_id=event_id, topic="t", key="k", value=b"{}",
                     headers_json=headers, xid=1, shard=ShardId(0), attempts=0, created_epoch=0.0)


@PROPERTIES
@given(headers=headers_json)
def test_headers_encode_to_kafka_headers_or_a_bad_row(headers: str) -> None:
    r = row(headers)
    try:
        decoded = json.loads(headers) if headers else {}
    except ValueError:
        decoded = None
    clean = isinstance(decoded, dict) and all(v is None or isinstance(v, str)
                                              for k, v in decoded.items() if k != "event_id")
    try:
        encoded = encode_headers(r)
    except BadRow as exc:
        assert str(exc) and not clean, (headers, exc)
        return
    assert clean, headers
    assert isinstance(encoded, list) and encoded[-1] == ("event_id", r.event_id.encode())
    names = [name for name, _ in encoded[:-1]]
    assert names == [k for k in decoded if k != "event_id"]  # the row cannot forge event_id
    for name, value in encoded[:-1]:
        assert isinstance(name, str)
        assert value is None or (isinstance(value, bytes) and value.decode() == decoded[name])


def test_deeply_nested_headers_are_a_bad_row_not_a_crash() -> None:
    depth = 5000  # PostgreSQL 15 and 18 store this as jsonb; Python's json gives up near 1000
    with pytest.raises(BadRow):
        encode_headers(row('{"a": ' + "[" * depth + "]" * depth + "}"))


# --- named queries and the statements the store sends --------------------------------

NAME_LINE = re.compile(r"^--\s*name:", re.MULTILINE)
block_names = st.from_regex(r"\A[a-z_][a-z0-9_]{0,12}\Z")
block_bodies = st.text(max_size=60).map(str.strip).filter(lambda body: not NAME_LINE.search(body))


@PROPERTIES
@given(text=st.text(max_size=200))
@example(text="-- name: a\n-- name: a\n")
@example(text="-- name: UPPER\nSELECT 1")
def test_parse_blocks_never_crashes_on_any_text(text: str) -> None:
    try:
        blocks = queries.parse_blocks(text)
    except ValueError as exc:
        assert "duplicate query name" in str(exc)
        return
    for name, body in blocks.items():
        assert re.fullmatch(r"[a-z_][a-z0-9_]*", name) and body == body.strip()


@PROPERTIES
@given(blocks=st.dictionaries(block_names, block_bodies, min_size=1, max_size=5),
       preamble=st.sampled_from(["", "-- a header comment\n", "\n\n"]))
def test_parse_blocks_round_trips_generated_files(blocks: dict[str, str], preamble: str) -> None:
    text = preamble + "".join(f"-- name: {name}\n{body}\n\n" for name, body in blocks.items())
    assert queries.parse_blocks(text) == blocks


def named_statements(table: str) -> list[tuple[str, Any]]:
    """(name, statement) of every named block, ``{table}`` filled in as an identifier."""
    found = []
    for group in ("relay", "leases", "admin"):
        for name, text in queries.load(group).items():
            found.append((name, queries.compose(group, name, table=table)
                          if "{table}" in text else text))
    return found


CANNED: Mapping[str, list[dict[str, Any]]] = {
    "mark_published": [{"held": [0], "marked": [1]}],
    "heartbeat": [{"live": 1, "shards": [0], "tokens": [1]}],
    "record_failure": [{"attempts": 1}],
    "dead_letter": [{"id": 1}],
    "cleanup_batch": [{"deleted": 0, "last_published_at": None}],
    "backlog": [{"pending": 0, "oldest_age_s": 0.0, "retrying": 0}],
    "sweep": [{"restamped": 0, "due_in_s": None}],
}


class FakeCursor:
    def __init__(self, conn: FakeConnection) -> None:
        self.conn = conn
        self.description: Any = None
        self.pgresult: Any = None  # what the store reads: whether the statement returned rows
        self.rowcount = 0
        self._rows: list[dict[str, Any]] = []

    def execute(self, statement: Any, params: Any = None, binary: bool = False) -> FakeCursor:
        names = [name for name, known in self.conn.statements if known == statement]
        assert names, f"not a named query: {statement!r}"
        self.conn.sent.append((names[0], params))
        self._rows = CANNED.get(names[0], [])
        self.description = [("x",)]
        self.pgresult = SimpleNamespace(nfields=1)
        return self

    def fetchall(self) -> list[dict[str, Any]]:
        return self._rows


class FakeConnection:
    """Accepts only the named blocks (``{table}`` composed for ``table``), verbatim."""

    closed = False

    def __init__(self, table: str) -> None:
        self.statements = named_statements(table)
        self.sent: list[tuple[str, Any]] = []

    def cursor(self, row_factory: Any = None) -> FakeCursor:
        return FakeCursor(self)

    def execute(self, statement: Any, params: Any = None, binary: bool = False) -> FakeCursor:
        return FakeCursor(self).execute(statement, params)

    def close(self) -> None:
        self.closed = True


tables = st.one_of(st.sampled_from(["outbox", "app.outbox", 'we"ird', "x; DROP TABLE y"]),
                   nasty_text)


@PROPERTIES
@given(owner=st.text(max_size=30) | st.sampled_from(["'; DROP TABLE outbox; --", "%(owner)s"]),
       error=nasty_text, reason=nasty_text, retention=st.floats(0.001, 1e9), table=tables)
def test_the_store_sends_only_named_queries_with_input_as_parameters(
        owner: str, error: str, reason: str, retention: float, table: str) -> None:
    """Whatever the rows, owners and errors hold, the statements are the named blocks
    verbatim; the configured table goes in only as a quoted identifier."""
    try:
        table = build_settings({"dsn": GOOD_DSN, "table": table}, require_broker=False).table
    except ConfigError:
        return
    fake = FakeConnection(table)
    lease = Lease(ShardId(0), Token(1), 0.0)

    def prepared_run(statement: Prepared, conn: FakeConnection, params: Mapping[str, Any]) -> list[tuple[Any, ...]]:
        # The claim and the mark go as prepared statements (relay/wire.py): what is prepared
        # is the named block, placeholders renumbered (tests/unit/test_relay_wire.py).
        block = queries.compose(statement.group, statement.query, table=statement.table)
        return [tuple(r.values()) for r in FakeCursor(conn).execute(block, params).fetchall()]

    with mock.patch("relay.store.connect", return_value=fake), mock.patch.object(Prepared, "run", prepared_run):
        store = Store("postgresql://x/y", table=table)
        store.claim(shards=[ShardId(0)], nshards=16, after=Cursor(0, 0), limit=10)
        store.mark_published(owner=owner, leases=[lease], rows=[row("{}")])
        store.record_failure(owner=owner, lease=lease, row=row("{}"), error=error, backoff_s=1.0)
        store.dead_letter(owner=owner, lease=lease, row=row("{}"), reason=reason, error=error)
        store.heartbeat(owner=owner, ttl_s=10.0, leases=[lease], lease_s=10.0)
        store.claim_shards(owner=owner, limit=4, lease_s=10.0)
        store.release(owner=owner, leases=[lease])
        store.forget_replica(owner=owner)
        store.cleanup_batch(retention_s=retention, limit=100)
        store.backlog()
        store.sweep(shards=[lease.shard], nshards=16)
    assert [name for name, _ in fake.sent if name != "async_commit"] == [
        "claim_batch", "mark_published", "record_failure", "dead_letter", "heartbeat",
        "claim_shards", "release_shards", "forget_replica", "cleanup_batch",
        "backlog", "sweep"]
    sent_values = [v for _, params in fake.sent for v in (params or {}).values()]
    assert owner in sent_values and reason in sent_values
    assert error[:2000] in sent_values
