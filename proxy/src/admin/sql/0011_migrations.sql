-- Version 11: the application's migrations once organizations have moved
-- (docs/migrations.md).
--
-- DDL on a LokaDB table reaches every moved organization's table, or nothing changes:
--    - ddl_command_start (ALTER TABLE, CREATE/DROP/ALTER INDEX) keeps, once per
--      transaction, the shape of every LokaDB table (columns by attnum, the parent's
--      indexes and CHECK constraints) in lokadb.ddl_before, and queues a deferred trigger;
--    - at COMMIT the trigger compares each shape with the table's shape now, derives the
--      statements that make an organization's table follow (by attnum, so a rename is a
--      rename, never a drop and an add), and, through dblink on each organization's
--      postgres_fdw server (relay, agent), runs them in every moved organization's database
--      in parallel and PREPAREs them there (two-phase commit). If any organization fails,
--      the prepared ones are rolled back and the COMMIT fails naming the organizations:
--      nothing changed anywhere;
--    - the gids are recorded in lokadb.ddl_prepared in the same cloud transaction and
--      NOTIFY lokadb_ddl is sent; lokadb.ddl_resolve() (called by the proxy on that
--      notification, at its start, and by `lokadb resolve`) commits the prepared
--      transactions of committed cloud transactions and rolls back the others.

