-- 0007: replays: republish retained (already published) outbox rows, in commit order.
--
-- Idempotent: safe to apply twice and readable by a DBA on its own.
--
-- An operator records a request (`outbox-relay replay --since ...`); the replicas
-- that hold the shards republish the rows it selects, each shard in the order its
-- rows were first published: (published_at, xid, id).  A key's rows are published
-- by one shard owner in claim order, which is commit order, so this order is the
-- key's commit order.  The selection is fixed at request time: rows created in
-- [since, until) and published at or before requested_at.
--
-- state: 'active' (being replayed), 'done' (every shard finished), 'cancelled'.
CREATE TABLE IF NOT EXISTS outbox_relay_replays (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    since         timestamptz NOT NULL,
    until         timestamptz NOT NULL,
    topics        text[]      NOT NULL DEFAULT '{}',
    keys          text[]      NOT NULL DEFAULT '{}',
    rate_per_s    double precision NOT NULL CHECK (rate_per_s > 0),
    state         text        NOT NULL DEFAULT 'active'
        CHECK (state IN ('active', 'done', 'cancelled')),
    requested_at  timestamptz NOT NULL DEFAULT now(),
    requested_by  text        NOT NULL DEFAULT current_user,
    selected_rows bigint      NOT NULL DEFAULT 0,
    finished_at   timestamptz,
    CONSTRAINT outbox_relay_replays_range CHECK (since < until)
);
CREATE INDEX IF NOT EXISTS outbox_relay_replays_active_idx
    ON outbox_relay_replays (id) WHERE state = 'active';

-- Progress of one replay in one shard: the last row acknowledged by the broker, as
-- (published_at, xid, id).  Written only by the shard's lease holder, fenced by its
-- token, so a takeover or a restart continues from the last acknowledged row
-- (at least once per replay).
CREATE TABLE IF NOT EXISTS outbox_relay_replay_progress (
    replay_id     bigint      NOT NULL REFERENCES outbox_relay_replays (id) ON DELETE CASCADE,
    shard         integer     NOT NULL CHECK (shard >= 0),
    published_at  timestamptz,
    xid           xid8,
    row_id        bigint,
    sent          bigint      NOT NULL DEFAULT 0,
    done          boolean     NOT NULL DEFAULT false,
    owner         text        NOT NULL,
    token         bigint      NOT NULL,
    updated_at    timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT outbox_relay_replay_progress_pkey PRIMARY KEY (replay_id, shard)
);
