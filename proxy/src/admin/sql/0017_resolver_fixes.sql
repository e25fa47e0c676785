-- Version 17, two fixes found by the tests:
--  - what the proxy's metadata watcher and migration resolver read of the migration tables
--    goes through SECURITY DEFINER functions, as direct_meta() and key_meta() do, so the plain
--    role of `auth_user` needs no grant beyond those docs/configuration.md lists;
--  - lokadb.ddl_resolve() no longer forgets a prepared transaction recorded while it ran.

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

-- Settles prepared transactions (version 15's), forgetting only the rows it read before it
-- listed the organization's prepared transactions. Version 15 forgot every row whose gid its
-- list did not show, also a row that a migration committing meanwhile had just added: that
-- migration's prepared transaction was then left in doubt for good, holding its locks in the
-- organization's database.
CREATE OR REPLACE FUNCTION lokadb.ddl_resolve(sweep boolean DEFAULT true,
                                              OUT committed int, OUT rolled_back int,
                                              OUT in_doubt int, OUT unreachable int)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    o record;
    g text;
    c text;
    left_ text[];
    known text[];
    st text;
BEGIN
    committed := 0; rolled_back := 0; in_doubt := 0; unreachable := 0;
    FOR o IN SELECT id, server FROM lokadb.org
             WHERE server IS NOT NULL
               AND (sweep OR id IN (SELECT p.org FROM lokadb.ddl_prepared p))
             ORDER BY id LOOP
        c := 'lokadb_resolve_' || o.id;
        left_ := '{}';
        -- The rows this pass may forget, read before the organization's list: a migration
        -- that commits while the list is read adds a row for a gid the list may not show.
        known := ARRAY(SELECT p.gid FROM lokadb.ddl_prepared p WHERE p.org = o.id);
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
        DELETE FROM lokadb.ddl_prepared p
        WHERE p.org = o.id AND p.gid = ANY (known) AND p.gid <> ALL (left_);
        PERFORM lokadb.ddl_disconnect(c);
    END LOOP;
END
$$;

DO $$
DECLARE s name := (SELECT n.nspname FROM pg_extension e JOIN pg_namespace n ON n.oid = e.extnamespace
                   WHERE e.extname = 'dblink');
BEGIN
    EXECUTE format('ALTER FUNCTION lokadb.ddl_resolve(boolean) SET search_path = pg_catalog, %I, pg_temp', s);
END
$$;
