"""Statements sent with libpq's own calls, below psycopg's cursor: one round trip that opens
a transaction and runs a prepared statement, or runs a whole fenced transaction.

Three callers, each once per job or message: the jobs' fence (BEGIN and the fence's lock,
see :func:`consumer_sdk.jobs.queue.fence_begin`), a job's one-statement fenced write
(BEGIN, the raising fence, the statement, COMMIT, see
:func:`consumer_sdk.jobs.fenced.fenced_execute`) and the inbox's first claim of a
transaction (the previous transaction's deferred COMMIT, BEGIN and the claim, see
:class:`consumer_sdk.store.PgInboxStore`).  Through a cursor, such a round trip cost the
client about twice its libpq calls (the cursor, the query's conversion, the
prepared-statement cache, the result sets): issue 19 measured it at about 40 µs of CPU a
job.  Here the statements without parameters and the prepared one go in one libpq
pipeline (extended protocol, one Sync: one round trip), the prepared statement's values
as text parameters, a caller's statement with its values as psycopg binds them for a
cursor (:func:`bind`), and the results are read with psycopg's own non-blocking generators
under the connection's lock, as psycopg does for ``commit()``: the same waits,
interruptions and notifications, no SQL built from values.

Driver errors are raised as psycopg errors (the caller translates them).  The
connection is left outside pipeline mode, with the transaction open (or failed) when
BEGIN went through; a connection that cannot leave pipeline mode is closed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any, NamedTuple

import psycopg
import psycopg.abc
import psycopg.errors
from psycopg import generators, pq
from psycopg.abc import Buffer, PQGen
from psycopg.adapt import Transformer

try:  # psycopg's own query conversion (server-side parameters), as its cursors use it
    from psycopg._queries import PostgresQuery
except ImportError:  # pragma: no cover - a psycopg without it: INTERNALS is false
    PostgresQuery = None  # type: ignore[assignment,misc]

_FATAL_ERROR = pq.ExecStatus.FATAL_ERROR
_PIPELINE_ABORTED = pq.ExecStatus.PIPELINE_ABORTED
_PIPELINE_OFF = pq.PipelineStatus.OFF
_IDLE = pq.TransactionStatus.IDLE
_ROLLBACK = b"ROLLBACK"
#: The statements without parameters every caller sends around its own (one spelling each).
BEGIN = b"BEGIN"
COMMIT = b"COMMIT"


#: The psycopg internals this module uses (tested with psycopg 3.3): a release without
#: them makes :func:`available` false, and the fence goes through psycopg's own pipeline.
#: tests/unit/jobs/test_jobs_wire.py fails when that happens, so it is seen, not silent.
INTERNALS = (hasattr(generators, "send") and hasattr(generators, "fetch_many")
             and hasattr(psycopg.Connection, "wait") and PostgresQuery is not None)


class Step(NamedTuple):
    """One statement of a pipeline: SQL text, or a prepared statement's name (``prepared``),
    with its parameters as libpq takes them; or, with ``prepare_as``, the PREPARE of ``sql``
    under that name (its parameters' ``types``; its own result)."""

    sql: bytes
    params: Sequence[Buffer | None] | None = None
    types: Sequence[int] | None = None
    formats: Sequence[pq.Format] | None = None
    prepared: bool = False
    prepare_as: bytes | None = None


def available(conn: psycopg.Connection[Any]) -> bool:
    """True when ``conn`` can take :func:`begin_and_execute` (libpq 14 or later, no pipeline
    of psycopg's open on it, the psycopg internals it uses present)."""
    return (INTERNALS and hasattr(conn, "lock") and psycopg.capabilities.has_pipeline()
            and conn.pgconn.pipeline_status == _PIPELINE_OFF)


def prepare(conn: psycopg.Connection[Any], sql: bytes) -> None:
    """Run ``sql``, a ``PREPARE``; a statement of that name already on the connection is kept."""
    try:
        conn.execute(sql)
    except psycopg.errors.DuplicatePreparedStatement:
        pass


def begin_and_execute(conn: psycopg.Connection[Any], begin: bytes, statement: bytes,
                      params: Sequence[bytes | None]) -> int:
    """Send ``begin`` and the prepared ``statement`` (text parameters) in one round trip;
    returns how many rows the statement returned.  Check :func:`available` first."""
    results = send_before(conn, (begin,), statement, params)
    raise_first_error(conn, results)
    rows: int = results[1].ntuples
    return rows


def send_before(conn: psycopg.Connection[Any], leading: Sequence[bytes], statement: bytes,
                params: Sequence[bytes | None]) -> list[pq.abc.PGresult]:
    """Send ``leading`` (statements without parameters), then the prepared ``statement`` (text
    parameters), in one round trip; returns their results in order (then the Sync's).  An
    error is a result here, not an exception (see :func:`raise_first_error`): the caller
    learns what the statements before it did.  Check :func:`available` first."""
    return send_all(conn, [*(Step(sql) for sql in leading), Step(statement, params, prepared=True)])


def send_all(conn: psycopg.Connection[Any], steps: Sequence[Step]) -> list[pq.abc.PGresult]:
    """Send ``steps`` in one pipeline with one Sync (one round trip); returns their results in
    order, then the Sync's.  After a failure the server skips the rest up to the Sync
    (their results say ``PIPELINE_ABORTED``); an error is a result here, not an exception.
    Check :func:`available` first."""
    with conn.lock:
        conn.pgconn.enter_pipeline_mode()
        try:
            results: list[pq.abc.PGresult] = conn.wait(_exchange(conn.pgconn, steps))
            return results
        finally:
            _leave_pipeline(conn)


def send_all_gen(conn: psycopg.Connection[Any], steps: Sequence[Step]) -> PQGen[list[pq.abc.PGresult]]:
    """:func:`send_all` as one of psycopg's generators, for a caller already inside psycopg's
    own wait, the connection's lock held (a connection's ``_start_query``)."""
    conn.pgconn.enter_pipeline_mode()
    try:
        return (yield from _exchange(conn.pgconn, steps))
    finally:
        _leave_pipeline(conn)


def _exchange(pgconn: pq.abc.PGconn, steps: Sequence[Step]) -> PQGen[list[pq.abc.PGresult]]:
    """Queue ``steps`` and a Sync, flush them, read their results and the Sync's (pipeline mode)."""
    _queue(pgconn, steps)
    yield from generators.send(pgconn)
    return (yield from _fetch_results(pgconn, len(steps)))


def _fetch_results(pgconn: pq.abc.PGconn, count: int) -> PQGen[list[pq.abc.PGresult]]:
    """The results of ``count`` statements sent, then their Sync's: one fetch per statement
    (each ends with libpq's NULL), one for the Sync."""
    results: list[pq.abc.PGresult] = []
    for _ in range(count + 1):
        results.extend((yield from generators.fetch_many(pgconn)))
    return results


def roll_back(conn: psycopg.Connection[Any]) -> None:
    """ROLLBACK the transaction a failed pipeline left open (none open: nothing sent), below
    psycopg, as the pipeline went: psycopg's ``rollback()`` answers with DEALLOCATE ALL once
    it holds prepared statements of its own, which takes the caller's prepared statements
    along.  Check :func:`available` first."""
    if conn.info.transaction_status != _IDLE:
        raise_first_error(conn, send_all(conn, [Step(_ROLLBACK)]))


def _queue(pgconn: pq.abc.PGconn, steps: Sequence[Step]) -> None:
    """``steps`` and a Sync into libpq's output buffer (pipeline mode; nothing flushed)."""
    for step in steps:
        if step.prepare_as is not None:
            pgconn.send_prepare(step.prepare_as, step.sql, param_types=step.types)
        elif step.prepared:
            pgconn.send_query_prepared(step.sql, step.params, param_formats=step.formats)
        else:
            pgconn.send_query_params(step.sql, step.params, param_types=step.types,
                                     param_formats=step.formats)
    pgconn.pipeline_sync()


def _results(conn: psycopg.Connection[Any], count: int) -> list[pq.abc.PGresult]:
    """:func:`_fetch_results`, waited for on ``conn``."""
    results: list[pq.abc.PGresult] = conn.wait(_fetch_results(conn.pgconn, count))
    return results


class Trips:
    """Transactions sent one after another in one libpq pipeline, each ending with its own
    Sync, their results read in order while later ones are still being sent: the server
    works on the next transaction while the client prepares the one after it, with no
    round trip between them.  Each ``send`` flushes its transaction; each ``receive`` waits
    for the oldest one's results.  :meth:`close` leaves pipeline mode (results not read yet
    are read and dropped first).  The connection's lock is held from the first ``send`` to
    :meth:`close`: no other caller may use the connection meanwhile.  Check
    :func:`available` first."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn
        self._sizes: deque[int] = deque()  # statements of each transaction sent and not read
        self._open = False

    def __len__(self) -> int:
        """Transactions sent whose results are not read yet."""
        return len(self._sizes)

    def send(self, steps: Sequence[Step]) -> None:
        conn = self.conn
        pgconn = conn.pgconn
        if not self._open:
            conn.lock.acquire()
            self._open = True
            pgconn.enter_pipeline_mode()
        _queue(pgconn, steps)
        self._sizes.append(len(steps))
        conn.wait(generators.send(pgconn))

    def receive(self) -> list[pq.abc.PGresult]:
        """The results of the oldest transaction not read yet, in order, then its Sync's."""
        return _results(self.conn, self._sizes.popleft())

    def close(self) -> None:
        if not self._open:
            return
        try:
            while self._sizes:
                self.receive()
        finally:
            self.abandon()

    def abandon(self) -> None:
        """Leave pipeline mode at once (a connection with answers still pending is closed) and
        give the connection's lock back: for a connection that is being dropped."""
        if not self._open:
            return
        self._sizes.clear()
        self._open = False
        try:
            _leave_pipeline(self.conn)
        finally:
            self.conn.lock.release()


def bind(conn: psycopg.Connection[Any], query: Any, params: Any = None, *,
         transformer: psycopg.abc.Transformer | None = None) -> Step:
    """``query`` (a string, bytes or ``psycopg.sql`` composition with ``%s`` or ``%(name)s``
    placeholders) and ``params`` as psycopg would send them from a cursor's ``execute``:
    server-side parameters, each value dumped by the connection's adapters.

    Without ``transformer``, a new one each call, as each ``conn.execute`` makes a new
    cursor.  A caller that binds many statements passes one (:func:`transformer`), as one
    cursor reuses its own: it keeps the dumpers it found, half the cost of a bind.  Keep it
    no longer than the connection (a transformer holds its connection alive)."""
    converted = PostgresQuery(transformer if transformer is not None else Transformer(conn))
    converted.convert(query, params)
    return Step(converted.query, converted.params, converted.types, converted.formats)


def transformer(conn: psycopg.Connection[Any]) -> psycopg.abc.Transformer:
    """A transformer for :func:`bind` on ``conn`` (see there)."""
    return Transformer(conn)


def failed(result: pq.abc.PGresult) -> bool:
    """The statement of ``result`` failed, or was skipped after a failure."""
    return result.status in (_FATAL_ERROR, _PIPELINE_ABORTED)


def raise_first_error(conn: psycopg.Connection[Any], results: Sequence[pq.abc.PGresult]) -> None:
    """Raise the first failure among ``results`` as a psycopg error."""
    for result in results:
        if result.status == _FATAL_ERROR:
            raise psycopg.errors.error_from_result(result, encoding=conn.info.encoding)
        if result.status == _PIPELINE_ABORTED:  # not expected without an error before it
            raise psycopg.errors.InternalError("the pipeline was aborted")


def _leave_pipeline(conn: psycopg.Connection[Any]) -> None:
    try:
        conn.pgconn.exit_pipeline_mode()
    except psycopg.Error:
        if not conn.closed:  # results still pending (an interrupted wait): nothing can use it
            conn.close()
