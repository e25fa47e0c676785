-- LokaDB cloud schema, version 1: organizations, metadata generation, pause.
-- Applied by `lokadb init` inside one transaction; recorded in lokadb.migrations.

CREATE SCHEMA lokadb;
COMMENT ON SCHEMA lokadb IS 'LokaDB: organizations, LokaDB tables, key maps, pause (managed by lokadb init)';

CREATE TABLE lokadb.migrations (
    version     int PRIMARY KEY,
    description text NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now()
);

-- One row: the metadata generation proxies cache against. Every change of lokadb.org or
-- lokadb.tables bumps it and NOTIFYs channel lokadb_meta with the new value.
CREATE TABLE lokadb.meta (
    singleton  boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    generation bigint NOT NULL DEFAULT 1
);
INSERT INTO lokadb.meta DEFAULT VALUES;

-- Organizations that are not plain cloud ones (a plain cloud organization has no row).
CREATE TABLE lokadb.org (
    id          text PRIMARY KEY CHECK (id <> '' AND id !~ '/'),
    name        text,
    state       text NOT NULL DEFAULT 'cloud'
                CHECK (state IN ('cloud', 'moving', 'moved', 'returning')),
    profile     text NOT NULL DEFAULT 'fdw' CHECK (profile IN ('fdw', 'fdw+direct')),
    -- Where its database is: the postgres_fdw server (through the relay) and the relay
    -- address and database the direct path uses.
    server      name,
    relay_host  text,
    relay_port  int CHECK (relay_port BETWEEN 1 AND 65535),
    dbname      text,
    pg_version  text,
    generation  bigint NOT NULL DEFAULT 0,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now()
);

CREATE FUNCTION lokadb.bump_generation() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    g bigint;
BEGIN
    UPDATE lokadb.meta SET generation = generation + 1 RETURNING generation INTO g;
    PERFORM pg_notify('lokadb_meta', g::text);
    RETURN NULL;
END
$$;

CREATE FUNCTION lokadb.org_touch() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.updated_at := now();
    NEW.generation := (SELECT generation FROM lokadb.meta) + 1;
    RETURN NEW;
END
$$;

CREATE TRIGGER org_touch BEFORE INSERT OR UPDATE ON lokadb.org
    FOR EACH ROW EXECUTE FUNCTION lokadb.org_touch();
CREATE TRIGGER org_generation AFTER INSERT OR UPDATE OR DELETE ON lokadb.org
    FOR EACH STATEMENT EXECUTE FUNCTION lokadb.bump_generation();

-- Pause. An organization's writers hold a shared advisory lock on its key until their
-- transaction ends; `lokadb pause` takes it exclusively, so it waits for writes in flight
-- and then holds new ones back until `lokadb resume` (or until its session ends: a pause
-- never outlives its holder). Reads take no lock.
CREATE FUNCTION lokadb.pause_key(org text) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT hashtextextended('lokadb.pause:' || org, 0)
$$;

-- Who holds or held a pause, for `lokadb status` and the error message.
CREATE TABLE lokadb.pause (
    org        text PRIMARY KEY,
    holder_pid int NOT NULL,
    reason     text NOT NULL,
    timeout    interval NOT NULL,
    since      timestamptz NOT NULL DEFAULT now()
);

-- Called by the row triggers of LokaDB tables before a write of `org`'s row. Fast path:
-- one try-lock (a waiting pause makes it fail, so writers cannot starve a pause).
CREATE FUNCTION lokadb.write_gate(org text) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    k bigint := lokadb.pause_key(org);
    wait interval;
    old_timeout text;
BEGIN
    IF pg_try_advisory_xact_lock_shared(k) THEN
        RETURN;
    END IF;
    SELECT p.timeout INTO wait FROM lokadb.pause p WHERE p.org = write_gate.org;
    wait := coalesce(wait, interval '30 seconds');
    old_timeout := current_setting('lock_timeout');
    PERFORM set_config('lock_timeout', (extract(epoch FROM wait) * 1000)::bigint::text, true);
    BEGIN
        PERFORM pg_advisory_xact_lock_shared(k);
    EXCEPTION WHEN lock_not_available THEN
        PERFORM set_config('lock_timeout', old_timeout, true);
        RAISE EXCEPTION 'organization % is paused: this write waited % and was refused', org, wait
            USING ERRCODE = '55P03',
                  HINT = 'Retry once the organization is resumed (lokadb resume, or the end of its move).';
    END;
    PERFORM set_config('lock_timeout', old_timeout, true);
END
$$;
