-- Version 17, two fixes found by the tests:
--  - what the proxy's metadata watcher and migration resolver read of the migration tables
--    goes through SECURITY DEFINER functions, as direct_meta() and key_meta() do, so the plain
--    role of `auth_user` needs no grant beyond those docs/configuration.md lists;
--  - lokadb.ddl_resolve() no longer forgets a prepared transaction recorded while it ran, and
--    settles every organization at once over connections it keeps.

-- The organizations that owe migrations (the proxy refuses their statements until synced).
CREATE FUNCTION lokadb.owed_orgs() RETURNS SETOF text
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT DISTINCT org FROM lokadb.ddl_owed ORDER BY 1
$$;

-- How many two-phase rounds have started: the resolver sweeps again while it moves.
CREATE FUNCTION lokadb.ddl_attempts() RETURNS bigint
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT last_value FROM lokadb.ddl_attempt
$$;

-- Settles prepared transactions (version 15's rules), every organization at once:
--  - its connections to organizations stay open in the calling session (the proxy's
--    resolver keeps one), so a pass after the first opens none: a connection costs about four
--    round trips through the relay, and version 15 opened and closed one per organization in
--    turn after every migration (16–22 s to settle 100 organizations 40 ms away, their
--    tables locked by the prepared transaction meanwhile). A kept connection that died is
--    opened again once;
--  - the organizations' lists are asked for all at once (dblink_send_query), then each
--    COMMIT/ROLLBACK PREPARED is sent to all of them at once, one gid per organization per
--    round (COMMIT PREPARED runs alone in its query);
--  - it forgets only the lokadb.ddl_prepared rows it read before the organization's list:
--    version 15 forgot every row whose gid the list did not show, also one that a migration
--    committing meanwhile had just added, which left that migration in doubt for good.
CREATE OR REPLACE FUNCTION lokadb.ddl_resolve(sweep boolean DEFAULT true,
                                              OUT committed int, OUT rolled_back int,
                                              OUT in_doubt int, OUT unreachable int)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    list CONSTANT text := $q$SELECT gid FROM pg_prepared_xacts
                              WHERE gid LIKE 'lokadb\_ddl\_%' AND database = current_database()$q$;
    o record;
    c text;
    g text;
    st text;
    n int := 0;
    i int;
    sent int;
    orgs text[] := '{}';
    known jsonb := '{}';    -- org → the gids of its rows, read before its list
    todo jsonb := '{}';     -- org → [[gid, 'COMMIT' | 'ROLLBACK'], …] still to send
    sending jsonb := '{}';  -- org → the [gid, verb] sent this round
    left_ jsonb := '{}';    -- org → gids kept (in doubt, or failed)
    gids text[];
    verb text;
BEGIN
    committed := 0; rolled_back := 0; in_doubt := 0; unreachable := 0;
    -- 1. Ask every organization for its list (connecting where no kept connection is).
    FOR o IN SELECT id, server FROM lokadb.org
             WHERE server IS NOT NULL
               AND (sweep OR id IN (SELECT p.org FROM lokadb.ddl_prepared p))
             ORDER BY id LOOP
        c := 'lokadb_resolve_' || o.id;
        known := known || jsonb_build_object(o.id,
                     to_jsonb(ARRAY(SELECT p.gid FROM lokadb.ddl_prepared p WHERE p.org = o.id)));
        sent := 0;
        BEGIN
            IF c = ANY (coalesce(dblink_get_connections(), '{}')) THEN
                sent := dblink_send_query(c, list);
            END IF;
        EXCEPTION WHEN OTHERS THEN
            sent := 0;
        END;
        IF sent <> 1 THEN
            BEGIN
                PERFORM lokadb.ddl_disconnect(c);
                PERFORM dblink_connect(c, o.server);
                -- Kept: named for the organization's operators (pg_stat_activity).
                PERFORM dblink_exec(c, 'SET application_name = ''lokadb resolver''');
                sent := dblink_send_query(c, list);
            EXCEPTION WHEN OTHERS THEN
                sent := 0;
            END;
        END IF;
        IF sent <> 1 THEN
            PERFORM lokadb.ddl_disconnect(c);
            unreachable := unreachable + 1;
            CONTINUE;
        END IF;
        orgs := orgs || o.id::text;
    END LOOP;
    n := coalesce(array_length(orgs, 1), 0);
    -- 2. Each list, and what each gid needs: by the cloud's row first.
    FOR i IN 1..n LOOP
        c := 'lokadb_resolve_' || orgs[i];
        BEGIN
            gids := ARRAY(SELECT t.gid FROM dblink_get_result(c) AS t(gid text));
            PERFORM 1 FROM dblink_get_result(c) AS t(gid text);  -- the end of the query
        EXCEPTION WHEN OTHERS THEN
            PERFORM lokadb.ddl_disconnect(c);
            unreachable := unreachable + 1;
            orgs[i] := NULL;
            CONTINUE;
        END;
        todo := todo || jsonb_build_object(orgs[i], '[]'::jsonb);
        left_ := left_ || jsonb_build_object(orgs[i], '[]'::jsonb);
        FOREACH g IN ARRAY gids LOOP
            IF EXISTS (SELECT 1 FROM lokadb.ddl_prepared p WHERE p.gid = g AND p.org = orgs[i]) THEN
                verb := 'COMMIT';
            ELSE
                st := pg_xact_status(split_part(g, '_', 3)::xid8);
                IF st = 'aborted' OR st IS NULL
                   OR EXISTS (SELECT 1 FROM lokadb.ddl_owed w WHERE w.gid = g AND w.org = orgs[i]) THEN
                    verb := 'ROLLBACK';
                ELSE
                    verb := NULL;
                END IF;
            END IF;
            IF verb IS NULL THEN
                in_doubt := in_doubt + 1;
                left_ := jsonb_set(left_, ARRAY[orgs[i]], (left_ -> orgs[i]) || to_jsonb(g));
            ELSE
                todo := jsonb_set(todo, ARRAY[orgs[i]],
                                  (todo -> orgs[i]) || jsonb_build_array(jsonb_build_array(g, verb)));
            END IF;
        END LOOP;
    END LOOP;
    -- 3. Rounds: the next statement of every organization sent at once, then their answers.
    LOOP
        sending := '{}';
        FOR i IN 1..n LOOP
            CONTINUE WHEN orgs[i] IS NULL OR jsonb_array_length(todo -> orgs[i]) = 0;
            c := 'lokadb_resolve_' || orgs[i];
            g := todo -> orgs[i] -> 0 ->> 0;
            verb := todo -> orgs[i] -> 0 ->> 1;
            todo := jsonb_set(todo, ARRAY[orgs[i]], (todo -> orgs[i]) - 0);
            BEGIN
                sent := dblink_send_query(c, format('%s PREPARED %L', verb, g));
            EXCEPTION WHEN OTHERS THEN
                sent := 0;
            END;
            IF sent = 1 THEN
                sending := sending || jsonb_build_object(orgs[i], jsonb_build_array(g, verb));
            ELSE
                left_ := jsonb_set(left_, ARRAY[orgs[i]], (left_ -> orgs[i]) || to_jsonb(g));
                PERFORM lokadb.ddl_disconnect(c);
                orgs[i] := NULL;
            END IF;
        END LOOP;
        EXIT WHEN sending = '{}';
        FOR i IN 1..n LOOP
            CONTINUE WHEN orgs[i] IS NULL OR NOT sending ? orgs[i];
            c := 'lokadb_resolve_' || orgs[i];
            g := sending -> orgs[i] ->> 0;
            verb := sending -> orgs[i] ->> 1;
            BEGIN
                PERFORM 1 FROM dblink_get_result(c) AS t(status text);
                PERFORM 1 FROM dblink_get_result(c) AS t(status text);
                IF verb = 'COMMIT' THEN
                    committed := committed + 1;
                ELSE
                    rolled_back := rolled_back + 1;
                END IF;
            EXCEPTION WHEN OTHERS THEN
                -- Kept for the next pass; the connection is opened again then.
                left_ := jsonb_set(left_, ARRAY[orgs[i]], (left_ -> orgs[i]) || to_jsonb(g));
                PERFORM lokadb.ddl_disconnect(c);
                orgs[i] := NULL;
            END;
        END LOOP;
    END LOOP;
    -- 4. The rows of what is settled.
    FOR i IN 1..n LOOP
        CONTINUE WHEN orgs[i] IS NULL;
        DELETE FROM lokadb.ddl_prepared p
        WHERE p.org = orgs[i]
          AND p.gid IN (SELECT jsonb_array_elements_text(known -> orgs[i]))
          AND p.gid NOT IN (SELECT jsonb_array_elements_text(left_ -> orgs[i]));
    END LOOP;
    -- A sweep closes kept connections of organizations no longer served from their database.
    IF sweep THEN
        FOR c IN SELECT unnest(coalesce(dblink_get_connections(), '{}')) LOOP
            IF c LIKE 'lokadb\_resolve\_%'
               AND NOT EXISTS (SELECT 1 FROM lokadb.org WHERE server IS NOT NULL
                               AND 'lokadb_resolve_' || id = c) THEN
                PERFORM dblink_disconnect(c);
            END IF;
        END LOOP;
    END IF;
END
$$;

DO $$
DECLARE s name := (SELECT n.nspname FROM pg_extension e JOIN pg_namespace n ON n.oid = e.extnamespace
                   WHERE e.extname = 'dblink');
BEGIN
    EXECUTE format('ALTER FUNCTION lokadb.ddl_resolve(boolean) SET search_path = pg_catalog, %I, pg_temp', s);
END
$$;
