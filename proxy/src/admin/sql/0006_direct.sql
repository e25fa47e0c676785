-- Version 6: writes on the direct path (fdw+direct).
--
-- The proxy may send an UPDATE of a moved fdw+direct organization straight to its database
-- when nothing the cloud keeps for that table depends on what it changes. The proxy's
-- metadata watcher reads lokadb.direct_meta() as its auth role; lokadb_client.direct_gate()
-- runs on a client's own cloud backend, as the client's role, so it lives in a schema of its
-- own that every role may use (lokadb itself is not open to them).

-- Per LokaDB table, what a direct UPDATE may not change ('c': a column the cloud keeps a
-- constraint on — the organization column, key-map keys, both sides of every foreign key,
-- guarded or native, unique and primary keys), and the tables a direct UPDATE may not
-- touch at all ('t': a user's trigger fires on UPDATE, and it runs only in the cloud).
CREATE FUNCTION lokadb.direct_meta()
RETURNS TABLE (kind text, schema_name text, table_name text, column_name text)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog AS $$
    WITH t AS (
        SELECT t.schema_name::text AS s, t.table_name::text AS n, t.org_column::text AS org,
               format('%I.%I', t.schema_name, t.table_name)::regclass AS rel
        FROM lokadb.tables t
    )
    SELECT 'c', s, n, org FROM t
    UNION ALL
    SELECT 'c', k.schema_name::text, k.table_name::text, unnest(k.columns)::text FROM lokadb.keys k
    UNION ALL
    SELECT 'c', g.child_schema::text, g.child_table::text, unnest(g.columns)::text FROM lokadb.guards g
    UNION ALL
    SELECT 'c', t.s, t.n, unnest(g.target_columns)::text
    FROM lokadb.guards g JOIN t ON t.rel = g.target
    UNION ALL
    SELECT 'c', t.s, t.n, a.attname::text
    FROM t JOIN pg_constraint con
        ON (con.conrelid = t.rel AND con.contype IN ('f', 'p', 'u'))
    JOIN pg_attribute a ON a.attrelid = t.rel AND a.attnum = ANY (con.conkey)
    UNION ALL
    SELECT 'c', t.s, t.n, a.attname::text
    FROM t JOIN pg_constraint con ON con.confrelid = t.rel AND con.contype = 'f'
    JOIN pg_attribute a ON a.attrelid = t.rel AND a.attnum = ANY (con.confkey)
    UNION ALL
    SELECT 't', t.s, t.n, NULL FROM t
    WHERE EXISTS (
        SELECT 1 FROM pg_trigger tg JOIN pg_proc p ON p.oid = tg.tgfoid
        WHERE tg.tgrelid = t.rel AND NOT tg.tgisinternal
          AND p.pronamespace <> 'lokadb'::regnamespace
          AND (tg.tgtype & 16) <> 0)
$$;

-- Before a direct write, in a transaction on the client's cloud backend that stays open
-- until the organization's transaction ends: the pause gate every cloud write passes (a
-- paused organization's direct writes wait too, and a pause waits for them), then the
-- organization must still be moved with the fdw+direct profile (else the proxy sends the
-- write through the cloud).
-- The key direct writers of an organization hold shared (from their gate to the end of
-- the organization's transaction) and a move's switch takes exclusively: the switch waits
-- for direct writes in flight, and no cloud writer ever takes this key (so the switch's
-- table locks and the cloud writers' pause key never wait on each other in a cycle).
CREATE FUNCTION lokadb.direct_key(org text) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT hashtextextended('lokadb.direct:' || org, 0)
$$;

CREATE SCHEMA lokadb_client;
COMMENT ON SCHEMA lokadb_client IS 'LokaDB: the functions client roles call through the proxy (managed by lokadb init)';
GRANT USAGE ON SCHEMA lokadb_client TO PUBLIC;

CREATE FUNCTION lokadb_client.direct_gate(org text) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog AS $$
BEGIN
    -- A read-only session's write fails as the cloud would fail it.
    IF current_setting('transaction_read_only') = 'on' THEN
        RAISE EXCEPTION 'cannot execute UPDATE in a read-only transaction'
            USING ERRCODE = '25006';
    END IF;
    PERFORM lokadb.write_gate(org);
    PERFORM pg_advisory_xact_lock_shared(lokadb.direct_key(org));
    IF NOT EXISTS (SELECT 1 FROM lokadb.org o
                   WHERE o.id = direct_gate.org AND o.state = 'moved' AND o.profile = 'fdw+direct') THEN
        RAISE EXCEPTION 'organization % does not take the direct path now', org
            USING ERRCODE = '55000';
    END IF;
END
$$;

-- The metadata generation, for the proxy's freshness check of a new client connection (on
-- the client's own backend, in the same round trip as its privileges).
CREATE FUNCTION lokadb_client.generation() RETURNS bigint
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog AS $$
    SELECT generation FROM lokadb.meta
$$;
