//! Verification: a table's rows of the organization on two sides, counted and summed
//! (an order-independent checksum of each row's text), and where rows must not be.

use super::layout::MoveTable;
use crate::admin::db::AdminError;
use postgres::GenericClient;

/// Rows and checksum of the organization's rows of `relation`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sum {
    pub rows: i64,
    pub checksum: String,
    /// Rows of another organization (must be 0).
    pub foreign_rows: i64,
}

/// Counts and sums `relation` (all its rows: other organizations' are counted apart),
/// leaving out the rows whose key (as `text[]` text) is in `except`.
///
/// # Errors
///
/// The query failed.
pub fn sum(
    c: &mut impl GenericClient,
    t: &MoveTable,
    relation: &str,
    except: &[String],
) -> Result<Sum, AdminError> {
    let keys: Vec<String> = t
        .key
        .iter()
        .map(|k| format!("s.{}::text", crate::admin::db::ident(k)))
        .collect();
    let r = c.query_one(
        &format!(
            "SELECT count(*) FILTER (WHERE {mine}),
                    coalesce(sum(('x' || substr(md5(ROW({cols})::text), 1, 15))::bit(60)::bigint::numeric)
                             FILTER (WHERE {mine}), 0)::text,
                    count(*) FILTER (WHERE NOT ({mine}) OR s.{o} IS NULL)
             FROM {relation} s WHERE NOT (ARRAY[{keys}]::text = ANY($1::text[]))",
            keys = keys.join(", "),
            mine = t.org_filter("s"),
            cols = t.cols_of("s"),
            o = crate::admin::db::ident(&t.org_column),
        ),
        &[&except],
    )?;
    Ok(Sum {
        rows: r.get(0),
        checksum: r.get(1),
        foreign_rows: r.get(2),
    })
}

/// Rows of the organization left in the DEFAULT partition (must be 0 once it has its own).
///
/// # Errors
///
/// The query failed.
pub fn left_in_default(c: &mut impl GenericClient, t: &MoveTable) -> Result<i64, AdminError> {
    Ok(c.query_one(
        &format!(
            "SELECT count(*) FROM ONLY {} s WHERE {}",
            t.default(),
            t.org_filter("s")
        ),
        &[],
    )?
    .get(0))
}

/// One table's verification line, and whether it passed.
pub fn compare(t: &MoveTable, source: &Sum, dest: &Sum, in_default: i64) -> (String, bool) {
    let ok = source.rows == dest.rows
        && source.checksum == dest.checksum
        && dest.foreign_rows == 0
        && in_default == 0;
    let mut line = format!(
        "{:<28} {:>10} rows  checksum {}",
        t.display(),
        dest.rows,
        if source.checksum == dest.checksum {
            "equal"
        } else {
            "DIFFERS"
        }
    );
    if source.rows != dest.rows {
        line.push_str(&format!(" (source {} rows)", source.rows));
    }
    if dest.foreign_rows != 0 {
        line.push_str(&format!(
            "  {} rows of other organizations!",
            dest.foreign_rows
        ));
    }
    if in_default != 0 {
        line.push_str(&format!(
            "  {in_default} rows still in the DEFAULT partition!"
        ));
    }
    (line, ok)
}
