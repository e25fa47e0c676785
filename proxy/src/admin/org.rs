//! `lokadb org add | list | show | remove`: registering an organization's database.
//!
//! An organization is reached from the cloud through a postgres_fdw server on the
//! relay's Postgres listener (`dbname 'ORG/DBNAME'`, `fetch_size 1000`), with a user
//! mapping for every cloud role (PUBLIC). `add` checks, from the cloud database itself,
//! that the database answers through that server, and records its Postgres version.

use super::db::{connect, describe, ident, literal, AdminError};
use super::migrations::require_current;

/// `lokadb org add` arguments.
#[derive(Debug, Clone)]
pub struct NewOrg {
    /// Organization id (as in `relay.tokens` and the organization column).
    pub id: String,
    /// Display name.
    pub name: Option<String>,
    /// The relays' Postgres listeners as the cloud database reaches them, HOST and PORT,
    /// in the order postgres_fdw (and the direct path) try them; at least one.
    pub relays: Vec<(String, u16)>,
    /// The database in the organization's Postgres.
    pub dbname: String,
    /// `fdw` or `fdw+direct`.
    pub profile: crate::profile::Profile,
    /// The role postgres_fdw logs in as in the organization's database.
    pub user: String,
    /// Its password.
    pub password: String,
    /// How postgres_fdw (and the direct path, which reads the server's options) speaks
    /// TLS to the relay.
    pub relay_sslmode: lokadb_shared::conninfo::SslMode,
    /// The CA the relay's certificate must chain to, a path on the cloud database's host.
    pub relay_sslrootcert: Option<String>,
}

/// `HOST:PORT, HOST:PORT` for messages.
fn relay_list(relays: &[(String, u16)]) -> String {
    let each: Vec<String> = relays.iter().map(|(h, p)| format!("{h}:{p}")).collect();
    each.join(", ")
}

/// The postgres_fdw server of an organization.
pub fn server_name(org: &str) -> String {
    format!("lokadb_org_{org}")
}

/// Checks an organization id as the relay and the schema accept it.
///
/// # Errors
///
/// Empty, with `/`, too long for a server name, or the relay's admin database name.
pub fn check_id(id: &str) -> Result<(), AdminError> {
    if id.is_empty() || id.contains('/') || id == "lokadb_relay" || id.len() > 52 {
        return Err(AdminError::usage(format!(
            "organization id {id:?}: 1 to 52 bytes, without '/', not lokadb_relay"
        )));
    }
    Ok(())
}

/// `lokadb org add`: returns the organization's Postgres version.
///
/// # Errors
///
/// Bad arguments, an id already registered, or a database that does not answer through
/// the relay: nothing is changed (one transaction).
pub fn add(dsn: &str, org: &NewOrg) -> Result<String, AdminError> {
    check_id(&org.id)?;
    if org.dbname.is_empty() {
        return Err(AdminError::usage("--dbname must not be empty"));
    }
    let Some((relay_host, relay_port)) = org.relays.first() else {
        return Err(AdminError::usage("--via-relay HOST:PORT is required"));
    };
    if org
        .relays
        .iter()
        .any(|(h, _)| h.is_empty() || h.contains(','))
    {
        return Err(AdminError::usage(
            "--via-relay: a host is empty or holds a ','",
        ));
    }
    let hosts: Vec<&str> = org.relays.iter().map(|(h, _)| h.as_str()).collect();
    let ports: Vec<String> = org.relays.iter().map(|(_, p)| p.to_string()).collect();
    let (hosts, ports) = (hosts.join(","), ports.join(","));
    let verifies = matches!(
        org.relay_sslmode,
        lokadb_shared::conninfo::SslMode::VerifyCa | lokadb_shared::conninfo::SslMode::VerifyFull
    );
    if verifies && org.relay_sslrootcert.is_none() {
        return Err(AdminError::usage(format!(
            "--relay-sslmode {} needs --relay-sslrootcert: the CA file (on the cloud database's host) the relay's certificate chains to; --relay-sslmode disable for plain TCP",
            org.relay_sslmode.as_str()
        )));
    }
    let mut tls_options = format!(", sslmode {}", literal(org.relay_sslmode.as_str()));
    if let Some(ca) = &org.relay_sslrootcert {
        tls_options.push_str(&format!(", sslrootcert {}", literal(ca)));
    }
    let mut client = connect(dsn)?;
    require_current(&mut client)?;
    let exists: bool = client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM lokadb.org WHERE id = $1)",
            &[&org.id],
        )?
        .get(0);
    if exists {
        return Err(AdminError::usage(format!(
            "organization {} is already registered (lokadb org show {})",
            org.id, org.id
        )));
    }
    let server = ident(&server_name(&org.id));
    let mut tx = client.transaction()?;
    tx.batch_execute(&format!(
        "CREATE EXTENSION IF NOT EXISTS postgres_fdw;
         CREATE SERVER {server} FOREIGN DATA WRAPPER postgres_fdw
           OPTIONS (host {host}, port {port}, dbname {dbname}, fetch_size '1000'{tls_options});
         CREATE USER MAPPING FOR PUBLIC SERVER {server}
           OPTIONS (user {user}, password {password});
         CREATE FOREIGN TABLE lokadb.org_check (name text, setting text) SERVER {server}
           OPTIONS (schema_name 'pg_catalog', table_name 'pg_settings');",
        host = literal(&hosts),
        port = literal(&ports),
        dbname = literal(&format!("{}/{}", org.id, org.dbname)),
        user = literal(&org.user),
        password = literal(&org.password),
    ))
    .map_err(|e| {
        AdminError::failed(format!(
            "cannot create the postgres_fdw server: {}",
            describe(&e)
        ))
    })?;
    // The check runs in the cloud database, so it proves the path postgres_fdw will use.
    let version: String = tx
        .query_one(
            "SELECT setting FROM lokadb.org_check WHERE name = 'server_version'",
            &[],
        )
        .map_err(|e| {
            AdminError::failed(format!(
                "organization {}'s database does not answer through the relay at {} (database {}/{}, sslmode {}): {}\nnothing was changed{}",
                org.id,
                relay_list(&org.relays),
                org.id,
                org.dbname,
                org.relay_sslmode.as_str(),
                describe(&e),
                if org.relay_sslmode.requires_tls() {
                    "\nhint: the relay offers TLS with its certificate (relay.postgres_tls); where the cloud's Postgres is built without SSL, or the relay's TLS is off, say --relay-sslmode disable"
                } else {
                    ""
                }
            ))
        })?
        .get(0);
    tx.batch_execute("DROP FOREIGN TABLE lokadb.org_check")?;
    tx.execute(
        "INSERT INTO lokadb.org (id, name, profile, server, relay_host, relay_port, dbname, pg_version)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        &[
            &org.id,
            &org.name,
            &org.profile.as_str(),
            &server_name(&org.id),
            relay_host,
            &i32::from(*relay_port),
            &org.dbname,
            &version,
        ],
    )?;
    tx.commit()?;
    Ok(version)
}

