-- Version 17: what the proxy's metadata watcher and migration resolver read of the migration
-- tables goes through SECURITY DEFINER functions, as direct_meta() and key_meta() do, so the
-- plain role of `auth_user` needs no grant beyond those docs/configuration.md lists.

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
