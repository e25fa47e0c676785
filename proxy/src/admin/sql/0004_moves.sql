-- LokaDB cloud schema, version 4: moving organizations (move-org, move-back).
-- Written by proxy/src/admin/moves/; see docs/moving.md.

-- One row per move in progress: what `lokadb status` shows and what a rerun resumes from.
CREATE TABLE lokadb.moves (
    org        text PRIMARY KEY REFERENCES lokadb.org (id),
    -- 'out' (move-org) or 'back' (move-back).
    direction  text NOT NULL CHECK (direction IN ('out', 'back')),
    mode       text NOT NULL CHECK (mode IN ('trigger', 'logical')),
    profile    text NOT NULL CHECK (profile IN ('fdw', 'fdw+direct')),
    -- The organization's state before the move (what an abort restores).
    from_state text NOT NULL,
    -- split: giving the organization a partition of its own (first move only);
    -- prepare, copy, catchup: before the switch (an abort rolls back);
    -- verify: switched; verification and clean-up left (a rerun finishes them).
    step       text NOT NULL CHECK (step IN ('split', 'prepare', 'copy', 'catchup', 'verify')),
    -- Tables (schema.table) whose copy is complete.
    copied     text[] NOT NULL DEFAULT '{}',
    -- The last progress line, for lokadb status.
    progress   text,
    started_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- Change capture (trigger mode and the split): the keys of rows written since the capture
-- began; a catch-up round copies those rows' current state and deletes the records it applied.
-- The same table exists in an organization's database for move-back (lokadb_org.sql).
CREATE TABLE lokadb.changes (
    id   bigserial PRIMARY KEY,
    org  text NOT NULL,
    -- The LokaDB table, schema.table.
    rel  text NOT NULL,
    -- The row's key, each column as text.
    key  text[] NOT NULL
);
CREATE INDEX changes_org ON lokadb.changes (org, id);

-- Logical mode: a row per organization, published with its rows; when the marker written
-- under the switch's lock reaches the organization's database, every earlier change has too.
CREATE TABLE lokadb.move_marker (
    org   text PRIMARY KEY,
    token text NOT NULL
);

-- Writers waiting at a pause are told to retry (40001) while a split attaches the
-- organization's new partition: they hold a lock on the DEFAULT partition that the attach needs.
CREATE FUNCTION lokadb.evict_key(org text) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT hashtextextended('lokadb.evict:' || org, 0)
$$;

CREATE OR REPLACE FUNCTION lokadb.write_gate(org text) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    k bigint := lokadb.pause_key(org);
    wait interval;
    deadline timestamptz;
    old_timeout text;
BEGIN
    IF pg_try_advisory_xact_lock_shared(k) THEN
        RETURN;
    END IF;
    SELECT p.timeout INTO wait FROM lokadb.pause p WHERE p.org = write_gate.org;
    wait := coalesce(wait, interval '30 seconds');
    deadline := clock_timestamp() + wait;
    old_timeout := current_setting('lock_timeout');
    -- Wait in short steps, so a split can tell a waiting writer to retry.
    PERFORM set_config('lock_timeout', '50', true);
    LOOP
        IF NOT pg_try_advisory_lock_shared(lokadb.evict_key(org)) THEN
            PERFORM set_config('lock_timeout', old_timeout, true);
            RAISE EXCEPTION 'organization % was given a partition of its own while this write waited', org
                USING ERRCODE = '40001',
                      HINT = 'Retry the transaction: it was rolled back and nothing was written.';
        END IF;
        PERFORM pg_advisory_unlock_shared(lokadb.evict_key(org));
        BEGIN
            PERFORM pg_advisory_xact_lock_shared(k);
            PERFORM set_config('lock_timeout', old_timeout, true);
            RETURN;
        EXCEPTION WHEN lock_not_available THEN
            IF clock_timestamp() >= deadline THEN
                PERFORM set_config('lock_timeout', old_timeout, true);
                RAISE EXCEPTION 'organization % is paused: this write waited % and was refused', org, wait
                    USING ERRCODE = '55P03',
                          HINT = 'Retry once the organization is resumed (lokadb resume, or the end of its move).';
            END IF;
        END;
    END LOOP;
END
$$;