-- dblink opens the organizations' connections from inside the cloud's transaction. In schema
-- lokadb (not the application's), unless the database has it already.
CREATE EXTENSION IF NOT EXISTS dblink SCHEMA lokadb;

-- A LokaDB table's shape as the migrations of organizations' tables follow it.
CREATE FUNCTION lokadb.ddl_shape(rel oid) RETURNS jsonb
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
SELECT jsonb_build_object(
    'cols', coalesce((
        SELECT jsonb_object_agg(a.attnum::text, jsonb_build_object(
                   'name', a.attname,
                   'type', format_type(a.atttypid, a.atttypmod)
                           || CASE WHEN a.attcollation <> 0 AND a.attcollation <> ty.typcollation
                                   THEN ' COLLATE ' || a.attcollation::regcollation::text ELSE '' END,
                   'notnull', a.attnotnull,
                   'default', pg_get_expr(d.adbin, d.adrelid)))
        FROM pg_attribute a
        JOIN pg_type ty ON ty.oid = a.atttypid
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        WHERE a.attrelid = rel AND a.attnum > 0 AND NOT a.attisdropped), '{}'),
    'indexes', coalesce((
        SELECT jsonb_object_agg(c.relname, jsonb_build_object(
                   'oid', i.indexrelid::bigint,
                   'def', replace(pg_get_indexdef(i.indexrelid), ' ON ONLY ', ' ON ')))
        FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
        WHERE i.indrelid = rel), '{}'),
    'checks', coalesce((
        SELECT jsonb_object_agg(k.conname, jsonb_build_object(
                   'oid', k.oid::bigint, 'def', pg_get_constraintdef(k.oid)))
        FROM pg_constraint k
        WHERE k.conrelid = rel AND k.contype = 'c'), '{}'))
$$;

-- The statements that take an organization's table `tbl` from shape `b` to shape `a`.
-- Organizations' tables have no defaults (writes through the cloud get the cloud's): a
-- column added with one gets it only to fill the rows already there. Types change with a
-- plain cast (the cloud's USING expression is not known here).
CREATE FUNCTION lokadb.ddl_delta(tbl text, b jsonb, a jsonb) RETURNS text[]
LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    out text[] := '{}';
    k text;
    v jsonb;
    o jsonb;
    renames int;
    schema_of text := split_part(tbl, '.', 1);
BEGIN
    -- Indexes and checks that are gone or changed: first (a dropped column takes its own with
    -- it, hence IF EXISTS). Same name and same object, or same definition: unchanged.
    FOR k, v IN SELECT key, value FROM jsonb_each(b->'indexes') ORDER BY key LOOP
        o := a->'indexes'->k;
        IF o IS NULL OR (o->>'oid' <> v->>'oid' AND o->>'def' <> v->>'def') THEN
            out := out || format('DROP INDEX IF EXISTS %s.%I', schema_of, k);
        END IF;
    END LOOP;
    FOR k, v IN SELECT key, value FROM jsonb_each(b->'checks') ORDER BY key LOOP
        o := a->'checks'->k;
        IF o IS NULL OR (o->>'oid' <> v->>'oid' AND o->>'def' <> v->>'def') THEN
            out := out || format('ALTER TABLE %s DROP CONSTRAINT IF EXISTS %I', tbl, k);
        END IF;
    END LOOP;
    -- Columns, by attnum: gone, renamed (through a temporary name when several, so that
    -- swaps work), retyped, NOT NULL changed, added.
    FOR k, v IN SELECT key, value FROM jsonb_each(b->'cols')
                WHERE NOT (a->'cols') ? key ORDER BY key::int LOOP
        out := out || format('ALTER TABLE %s DROP COLUMN %I', tbl, v->>'name');
    END LOOP;
    SELECT count(*) INTO renames FROM jsonb_each(b->'cols') x
    WHERE (a->'cols') ? x.key AND a->'cols'->x.key->>'name' <> x.value->>'name';
    FOR k, v IN SELECT key, value FROM jsonb_each(b->'cols') x
                WHERE (a->'cols') ? x.key AND a->'cols'->x.key->>'name' <> x.value->>'name'
                ORDER BY key::int LOOP
        out := out || format('ALTER TABLE %s RENAME COLUMN %I TO %I', tbl, v->>'name',
                             CASE WHEN renames > 1 THEN 'lokadb_renaming_' || k
                                  ELSE a->'cols'->k->>'name' END);
    END LOOP;
    IF renames > 1 THEN
        FOR k, v IN SELECT key, value FROM jsonb_each(b->'cols') x
                    WHERE (a->'cols') ? x.key AND a->'cols'->x.key->>'name' <> x.value->>'name'
                    ORDER BY key::int LOOP
            out := out || format('ALTER TABLE %s RENAME COLUMN %I TO %I', tbl,
                                 'lokadb_renaming_' || k, a->'cols'->k->>'name');
        END LOOP;
    END IF;
    FOR k, v IN SELECT key, value FROM jsonb_each(a->'cols')
                WHERE (b->'cols') ? key ORDER BY key::int LOOP
        o := b->'cols'->k;
        IF v->>'type' <> o->>'type' THEN
            out := out || format('ALTER TABLE %s ALTER COLUMN %I TYPE %s USING %I::%s', tbl,
                                 v->>'name', v->>'type', v->>'name', v->>'type');
        END IF;
        IF (v->>'notnull')::bool AND NOT (o->>'notnull')::bool THEN
            out := out || format('ALTER TABLE %s ALTER COLUMN %I SET NOT NULL', tbl, v->>'name');
        ELSIF NOT (v->>'notnull')::bool AND (o->>'notnull')::bool THEN
            out := out || format('ALTER TABLE %s ALTER COLUMN %I DROP NOT NULL', tbl, v->>'name');
        END IF;
    END LOOP;
    FOR k, v IN SELECT key, value FROM jsonb_each(a->'cols')
                WHERE NOT (b->'cols') ? key ORDER BY key::int LOOP
        out := out || format('ALTER TABLE %s ADD COLUMN %I %s%s%s', tbl, v->>'name', v->>'type',
                             CASE WHEN v->>'default' IS NOT NULL THEN ' DEFAULT ' || (v->>'default') ELSE '' END,
                             CASE WHEN (v->>'notnull')::bool THEN ' NOT NULL' ELSE '' END);
        IF v->>'default' IS NOT NULL THEN
            out := out || format('ALTER TABLE %s ALTER COLUMN %I DROP DEFAULT', tbl, v->>'name');
        END IF;
    END LOOP;
    -- New or changed checks and indexes, once every column is there.
    FOR k, v IN SELECT key, value FROM jsonb_each(a->'checks') ORDER BY key LOOP
        o := b->'checks'->k;
        IF o IS NULL OR (o->>'oid' <> v->>'oid' AND o->>'def' <> v->>'def') THEN
            out := out || format('ALTER TABLE %s ADD CONSTRAINT %I %s', tbl, k, v->>'def');
        END IF;
    END LOOP;
    FOR k, v IN SELECT key, value FROM jsonb_each(a->'indexes') ORDER BY key LOOP
        o := b->'indexes'->k;
        IF o IS NULL OR (o->>'oid' <> v->>'oid' AND o->>'def' <> v->>'def') THEN
            out := out || (v->>'def');
        END IF;
    END LOOP;
    RETURN out;
END
$$;

-- The shapes before this transaction's first DDL; deleted at its commit.
CREATE TABLE lokadb.ddl_before (
    xid   xid8 NOT NULL DEFAULT pg_current_xact_id(),
    rel   oid NOT NULL,
    shape jsonb NOT NULL,
    PRIMARY KEY (xid, rel)
);

-- One row per transaction with DDL: its insert queues the deferred trigger that runs at COMMIT.
CREATE TABLE lokadb.ddl_round (xid xid8 PRIMARY KEY DEFAULT pg_current_xact_id());

-- Transactions prepared in organizations' databases whose cloud transaction committed, until
-- lokadb.ddl_resolve() has committed them there.
CREATE TABLE lokadb.ddl_prepared (
    gid        text NOT NULL,
    org        text NOT NULL,
    statements text NOT NULL,
    at         timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (gid, org)
);

-- Moves once before and once after every round that prepares anything (whether its cloud
-- transaction commits or not): the proxy's resolver looks for prepared transactions of rolled
-- back cloud transactions while it moves (sequences ignore rollbacks).
CREATE SEQUENCE lokadb.ddl_attempt;

CREATE FUNCTION lokadb.ddl_start() RETURNS event_trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM lokadb.org WHERE state = 'moved') THEN
        RETURN;
    END IF;
    IF EXISTS (SELECT 1 FROM lokadb.ddl_prepared p
               WHERE split_part(p.gid, '_', 3) = pg_current_xact_id()::text) THEN
        RAISE EXCEPTION 'this transaction''s changes to LokaDB tables are already prepared in the organizations'' databases'
            USING ERRCODE = '55000',
                  HINT = 'SET CONSTRAINTS ALL IMMEDIATE ran them early; run further DDL in a new transaction.';
    END IF;
    INSERT INTO lokadb.ddl_before (rel, shape)
    SELECT r, lokadb.ddl_shape(r)
    FROM (SELECT to_regclass(format('%I.%I', t.schema_name, t.table_name))::oid AS r
          FROM lokadb.tables t WHERE t.state = 'enabled') s
    WHERE r IS NOT NULL
    ON CONFLICT DO NOTHING;
    INSERT INTO lokadb.ddl_round DEFAULT VALUES ON CONFLICT DO NOTHING;
