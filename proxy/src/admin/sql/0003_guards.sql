-- LokaDB cloud schema, version 3: foreign keys kept across foreign partitions.
-- Written by `lokadb enable` / `lokadb disable` (proxy/src/admin/guards.rs); see
-- docs/cloud-schema.md, "Foreign keys across foreign partitions".

-- One row per foreign key of a LokaDB table (a foreign key of its default partition) that
-- LokaDB keeps for the rows of its other partitions (moved organizations):
-- * the parent check: row triggers on the LokaDB table (disabled on the default partition,
--   where the native foreign key holds) check that the referenced row exists in the cloud
--   (`target`: a cloud table, a key map, or, while a key map is being filled, the default
--   partition that holds every row), FOR KEY SHARE;
-- * `lokadb.<refs>`: one row (key, organization) per reference from a row of a non-default
--   partition, kept by the same triggers; a row trigger on `target` reads it when a key is
--   deleted or changed, and refuses or cascades into the organizations it names.
CREATE TABLE lokadb.guards (
    child_schema    name NOT NULL,
    child_table     name NOT NULL,
    constraint_name name NOT NULL,
    -- The referencing columns of the child, in key order; the refs table has k1..kN (the
    -- referenced columns' types) and org.
    columns         name[] NOT NULL,
    target          regclass NOT NULL,
    target_columns  name[] NOT NULL,
    refs            name NOT NULL UNIQUE,
    -- The SQL that installed it: a rerun compares and skips what is already current.
    definition      text NOT NULL,
    PRIMARY KEY (child_schema, child_table, constraint_name),
    FOREIGN KEY (child_schema, child_table) REFERENCES lokadb.tables ON DELETE CASCADE
);

CREATE TRIGGER guards_generation AFTER INSERT OR UPDATE OR DELETE ON lokadb.guards
    FOR EACH STATEMENT EXECUTE FUNCTION lokadb.bump_generation();

-- Records the references of the rows of `part` (a partition of a LokaDB table, e.g. a
-- foreign partition just attached by move-org) for organization `org`: what the row
-- triggers would have recorded had the rows been inserted through the table. Replaces what
-- was recorded for that organization. Returns how many references it recorded.
CREATE FUNCTION lokadb.refs_fill(part regclass, org text) RETURNS bigint
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
        WHERE format('%I.%I', gd.child_schema, gd.child_table)::regclass =
              (SELECT inhparent FROM pg_inherits WHERE inhrelid = part)
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
