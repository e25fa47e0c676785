//! A new connection's check at login, when its database has the direct path: the cloud's
//! metadata generation (the login waits until its core has it) and the role's privileges on
//! the LokaDB tables, in one round trip on the client's own backend ([routing], "Fresh
//! metadata").
//!
//! [routing]: ../../../docs/routing.md

use super::router::Privileges;
use crate::backend::conn::BackendConn;
use crate::core::{Core, Database};
use std::collections::HashMap;
use std::time::Instant;

/// How long a login waits for this core's metadata to reach the cloud's generation.
const METADATA_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// The cloud's metadata generation and what the client's role may do to each LokaDB table
/// (read, update), as the cloud says when it logs in: `GENERATION:flags,flags,…`.
const CHECK_SQL: &str = "SELECT lokadb_client.generation()::text || ':' || coalesce((\
     SELECT string_agg(CASE WHEN c.relrowsecurity THEN '--' ELSE \
     CASE WHEN has_table_privilege(c.oid, 'SELECT') THEN 'r' ELSE '-' END || \
     CASE WHEN has_table_privilege(c.oid, 'UPDATE') THEN 'u' ELSE '-' END END, ',' ORDER BY t.n) \
     FROM unnest(string_to_array($1, E'\\n')) WITH ORDINALITY AS t(name, n) \
     LEFT JOIN pg_catalog.pg_class c ON c.oid = pg_catalog.to_regclass(t.name)), '')";

/// The freshness check of a new connection, when the database has the direct path (the
/// only route that depends on the metadata for correctness of reads): one round trip on the
/// client's own backend, as its role, that returns the cloud's metadata generation — the
/// login waits until this core has it, so a statement right after a move is routed by it —
/// and the role's privileges on the LokaDB tables. The direct path runs as one role in every
/// organization's database, so a statement takes it only if the client's role could run it
/// in the cloud (SELECT, or UPDATE; no row-level security). With `meta_cache.verify`, a
/// check of the same role on this core within that interval is reused instead.
pub async fn direct_privileges(
    core: &Core,
    db: &Database,
    user: &str,
    backend: &mut BackendConn,
) -> Privileges {
    let now = Instant::now();
    let key = (db.name.clone(), user.to_owned());
    let core_generation = || core.meta.borrow().get(&*db.name).map(|m| m.meta.generation);
    if let Some(verify) = db.config.meta_cache.verify {
        let cached = core.checks.borrow().get(&key).and_then(|c| {
            let fresh =
                now.duration_since(c.at) < verify && Some(c.generation) <= core_generation();
            fresh.then(|| c.by_name.clone())
        });
        if let Some(by_name) = cached {
            return Privileges::new(by_name);
        }
    }
    // Right after the proxy starts, the metadata may still be on its way to this core.
    let deadline = now + METADATA_WAIT;
    while core_generation().is_none() && Instant::now() < deadline {
        crate::rt::sleep(std::time::Duration::from_millis(5)).await;
    }
    let tables = match core.meta.borrow().get(&*db.name) {
        Some(m) if m.has_tables() => m.meta.catalog.tables().to_vec(),
        _ => return Privileges::default(),
    };
    let quote = |s: &str| format!("\"{}\"", s.replace('"', "\"\""));
    let names: Vec<String> = tables
        .iter()
        .map(|t| format!("{}.{}", quote(&t.schema), quote(&t.name)))
        .collect();
    let answer = match backend
        .query_one("", CHECK_SQL, true, &names.join("\n"))
        .await
    {
        Ok(Some(Some(answer))) => answer,
        other => {
            tracing::info!(result = ?other.map(|_| ()), "could not check the routing metadata and the client's privileges (is the cloud's schema at version 6? lokadb init); its statements go through the cloud");
            return Privileges::default();
        }
    };
    let Some((generation, flags)) = answer
        .split_once(':')
        .and_then(|(g, f)| Some((g.parse::<i64>().ok()?, f)))
    else {
        return Privileges::default();
    };
    while core_generation().is_some_and(|g| g < generation) && Instant::now() < deadline {
        crate::rt::sleep(std::time::Duration::from_millis(2)).await;
    }
    if core_generation().is_some_and(|g| g < generation) {
        tracing::warn!(generation, "this core's routing metadata is behind the cloud's; the session's statements go through the cloud");
        return Privileges::default();
    }
    let by_name: HashMap<(String, String), (bool, bool)> = tables
        .iter()
        .zip(flags.split(','))
        .map(|(t, f)| {
            (
                (t.schema.clone(), t.name.clone()),
                (f.starts_with('r'), f.ends_with('u')),
            )
        })
        .collect();
    if db.config.meta_cache.verify.is_some() {
        core.checks.borrow_mut().insert(
            key,
            crate::core::Check {
                at: now,
                generation,
                by_name: by_name.clone(),
            },
        );
    }
    Privileges::new(by_name)
}