END
$$;

-- The organizations whose rows of `rel` are in their own database (a foreign partition on
-- their server under it).
CREATE FUNCTION lokadb.ddl_orgs(rel oid) RETURNS TABLE (org text, server name)
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
SELECT o.id, o.server
FROM lokadb.org o
WHERE o.state = 'moved'
  AND EXISTS (SELECT 1
              FROM pg_partition_tree(rel) p
              JOIN pg_foreign_table f ON f.ftrelid = p.relid
              JOIN pg_foreign_server s ON s.oid = f.ftserver
              WHERE s.srvname = o.server)
ORDER BY o.id
$$;

-- At COMMIT of a transaction that ran DDL while organizations are moved.
CREATE FUNCTION lokadb.ddl_commit() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    me xid8 := pg_current_xact_id();
    gid text;
    g text;
    b record;
    o record;
    stmts text[];
    per_org jsonb := '{}';   -- org -> {server, statements[]}
    conns text[] := '{}';
    orgs text[] := '{}';
    failed jsonb := '{}';    -- org -> {code, message}
    prepared text[] := '{}';
    lock_timeout text := coalesce(nullif(current_setting('lokadb.migration_lock_timeout', true), ''), '5s');
    c text;
    i int;
    phase int;
    sql text;
    e_code text; e_msg text; e_detail text;
    lines text := '';
    first_code text;
