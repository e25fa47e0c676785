//! What `move-back` takes back, checked under its switch's lock, once the last changes are
//! in the cloud's copy (docs/moving.md). Rows written straight into the organization's own
//! database, not through the cloud, passed none of the cloud's checks: one may hold a key
//! another organization holds in a key map, or reference a row the cloud lacks. Such rows
//! make the switch refuse, naming them: nothing is switched, and once they are fixed there
//! the move is run again (or `--abort`ed). Otherwise the key maps learn the keys written
//! there, which the cloud's triggers never saw, before the foreign keys that go through the
//! key maps are checked.

use super::fold::{foreign_key_checks, offending, shown_key, SHOWN};
use super::layout::MoveTable;
use crate::admin::catalog::qualify;
use crate::admin::db::{describe, ident, AdminError};
use postgres::Transaction;

/// A key map of a table: its table in schema `lokadb`, and its key's columns (quoted).
struct KeyMap {
    table: String,
    /// `lokadb.km_…`, for messages.
    display: String,
    names: Vec<String>,
    cols: Vec<String>,
}

impl KeyMap {
    /// `c.k = k.k AND …`: a row of the copy (`c`) and its key in the map (`k`).
    fn on(&self) -> String {
        self.cols
            .iter()
            .map(|c| format!("k.{c} = c.{c}"))
            .collect::<Vec<_>>()
            .join(" AND ")
    }

    /// `c.k1, c.k2`.
    fn of_copy(&self) -> Vec<String> {
        self.cols.iter().map(|c| format!("c.{c}")).collect()
    }
}

fn key_maps(tx: &mut Transaction<'_>, t: &MoveTable) -> Result<Vec<KeyMap>, AdminError> {
    Ok(tx
        .query(
            "SELECT keymap::text, columns::text[] FROM lokadb.keys
             WHERE schema_name = $1 AND table_name = $2 ORDER BY keymap",
            &[&t.schema, &t.name],
        )?
        .iter()
        .map(|r| {
            let name: String = r.get(0);
            let names: Vec<String> = r.get(1);
            KeyMap {
                table: qualify("lokadb", &name),
                display: format!("lokadb.{name}"),
                cols: names.iter().map(|c| ident(c)).collect(),
                names,
            }
        })
        .collect())
}

/// Checks what the organization's copy in the cloud holds, and has the key maps learn its
/// keys. Returns how many keys they learned.
///
/// # Errors
///
/// A row the cloud would refuse (the keys named; nothing switched), or a query failed.
pub fn check(tx: &mut Transaction<'_>, tables: &[MoveTable], org: &str) -> Result<u64, AdminError> {
    let failed = |e: postgres::Error| {
        AdminError::failed(format!(
            "switch of {org}: checking the rows it takes back failed: {}; nothing was switched",
            describe(&e)
        ))
    };
    let refuse = |what: String| {
        AdminError::failed(format!(
            "move-back of {org} refused: rows written in its database {what}; nothing was switched. Change or remove them there, then run lokadb move-back {org} again (or --abort)"
        ))
    };
    let mut maps = Vec::new();
    for t in tables {
        for km in key_maps(tx, t)? {
            maps.push((t, km));
        }
    }
    // Keys another organization holds.
    for (t, km) in &maps {
        let org_col = ident(&t.org_column);
        let sql = format!(
            "SELECT {shown} FROM {part} c JOIN {map} k ON {on}
             WHERE k.{org_col} IS DISTINCT FROM c.{org_col} LIMIT {SHOWN}",
            shown = shown_key(&km.names.join(", "), &km.of_copy()),
            part = t.cloud_part(),
            map = km.table,
            on = km.on(),
        );
        let found = tx.query(&sql, &[]).map_err(failed)?;
        if !found.is_empty() {
            return Err(refuse(format!(
                "hold keys of {} that another organization holds (key map {}): {}",
                t.display(),
                km.display,
                offending(&found)
            )));
        }
    }
    // The keys written there: the key maps learn them.
    let mut learned = 0;
    for (t, km) in &maps {
        let org_col = ident(&t.org_column);
        let values = km.of_copy();
        let present: Vec<String> = values.iter().map(|v| format!("{v} IS NOT NULL")).collect();
        let sql = format!(
            "INSERT INTO {map} ({list}, {org_col})
             SELECT {values}, c.{org_col} FROM {part} c
             WHERE {present} AND NOT EXISTS (SELECT 1 FROM {map} k WHERE {on})
             ON CONFLICT DO NOTHING",
            map = km.table,
            list = km.cols.join(", "),
            values = values.join(", "),
            part = t.cloud_part(),
            present = present.join(" AND "),
            on = km.on(),
        );
        learned += tx.execute(&sql, &[]).map_err(failed)?;
    }
    // References to rows the cloud lacks (through the key maps too, which know every key
    // of the organization now).
    for t in tables {
        for (name, sql) in foreign_key_checks(tx, t)? {
            let found = tx.query(&sql, &[]).map_err(failed)?;
            if !found.is_empty() {
                return Err(refuse(format!(
                    "break {}'s foreign key {name} (they reference rows the cloud lacks): {}",
                    t.display(),
                    offending(&found)
                )));
            }
        }
    }
    Ok(learned)
}
