-- Version 10: the relations a move makes for a LokaDB table (the organization's own
-- partitioned table, its cloud and foreign partitions) belong to the table's owner, as the
-- default partition (the original table) always did: `ALTER TABLE` on a partitioned table
-- recurses into every partition and needs ownership of each, so until now only a superuser
-- could migrate the application's tables once an organization had moved. New moves give
-- them to the owner as they make them; this fixes existing installations.
--
-- Key maps and refs (schema lokadb) stay LokaDB's: no ALTER of the application's table
-- reaches them, and foreign keys into a key map are checked as the key map's owner, which
-- must be able to use schema lokadb.

DO $$
DECLARE r record;
BEGIN
    FOR r IN
        SELECT p.relid::regclass AS rel, c.relkind, pg_get_userbyid(pc.relowner) AS owner
        FROM lokadb.tables t
        JOIN pg_class pc ON pc.oid = to_regclass(format('%I.%I', t.schema_name, t.table_name))
        CROSS JOIN LATERAL pg_partition_tree(pc.oid) p
        JOIN pg_class c ON c.oid = p.relid
        WHERE p.level > 0 AND c.relowner <> pc.relowner
    LOOP
        EXECUTE format('ALTER %s %s OWNER TO %I',
                       CASE r.relkind WHEN 'f' THEN 'FOREIGN TABLE' ELSE 'TABLE' END, r.rel, r.owner);
    END LOOP;
END
$$;
