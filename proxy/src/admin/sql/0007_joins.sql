-- The join rewrite (docs/routing.md, "Joins with cloud tables"): the foreign keys from a
-- LokaDB table to a cloud table that every row of it meets in exactly one row, so that an
-- inner join on one keeps every row and the proxy may apply the statement's ORDER BY and
-- LIMIT to the LokaDB table first. Such a key: kept for every organization (on the DEFAULT
-- partition for cloud ones, by a guard for moved ones), not deferrable (no transaction
-- sees a row without its target), every column NOT NULL, the target without row-level
-- security (its rows are all visible to the join), validated (no row predates it unchecked). Read by the proxy's metadata watcher,
-- as its auth role (as lokadb.direct_meta()).
CREATE FUNCTION lokadb.join_meta()
RETURNS TABLE (schema_name text, table_name text, columns text[],
               target_schema text, target_table text, target_columns text[])
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT g.child_schema::text, g.child_table::text, g.columns::text[],
           rn.nspname::text, rc.relname::text, g.target_columns::text[]
    FROM lokadb.guards g
    JOIN lokadb.tables t ON t.schema_name = g.child_schema AND t.table_name = g.child_table
    JOIN pg_namespace tn ON tn.nspname = t.schema_name
    JOIN pg_class p ON p.relnamespace = tn.oid AND p.relname = t.default_partition
    JOIN pg_constraint con ON con.conrelid = p.oid AND con.conname = g.constraint_name
        AND con.contype = 'f' AND NOT con.condeferrable AND con.convalidated
    JOIN pg_class rc ON rc.oid = g.target
    JOIN pg_namespace rn ON rn.oid = rc.relnamespace
    WHERE rn.nspname <> 'lokadb'
      AND NOT rc.relrowsecurity
      AND NOT EXISTS (
          SELECT 1 FROM pg_attribute a
          WHERE a.attrelid = p.oid AND a.attname = ANY (g.columns) AND NOT a.attnotnull)
$$;
