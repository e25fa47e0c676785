//! The shape of the LokaDB tables a move copied, and what a migration changed since.
//!
//! A move creates the destination's tables from the cloud's catalog at step `prepare`, and
//! records the tables' shapes (`lokadb.move_shapes()`) in its journal just before. A
//! migration committed after that changes the cloud's tables (and, moving out, the attached
//! cloud partition), but not the destination. The switch compares the recorded shapes with
//! the tables' shapes under its lock, which every DDL on a LokaDB table must wait for (it
//! recurses into the organization's partition), and copies again with the new shape rather
//! than switch to a destination of the old one. See docs/migrations.md.

use crate::admin::db::AdminError;
use postgres::GenericClient;

/// A LokaDB table changed since the move recorded its shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Changed {
    /// `schema.table`.
    pub table: String,
    /// What the organization's table would need to follow (as a migration sends it).
    pub statements: Vec<String>,
}

/// A migration changed the tables while a move copied them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchemaChanged(pub Vec<Changed>);

impl std::fmt::Display for SchemaChanged {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts: Vec<String> = self
            .0
            .iter()
            .map(|c| format!("{} ({})", c.table, c.statements.join("; ")))
            .collect();
        write!(
            f,
            "a migration changed {} since the copy began",
            parts.join(", ")
        )
    }
}

/// Records the tables' shapes now in `org`'s journal row (before its destination is made).
///
/// # Errors
///
/// The statement failed.
pub fn record(c: &mut impl GenericClient, org: &str) -> Result<(), AdminError> {
    c.execute(
        "UPDATE lokadb.moves SET shapes = lokadb.move_shapes(), updated_at = now() WHERE org = $1",
        &[&org],
    )?;
    Ok(())
}

/// What changed since [`record`]; `None` when nothing did (or nothing was recorded: a move
/// journaled by an older lokadb, whose destination cannot be compared).
///
/// # Errors
///
/// The query failed.
pub fn changed(c: &mut impl GenericClient, org: &str) -> Result<Option<SchemaChanged>, AdminError> {
    let rows = c.query(
        "SELECT x.tbl, x.statements
         FROM lokadb.moves m, LATERAL lokadb.move_shape_changes(m.shapes) x
         WHERE m.org = $1 AND m.shapes IS NOT NULL",
        &[&org],
    )?;
    let changes: Vec<Changed> = rows
        .iter()
        .map(|r| Changed {
            table: r.get(0),
            statements: r.get(1),
        })
        .collect();
    Ok((!changes.is_empty()).then_some(SchemaChanged(changes)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_message_names_each_table_and_what_changed() {
        let s = SchemaChanged(vec![Changed {
            table: "public.notes".to_owned(),
            statements: vec!["ALTER TABLE public.notes ADD COLUMN x integer".to_owned()],
        }]);
        assert_eq!(
            s.to_string(),
            "a migration changed public.notes (ALTER TABLE public.notes ADD COLUMN x integer) since the copy began"
        );
    }
}
