-- 0018: which of a job's interruptions (0017) were conflicts, and which a read-only database.
--
-- Idempotent: safe to apply twice and readable by a DBA on its own.
--
-- A handler whose statement met a conflict (SQLSTATE class 40: a deadlock, a serialization
-- failure) or a read-only database (25006: a failover in progress, a pooler routing to a
-- standby) counted an attempt, and a failover's read-only window or a contended row
-- dead-lettered jobs 'attempts_exhausted' for what was not their doing.  A worker now gives
-- such a job back with the attempt not counted, as it does when the connection broke, within
-- the same budget (jobs.interruptions, bounded by the worker pool's max_interruptions): a job
-- that deadlocks every time still comes to an end.  These columns count the conflicts and the
-- read-only ones among jobs.interruptions (the rest: the connection broke), so that the dead
-- letter of a job past its budget says how many of each.  consumer_sdk/jobs/interruptions.py
-- writes them (give_back_interrupted in sql/queries/jobs.sql); an operator's requeue resets them.
--
-- Constant defaults: PostgreSQL 11 and later add the columns without rewriting the table (a
-- brief ACCESS EXCLUSIVE lock, under migrate's lock_timeout).  No CHECK (see 0017).
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS conflict_interruptions integer NOT NULL DEFAULT 0,
                 ADD COLUMN IF NOT EXISTS read_only_interruptions integer NOT NULL DEFAULT 0;
