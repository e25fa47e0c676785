//! Change capture and catch-up (trigger mode, and the split out of DEFAULT).
//!
//! Row triggers on the source record the *keys* of the rows the organization writes in
//! `lokadb.changes` of the source database. A catch-up round takes up to
//! [`ROUND_RECORDS`] records, reads the current state of those rows at the source (as
//! JSON, one query per table), and sends the destination one batch for every table — one
//! round trip: in a transaction, delete the keys, insert the rows that exist
//! (`json_populate_recordset` into the table's row type). Replaying a round gives the
//! same result, so a crash anywhere only repeats work; the records are deleted (by id,
//! never by range: ids are not given in commit order) after the destination committed.

use super::layout::{capture_function, MoveTable};
use crate::admin::db::{ident, literal, AdminError};
use crate::admin::DEFINER;
use std::time::{Duration, Instant};

/// Records per round (at most).
pub const ROUND_RECORDS: i64 = 5_000;
/// Bytes of row data per round the record count is adjusted to (about).
pub const ROUND_BYTES: u64 = 8 << 20;

/// The trigger names on the source.
fn trigger_name(t: &MoveTable, op: &str) -> String {
    format!("lokadb_capture_{}_{op}", super::layout::org_key(&t.org))
}

/// What a capture is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Capture {
    /// The source of a move: every write of the organization.
    Source,
    /// The DEFAULT partition at a split: only the organization's rows.
    FilteredSource,
    /// The destination: what the organization writes after the switch (for a
    /// verification redone), not what this command's own sessions apply.
    Destination,
}

/// The capture function and triggers on `source` (a relation holding `t`'s rows).
pub fn install_sql(t: &MoveTable, source: &str, kind: Capture) -> Vec<String> {
    let filtered = kind == Capture::FilteredSource;
    // Only the destination skips the command's own sessions: a session that set the
    // flag at a source would have its writes left behind.
    let skip_own = if kind == Capture::Destination {
        "IF current_setting('lokadb.applying', true) = 'on' THEN
        RETURN NULL;
    END IF;"
    } else {
        ""
    };
    let f = capture_function(t);
    let keys = |rec: &str| -> String {
        let k: Vec<String> = t
            .key
            .iter()
            .map(|c| format!("{rec}.{}::text", ident(c)))
            .collect();
        format!("ARRAY[{}]", k.join(", "))
    };
    let rel = literal(&t.display());
    let org = &t.org_literal;
    let key_new = t.key_of("NEW");
    let key_old = t.key_of("OLD");
    // A date or time key prints in the writer's DateStyle; the catch-up reads it back in
    // ISO. Fixed for such keys only (the SET costs every write a settings save/restore).
    let styles = if t
        .key_types
        .iter()
        .any(|k| k.contains("date") || k.contains("time") || k.contains("interval"))
    {
        " SET DateStyle = 'ISO, YMD' SET IntervalStyle = 'postgres' SET TimeZone = 'UTC'"
    } else {
        ""
    };
    let body = format!(
        "CREATE OR REPLACE FUNCTION {f}() RETURNS trigger LANGUAGE plpgsql {DEFINER}{styles} AS $lokadb$
BEGIN
    {skip_own}
    IF TG_OP <> 'INSERT' THEN
        INSERT INTO lokadb.changes (org, rel, key) VALUES ({org}, {rel}, {old});
    END IF;
    IF TG_OP = 'INSERT' OR (TG_OP = 'UPDATE' AND {key_new} IS DISTINCT FROM {key_old}) THEN
        INSERT INTO lokadb.changes (org, rel, key) VALUES ({org}, {rel}, {new});
    END IF;
    RETURN NULL;
END
$lokadb$",
        old = keys("OLD"),
        new = keys("NEW"),
    );
    let o = ident(&t.org_column);
    let mut sql = vec![body];
    if filtered {
        for (op, event, when) in [
            ("i", "INSERT", format!("NEW.{o} = {org}")),
            ("u", "UPDATE", format!("OLD.{o} = {org} OR NEW.{o} = {org}")),
            ("d", "DELETE", format!("OLD.{o} = {org}")),
        ] {
            sql.push(format!(
                "CREATE TRIGGER {} AFTER {event} ON {source} FOR EACH ROW WHEN ({when}) EXECUTE FUNCTION {f}()",
                ident(&trigger_name(t, op))
            ));
        }
    } else {
        sql.push(format!(
            "CREATE TRIGGER {} AFTER INSERT OR UPDATE OR DELETE ON {source} FOR EACH ROW EXECUTE FUNCTION {f}()",
            ident(&trigger_name(t, "a"))
        ));
    }
    sql
}