BEGIN
    FOR b IN SELECT d.rel, d.shape, format('%I.%I', n.nspname, cl.relname) AS tbl
             FROM lokadb.ddl_before d
             JOIN pg_class cl ON cl.oid = d.rel
             JOIN pg_namespace n ON n.oid = cl.relnamespace
             WHERE d.xid = me
             ORDER BY d.rel LOOP
        stmts := lokadb.ddl_delta(b.tbl, b.shape, lokadb.ddl_shape(b.rel));
        CONTINUE WHEN cardinality(stmts) = 0;
        FOR o IN SELECT * FROM lokadb.ddl_orgs(b.rel) LOOP
            per_org := jsonb_set(per_org, ARRAY[o.org], jsonb_build_object(
                'server', o.server,
                'statements', coalesce(per_org->o.org->'statements', '[]') || to_jsonb(stmts)));
        END LOOP;
    END LOOP;
    DELETE FROM lokadb.ddl_before WHERE xid = me;
    DELETE FROM lokadb.ddl_round WHERE xid = me;
    IF per_org = '{}' THEN
        RETURN NULL;
    END IF;
    -- Each organization's transaction is prepared as gid_<its id's md5, shortened>: a gid is
    -- unique in a whole Postgres cluster, and organizations may share one.
    gid := format('lokadb_ddl_%s_%s', me, nextval('lokadb.ddl_attempt'));
    SELECT array_agg(k ORDER BY k) INTO orgs FROM jsonb_object_keys(per_org) k;

    -- Open every connection and send BEGIN (each connection is opened in turn: dblink has no
    -- asynchronous connect), then run the statements everywhere at once, then PREPARE
    -- everywhere at once: the cloud's locks are held about as long as the slowest
    -- organization needs, plus the connections.
    FOR i IN 1 .. cardinality(orgs) LOOP
        c := 'lokadb_ddl_' || orgs[i];
        conns := conns || c;
        BEGIN
            IF c = ANY (coalesce(dblink_get_connections(), '{}')) THEN
                PERFORM dblink_disconnect(c);
            END IF;
            PERFORM dblink_connect(c, per_org->orgs[i]->>'server');
            -- An earlier migration committed in the cloud whose second phase has not run yet
            -- (no resolver, or not yet) holds the table's locks there: finish it first, or
            -- this one would wait for it.
            FOR g IN SELECT p.gid FROM lokadb.ddl_prepared p WHERE p.org = orgs[i] ORDER BY p.at LOOP
                BEGIN
                    PERFORM dblink_exec(c, format('COMMIT PREPARED %L', g));
                EXCEPTION WHEN undefined_object THEN
                    NULL;  -- committed there already
                END;
                DELETE FROM lokadb.ddl_prepared p WHERE p.org = orgs[i] AND p.gid = g;
            END LOOP;
            PERFORM dblink_send_query(c, 'BEGIN');
        EXCEPTION WHEN OTHERS THEN
            GET STACKED DIAGNOSTICS e_code = RETURNED_SQLSTATE, e_msg = MESSAGE_TEXT, e_detail = PG_EXCEPTION_DETAIL;
            failed := failed || jsonb_build_object(orgs[i], jsonb_build_object(
                'code', e_code, 'message', e_msg || coalesce(': ' || nullif(e_detail, ''), '')));
        END;
    END LOOP;
    FOR phase IN 1 .. 3 LOOP
        FOR i IN 1 .. cardinality(orgs) LOOP
            CONTINUE WHEN failed ? orgs[i];
            c := conns[i];
            BEGIN
                IF phase > 1 THEN
                    IF phase = 2 THEN
                        -- One block: one result to collect, and the statements' text
                        -- passes quoted, whatever it holds.
                        SELECT 'DO ' || quote_literal(
                                   format('BEGIN PERFORM set_config(%L, %L, true); ', 'lock_timeout', lock_timeout)
                                   || string_agg(format('EXECUTE %L;', s), ' ') || ' END')
                        INTO sql FROM jsonb_array_elements_text(per_org->orgs[i]->'statements') s;
                    ELSE
                        sql := format('PREPARE TRANSACTION %L', gid || '_' || left(md5(orgs[i]), 12));
                    END IF;
                    PERFORM dblink_send_query(c, sql);
                END IF;
            EXCEPTION WHEN OTHERS THEN
                GET STACKED DIAGNOSTICS e_code = RETURNED_SQLSTATE, e_msg = MESSAGE_TEXT, e_detail = PG_EXCEPTION_DETAIL;
                failed := failed || jsonb_build_object(orgs[i], jsonb_build_object(
                    'code', e_code, 'message', e_msg || coalesce(': ' || nullif(e_detail, ''), '')));
            END;
        END LOOP;
        FOR i IN 1 .. cardinality(orgs) LOOP
            CONTINUE WHEN failed ? orgs[i];
            c := conns[i];
            BEGIN
                PERFORM * FROM dblink_get_result(c, true) AS t(status text);
                PERFORM * FROM dblink_get_result(c, true) AS t(status text);
                IF phase = 3 THEN
                    prepared := prepared || orgs[i];
                END IF;
            EXCEPTION WHEN OTHERS THEN
                GET STACKED DIAGNOSTICS e_code = RETURNED_SQLSTATE, e_msg = MESSAGE_TEXT, e_detail = PG_EXCEPTION_DETAIL;
                failed := failed || jsonb_build_object(orgs[i], jsonb_build_object(
                    'code', e_code, 'message', e_msg || coalesce(': ' || nullif(e_detail, ''), '')));
            END;
        END LOOP;
    END LOOP;
    PERFORM nextval('lokadb.ddl_attempt');

    IF failed <> '{}' THEN
        -- Nothing may stay changed: roll back what was prepared; a connection closed ends the
        -- rest. What cannot be rolled back now stays prepared for lokadb.ddl_resolve(), which
        -- rolls it back (this cloud transaction will not have committed).
        FOR i IN 1 .. cardinality(orgs) LOOP
            c := conns[i];
            BEGIN
                IF orgs[i] = ANY (prepared) THEN
                    PERFORM dblink_exec(c, format('ROLLBACK PREPARED %L', gid || '_' || left(md5(orgs[i]), 12)));
                END IF;
            EXCEPTION WHEN OTHERS THEN
                NULL;
            END;
            IF c = ANY (coalesce(dblink_get_connections(), '{}')) THEN
                PERFORM dblink_disconnect(c);
            END IF;
        END LOOP;
        SELECT string_agg(format('organization %s: %s (SQLSTATE %s)', k, failed->k->>'message', failed->k->>'code'), E'\n' ORDER BY k),
               (array_agg(failed->k->>'code' ORDER BY k))[1],
               string_agg(k, ', ' ORDER BY k)
        INTO lines, first_code, e_msg
        FROM jsonb_object_keys(failed) k;
        RAISE EXCEPTION 'migration not applied: organization% % could not take it%',
                CASE WHEN position(',' IN e_msg) > 0 THEN 's' ELSE '' END, e_msg,
                CASE WHEN position(',' IN e_msg) > 0 THEN ''
                     ELSE ': ' || (failed->(SELECT k FROM jsonb_object_keys(failed) k LIMIT 1)->>'message') END
            USING ERRCODE = coalesce(first_code, '58000'),
                  DETAIL = lines,
                  HINT = 'Nothing was changed, in the cloud or in any organization''s database. Bring the organization''s database back (its agent connected, the conflict fixed) and run the migration again.';
    END IF;

    FOR i IN 1 .. cardinality(orgs) LOOP
        PERFORM dblink_disconnect(conns[i]);
        INSERT INTO lokadb.ddl_prepared (gid, org, statements)
        VALUES (gid || '_' || left(md5(orgs[i]), 12), orgs[i], array_to_string(ARRAY(SELECT jsonb_array_elements_text(per_org->orgs[i]->'statements')), E';\n'));
    END LOOP;
    -- Delivered only if this transaction commits: the proxy then commits the prepared ones.
    PERFORM pg_notify('lokadb_ddl', gid);
    -- Columns and constraints the proxy's routing reads may have changed.
    PERFORM lokadb.touch();
    RETURN NULL;
