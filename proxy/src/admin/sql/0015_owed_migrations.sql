-- Version 15: an organization that cannot be reached need not stop every deploy
-- (docs/migrations.md, "An organization offline").
--
-- By default a migration that cannot reach a moved organization fails and changes nothing
-- (version 11). With `lokadb.migration_offline = defer` (a setting: per session, role or
-- database) it goes on for the others when every organization that failed could not be
-- reached (SQLSTATE class 08); each of those owes the migration's statements, recorded in
-- lokadb.ddl_owed in the migration's own transaction. The proxy refuses an owing
-- organization's statements (55000) until lokadb.ddl_sync() has applied what it owes, in
-- order, in one prepared transaction there: `lokadb org sync ORG`, or the proxy's resolver
-- once the organization can be reached again. A later migration that reaches an owing
-- organization applies what it owes first, in the same transaction.
--
-- ddl_commit's work in organizations is now lokadb.ddl_prepare_in(), shared with ddl_sync.

CREATE TABLE lokadb.ddl_owed (
    seq        bigserial PRIMARY KEY,
    org        text NOT NULL,
    statements text[] NOT NULL,
    -- The gid its transaction in the organization would have had: prepared there after all
    -- (its answer lost), it is rolled back (lokadb.ddl_resolve, lokadb.ddl_sync).
    gid        text NOT NULL,
    reason     text NOT NULL,
    at         timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX ON lokadb.ddl_owed (org, seq);

-- `lokadb.migration_offline`: 'fail' (unset or empty too) or 'defer'.
CREATE FUNCTION lokadb.ddl_offline_mode() RETURNS text
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v text := lower(coalesce(nullif(current_setting('lokadb.migration_offline', true), ''), 'fail'));
BEGIN
    IF v NOT IN ('fail', 'defer') THEN
        RAISE EXCEPTION 'invalid value for lokadb.migration_offline: "%"', current_setting('lokadb.migration_offline', true)
            USING ERRCODE = '22023',
                  HINT = 'fail (the default: a migration that cannot reach an organization changes nothing) or defer (it goes on for the others; those it could not reach owe it).';
    END IF;
    RETURN v;
END
$$;

-- Runs `per_org` ({org: {server, statements[], rollback[]}}) in each organization's database
-- in a transaction of its own and prepares it as `gid`_<its id's md5, shortened> (a gid is
-- unique in a whole Postgres cluster, and organizations may share one). Returns those that
-- failed, {org: {code, message}}; the others are prepared. Three round trips whatever the
-- number of organizations: BEGIN everywhere, the statements everywhere, PREPARE everywhere
-- (dblink's asynchronous queries). Connections are `lokadb_ddl_<org>`: kept from an earlier
-- migration of the session or opened ahead (lokadb.ddl_connect_ahead), else opened now; a
-- kept one that died since is opened again once. Before its BEGIN, an organization's
-- `rollback` gids are rolled back (prepared by a round whose answer was lost) and what an
-- earlier migration committed in the cloud but left prepared there is committed.
CREATE FUNCTION lokadb.ddl_prepare_in(per_org jsonb, gid text) RETURNS jsonb
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    g text;
    conns text[] := '{}';
    orgs text[];
    failed jsonb := '{}';
    lock_timeout text := coalesce(nullif(current_setting('lokadb.migration_lock_timeout', true), ''), '5s');
    c text;
    i int;
    phase int;
    attempt int;
    fresh boolean;
    reused text[] := '{}';
    sql text;
    e_code text; e_msg text; e_detail text;
BEGIN
    SELECT array_agg(k ORDER BY k) INTO orgs FROM jsonb_object_keys(per_org) k;
    FOR i IN 1 .. coalesce(cardinality(orgs), 0) LOOP
        c := 'lokadb_ddl_' || orgs[i];
        conns := conns || c;
        FOR attempt IN 1 .. 2 LOOP
            fresh := NOT (c = ANY (coalesce(dblink_get_connections(), '{}')));
            BEGIN
                IF fresh THEN
                    PERFORM dblink_connect(c, per_org->orgs[i]->>'server');
                END IF;
                FOR g IN SELECT jsonb_array_elements_text(coalesce(per_org->orgs[i]->'rollback', '[]')) LOOP
                    BEGIN
                        PERFORM dblink_exec(c, format('ROLLBACK PREPARED %L', g));
                    EXCEPTION WHEN undefined_object THEN
                        NULL;  -- never prepared there
                    END;
                END LOOP;
                -- Rows a resolver is deleting are skipped: it has settled them.
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
                IF fresh THEN
                    failed := failed || jsonb_build_object(orgs[i], jsonb_build_object(
                        'code', e_code, 'message', e_msg || coalesce(': ' || nullif(e_detail, ''), '')));
                    EXIT;
                END IF;
            END;
        END LOOP;
    END LOOP;
    FOR phase IN 1 .. 3 LOOP
        FOR i IN 1 .. coalesce(cardinality(orgs), 0) LOOP
            CONTINUE WHEN failed ? orgs[i];
            c := conns[i];
            BEGIN
                IF phase > 1 THEN
                    IF phase = 2 THEN
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
        FOR i IN 1 .. coalesce(cardinality(orgs), 0) LOOP
            CONTINUE WHEN failed ? orgs[i];
            c := conns[i];
            BEGIN
                PERFORM * FROM dblink_get_result(c, true) AS t(status text);
                PERFORM * FROM dblink_get_result(c, true) AS t(status text);
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
    -- A failed organization's transaction there ends with its connection.
    FOR i IN 1 .. coalesce(cardinality(orgs), 0) LOOP
        IF failed ? orgs[i] THEN
            PERFORM lokadb.ddl_disconnect(conns[i]);
        END IF;
    END LOOP;
    RETURN failed;
END
$$;

-- Rolls back what ddl_prepare_in prepared as `gid` in `orgs` and closes their connections.
-- What cannot be rolled back now stays prepared for lokadb.ddl_resolve(), which rolls it back
-- (its cloud transaction will not have committed).
CREATE FUNCTION lokadb.ddl_unprepare(orgs text[], gid text) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    o text;
BEGIN
    FOREACH o IN ARRAY coalesce(orgs, '{}') LOOP
        BEGIN
            PERFORM dblink_exec('lokadb_ddl_' || o, format('ROLLBACK PREPARED %L', gid || '_' || left(md5(o), 12)));
        EXCEPTION WHEN OTHERS THEN
            NULL;
        END;
        PERFORM lokadb.ddl_disconnect('lokadb_ddl_' || o);
    END LOOP;
END
$$;

-- The error of organizations that could not take a change: `failed` as ddl_prepare_in
-- returns it; `what` begins the message.
CREATE FUNCTION lokadb.ddl_raise(failed jsonb, what text, hint text) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    lines text; first_code text; names text;
    several boolean;
BEGIN
    SELECT string_agg(format('organization %s: %s (SQLSTATE %s)', k, failed->k->>'message', failed->k->>'code'), E'\n' ORDER BY k),
           (array_agg(failed->k->>'code' ORDER BY k))[1],
           string_agg(k, ', ' ORDER BY k), count(*) > 1
    INTO lines, first_code, names, several
    FROM jsonb_object_keys(failed) k;
    RAISE EXCEPTION '%: organization% % could not take it%', what,
            CASE WHEN several THEN 's' ELSE '' END, names,
            CASE WHEN several THEN ''
                 ELSE ': ' || (failed->(SELECT k FROM jsonb_object_keys(failed) k LIMIT 1)->>'message') END
        USING ERRCODE = coalesce(first_code, '58000'), DETAIL = lines, HINT = hint;
END
$$;

-- At COMMIT (version 14's, with owed migrations: an owing organization gets what it owes
-- first; with lokadb.migration_offline = defer, organizations that cannot be reached owe).
CREATE OR REPLACE FUNCTION lokadb.ddl_commit() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    me xid8 := pg_current_xact_id();
    gid text;
    b record;
    o record;
    stmts text[];
    per_org jsonb := '{}';   -- org -> {server, statements[], new[], owed[], rollback[]}
    orgs text[];
    failed jsonb;
    deferred text[] := '{}';
    mode text;
    og text;
    lines text;
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
                'new', coalesce(per_org->o.org->'new', '[]') || to_jsonb(stmts)));
        END LOOP;
    END LOOP;
    DELETE FROM lokadb.ddl_before WHERE xid = me;
    DELETE FROM lokadb.ddl_fill WHERE xid = me;
    DELETE FROM lokadb.ddl_round WHERE xid = me;
    IF per_org = '{}' THEN
        RETURN NULL;
    END IF;
    mode := lokadb.ddl_offline_mode();
    SELECT array_agg(k ORDER BY k) INTO orgs FROM jsonb_object_keys(per_org) k;
    -- What an organization owes comes first, in order (its rows locked: a sync waits).
    FOR o IN SELECT w.org, jsonb_agg(u.stmt ORDER BY w.seq, u.n) AS statements,
                    jsonb_agg(DISTINCT w.seq) AS seqs, jsonb_agg(DISTINCT w.gid) AS gids
             FROM (SELECT * FROM lokadb.ddl_owed WHERE org = ANY (orgs) ORDER BY seq FOR UPDATE) w,
                  unnest(w.statements) WITH ORDINALITY u(stmt, n)
             GROUP BY w.org LOOP
        per_org := jsonb_set(per_org, ARRAY[o.org], per_org->o.org || jsonb_build_object(
            'owed', o.seqs, 'rollback', o.gids, 'statements', o.statements));
    END LOOP;
    FOREACH og IN ARRAY orgs LOOP
        per_org := jsonb_set(per_org, ARRAY[og, 'statements'],
                             coalesce(per_org->og->'statements', '[]') || (per_org->og->'new'));
    END LOOP;
    gid := format('lokadb_ddl_%s_%s', me, nextval('lokadb.ddl_attempt'));
    failed := lokadb.ddl_prepare_in(per_org, gid);
    PERFORM nextval('lokadb.ddl_attempt');

    IF failed <> '{}' THEN
        IF mode = 'defer' AND NOT EXISTS (SELECT 1 FROM jsonb_object_keys(failed) k
                                          WHERE (failed->k->>'code') NOT LIKE '08%') THEN
            -- Every organization that failed could not be reached: they owe it.
            SELECT array_agg(k ORDER BY k) INTO deferred FROM jsonb_object_keys(failed) k;
        ELSE
            PERFORM lokadb.ddl_unprepare(
                ARRAY(SELECT x FROM unnest(orgs) x WHERE NOT failed ? x), gid);
            PERFORM lokadb.ddl_raise(failed, 'migration not applied',
                'Nothing was changed, in the cloud or in any organization''s database. Bring the organization''s database back (its agent connected, the conflict fixed) and run the migration again'
                || CASE WHEN mode = 'fail' AND NOT EXISTS (SELECT 1 FROM jsonb_object_keys(failed) k
                                                           WHERE (failed->k->>'code') NOT LIKE '08%')
                        THEN ', or run it with SET lokadb.migration_offline = defer to go on without the organizations that cannot be reached (they then owe it).'
                        ELSE '.' END);
        END IF;
    END IF;

    FOREACH og IN ARRAY orgs LOOP
        IF og = ANY (deferred) THEN
            INSERT INTO lokadb.ddl_owed (org, statements, gid, reason)
            VALUES (og, ARRAY(SELECT jsonb_array_elements_text(per_org->og->'new')),
                    gid || '_' || left(md5(og), 12), failed->og->>'message');
        ELSE
            -- The connections stay open for this session's next migration (a migration
            -- tool runs many in one session); they close with the cloud backend.
            INSERT INTO lokadb.ddl_prepared (gid, org, statements)
            VALUES (gid || '_' || left(md5(og), 12), og,
                    array_to_string(ARRAY(SELECT jsonb_array_elements_text(per_org->og->'statements')), E';\n'));
            DELETE FROM lokadb.ddl_owed
            WHERE seq IN (SELECT jsonb_array_elements_text(coalesce(per_org->og->'owed', '[]'))::bigint);
        END IF;
    END LOOP;
    IF cardinality(deferred) > 0 THEN
        SELECT string_agg(format('organization %s: %s (SQLSTATE %s)', x, failed->x->>'message', failed->x->>'code'), E'\n' ORDER BY x)
        INTO lines FROM unnest(deferred) x;
        RAISE WARNING 'migration applied in the cloud and the organizations reached; organization% % could not be reached and owe% it: % statements are refused until % it',
                CASE WHEN cardinality(deferred) > 1 THEN 's' ELSE '' END, array_to_string(deferred, ', '),
                CASE WHEN cardinality(deferred) > 1 THEN '' ELSE 's' END,
                CASE WHEN cardinality(deferred) > 1 THEN 'their' ELSE 'its' END,
                CASE WHEN cardinality(deferred) > 1 THEN 'they have' ELSE 'it has' END
            USING DETAIL = lines,
                  HINT = format('lokadb.migration_offline is defer. The proxy applies it when the organization can be reached again; or run lokadb org sync %s.', deferred[1]);
    END IF;
    -- Delivered only if this transaction commits: the proxy then commits the prepared ones.
    PERFORM pg_notify('lokadb_ddl', gid);
    -- Columns and constraints the proxy's routing reads may have changed; owing
    -- organizations are refused.
    PERFORM lokadb.touch();
    RETURN NULL;