/// Removes what [`install_sql`] created (whichever form), and the records.
pub fn remove_sql(t: &MoveTable, source: &str) -> Vec<String> {
    let mut sql: Vec<String> = ["i", "u", "d", "a"]
        .iter()
        .map(|op| {
            format!(
                "DROP TRIGGER IF EXISTS {} ON {source}",
                ident(&trigger_name(t, op))
            )
        })
        .collect();
    sql.push(format!(
        "DROP FUNCTION IF EXISTS {}() CASCADE",
        capture_function(t)
    ));
    sql.push(format!(
        "DELETE FROM lokadb.changes WHERE org = {} AND rel = {}",
        t.org_literal,
        literal(&t.display())
    ));
    sql
}

/// Whether the capture triggers are on `source`.
///
/// # Errors
///
/// The query failed.
pub fn installed(
    c: &mut impl postgres::GenericClient,
    t: &MoveTable,
    source: &str,
) -> Result<bool, AdminError> {
    Ok(c.query_one(
        "SELECT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = to_regclass($1)
                            AND tgname::text = ANY($2))",
        &[
            &source,
            &["i", "u", "d", "a"]
                .iter()
                .map(|op| trigger_name(t, op))
                .collect::<Vec<_>>(),
        ],
    )?
    .get(0))
}

/// One side of a catch-up: a connection and the relation `t`'s rows are in there.
pub struct Side<'a> {
    pub client: &'a mut postgres::Client,
    pub relation: String,
    /// Only the organization's rows of `relation` are the source (the DEFAULT partition).
    pub filtered: bool,
}

/// What one round did.
#[derive(Debug, Default, Clone, Copy)]
pub struct Round {
    pub records: u64,
    pub rows: u64,
    pub bytes: u64,
    /// Records left when the round began (its own included; 0 in final mode).
    pub backlog: u64,
    /// Final mode: this round took every record left.
    pub last: bool,
}

/// Applies catch-up rounds for the organization of `tables` from `source` to `dest`
/// (both hold the tables under the relation names `place` gives).
pub struct CatchUp {
    limit: i64,
    /// Final mode (under the pause, nothing new can arrive): SQL sent to the destination
    /// with the last round, the backlog not counted, records left for the clean-up.
    tail: Option<String>,
    /// When kept: per table (displayed name), the keys each round applied, as the JSON
    /// array of key objects its statements used.
    applied: Option<Vec<(String, String)>>,
}

impl Default for CatchUp {
    fn default() -> CatchUp {
        CatchUp::new()
    }
}

impl CatchUp {
    pub fn new() -> CatchUp {
        CatchUp {
            limit: ROUND_RECORDS,
            tail: None,
            applied: None,
        }
    }

    /// Keeps the keys the next rounds apply, for [`CatchUp::take_applied`].
    pub fn keep_applied(&mut self) {
        self.applied = Some(Vec::new());
    }

    /// The keys applied since [`CatchUp::keep_applied`]: (table, JSON array of keys).
    pub fn take_applied(&mut self) -> Vec<(String, String)> {
        self.applied.take().unwrap_or_default()
    }

    /// Records waiting in the source.
    ///
    /// # Errors
    ///
    /// The query failed.
    pub fn backlog(source: &mut postgres::Client, org: &str) -> Result<u64, AdminError> {
        let n: i64 = source
            .query_one(
                "SELECT count(*) FROM lokadb.changes WHERE org = $1",
                &[&org],
            )?
            .get(0);
        Ok(n.unsigned_abs())
    }

