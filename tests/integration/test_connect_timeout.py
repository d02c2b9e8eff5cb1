"""A DSN's own ``connect_timeout`` (or ``PGCONNECT_TIMEOUT``) is the one the relay and the SDK use.

Each connected with ``connect_timeout=5`` (10 for the jobs command line) as an argument,
which outranks the DSN's value: a DBA's ``connect_timeout=15`` for a distant server was
replaced, silently.  The default still applies when neither says anything.
"""

from __future__ import annotations

import asyncio

import pytest
from psycopg.conninfo import make_conninfo

from consumer_sdk import _pg
from relay import store as relay_store


def _timeout_of(conn) -> str:
    # libpq's effective connection options (without the password), as the server was reached.
    options = dict(item.split("=", 1) for item in conn.info.dsn.split() if "=" in item)
    return options.get("connect_timeout", "")


def _async_timeout(dsn: str) -> str:
    async def run() -> str:
        conn = await _pg.connect_async(dsn, application_name="t")
        try:
            return _timeout_of(conn)
        finally:
            await conn.close()
    return asyncio.run(run())


def _sync_timeout(make, dsn: str) -> str:
    with make(dsn) as conn:
        return _timeout_of(conn)


CONNECTS = {
    "relay": lambda dsn: _sync_timeout(relay_store.connect, dsn),
    "sdk": lambda dsn: _sync_timeout(lambda d: _pg.connect(d, application_name="t"), dsn),
    "sdk-async": _async_timeout,
}


@pytest.mark.parametrize("who", sorted(CONNECTS))
def test_the_dsns_connect_timeout_is_kept(db_dsn, who, monkeypatch):
    monkeypatch.delenv("PGCONNECT_TIMEOUT", raising=False)
    assert CONNECTS[who](make_conninfo(db_dsn, connect_timeout=17)) == "17"
    assert CONNECTS[who](db_dsn) == "5"


@pytest.mark.parametrize("who", sorted(CONNECTS))
def test_pgconnect_timeout_is_kept(db_dsn, who, monkeypatch):
    monkeypatch.setenv("PGCONNECT_TIMEOUT", "13")
    assert CONNECTS[who](db_dsn) == "13"


def test_the_argument_is_left_out_only_when_something_else_sets_it(monkeypatch):
    from outbox_core.connect_errors import connect_timeout

    monkeypatch.delenv("PGCONNECT_TIMEOUT", raising=False)
    assert connect_timeout("host=h connect_timeout=0", 5) == {}
    assert connect_timeout("postgresql://u@h/db?connect_timeout=30", 5) == {}
    assert connect_timeout("host=h dbname=d", 5) == {"connect_timeout": 5}
    # Unparsable: the default, and connecting says what is wrong with the string.
    assert connect_timeout("host='unterminated", 7) == {"connect_timeout": 7}
    monkeypatch.setenv("PGCONNECT_TIMEOUT", " ")
    assert connect_timeout("host=h", 5) == {"connect_timeout": 5}
