-- Version 13: what cannot run in a transaction reaches organizations too
-- (`lokadb concurrently`, docs/migrations.md "Not in a transaction").
--
-- Postgres refuses CREATE INDEX CONCURRENTLY on a partitioned table, so on a LokaDB table.
-- `lokadb concurrently` builds the index concurrently on each of the cloud's partitions,
-- then in each moved organization's database (lokadb.index_in_org, below), then declares it
-- on the parent with a plain CREATE INDEX, which only attaches what is there. That last step
-- is a migration like any other (lokadb.ddl_commit): its CREATE INDEX reaches organizations
-- IF NOT EXISTS, so the index built there beforehand stands for it.

ALTER FUNCTION lokadb.ddl_delta(text, jsonb, jsonb) RENAME TO ddl_delta_statements;

CREATE FUNCTION lokadb.ddl_delta(tbl text, b jsonb, a jsonb) RETURNS text[]
LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
SELECT coalesce(array_agg(regexp_replace(s, '^CREATE (UNIQUE )?INDEX ', 'CREATE \1INDEX IF NOT EXISTS ')
                          ORDER BY n), '{}')
FROM unnest(lokadb.ddl_delta_statements(tbl, b, a)) WITH ORDINALITY u(s, n)
$$;

-- Builds, concurrently, in organization `org_id`'s database the index `name` of the LokaDB
-- table `parent`, defined as the cloud's index `model` on one of its partitions (so the
-- definition is Postgres's own text, never the caller's). Callable by whoever may alter the
-- table (its owner's members), as CREATE INDEX is. Returns 'built', 'rebuilt' (an invalid
-- index of that name, left by a build that failed, was dropped first) or 'there'. An index
-- of that name with another definition is an error: it is not this one.
CREATE FUNCTION lokadb.index_in_org(parent regclass, name text, model regclass, org_id text)
RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    tbl text;
    nsp name;
    owner oid;
    prefix text;
    def text;
    want text;
    srv name;
    c text := 'lokadb_concurrently';
    state text;
    result text;
BEGIN
    SELECT format('%I.%I', n.nspname, cl.relname), n.nspname, cl.relowner
    INTO tbl, nsp, owner
    FROM pg_class cl JOIN pg_namespace n ON n.oid = cl.relnamespace
    JOIN lokadb.tables t ON t.schema_name = n.nspname AND t.table_name = cl.relname
    WHERE cl.oid = parent AND t.state = 'enabled';
    IF tbl IS NULL THEN
        RAISE EXCEPTION '% is not a LokaDB table', parent USING ERRCODE = '42809';
    END IF;
    IF NOT pg_has_role(session_user, owner, 'USAGE') THEN
        RAISE EXCEPTION 'must be owner of table %', parent USING ERRCODE = '42501';
    END IF;
    SELECT format('CREATE INDEX %I ON %I.%I ', ic.relname, ln.nspname, lc.relname), pg_get_indexdef(i.indexrelid)
    INTO prefix, def
    FROM pg_index i
    JOIN pg_class ic ON ic.oid = i.indexrelid
    JOIN pg_class lc ON lc.oid = i.indrelid
    JOIN pg_namespace ln ON ln.oid = lc.relnamespace
    WHERE i.indexrelid = model AND i.indisvalid
      AND i.indrelid IN (SELECT p.relid FROM pg_partition_tree(parent) p);
    IF def IS NULL OR left(def, length(prefix)) <> prefix THEN
        RAISE EXCEPTION '% is not a valid, non-unique index on a partition of %', model, parent
            USING ERRCODE = '42809';
    END IF;
    -- As pg_get_indexdef shows it in the organization's database once built.
    want := format('CREATE INDEX %I ON %s ', name, tbl) || substr(def, length(prefix) + 1);
    SELECT o.server INTO srv FROM lokadb.ddl_orgs(parent) o WHERE o.org = org_id;
    IF srv IS NULL THEN
        RAISE EXCEPTION 'organization % has no rows of % in its own database', org_id, parent
            USING ERRCODE = '42704';
    END IF;
    IF c = ANY (coalesce(dblink_get_connections(), '{}')) THEN
        PERFORM dblink_disconnect(c);
    END IF;
    PERFORM dblink_connect(c, srv);
    BEGIN
        SELECT t.state, t.def INTO state, def FROM dblink(c, format(
            $q$SELECT CASE WHEN i.indisvalid THEN 'valid' ELSE 'invalid' END, pg_get_indexdef(i.indexrelid)
               FROM pg_index i WHERE i.indexrelid = to_regclass(%L)$q$,
            format('%I.%I', nsp, name))) AS t(state text, def text);
        IF state = 'valid' THEN
            IF def <> rtrim(want) THEN
                RAISE EXCEPTION 'organization %''s database has an index % that is not this one: %', org_id, name, def
                    USING ERRCODE = '42P07',
                          HINT = 'Drop or rename it there, or give the new index another name.';
            END IF;
            result := 'there';
        ELSE
            IF state = 'invalid' THEN
                PERFORM dblink_exec(c, format('DROP INDEX CONCURRENTLY IF EXISTS %I.%I', nsp, name));
                result := 'rebuilt';
            ELSE
                result := 'built';
            END IF;
            PERFORM dblink_exec(c, regexp_replace(want, '^CREATE INDEX ', 'CREATE INDEX CONCURRENTLY '));
        END IF;
    EXCEPTION WHEN OTHERS THEN
        PERFORM dblink_disconnect(c);
        RAISE;
    END;
    PERFORM dblink_disconnect(c);
    RETURN result;
END
$$;

DO $$
DECLARE s name := (SELECT n.nspname FROM pg_extension e JOIN pg_namespace n ON n.oid = e.extnamespace
                   WHERE e.extname = 'dblink');
BEGIN
    EXECUTE format('ALTER FUNCTION lokadb.index_in_org(regclass, text, regclass, text) SET search_path = pg_catalog, %I, pg_temp', s);
END
$$;