END
$$;

-- Applies what `org_id` owes, in order, in one transaction prepared in its database, and
-- records it in lokadb.ddl_prepared as a migration does; the caller's COMMIT (then
-- lokadb.ddl_resolve) commits it there. Returns how many migrations and statements it
-- applies (0, 0: it owes nothing). Fails, changing nothing, when the organization still
-- cannot take it; 55P03 when another sync (or a migration) holds its rows.
CREATE FUNCTION lokadb.ddl_sync(org_id text, OUT migrations int, OUT statements int)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    o record;
    gid text;
    failed jsonb;
    server name;
BEGIN
    migrations := 0; statements := 0;
    SELECT lo.server INTO server FROM lokadb.org lo WHERE lo.id = org_id;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'organization % is not registered', org_id USING ERRCODE = '42704';
    END IF;
    SELECT count(DISTINCT w.seq)::int AS n, count(*)::int AS m,
           jsonb_agg(u.stmt ORDER BY w.seq, u.n) AS stmts,
           jsonb_agg(DISTINCT w.seq) AS seqs, jsonb_agg(DISTINCT w.gid) AS gids
    INTO o
    FROM (SELECT * FROM lokadb.ddl_owed WHERE org = org_id ORDER BY seq FOR UPDATE NOWAIT) w,
         unnest(w.statements) WITH ORDINALITY u(stmt, n);
    IF o.n = 0 THEN
        RETURN;
    END IF;
    gid := format('lokadb_ddl_%s_%s', pg_current_xact_id(), nextval('lokadb.ddl_attempt'));
    failed := lokadb.ddl_prepare_in(jsonb_build_object(org_id, jsonb_build_object(
        'server', server, 'statements', o.stmts, 'rollback', o.gids)), gid);
    PERFORM nextval('lokadb.ddl_attempt');
    IF failed <> '{}' THEN
        PERFORM lokadb.ddl_raise(failed, format('owed migrations not applied (%s)', o.n),
            'Nothing was changed; the organization still owes them, and its statements are refused. Bring its database back (its agent connected, the conflict fixed) and run lokadb org sync again.');
    END IF;
    INSERT INTO lokadb.ddl_prepared (gid, org, statements)
    VALUES (gid || '_' || left(md5(org_id), 12), org_id,
            array_to_string(ARRAY(SELECT jsonb_array_elements_text(o.stmts)), E';\n'));
    DELETE FROM lokadb.ddl_owed WHERE seq IN (SELECT jsonb_array_elements_text(o.seqs)::bigint);
    PERFORM lokadb.ddl_disconnect('lokadb_ddl_' || org_id);
    PERFORM pg_notify('lokadb_ddl', gid);
    PERFORM lokadb.touch();
    migrations := o.n;
    statements := o.m;