    /// One round: returns what it applied (0 records: nothing was waiting).
    ///
    /// # Errors
    ///
    /// A failure on either side; what was applied stays applied, the rest is retried
    /// by the next round.
    pub fn round(
        &mut self,
        tables: &[MoveTable],
        source: &mut postgres::Client,
        source_rel: &dyn Fn(&MoveTable) -> (String, bool),
        dest: &mut postgres::Client,
        dest_rel: &dyn Fn(&MoveTable) -> String,
    ) -> Result<Round, AdminError> {
        let Some(first) = tables.first() else {
            return Ok(Round::default());
        };
        let org = &first.org;
        let final_round = self.tail.is_some();
        let backlog = if final_round {
            0
        } else {
            Self::backlog(source, org)?
        };
        let rows = source.query(
            "SELECT id, rel FROM lokadb.changes WHERE org = $1 ORDER BY id LIMIT $2",
            &[org, &self.limit],
        )?;
        let last = (rows.len() as i64) < self.limit;
        if rows.is_empty() {
            if let Some(tail) = self.tail.take() {
                dest.batch_execute(&tail)?;
            }
            return Ok(Round {
                backlog,
                ..Round::default()
            });
        }
        let mut round = Round {
            records: rows.len() as u64,
            backlog,
            ..Round::default()
        };
        let mut all_ids: Vec<i64> = Vec::with_capacity(rows.len());
        let mut batch = String::from("BEGIN;\n");
        for t in tables {
            let ids: Vec<i64> = rows
                .iter()
                .filter(|r| r.get::<_, &str>(1) == t.display())
                .map(|r| r.get(0))
                .collect();
            if ids.is_empty() {
                continue;
            }
            all_ids.extend(&ids);
            let (src, filtered) = source_rel(t);
            let (keys, present, n) = read_table(t, source, &src, filtered, &ids)?;
            round.rows += n;
            round.bytes += (keys.len() + present.len()) as u64;
            batch.push_str(&apply_sql(t, &dest_rel(t), &keys, &present));
            if let Some(applied) = &mut self.applied {
                applied.push((t.display(), keys));
            }
        }
        batch.push_str("COMMIT;");
        if last {
            if let Some(tail) = self.tail.take() {
                batch.push_str(&tail);
            }
        }
        dest.batch_execute(&batch)?;
        if final_round && last {
            // Under the pause: the clean-up deletes these records; replaying is harmless.
            round.last = true;
            return Ok(round);
        }
        source.execute("DELETE FROM lokadb.changes WHERE id = ANY($1)", &[&all_ids])?;
        // Keep a round near ROUND_BYTES of rows whatever their width.
        if round.bytes > ROUND_BYTES && self.limit > 100 {
            self.limit /= 2;
        } else if round.bytes < ROUND_BYTES / 4 && self.limit < ROUND_RECORDS {
            self.limit = (self.limit * 2).min(ROUND_RECORDS);
        }
        Ok(round)
    }

    /// The final rounds, under the pause (no record can be added): until every record is
    /// applied, then `tail` runs at the destination in the same batch as the last round
    /// (one round trip for the whole final catch-up when it fits one round). Applied
    /// records stay for the clean-up to delete.
    ///
    /// # Errors
    ///
    /// As [`CatchUp::round`].
    pub fn finish_then(
        &mut self,
        tables: &[MoveTable],
        source: &mut postgres::Client,
        source_rel: &dyn Fn(&MoveTable) -> (String, bool),
        dest: &mut postgres::Client,
        dest_rel: &dyn Fn(&MoveTable) -> String,
        tail: &str,
    ) -> Result<u64, AdminError> {
        self.tail = Some(tail.to_owned());
        let mut total = 0;
        let result = loop {
            match self.round(tables, source, source_rel, dest, dest_rel) {
                Ok(r) => {
                    total += r.records;
                    if r.records == 0 || r.last {
                        break Ok(total);
                    }
                }
                Err(e) => break Err(e),
            }
        };
        self.tail = None;
        result
    }

    /// Rounds until the source holds no record; returns the records applied.
    ///
    /// # Errors
    ///
    /// As [`CatchUp::round`].
    pub fn drain(
        &mut self,
        tables: &[MoveTable],
        source: &mut postgres::Client,
        source_rel: &dyn Fn(&MoveTable) -> (String, bool),
        dest: &mut postgres::Client,
        dest_rel: &dyn Fn(&MoveTable) -> String,
    ) -> Result<u64, AdminError> {
        let mut total = 0;
        loop {
            let r = self.round(tables, source, source_rel, dest, dest_rel)?;
            if r.records == 0 || r.last {
                total += r.records;
                return Ok(total);
            }
            total += r.records;
        }
    }
}

