-- The key-map rewrite (docs/routing.md, "Statements without the organization"): a statement
-- on a LokaDB table that names no organization but one key a key map keeps (`WHERE id = $1`,
-- an ORM's get by primary key) is sent with `AND <organization column> =
-- lokadb_client.key_org(<key map>, <key>)` added. The cloud evaluates that once, when the
-- statement starts, and prunes every other partition: the statement touches the key's
-- organization only, instead of every organization's partition (for moved ones, a round trip
-- to each database). The rows are the same: the key map holds every row's key and
-- organization (once backfilled), and no other organization has a row with that key.

-- The key maps the proxy may use: backfilled, on one column; with the key's and the
-- organization column's types (the proxy casts to them) and whether the table has row-level
-- security (then the rewrite is not made). Read by the proxy's metadata watcher.
CREATE FUNCTION lokadb.key_meta()
RETURNS TABLE (schema_name text, table_name text, column_name text, column_type text,
               org_type text, keymap text, row_security boolean)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog AS $$
    SELECT k.schema_name::text, k.table_name::text, k.columns[1]::text,
           format_type(a.atttypid, a.atttypmod), format_type(o.atttypid, o.atttypmod),
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
-- type; NULL for a key no row has), for a role that may read a column of the table: a
-- statement that compares the key needs that, so any other role's fails as it would have
-- (42501). STABLE: the cloud calls it once per statement, at its start.
CREATE FUNCTION lokadb_client.key_org(keymap text, key anyelement) RETURNS text
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog AS $$
DECLARE
    k record;
    org text;
BEGIN
    SELECT km.schema_name, km.table_name, km.columns[1] AS key_column, t.org_column
    INTO k
    FROM lokadb.keys km
    JOIN lokadb.tables t ON t.schema_name = km.schema_name AND t.table_name = km.table_name
    WHERE km.keymap = key_org.keymap;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF NOT has_any_column_privilege(session_user, format('%I.%I', k.schema_name, k.table_name),
                                    'SELECT') THEN
        RAISE EXCEPTION 'permission denied for table %', k.table_name USING ERRCODE = '42501';
    END IF;
    EXECUTE format('SELECT %I::text FROM lokadb.%I WHERE %I = $1',
                   k.org_column, key_org.keymap, k.key_column)
    INTO org USING key;
    RETURN org;
END
$$;
