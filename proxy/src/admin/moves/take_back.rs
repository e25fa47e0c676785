//! What `move-back` takes back, checked before its switch's lock (the whole copy) and
//! under it (only the rows the last changes wrote), so the switch's pause does not grow
//! with the organization (docs/moving.md). Rows written straight into the organization's own
//! database, not through the cloud, passed none of the cloud's checks: one may hold a key
//! another organization holds in a key map, or reference a row the cloud lacks. Such rows
//! make the switch refuse, naming them: nothing is switched, and once they are fixed there
//! the move is run again (or `--abort`ed). Otherwise the key maps learn the keys written
//! there, which the cloud's triggers never saw, before the foreign keys that go through the
//! key maps are checked.

use super::fold::{foreign_key_checks, offending, shown_key, SHOWN};
use super::layout::MoveTable;
use crate::admin::catalog::qualify;
use crate::admin::db::{describe, ident, literal, AdminError};
use postgres::Transaction;

/// Which rows of the organization's copy in the cloud are checked.
pub enum Rows<'a> {
    /// All of them: before the switch's lock, while the copy still changes.
    All,
    /// Those whose keys the catch-up applied since (under the lock): per table, the JSON
    /// arrays of keys its rounds applied ([`super::capture::CatchUp::take_applied`]).
    Applied(&'a [(String, String)]),
}

impl Rows<'_> {
    /// The relation (or subquery) of `t`'s rows to check; `None`: none of its rows.
    fn of(&self, t: &MoveTable) -> Option<String> {
        let part = t.cloud_part();
        let Rows::Applied(applied) = self else {
            return Some(part);
        };
        let key: Vec<String> = t.key.iter().map(|c| format!("k.{}", ident(c))).collect();
        let sets: Vec<String> = applied
            .iter()
            .filter(|(table, _)| *table == t.display())
            .map(|(_, keys)| {
                format!(
                    "SELECT {} FROM json_populate_recordset(NULL::{part}, {}) k",
                    key.join(", "),
                    literal(keys)
                )
            })
            .collect();
        if sets.is_empty() {
            return None;
        }
        Some(format!(
            "(SELECT * FROM {part} x WHERE {} IN ({}))",
            t.key_of("x"),
            sets.join(" UNION ALL ")
        ))
    }
}

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
pub fn check(
    tx: &mut Transaction<'_>,
    tables: &[MoveTable],
    org: &str,
    rows: Rows<'_>,
) -> Result<u64, AdminError> {
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
    let mut checked = Vec::new();
    for t in tables {
        let Some(part) = rows.of(t) else { continue };
        for km in key_maps(tx, t)? {
            maps.push((t, part.clone(), km));
        }
        checked.push((t, part));
    }
    // Keys another organization holds.
    for (t, part, km) in &maps {
        let org_col = ident(&t.org_column);
        let sql = format!(
            "SELECT {shown} FROM {part} c JOIN {map} k ON {on}
             WHERE k.{org_col} IS DISTINCT FROM c.{org_col} LIMIT {SHOWN}",
            shown = shown_key(&km.names.join(", "), &km.of_copy()),
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
    for (t, part, km) in &maps {
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
            present = present.join(" AND "),
            on = km.on(),
        );
        learned += tx.execute(&sql, &[]).map_err(failed)?;
    }
    // References to rows the cloud lacks (through the key maps too, which know every key
    // of the organization now).
    for (t, part) in &checked {
        for (name, sql) in foreign_key_checks(tx, t, part)? {
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
