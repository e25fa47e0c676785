-- LokaDB cloud schema, version 2: LokaDB tables, their key maps and re-pointed foreign keys.
-- Written by `lokadb enable` / `lokadb disable`; read by later commands (move-org) and by
-- the proxy (routing by organization column, key-map lookups). See docs/cloud-schema.md.

-- One row per LokaDB table. `name` is the partitioned parent (what the application uses),
-- `default_partition` the original table, attached as the DEFAULT partition that holds every
-- organization still in the cloud.
CREATE TABLE lokadb.tables (
    schema_name       name NOT NULL,
    table_name        name NOT NULL,
    org_column        name NOT NULL,
    default_partition name NOT NULL,
    -- 'enabling': swapped, key maps still being filled (a rerun of enable resumes);
    -- 'enabled': key maps complete, foreign keys re-pointed.
    state             text NOT NULL CHECK (state IN ('enabling', 'enabled')),
    enabled_at        timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (schema_name, table_name)
);

-- The unique keys without the organization column, each kept by a key map
-- lokadb.<keymap> (key columns + organization column, PRIMARY KEY (key columns)).
CREATE TABLE lokadb.keys (
    schema_name name NOT NULL,
    table_name  name NOT NULL,
    -- The unique constraint or index on the default partition the key comes from.
    key_name    name NOT NULL,
    columns     name[] NOT NULL,
    keymap      name NOT NULL UNIQUE,
    -- The backfill of the existing rows is complete (until then the row trigger keeps
    -- new writes, and a rerun of enable copies again from the start, skipping what is there).
    backfilled  boolean NOT NULL DEFAULT false,
    PRIMARY KEY (schema_name, table_name, key_name),
    FOREIGN KEY (schema_name, table_name) REFERENCES lokadb.tables ON DELETE CASCADE
);

-- Foreign keys of other tables that referenced a key of a LokaDB table and now reference
-- its key map (same name, columns and actions).
CREATE TABLE lokadb.fkeys (
    child_schema name NOT NULL,
    child_table  name NOT NULL,
    constraint_name name NOT NULL,
    keymap       name NOT NULL REFERENCES lokadb.keys (keymap) ON DELETE CASCADE,
    PRIMARY KEY (child_schema, child_table, constraint_name)
);

CREATE TRIGGER tables_generation AFTER INSERT OR UPDATE OR DELETE ON lokadb.tables
    FOR EACH STATEMENT EXECUTE FUNCTION lokadb.bump_generation();
CREATE TRIGGER keys_generation AFTER INSERT OR UPDATE OR DELETE ON lokadb.keys
    FOR EACH STATEMENT EXECUTE FUNCTION lokadb.bump_generation();
CREATE TRIGGER fkeys_generation AFTER INSERT OR UPDATE OR DELETE ON lokadb.fkeys
    FOR EACH STATEMENT EXECUTE FUNCTION lokadb.bump_generation();
