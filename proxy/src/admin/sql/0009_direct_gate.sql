-- Version 9: the gate of direct writes opens only for a role that may write organizations'
-- rows.
--
-- lokadb_client.direct_gate(org) is open to every role: the proxy calls it before a direct
-- write, on the client's own cloud backend, as the client's role. It holds the
-- organization's pause lock and direct-writers key shared until its transaction ends, so
-- until now any role could leave `BEGIN; SELECT lokadb_client.direct_gate('acme')` idle and
-- hold up acme's pause and move back. It now refuses (42501) a role that may update no
-- LokaDB table.
--
-- Inside a SECURITY DEFINER function current_user is the function's owner, so the role is
-- named by the caller: direct_gate(org) runs as its caller (SECURITY INVOKER) and passes
-- current_user (the role after any SET ROLE) to direct_gate_as(org, writer), the part that
-- needs the owner's rights. direct_gate_as takes a writer only from a session that holds
-- its privileges already (session_user has USAGE of it: it is that role, or inherits it),
-- so calling it directly with another role's name gains nothing.

CREATE FUNCTION lokadb_client.direct_gate_as(org text, writer name) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles r
                   WHERE r.rolname = writer AND pg_has_role(session_user, r.oid, 'USAGE'))
       OR NOT EXISTS (
           SELECT 1 FROM lokadb.tables t
           WHERE has_table_privilege(writer,
                     to_regclass(format('%I.%I', t.schema_name, t.table_name)), 'UPDATE'))
    THEN
        RAISE EXCEPTION 'permission denied to open the gate of direct writes of organization %', org
            USING ERRCODE = '42501',
                  DETAIL = format('Role %I may update no LokaDB table, as session user %I.',
                                  writer, session_user),
                  HINT = 'The LokaDB proxy opens this gate itself, before a direct write of a role that may make it.';
    END IF;
    -- A read-only session's write fails as the cloud would fail it.
    IF current_setting('transaction_read_only') = 'on' THEN
        RAISE EXCEPTION 'cannot execute UPDATE in a read-only transaction'
            USING ERRCODE = '25006';
    END IF;
    PERFORM lokadb.write_gate(org);
    PERFORM pg_advisory_xact_lock_shared(lokadb.direct_key(org));
    IF NOT EXISTS (SELECT 1 FROM lokadb.org o
                   WHERE o.id = direct_gate_as.org AND o.state = 'moved' AND o.profile = 'fdw+direct') THEN
        RAISE EXCEPTION 'organization % does not take the direct path now', org
            USING ERRCODE = '55000';
    END IF;
END
$$;

CREATE OR REPLACE FUNCTION lokadb_client.direct_gate(org text) RETURNS void
LANGUAGE plpgsql SECURITY INVOKER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM lokadb_client.direct_gate_as(org, current_user);
END
$$;

COMMENT ON FUNCTION lokadb_client.direct_gate(text) IS
    'LokaDB: the gate of direct writes, which the proxy opens before a direct write of the calling role (managed by lokadb init)';
COMMENT ON FUNCTION lokadb_client.direct_gate_as(text, name) IS
    'LokaDB: the gate of direct writes for role writer, which the session must hold the privileges of (managed by lokadb init)';
