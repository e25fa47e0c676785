-- Version 14: a migration's connections to organizations are opened before it takes the cloud's
-- locks and kept for the session's next migration (docs/migrations.md, "Locks").
--
-- dblink opens connections one after another (it has no asynchronous connect), each a few
-- round trips through the relay and the agent; opened at COMMIT, they were paid while the
-- migration's cloud locks were held (1.4 s at ten organizations 40 ms away,
-- research/bench/migrations.py). Now lokadb_ddl_start_connect opens them at the start of a
-- statement that names a LokaDB table, before that statement's locks; lokadb.ddl_commit uses
-- them, opens what is missing, and leaves them open: the next migration of the session (a
-- migration tool runs many in one) pays none. A kept connection that died since is opened
-- again once. lokadb.ddl_resolve decides by the cloud's row first (a committing transaction
-- was rolled back in a race). An earlier migration's rows in lokadb.ddl_prepared that a resolver is deleting
-- are skipped, not waited for. A column added NOT NULL with a default that the same
-- transaction drops (Django's way) fills the organizations' rows with that default.

-- Closes dblink connection `c` if this session has it (a broken one too).
CREATE FUNCTION lokadb.ddl_disconnect(c text) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF c = ANY (coalesce(dblink_get_connections(), '{}')) THEN
        PERFORM dblink_disconnect(c);
    END IF;
END
$$;

-- At the start of DDL (ALTER TABLE, CREATE/DROP/ALTER INDEX) whose text names a LokaDB table
-- with moved organizations: opens the connections its COMMIT will use, unless open. The
-- name is matched in the statement's text (the command's target is not known before it
-- runs): a statement that merely mentions it costs connections opened early, nothing else.
-- A connection that fails here is tried again at COMMIT, which reports it.
CREATE FUNCTION lokadb.ddl_connect_ahead() RETURNS event_trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    q text := lower(coalesce(current_query(), ''));
    o record;
    c text;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM lokadb.org WHERE state IN ('moved', 'returning')) THEN
        RETURN;
    END IF;
    FOR o IN SELECT DISTINCT d.org, d.server
             FROM (SELECT to_regclass(format('%I.%I', t.schema_name, t.table_name))::oid AS r
                   FROM lokadb.tables t
                   WHERE t.state = 'enabled' AND position(lower(t.table_name) IN q) > 0) s,
                  LATERAL lokadb.ddl_orgs(s.r) d
             WHERE s.r IS NOT NULL
             ORDER BY d.org LOOP
        c := 'lokadb_ddl_' || o.org;
        CONTINUE WHEN c = ANY (coalesce(dblink_get_connections(), '{}'));
        BEGIN
            PERFORM dblink_connect(c, o.server);
        EXCEPTION WHEN OTHERS THEN
            NULL;
        END;
    END LOOP;
END
$$;

CREATE EVENT TRIGGER lokadb_ddl_start_connect ON ddl_command_start
    WHEN TAG IN ('ALTER TABLE', 'CREATE INDEX', 'DROP INDEX', 'ALTER INDEX')
    EXECUTE FUNCTION lokadb.ddl_connect_ahead();

-- What fills the rows already there when a column is added NOT NULL: its default at the end
-- of the statement that added it. Migration tools add a column with a default to fill the
-- rows and drop the default in the same transaction (Django: ADD COLUMN … DEFAULT 0 NOT NULL,
-- then ALTER COLUMN … DROP DEFAULT): at COMMIT the cloud's table has no default left, and the
-- organizations' rows would have nothing to be filled with.
CREATE TABLE lokadb.ddl_fill (
    xid    xid8 NOT NULL DEFAULT pg_current_xact_id(),
    rel    oid NOT NULL,
    attnum int2 NOT NULL,
    expr   text NOT NULL,
    PRIMARY KEY (xid, rel, attnum)
);

CREATE FUNCTION lokadb.ddl_note_fill() RETURNS event_trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    INSERT INTO lokadb.ddl_fill (rel, attnum, expr)
    SELECT b.rel, a.attnum, pg_get_expr(d.adbin, d.adrelid)
    FROM lokadb.ddl_before b
    JOIN pg_attribute a ON a.attrelid = b.rel AND a.attnum > 0 AND NOT a.attisdropped
    JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
    WHERE b.xid = pg_current_xact_id() AND NOT (b.shape->'cols') ? a.attnum::text
    ON CONFLICT DO NOTHING;