END
$$;

CREATE CONSTRAINT TRIGGER lokadb_ddl_commit AFTER INSERT ON lokadb.ddl_round
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION lokadb.ddl_commit();

CREATE EVENT TRIGGER lokadb_ddl_start ON ddl_command_start
    WHEN TAG IN ('ALTER TABLE', 'CREATE INDEX', 'DROP INDEX', 'ALTER INDEX')
    EXECUTE FUNCTION lokadb.ddl_start();

-- Settles the transactions LokaDB prepared in organizations' databases: committed where the
-- cloud's transaction committed (its row in lokadb.ddl_prepared), rolled back where it did
-- not; those of cloud transactions still running are left (in_doubt). `sweep` asks every
-- organization with a server; otherwise only those with committed rows.
CREATE FUNCTION lokadb.ddl_resolve(sweep boolean DEFAULT true,
                                   OUT committed int, OUT rolled_back int,
                                   OUT in_doubt int, OUT unreachable int)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    o record;
    g text;
    c text;
    left_ text[];
    st text;
BEGIN
    committed := 0; rolled_back := 0; in_doubt := 0; unreachable := 0;
    FOR o IN SELECT id, server FROM lokadb.org
             WHERE server IS NOT NULL
               AND (sweep OR id IN (SELECT p.org FROM lokadb.ddl_prepared p))
             ORDER BY id LOOP
        c := 'lokadb_resolve_' || o.id;
        left_ := '{}';
        BEGIN
            IF c = ANY (coalesce(dblink_get_connections(), '{}')) THEN
                PERFORM dblink_disconnect(c);
            END IF;
            PERFORM dblink_connect(c, o.server);
        EXCEPTION WHEN OTHERS THEN
            unreachable := unreachable + 1;
            CONTINUE;
        END;
        FOR g IN SELECT t.gid FROM dblink(c,
                    $q$SELECT gid FROM pg_prepared_xacts
                       WHERE gid LIKE 'lokadb\_ddl\_%' AND database = current_database()$q$) AS t(gid text)
        LOOP
            BEGIN
                st := pg_xact_status(split_part(g, '_', 3)::xid8);
                IF st = 'in progress' THEN
                    in_doubt := in_doubt + 1;
                    left_ := left_ || g;
                ELSIF EXISTS (SELECT 1 FROM lokadb.ddl_prepared p WHERE p.gid = g AND p.org = o.id) THEN
                    PERFORM dblink_exec(c, format('COMMIT PREPARED %L', g));
                    committed := committed + 1;
                ELSE
                    PERFORM dblink_exec(c, format('ROLLBACK PREPARED %L', g));
                    rolled_back := rolled_back + 1;
                END IF;
            EXCEPTION WHEN OTHERS THEN
                -- Another resolver settled it meanwhile, or the organization went away: the
                -- next call sees.
                left_ := left_ || g;
            END;
        END LOOP;
        DELETE FROM lokadb.ddl_prepared p WHERE p.org = o.id AND p.gid <> ALL (left_);
        PERFORM dblink_disconnect(c);
    END LOOP;
END
$$;

-- The functions that call dblink find it where it is.
DO $$
DECLARE s name := (SELECT n.nspname FROM pg_extension e JOIN pg_namespace n ON n.oid = e.extnamespace
                   WHERE e.extname = 'dblink');
BEGIN
    EXECUTE format('ALTER FUNCTION lokadb.ddl_commit() SET search_path = pg_catalog, %I, pg_temp', s);
    EXECUTE format('ALTER FUNCTION lokadb.ddl_resolve(boolean) SET search_path = pg_catalog, %I, pg_temp', s);
END
$$;
