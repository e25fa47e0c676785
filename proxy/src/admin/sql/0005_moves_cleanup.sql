-- Version 5: fixes to moving organizations found in review (a separate migration, so a
-- cloud already at version 4 gets them from `lokadb init`).

-- A move's last step: after the verification, the old copy and what the move installed
-- are removed; a rerun from here repeats the clean-up and does not verify again.
ALTER TABLE lokadb.moves DROP CONSTRAINT moves_step_check;
ALTER TABLE lokadb.moves ADD CONSTRAINT moves_step_check
    CHECK (step IN ('split', 'prepare', 'copy', 'catchup', 'verify', 'cleanup'));

-- refs_fill under a given LokaDB table: the split records the references of the
-- organization's rows in its copy before that copy is attached (so other organizations'
-- writers do not wait for it); refs_fill(part, org) is the same for an attached partition
-- at any depth.
CREATE FUNCTION lokadb.refs_fill_under(root regclass, part regclass, org text) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    g record;
    total bigint := 0;
    n bigint;
    keys text;
    cols text;
    present text;
BEGIN
    FOR g IN
        SELECT gd.*, t.org_column FROM lokadb.guards gd
        JOIN lokadb.tables t ON t.schema_name = gd.child_schema AND t.table_name = gd.child_table
        WHERE format('%I.%I', gd.child_schema, gd.child_table)::regclass = root
    LOOP
        SELECT string_agg(format('k%s', o), ', ' ORDER BY o),
               string_agg(format('%I', c), ', ' ORDER BY o),
               string_agg(format('%I IS NOT NULL', c), ' AND ' ORDER BY o)
          INTO keys, cols, present
          FROM unnest(g.columns) WITH ORDINALITY u(c, o);
        EXECUTE format('DELETE FROM lokadb.%I WHERE org = %L', g.refs, org);
        EXECUTE format('INSERT INTO lokadb.%I (%s, org) SELECT %s, %I FROM %s WHERE %I = %L AND %s',
                       g.refs, keys, cols, g.org_column, part, g.org_column, org, present);
        GET DIAGNOSTICS n = ROW_COUNT;
        total := total + n;
    END LOOP;
    RETURN total;
END
$$;

CREATE OR REPLACE FUNCTION lokadb.refs_fill(part regclass, org text) RETURNS bigint
LANGUAGE sql AS $$
    SELECT lokadb.refs_fill_under(pg_partition_root(part), part, org)
$$;