END
$$;

CREATE EVENT TRIGGER lokadb_ddl_end_fill ON ddl_command_end
    WHEN TAG IN ('ALTER TABLE')
    EXECUTE FUNCTION lokadb.ddl_note_fill();

-- Shape `a` of `rel` with each column added in transaction `me` that has no default now
-- given the one it was added with (lokadb.ddl_fill): the organization's ADD COLUMN fills its
-- rows with it and drops it (lokadb.ddl_delta), as the cloud's rows were filled.
CREATE FUNCTION lokadb.ddl_with_fill(me xid8, rel oid, a jsonb) RETURNS jsonb
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
SELECT coalesce(jsonb_set(a, '{cols}', (a->'cols') || (
           SELECT jsonb_object_agg(f.attnum::text,
                                   jsonb_set(a->'cols'->(f.attnum::text), '{default}', to_jsonb(f.expr)))
           FROM lokadb.ddl_fill f
           WHERE f.xid = me AND f.rel = ddl_with_fill.rel
             AND (a->'cols') ? f.attnum::text
             AND a->'cols'->(f.attnum::text)->>'default' IS NULL)), a)
$$;

-- At COMMIT (version 11's, with the connections kept and opened ahead).
CREATE OR REPLACE FUNCTION lokadb.ddl_commit() RETURNS trigger
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
    attempt int;
    fresh boolean;
    reused text[] := '{}';   -- orgs whose connection was open before this COMMIT
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
        stmts := lokadb.ddl_delta(b.tbl, b.shape, lokadb.ddl_with_fill(me, b.rel, lokadb.ddl_shape(b.rel)));
        CONTINUE WHEN cardinality(stmts) = 0;
        FOR o IN SELECT * FROM lokadb.ddl_orgs(b.rel) LOOP
            per_org := jsonb_set(per_org, ARRAY[o.org], jsonb_build_object(
                'server', o.server,
                'statements', coalesce(per_org->o.org->'statements', '[]') || to_jsonb(stmts)));
        END LOOP;
    END LOOP;
    DELETE FROM lokadb.ddl_before WHERE xid = me;
    DELETE FROM lokadb.ddl_fill WHERE xid = me;
    DELETE FROM lokadb.ddl_round WHERE xid = me;
    IF per_org = '{}' THEN
        RETURN NULL;
    END IF;
    -- Each organization's transaction is prepared as gid_<its id's md5, shortened>: a gid is
    -- unique in a whole Postgres cluster, and organizations may share one.
    gid := format('lokadb_ddl_%s_%s', me, nextval('lokadb.ddl_attempt'));
    SELECT array_agg(k ORDER BY k) INTO orgs FROM jsonb_object_keys(per_org) k;

    -- Send BEGIN on every organization's connection: kept from an earlier migration of this
    -- session or opened ahead by lokadb.ddl_connect_ahead() (before this transaction's first
    -- DDL took the cloud's locks), else opened now, one after another (dblink has no
    -- asynchronous connect). Then run the statements everywhere at once, then PREPARE
    -- everywhere at once: the cloud's locks are held about as long as the slowest
    -- organization needs.
    FOR i IN 1 .. cardinality(orgs) LOOP
        c := 'lokadb_ddl_' || orgs[i];
        conns := conns || c;
        FOR attempt IN 1 .. 2 LOOP
            fresh := NOT (c = ANY (coalesce(dblink_get_connections(), '{}')));
            BEGIN
                IF fresh THEN
                    PERFORM dblink_connect(c, per_org->orgs[i]->>'server');
                END IF;
                -- An earlier migration committed in the cloud whose second phase has not run
                -- yet (no resolver, or not yet) holds the table's locks there: finish it
                -- first, or this one would wait for it. Rows a resolver is deleting are
                -- skipped: it has settled them, and its transaction may go on for a while
                -- with other organizations (waiting for it held the cloud's locks 1.4 s).
                FOR g IN SELECT p.gid FROM lokadb.ddl_prepared p WHERE p.org = orgs[i]
                         ORDER BY p.at FOR UPDATE SKIP LOCKED LOOP
                    BEGIN
                        PERFORM dblink_exec(c, format('COMMIT PREPARED %L', g));
                    EXCEPTION WHEN undefined_object THEN
                        NULL;  -- committed there already
                    END;
                    DELETE FROM lokadb.ddl_prepared p WHERE p.org = orgs[i] AND p.gid = g;
                END LOOP;
                PERFORM dblink_send_query(c, 'BEGIN');
                IF NOT fresh THEN
                    reused := reused || orgs[i];
                END IF;
                EXIT;
            EXCEPTION WHEN OTHERS THEN
                GET STACKED DIAGNOSTICS e_code = RETURNED_SQLSTATE, e_msg = MESSAGE_TEXT, e_detail = PG_EXCEPTION_DETAIL;
                PERFORM lokadb.ddl_disconnect(c);
                -- A kept connection may have died since (the organization's database or
                -- agent restarted): once more, on a new one.
                IF fresh THEN
                    failed := failed || jsonb_build_object(orgs[i], jsonb_build_object(
                        'code', e_code, 'message', e_msg || coalesce(': ' || nullif(e_detail, ''), '')));
                    EXIT;
                END IF;
            END;
        END LOOP;
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
                IF phase = 1 AND orgs[i] = ANY (reused) THEN
                    -- A kept connection that died since took the BEGIN without a word: a new
                    -- one, and BEGIN there.
                    BEGIN
                        PERFORM lokadb.ddl_disconnect(c);
                        PERFORM dblink_connect(c, per_org->orgs[i]->>'server');
                        PERFORM dblink_exec(c, 'BEGIN');
                        CONTINUE;
                    EXCEPTION WHEN OTHERS THEN
                        GET STACKED DIAGNOSTICS e_code = RETURNED_SQLSTATE, e_msg = MESSAGE_TEXT, e_detail = PG_EXCEPTION_DETAIL;
                    END;
                END IF;
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
            PERFORM lokadb.ddl_disconnect(c);
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

    -- The connections stay open for this session's next migration (a migration tool runs
    -- many in one session); they close with the cloud backend.
    FOR i IN 1 .. cardinality(orgs) LOOP
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

-- Settles the transactions LokaDB prepared in organizations' databases (version 11's, one
-- organization after another as before). The decision looks for the cloud's row first: a
-- transaction that is committing is 'committed' for pg_xact_status a moment before a new
-- snapshot sees its rows, and a sweep that met that moment rolled back a migration the cloud
-- kept (found by research/bench/migrations.py). Rolled back only when the cloud's
-- transaction aborted; left for the next call while it runs or is committing.
CREATE OR REPLACE FUNCTION lokadb.ddl_resolve(sweep boolean DEFAULT true,
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
            PERFORM lokadb.ddl_disconnect(c);
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
                IF EXISTS (SELECT 1 FROM lokadb.ddl_prepared p WHERE p.gid = g AND p.org = o.id) THEN
                    PERFORM dblink_exec(c, format('COMMIT PREPARED %L', g));
                    committed := committed + 1;
                    CONTINUE;
                END IF;
                st := pg_xact_status(split_part(g, '_', 3)::xid8);
                IF st = 'aborted' OR st IS NULL THEN
                    PERFORM dblink_exec(c, format('ROLLBACK PREPARED %L', g));
                    rolled_back := rolled_back + 1;
                ELSE
                    in_doubt := in_doubt + 1;
                    left_ := left_ || g;
                END IF;
            EXCEPTION WHEN OTHERS THEN
                -- Another resolver settled it meanwhile, or the organization went away: the
                -- next call sees.
                left_ := left_ || g;
            END;
        END LOOP;
        DELETE FROM lokadb.ddl_prepared p WHERE p.org = o.id AND p.gid <> ALL (left_);
        PERFORM lokadb.ddl_disconnect(c);
    END LOOP;
END
$$;

-- The functions that call dblink find it where it is.
DO $$
DECLARE s name := (SELECT n.nspname FROM pg_extension e JOIN pg_namespace n ON n.oid = e.extnamespace
                   WHERE e.extname = 'dblink');
BEGIN
    EXECUTE format('ALTER FUNCTION lokadb.ddl_commit() SET search_path = pg_catalog, %I, pg_temp', s);
    EXECUTE format('ALTER FUNCTION lokadb.ddl_disconnect(text) SET search_path = pg_catalog, %I, pg_temp', s);
    EXECUTE format('ALTER FUNCTION lokadb.ddl_connect_ahead() SET search_path = pg_catalog, %I, pg_temp', s);
    EXECUTE format('ALTER FUNCTION lokadb.ddl_resolve(boolean) SET search_path = pg_catalog, %I, pg_temp', s);
END
$$;
