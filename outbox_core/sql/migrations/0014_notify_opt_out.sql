-- 0014: a writer that prepares its transaction (two-phase commit) can leave out the wake-up.
--
-- Idempotent: safe to apply twice and readable by a DBA on its own.
--
-- PostgreSQL refuses PREPARE TRANSACTION in a transaction that ran NOTIFY ("cannot
-- PREPARE a transaction that has executed LISTEN, UNLISTEN, or NOTIFY").  The wake-up
-- trigger of 0003 notifies while a relay sleeps, and an idle relay sleeps: a writer that
-- inserts into the outbox and then prepares (XA, a transaction manager) failed at PREPARE
-- whenever the outbox had been idle.  Such a writer sets outbox.notify to off in that
-- transaction (SET LOCAL outbox.notify = 'off'): nothing notifies, PREPARE works, and the
-- relay finds its rows at its poll (--poll-interval-s) after COMMIT PREPARED.  Unset, or
-- any other value, the trigger notifies as before.
CREATE OR REPLACE FUNCTION outbox_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('outbox.notify', true) IS DISTINCT FROM 'off' THEN
        PERFORM pg_notify('outbox_relay', '');
    END IF;
    RETURN NULL;
END;
$$;
