-- Version 16: ALTER TYPE … ADD VALUE and RENAME VALUE of an enum that a LokaDB table's column
-- uses reach moved organizations with the migration (docs/migrations.md, "Enums").
--
-- Both run in a transaction since PostgreSQL 12, so they take the two-phase path: the event
-- trigger now starts at ALTER TYPE too, and a table's shape carries the labels of the enum
-- types of its columns (each with its pg_enum oid, so a renamed value is told from a new
-- one). The organization's type must exist there under the same name (as for any type of
-- the table's columns) and belong to the role of its user mapping.

ALTER FUNCTION lokadb.ddl_shape(oid) RENAME TO ddl_shape_table;

-- A LokaDB table's shape (version 11's) and `enums`: for each enum type of its columns (or
-- of their arrays), its values in order as [oid, label] pairs.
CREATE FUNCTION lokadb.ddl_shape(rel oid) RETURNS jsonb
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
SELECT lokadb.ddl_shape_table(rel) || jsonb_build_object('enums', coalesce((
    SELECT jsonb_object_agg(t.name, t.labels)
    FROM (SELECT DISTINCT format_type(e.oid, NULL) AS name,
                 (SELECT jsonb_agg(jsonb_build_array(l.oid::bigint, l.enumlabel) ORDER BY l.enumsortorder)
                  FROM pg_enum l WHERE l.enumtypid = e.oid) AS labels
          FROM pg_attribute a
          JOIN pg_type ty ON ty.oid = a.atttypid
          JOIN pg_type e ON e.oid = CASE WHEN ty.typtype = 'e' THEN ty.oid ELSE ty.typelem END
                        AND e.typtype = 'e'
          WHERE a.attrelid = rel AND a.attnum > 0 AND NOT a.attisdropped) t), '{}'))
$$;

-- The statements that take the enum types of shape `b` to those of shape `a`: values renamed
-- (same oid, another label), then values added where they sit in the order (after the
-- value before them, or before the first one that was there). Idempotent (IF NOT EXISTS):
-- two tables with the same type give the same statements. Shapes recorded before version 16
-- (a move's) have no `enums`: nothing.
CREATE FUNCTION lokadb.ddl_enum_delta(b jsonb, a jsonb) RETURNS text[]
LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    out text[] := '{}';
    ty text;
    now_ jsonb;
    was jsonb;
    old_ids text[];
    old_label text;
    i int;
    j int;
    anchor text;
BEGIN
    IF NOT (b ? 'enums' AND a ? 'enums') THEN
        RETURN out;
    END IF;
    FOR ty, now_ IN SELECT key, value FROM jsonb_each(a->'enums') ORDER BY key LOOP
        was := b->'enums'->ty;
        CONTINUE WHEN was IS NULL OR was = now_;
        old_ids := ARRAY(SELECT x->>0 FROM jsonb_array_elements(was) x);
        FOR i IN 0 .. jsonb_array_length(now_) - 1 LOOP
            SELECT x->>1 INTO old_label FROM jsonb_array_elements(was) x WHERE x->>0 = now_->i->>0;
            IF old_label IS NOT NULL AND old_label <> now_->i->>1 THEN
                out := out || format('ALTER TYPE %s RENAME VALUE %L TO %L', ty, old_label, now_->i->>1);
            END IF;
        END LOOP;
        FOR i IN 0 .. jsonb_array_length(now_) - 1 LOOP
            CONTINUE WHEN (now_->i->>0) = ANY (old_ids);
            IF i > 0 THEN
                out := out || format('ALTER TYPE %s ADD VALUE IF NOT EXISTS %L AFTER %L', ty, now_->i->>1, now_->(i - 1)->>1);
                CONTINUE;
            END IF;
            anchor := NULL;
            FOR j IN 1 .. jsonb_array_length(now_) - 1 LOOP
                IF (now_->j->>0) = ANY (old_ids) THEN
                    anchor := now_->j->>1;
                    EXIT;
                END IF;
            END LOOP;
            out := out || format('ALTER TYPE %s ADD VALUE IF NOT EXISTS %L%s', ty, now_->i->>1,
                                 CASE WHEN anchor IS NULL THEN '' ELSE format(' BEFORE %L', anchor) END);
        END LOOP;
    END LOOP;
    RETURN out;
END
$$;

-- The statements for an organization's table (version 13's), the enums' first: a column's
-- new type or check may need the value.
CREATE OR REPLACE FUNCTION lokadb.ddl_delta(tbl text, b jsonb, a jsonb) RETURNS text[]
LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
SELECT lokadb.ddl_enum_delta(b, a)
       || coalesce(array_agg(regexp_replace(s, '^CREATE (UNIQUE )?INDEX ', 'CREATE \1INDEX IF NOT EXISTS ')
                             ORDER BY n), '{}')
FROM unnest(lokadb.ddl_delta_statements(tbl, b, a)) WITH ORDINALITY u(s, n)
$$;

-- The event trigger records the shapes at ALTER TYPE too.
DROP EVENT TRIGGER lokadb_ddl_start;
CREATE EVENT TRIGGER lokadb_ddl_start ON ddl_command_start
    WHEN TAG IN ('ALTER TABLE', 'CREATE INDEX', 'DROP INDEX', 'ALTER INDEX', 'ALTER TYPE')
    EXECUTE FUNCTION lokadb.ddl_start();
