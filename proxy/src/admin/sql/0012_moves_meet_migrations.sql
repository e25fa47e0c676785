-- Version 12: moves and migrations meet safely (docs/migrations.md, "During a move").
--
--    - A move records, when it creates the destination's tables (step prepare), the shape
--      (lokadb.ddl_shape) of every LokaDB table; its switch compares it with the shape under
--      the switch's lock, and a migration committed in between makes the move copy again
--      with the new shape instead of switching.
--    - A migration records the shapes before its first DDL while a move is in progress too
--      (not only while some organization is moved): one blocked by a switch's lock commits
--      after it, and must then reach the organization that has just moved.
--    - A migration reaches an organization whose rows are served from its database, moved
--      or returning (move-back before its switch): its foreign partition is under the table.

ALTER TABLE lokadb.moves ADD COLUMN shapes jsonb;

CREATE OR REPLACE FUNCTION lokadb.ddl_start() RETURNS event_trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM lokadb.org WHERE state IN ('moved', 'moving', 'returning')) THEN
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

CREATE OR REPLACE FUNCTION lokadb.ddl_orgs(rel oid) RETURNS TABLE (org text, server name)
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
SELECT o.id, o.server
FROM lokadb.org o
WHERE o.state IN ('moved', 'returning')
  AND EXISTS (SELECT 1
              FROM pg_partition_tree(rel) p
              JOIN pg_foreign_table f ON f.ftrelid = p.relid
              JOIN pg_foreign_server s ON s.oid = f.ftserver
              WHERE s.srvname = o.server)
ORDER BY o.id
$$;

-- The shape of every LokaDB table: [{schema, table, shape}].
CREATE FUNCTION lokadb.move_shapes() RETURNS jsonb
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
SELECT coalesce(jsonb_agg(jsonb_build_object(
           'schema', t.schema_name, 'table', t.table_name,
           'shape', lokadb.ddl_shape(format('%I.%I', t.schema_name, t.table_name)::regclass))
           ORDER BY t.schema_name, t.table_name), '[]')
FROM lokadb.tables t
WHERE t.state = 'enabled' AND to_regclass(format('%I.%I', t.schema_name, t.table_name)) IS NOT NULL
$$;

-- What changed in the LokaDB tables since `before` (lokadb.move_shapes()): per changed table
-- (`schema.table`), the statements that would make an organization's table follow.
CREATE FUNCTION lokadb.move_shape_changes(before jsonb)
RETURNS TABLE (tbl text, statements text[])
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
SELECT b->>'schema' || '.' || (b->>'table'),
       CASE WHEN r IS NULL THEN ARRAY['(the table is gone)']
            ELSE lokadb.ddl_delta(format('%I.%I', b->>'schema', b->>'table'), b->'shape', lokadb.ddl_shape(r))
       END
FROM jsonb_array_elements(before) b,
     LATERAL (SELECT to_regclass(format('%I.%I', b->>'schema', b->>'table'))::oid AS r) x
WHERE r IS NULL
   OR cardinality(lokadb.ddl_delta(format('%I.%I', b->>'schema', b->>'table'), b->'shape', lokadb.ddl_shape(r))) > 0
ORDER BY 1
$$;