/// `lokadb org list`: one line per organization.
///
/// # Errors
///
/// The query failed.
pub fn list(dsn: &str) -> Result<String, AdminError> {
    let mut client = connect(dsn)?;
    require_current(&mut client)?;
    let rows = client.query(
        "SELECT id, coalesce(name, ''), state, profile,
                coalesce(relay_host || ':' || relay_port, ''), coalesce(dbname, ''),
                coalesce(pg_version, ''), generation,
                (SELECT count(*) FROM lokadb.ddl_owed w WHERE w.org = o.id)
         FROM lokadb.org o ORDER BY id",
        &[],
    )?;
    let mut table = vec![[
        "id",
        "name",
        "state",
        "profile",
        "relay",
        "dbname",
        "postgres",
        "generation",
        "owes",
    ]
    .map(str::to_owned)];
    for r in &rows {
        let g: i64 = r.get(7);
        let owes: i64 = r.get(8);
        table.push([
            r.get(0),
            r.get(1),
            r.get(2),
            r.get(3),
            r.get(4),
            r.get(5),
            r.get(6),
            g.to_string(),
            match owes {
                0 => String::new(),
                n => format!("{n} migration{}", if n == 1 { "" } else { "s" }),
            },
        ]);
    }
    Ok(format_table(&table))
}

/// `lokadb org show ID`: every field, and a pause if one is held.
///
/// # Errors
///
/// Unknown organization (usage) or a failed query.
pub fn show(dsn: &str, id: &str) -> Result<String, AdminError> {
    let mut client = connect(dsn)?;
    require_current(&mut client)?;
    let row = client.query_opt(
        "SELECT id, coalesce(name, ''), state, profile, coalesce(server::text, ''),
                coalesce(relay_host || ':' || relay_port, ''), coalesce(dbname, ''),
                coalesce(pg_version, ''), generation::text, created_at::text, updated_at::text
         FROM lokadb.org WHERE id = $1",
        &[&id],
    )?;
    let Some(r) = row else {
        return Err(unknown(id));
    };
    let names = [
        "id",
        "name",
        "state",
        "profile",
        "server",
        "relay",
        "dbname",
        "postgres",
        "generation",
        "created",
        "updated",
    ];
    let mut out = String::new();
    for (i, n) in names.iter().enumerate() {
        out.push_str(&format!("{n:<11} {}\n", r.get::<_, String>(i)));
    }
    let pause = client.query_opt(
        "SELECT holder_pid, reason, timeout::text, since::text FROM lokadb.pause p
         WHERE org = $1 AND EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.pid = p.holder_pid)",
        &[&id],
    )?;
    match pause {
        Some(p) => out.push_str(&format!(
            "{:<11} since {} by backend {} ({}), writers wait up to {}\n",
            "paused",
            p.get::<_, String>(3),
            p.get::<_, i32>(0),
            p.get::<_, String>(1),
            p.get::<_, String>(2)
        )),
        None => out.push_str(&format!("{:<11} no\n", "paused")),
    }
    let owed = client.query_one(
        "SELECT count(*), min(at)::text, (array_agg(reason ORDER BY seq DESC))[1]
         FROM lokadb.ddl_owed WHERE org = $1",
        &[&id],
    )?;
    match owed.get::<_, i64>(0) {
        0 => out.push_str(&format!("{:<11} nothing\n", "owes")),
        n => out.push_str(&format!(
            "{:<11} {n} migration{} since {} (statements refused until lokadb org sync {id}); last: {}\n",
            "owes",
            if n == 1 { "" } else { "s" },
            owed.get::<_, String>(1),
            owed.get::<_, String>(2)
        )),
    }
    Ok(out)
}

