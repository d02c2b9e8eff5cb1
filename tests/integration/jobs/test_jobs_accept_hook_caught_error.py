"""``accept``'s ``on_accept`` hook (sync and asyncio) that catches a database error and carries on, on
the real PostgreSQL: accept's transaction was aborted, its COMMIT answered ROLLBACK without an
error, and accept returned a created run that was never stored.  Now it raises what the error
stands for (:mod:`consumer_sdk.jobs.aborted`) and nothing is stored."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest

from consumer_sdk.errors import HandlerTransactionFailed, TransactionConflict
from consumer_sdk.jobs import accept, aio
from consumer_sdk.store import PgInboxStore
from tests.integration.jobs._support import scalar

CAUGHT = pytest.mark.parametrize(("statement", "raised", "said"), [
    ("SELECT 1/0", HandlerTransactionFailed,
     "on_accept caught a database error inside accept()'s transaction and carried on: 22012 division by zero; "
     "its transaction was rolled back, nothing written"),
    ("DO $$ BEGIN RAISE EXCEPTION 'conflict' USING ERRCODE = '40001'; END $$", TransactionConflict,
     "transaction aborted: 40001 conflict (on_accept caught"),
], ids=["22012", "40001"])


@CAUGHT
def test_a_hook_that_caught_an_error_makes_accept_raise_and_store_nothing(jobs_db, statement, raised, said):
    def hook(conn: psycopg.Connection[Any], accepted: Any) -> None:
        conn.execute("INSERT INTO effects (job_id, token, step) VALUES (%s, 0, 1)", (accepted.job_id,))
        try:
            conn.execute(statement)
        except psycopg.Error:
            pass  # the hook carries on

    with psycopg.connect(jobs_db, autocommit=True) as conn:
        with pytest.raises(raised) as caught:
            accept(conn, owner_id="u1", request_key="k1", kind="r", body={}, on_accept=hook)
        assert str(caught.value).startswith(said), caught.value
        assert isinstance(caught.value.__cause__, psycopg.Error)
        assert accept(conn, owner_id="u1", request_key="k1", kind="r", body={}).created  # the connection is fine
    assert scalar(jobs_db, "SELECT count(*) FROM runs") == 1  # the second accept's only
    assert scalar(jobs_db, "SELECT count(*) FROM effects") == 0


@CAUGHT
def test_an_asyncio_hook_that_caught_an_error_makes_accept_raise_and_store_nothing(jobs_db, statement, raised, said):
    async def hook(conn: psycopg.AsyncConnection[Any], accepted: Any) -> None:
        await conn.execute("INSERT INTO effects (job_id, token, step) VALUES (%s, 0, 1)", (accepted.job_id,))
        try:
            await conn.execute(statement)
        except psycopg.Error:
            pass  # the hook carries on

    async def body() -> None:
        async with await psycopg.AsyncConnection.connect(jobs_db, autocommit=True) as conn:
            with pytest.raises(raised) as caught:
                await aio.accept(conn, owner_id="u1", request_key="k1", kind="r", body={}, on_accept=hook)
            assert str(caught.value).startswith(said), caught.value
            assert isinstance(caught.value.__cause__, psycopg.Error)
            again = await aio.accept(conn, owner_id="u1", request_key="k1", kind="r", body={})  # the connection is fine
            assert again.created

    asyncio.run(body())
    assert scalar(jobs_db, "SELECT count(*) FROM runs") == 1  # the second accept's only
    assert scalar(jobs_db, "SELECT count(*) FROM effects") == 0


def test_a_connection_the_inbox_store_used_first_still_tells_accept_which_error_its_hook_caught(jobs_db):
    """One connection object, given to the inbox's store and then to accept: its round trips
    had one watcher, the first to come (the store's), and accept's never heard of the conflict
    its hook caught, so the database's doing passed for the hook's own failure
    (HandlerTransactionFailed, "which error, the connection did not see") instead of a
    TransactionConflict to retry.  Both read the connection's one watcher now
    (``consumer_sdk._pg.failed_trip``)."""
    def hook(conn: psycopg.Connection[Any], accepted: Any) -> None:
        try:
            conn.execute("DO $$ BEGIN RAISE EXCEPTION 'conflict' USING ERRCODE = '40001'; END $$")
        except psycopg.Error:
            pass  # the hook carries on

    with psycopg.connect(jobs_db, autocommit=True) as conn:
        store = PgInboxStore(lambda: conn)
        with store.transaction() as tx:
            assert tx.execute("SELECT 1").fetchone() == (1,)
        with pytest.raises(TransactionConflict, match="^transaction aborted: 40001 conflict"):
            accept(conn, owner_id="u1", request_key="k1", kind="r", body={}, on_accept=hook)
    assert scalar(jobs_db, "SELECT count(*) FROM runs") == 0