END
$$;

-- Settles prepared transactions (version 14's): one whose gid an owing organization's row
-- names was prepared by a round that deferred it (its answer lost): rolled back.
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
                IF st = 'aborted' OR st IS NULL
                   OR EXISTS (SELECT 1 FROM lokadb.ddl_owed w WHERE w.gid = g AND w.org = o.id) THEN
                    PERFORM dblink_exec(c, format('ROLLBACK PREPARED %L', g));
                    rolled_back := rolled_back + 1;
                ELSE
                    in_doubt := in_doubt + 1;
                    left_ := left_ || g;
                END IF;
            EXCEPTION WHEN OTHERS THEN
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
    EXECUTE format('ALTER FUNCTION lokadb.ddl_prepare_in(jsonb, text) SET search_path = pg_catalog, %I, pg_temp', s);
    EXECUTE format('ALTER FUNCTION lokadb.ddl_unprepare(text[], text) SET search_path = pg_catalog, %I, pg_temp', s);
    EXECUTE format('ALTER FUNCTION lokadb.ddl_sync(text) SET search_path = pg_catalog, %I, pg_temp', s);
    EXECUTE format('ALTER FUNCTION lokadb.ddl_resolve(boolean) SET search_path = pg_catalog, %I, pg_temp', s);
END
$$;