/// `lokadb org remove ID`: only an organization whose rows are in the cloud.
///
/// # Errors
///
/// Unknown, or not in the cloud (usage): nothing is changed.
pub fn remove(dsn: &str, id: &str) -> Result<(), AdminError> {
    let mut client = connect(dsn)?;
    require_current(&mut client)?;
    let mut tx = client.transaction()?;
    let state: Option<String> = tx
        .query_opt(
            "SELECT state FROM lokadb.org WHERE id = $1 FOR UPDATE",
            &[&id],
        )?
        .map(|r| r.get(0));
    match state.as_deref() {
        None => return Err(unknown(id)),
        Some("cloud") => {}
        Some(s) => {
            return Err(AdminError::usage(format!(
                "organization {id} is {s}: its rows are not (only) in the cloud; move it back first (lokadb move-back {id})"
            )))
        }
    }
    // Partitions of its own (moved back with them kept, or a move aborted after its split)
    // would be left with nobody to fold them.
    let own: Vec<String> = tx
        .query(
            "SELECT c.relname::text FROM lokadb.tables t
             JOIN pg_inherits i ON i.inhparent = to_regclass(format('%I.%I', t.schema_name, t.table_name))
             JOIN pg_class c ON c.oid = i.inhrelid
             WHERE pg_get_expr(c.relpartbound, c.oid)
                   IN (format('FOR VALUES IN (%L)', $1::text), format('FOR VALUES IN (%s)', $1::text))
             ORDER BY 1",
            &[&id],
        )?
        .iter()
        .map(|r| r.get(0))
        .collect();
    if !own.is_empty() {
        return Err(AdminError::usage(format!(
            "organization {id} still has partitions of its own ({}): fold it into DEFAULT first (lokadb fold {id}); nothing was changed",
            own.join(", ")
        )));
    }
    let server = ident(&server_name(id));
    tx.batch_execute(&format!(
        "DROP USER MAPPING IF EXISTS FOR PUBLIC SERVER {server};
         DROP SERVER IF EXISTS {server} RESTRICT;"
    ))
    .map_err(|e| {
        AdminError::failed(format!(
            "cannot drop the postgres_fdw server: {}",
            describe(&e)
        ))
    })?;
    tx.execute("DELETE FROM lokadb.org WHERE id = $1", &[&id])?;
    tx.commit()?;
    Ok(())
}

/// `lokadb org sync ID`: applies the migrations the organization owes (it could not be
/// reached when they ran, with `lokadb.migration_offline = defer`), in order, in one
/// transaction in its database; its statements are served again.
///
/// # Errors
///
/// Unknown organization (usage), or it still cannot take them: nothing is changed.
pub fn sync(dsn: &str, id: &str) -> Result<String, AdminError> {
    let mut client = connect(dsn)?;
    require_current(&mut client)?;
    let known = client
        .query_opt("SELECT 1 FROM lokadb.org WHERE id = $1", &[&id])?
        .is_some();
    if !known {
        return Err(unknown(id));
    }
    let s = crate::migrate::sync(&mut client, id)
        .map_err(|e| AdminError::failed(format!("organization {id}: {}", describe(&e))))?;
    Ok(match s.migrations {
        0 => format!("organization {id} owes no migration"),
        n => format!(
            "organization {id}: {n} owed migration{} applied ({} statement{}); its statements are served again",
            if n == 1 { "" } else { "s" },
            s.statements,
            if s.statements == 1 { "" } else { "s" },
        ),
    })
}

fn unknown(id: &str) -> AdminError {
    AdminError::usage(format!(
        "organization {id} is not registered (lokadb org list shows those that are)"
    ))
}

/// Left-aligned columns separated by two spaces.
pub fn format_table<const N: usize>(rows: &[[String; N]]) -> String {
    let mut widths = [0usize; N];
    for r in rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let mut out = String::new();
    for r in rows {
        let line: Vec<String> = r
            .iter()
            .zip(widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    out
}
