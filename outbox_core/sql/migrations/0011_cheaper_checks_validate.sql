-- 0011: validate 0010's checks against the rows already in the tables.
--
-- Idempotent: safe to apply twice and readable by a DBA on its own.
--
-- A file of its own, so its own transaction: VALIDATE CONSTRAINT scans the table under a
-- SHARE UPDATE EXCLUSIVE lock, which lets writers, workers and the relay go on meanwhile.
-- (A script printed by `migrate --print` and run as one transaction holds 0010's locks
-- through these scans instead.)
ALTER TABLE outbox VALIDATE CONSTRAINT outbox_topic_valid;
ALTER TABLE jobs VALIDATE CONSTRAINT jobs_queue_valid;
