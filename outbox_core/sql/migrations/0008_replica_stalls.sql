-- 0008: what a replica waits on, for `outbox-relay status`.
--
-- Idempotent: safe to apply twice and readable by a DBA on its own.
--
-- Each heartbeat writes the partitions that acknowledge nothing (no leader: a broker
-- down) as {"<topic>": {"<partition>": <rows waiting>}}, {} when none.  A constant
-- default: adding the column rewrites nothing.
ALTER TABLE outbox_relay_replicas ADD COLUMN IF NOT EXISTS stalled jsonb NOT NULL DEFAULT '{}'::jsonb;
