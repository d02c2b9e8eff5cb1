-- 0002: the relay's own state: shard leases with fencing tokens, live replicas,
-- and dead letters.

-- One row.  The number of shards the keys are hashed into; every replica must agree.
CREATE TABLE IF NOT EXISTS outbox_relay_settings (
    singleton  boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    shards     integer NOT NULL CHECK (shards BETWEEN 1 AND 4096),
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- A lease on a shard: its owner publishes every pending row whose key hashes to it.
-- token grows by one at every new claim; every relay write carries it.
CREATE TABLE IF NOT EXISTS outbox_relay_shards (
    shard       integer PRIMARY KEY CHECK (shard >= 0),
    owner       text,
    lease_until timestamptz,
    token       bigint NOT NULL DEFAULT 0
);

-- Replicas announce themselves so that every replica can compute its fair share
-- of shards without a coordinator.
CREATE TABLE IF NOT EXISTS outbox_relay_replicas (
    owner      text PRIMARY KEY,
    seen_until timestamptz NOT NULL,
    started_at timestamptz NOT NULL DEFAULT now()
);

-- Rows that could never be published, with their original content and the reason.
CREATE TABLE IF NOT EXISTS outbox_dead_letters (
    id              bigint PRIMARY KEY,
    event_id        uuid        NOT NULL UNIQUE,
    topic           text        NOT NULL,
    key             text,
    payload         jsonb,
    payload_bytes   bytea,
    headers         jsonb       NOT NULL,
    created_at      timestamptz NOT NULL,
    reason          text        NOT NULL,
    error           text        NOT NULL,
    attempts        integer     NOT NULL,
    dead_at         timestamptz NOT NULL DEFAULT now(),
    owner           text
);
CREATE INDEX IF NOT EXISTS outbox_dead_letters_dead_at_idx ON outbox_dead_letters (dead_at);