/// One table's part of a round, read at the source: the distinct keys of `ids` and the
/// rows with those keys as they are now, each a JSON array of objects; and the rows' count.
fn read_table(
    t: &MoveTable,
    source: &mut postgres::Client,
    src: &str,
    filtered: bool,
    ids: &[i64],
) -> Result<(String, String, u64), AdminError> {
    let casts: Vec<String> = t
        .key
        .iter()
        .zip(&t.key_types)
        .enumerate()
        .map(|(i, (_, ty))| format!("key[{}]::{ty}", i + 1))
        .collect();
    let key_object: Vec<String> = t
        .key
        .iter()
        .zip(&casts)
        .map(|(k, c)| format!("{}, {c}", literal(k)))
        .collect();
    let filter = if filtered {
        format!("{} AND ", t.org_filter("s"))
    } else {
        String::new()
    };
    let r = source.query_one(
        &format!(
            "WITH k AS (SELECT DISTINCT key FROM lokadb.changes WHERE id = ANY($1) AND rel = $2),
                  r AS (SELECT {cols} FROM {src} s WHERE {filter}{key} IN (SELECT {casts} FROM k))
             SELECT (SELECT coalesce(json_agg(json_build_object({key_object})), '[]')::text FROM k),
                    (SELECT coalesce(json_agg(r.*), '[]')::text FROM r),
                    (SELECT count(*) FROM r)",
            cols = t.cols_of("s"),
            key = t.key_of("s"),
            casts = casts.join(", "),
            key_object = key_object.join(", "),
        ),
        &[&ids, &t.display()],
    )?;
    let n: i64 = r.get(2);
    Ok((r.get(0), r.get(1), n.unsigned_abs()))
}

/// The destination's statements for one table of a round: delete the keys, insert the
/// rows (JSON turned back into the table's row type: every column through its input
/// function, as COPY would).
fn apply_sql(t: &MoveTable, dst: &str, keys: &str, rows: &str) -> String {
    format!(
        "DELETE FROM {dst} d USING json_populate_recordset(NULL::{dst}, {keys}) k WHERE {kd} = {kk};
         INSERT INTO {dst} ({cols}) SELECT {rcols} FROM json_populate_recordset(NULL::{dst}, {rows}) r;\n",
        keys = literal(keys),
        rows = literal(rows),
        kd = t.key_of("d"),
        kk = t.key_of("k"),
        cols = t.cols(),
        rcols = t.cols_of("r"),
    )
}

/// Progress of the catch-up for the log: a line at most every `every`.
pub struct LagReport {
    last: Instant,
    every: Duration,
}

impl LagReport {
    pub fn new(every: Duration) -> LagReport {
        LagReport {
            last: Instant::now(),
            every,
        }
    }

    /// Prints `line` when the interval has passed.
    pub fn maybe(&mut self, line: impl FnOnce() -> String) {
        if self.last.elapsed() >= self.every {
            self.last = Instant::now();
            eprintln!("lokadb: {}", line());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admin::moves::layout::tests::table;

    #[test]
    fn only_the_destination_skips_the_commands_own_sessions() {
        let t = table("42", "documents");
        let dest = install_sql(&t, "d", Capture::Destination).join("\n");
        let src = install_sql(&t, "s", Capture::Source).join("\n");
        assert!(dest.contains("lokadb.applying"));
        assert!(!src.contains("lokadb.applying"));
    }

    #[test]
    fn a_filtered_source_fires_only_for_the_organization() {
        let t = table("42", "documents");
        let sql = install_sql(&t, "def", Capture::FilteredSource);
        assert_eq!(sql.len(), 4);
        assert!(sql[1]
            .contains("AFTER INSERT ON def FOR EACH ROW WHEN (NEW.\"organization_id\" = '42')"));
        assert!(sql[2]
            .contains("WHEN (OLD.\"organization_id\" = '42' OR NEW.\"organization_id\" = '42')"));
        assert!(sql[3]
            .contains("AFTER DELETE ON def FOR EACH ROW WHEN (OLD.\"organization_id\" = '42')"));
        // Removal drops every form, and the records.
        let rm = remove_sql(&t, "def").join("\n");
        for op in ["i", "u", "d", "a"] {
            assert!(rm.contains(&format!("lokadb_capture_42_{op}")), "{rm}");
        }
        assert!(rm.contains("DELETE FROM lokadb.changes WHERE org = '42'"));
    }
}
