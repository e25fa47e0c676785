-- The key-map rewrite (docs/routing.md, "Statements without the organization"): a statement
-- on a LokaDB table that names no organization but one key a key map keeps (`WHERE id = $1`,
-- an ORM's get by primary key) is sent with `AND <organization column> =
-- lokadb_client.key_org(<key map>, <key>)` added. The cloud evaluates that once, when the
-- statement starts, and prunes every other partition: the statement touches the key's
-- organization only, instead of every organization's partition (for moved ones, a round trip
-- to each database). The rows are the same: the key map holds every row's key and
-- organization (once backfilled), and no other organization has a row with that key.

-- The key maps the proxy may use: backfilled, on one column; with the key's and the
-- organization column's types, without a length (the proxy casts to them: a parameter the
-- statement leaves untyped gets the key's type, as `key = $1` gives it) and whether the table has row-level
-- security (then the rewrite is not made). Read by the proxy's metadata watcher.
CREATE FUNCTION lokadb.key_meta()
RETURNS TABLE (schema_name text, table_name text, column_name text, column_type text,
               org_type text, keymap text, row_security boolean)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT k.schema_name::text, k.table_name::text, k.columns[1]::text,
           format_type(a.atttypid, NULL), format_type(o.atttypid, NULL),
           k.keymap::text, c.relrowsecurity
    FROM lokadb.keys k
    JOIN lokadb.tables t ON t.schema_name = k.schema_name AND t.table_name = k.table_name
    JOIN pg_namespace kn ON kn.nspname = 'lokadb'
    JOIN pg_class km ON km.relnamespace = kn.oid AND km.relname = k.keymap
    JOIN pg_attribute a ON a.attrelid = km.oid AND a.attname = k.columns[1]
    JOIN pg_attribute o ON o.attrelid = km.oid AND o.attname = t.org_column
    JOIN pg_namespace tn ON tn.nspname = t.schema_name
    JOIN pg_class c ON c.relnamespace = tn.oid AND c.relname = t.table_name
    WHERE k.backfilled AND cardinality(k.columns) = 1
$$;

-- The organization of a key, as text (the proxy casts it to the organization column's
-- type; NULL for a key no row has). For a role that may read the key column (itself, or a
-- role it may SET ROLE to): a statement that compares the key needs that, so any other
-- role's fails as it would have (42501). A key map that is gone, not backfilled yet, or of
-- a table with row-level security raises an error: the proxy's metadata is behind (it
-- learns at the next generation), and a statement must fail rather than find nothing.
-- STABLE: the cloud calls it once per statement, at its start.
CREATE FUNCTION lokadb_client.key_org(keymap text, key anyelement) RETURNS text
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    k record;
    tbl regclass;
    org pg_catalog.text;
BEGIN
    SELECT km.schema_name, km.table_name, km.columns[1] AS key_column, km.backfilled,
           t.org_column
    INTO k
    FROM lokadb.keys km
    JOIN lokadb.tables t ON t.schema_name = km.schema_name AND t.table_name = km.table_name
    WHERE km.keymap = key_org.keymap AND pg_catalog.cardinality(km.columns) = 1;
    IF NOT FOUND OR NOT k.backfilled THEN
        RAISE EXCEPTION 'LokaDB key map % is not in use', key_org.keymap
            USING ERRCODE = '55000',
                  HINT = 'The proxy''s routing metadata is behind; retry the statement.';
    END IF;
    tbl := pg_catalog.format('%I.%I', k.schema_name, k.table_name)::regclass;
    IF (SELECT c.relrowsecurity FROM pg_catalog.pg_class c WHERE c.oid = tbl) THEN
        RAISE EXCEPTION 'LokaDB does not look keys up for table % (row-level security)', tbl
            USING ERRCODE = '55000',
                  HINT = 'Run SELECT lokadb.touch() in the cloud so proxies reload their metadata, then retry.';
    END IF;
    IF NOT pg_catalog.has_column_privilege(session_user, tbl, k.key_column, 'SELECT')
       AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles r
                       WHERE pg_catalog.pg_has_role(session_user, r.oid, 'MEMBER')
                         AND pg_catalog.has_column_privilege(r.oid, tbl, k.key_column, 'SELECT')) THEN
        RAISE EXCEPTION 'permission denied for table %', k.table_name USING ERRCODE = '42501';
    END IF;
    EXECUTE pg_catalog.format('SELECT %I::pg_catalog.text FROM lokadb.%I WHERE %I = $1',
                              k.org_column, key_org.keymap, k.key_column)
    INTO org USING key;
    RETURN org;
END
$$;

-- Bumps the metadata generation by hand: proxies reload at once. For changes LokaDB does not
-- see, such as row-level security turned on for a LokaDB table.
CREATE FUNCTION lokadb.touch() RETURNS bigint
LANGUAGE sql SET search_path = pg_catalog, pg_temp AS $$
    WITH g AS (UPDATE lokadb.meta SET generation = generation + 1 RETURNING generation)
    SELECT generation FROM g, pg_notify('lokadb_meta', generation::text)
$$;

-- The generation trigger does the same.
CREATE OR REPLACE FUNCTION lokadb.bump_generation() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM lokadb.touch();
    RETURN NULL;
END
$$;

-- The SECURITY DEFINER functions of versions 6 and 7 searched pg_temp first for relations and
-- types (it was not in their search_path); as every other LokaDB function, last.
ALTER FUNCTION lokadb.direct_meta() SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION lokadb_client.direct_gate(text) SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION lokadb_client.generation() SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION lokadb.join_meta() SET search_path = pg_catalog, pg_temp;
