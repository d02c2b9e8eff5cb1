"""Statements sent with libpq's own calls, below psycopg's cursor: the fence's first round trip.

A fenced transaction opens with BEGIN and the fence's lock (see
:func:`consumer_sdk.jobs.queue.fence_begin`), once per job.  Through a cursor, that
round trip cost the client about twice its libpq calls (the cursor, the query's
conversion, the prepared-statement cache, the result sets): issue 19 measured it at
about 40 µs of CPU a job.  Here BEGIN and the prepared lock go in one libpq pipeline
(extended protocol, one Sync: one round trip), the lock's values as parameters, and
the results are read with psycopg's own non-blocking generators under the
connection's lock, as psycopg does for ``commit()``: the same waits, interruptions and
notifications, no SQL built from values.

Driver errors are raised as psycopg errors (the caller translates them).  The
connection is left outside pipeline mode, with the transaction open (or failed) when
BEGIN went through; a connection that cannot leave pipeline mode is closed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg
import psycopg.errors
from psycopg import generators, pq

_FATAL_ERROR = pq.ExecStatus.FATAL_ERROR
_PIPELINE_ABORTED = pq.ExecStatus.PIPELINE_ABORTED
_PIPELINE_OFF = pq.PipelineStatus.OFF


#: The psycopg internals this module uses (tested with psycopg 3.3): a release without
#: them makes :func:`available` false, and the fence goes through psycopg's own pipeline.
#: tests/unit/jobs/test_jobs_wire.py fails when that happens, so it is seen, not silent.
INTERNALS = (hasattr(generators, "send") and hasattr(generators, "fetch_many")
             and hasattr(psycopg.Connection, "wait"))


def available(conn: psycopg.Connection[Any]) -> bool:
    """True when ``conn`` can take :func:`begin_and_execute` (libpq 14 or later, no pipeline
    of psycopg's open on it, the psycopg internals it uses present)."""
    return (INTERNALS and hasattr(conn, "lock") and psycopg.capabilities.has_pipeline()
            and conn.pgconn.pipeline_status == _PIPELINE_OFF)


def begin_and_execute(conn: psycopg.Connection[Any], begin: bytes, statement: bytes,
                      params: Sequence[bytes | None]) -> int:
    """Send ``begin`` and the prepared ``statement`` (text parameters) in one round trip;
    returns how many rows the statement returned.  Check :func:`available` first."""
    pgconn = conn.pgconn
    with conn.lock:
        pgconn.enter_pipeline_mode()
        try:
            pgconn.send_query_params(begin, None)
            pgconn.send_query_prepared(statement, params)
            pgconn.pipeline_sync()
            conn.wait(generators.send(pgconn))
            # One fetch per statement (each ends with libpq's NULL), one for the Sync.
            results = [result for _ in range(3) for result in conn.wait(generators.fetch_many(pgconn))]
        finally:
            _leave_pipeline(conn)
    for result in results:
        if result.status == _FATAL_ERROR:
            raise psycopg.errors.error_from_result(result, encoding=conn.info.encoding)
        if result.status == _PIPELINE_ABORTED:  # not expected without an error before it
            raise psycopg.errors.InternalError("the fence's pipeline was aborted")
    rows: int = results[1].ntuples
    return rows


def _leave_pipeline(conn: psycopg.Connection[Any]) -> None:
    try:
        conn.pgconn.exit_pipeline_mode()
    except psycopg.Error:
        if not conn.closed:  # results still pending (an interrupted wait): nothing can use it
            conn.close()
