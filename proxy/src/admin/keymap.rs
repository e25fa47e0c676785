//! Key maps: a unique key of a LokaDB table that lacks the organization column (e.g.
//! `id` alone) cannot be a unique index of the partitioned parent, and a foreign partition
//! cannot enforce it against the others. A key map `lokadb."km_<table>_<columns>"` holds
//! every key with its organization, `PRIMARY KEY (key columns)`, and is kept by a row
//! trigger on the parent (cloned onto every partition): so the key stays unique across all
//! organizations, foreign keys that pointed at the key point at the key map instead, and
//! the proxy learns from it which organization a key belongs to.
//!
//! Existing rows are copied by [`backfill`] after the swap, online, in key order.

use super::catalog::{idents, qualify, Column};
use super::db::{ident, literal, AdminError};
use super::DEFINER;
use std::io::IsTerminal;
use std::time::{Duration, Instant};

/// Postgres truncates identifiers longer than this (NAMEDATALEN - 1).
const MAX_IDENT: usize = 63;

/// `name`, or when it is longer than Postgres keeps, a prefix of it with a hash of the
/// whole, so that two long names stay distinct.
pub fn fit(name: &str) -> String {
    if name.len() <= MAX_IDENT {
        return name.to_owned();
    }
    // FNV-1a: stable across builds, so --plan and the real run agree.
    let mut h: u32 = 0x811c_9dc5;
    for b in name.bytes() {
        h = (h ^ u32::from(b)).wrapping_mul(0x0100_0193);
    }
    format!(
        "{}_{h:08x}",
        lokadb_shared::text::prefix(name, MAX_IDENT - 9)
    )
}

/// `name` with `suffix`, the name shortened to fit.
pub fn suffixed(name: &str, suffix: &str) -> String {
    if name.len() + suffix.len() <= MAX_IDENT {
        return format!("{name}{suffix}");
    }
    let short = fit(&format!("{name}~"));
    let kept = lokadb_shared::text::prefix(&short, MAX_IDENT - suffix.len() - 9);
    format!("{kept}{}{suffix}", &short[short.len() - 9..])
}

/// One key map.
#[derive(Debug, Clone)]
pub struct KeyMap {
    /// The table (the partitioned parent once enabled).
    pub schema: String,
    pub table: String,
    /// The unique constraint or index the key comes from.
    pub key_name: String,
    /// Key columns with their types.
    pub columns: Vec<Column>,
    pub org: Column,
    /// The key map's name in schema `lokadb` (also the name of its trigger function).
    pub name: String,
}

impl KeyMap {
    pub fn new(
        schema: &str,
        table: &str,
        key_name: &str,
        columns: Vec<Column>,
        org: Column,
    ) -> KeyMap {
        let prefix = if schema == "public" {
            format!("km_{table}")
        } else {
            format!("km_{schema}_{table}")
        };
        let cols: Vec<&str> = columns.iter().map(|c| c.name.as_str()).collect();
        KeyMap {
            schema: schema.to_owned(),
            table: table.to_owned(),
            key_name: key_name.to_owned(),
            name: fit(&format!("{prefix}_{}", cols.join("_"))),
            columns,
            org,
        }
    }

    /// `lokadb."km_…"`.
    pub fn qualified(&self) -> String {
        qualify("lokadb", &self.name)
    }

    /// `lokadb.km_…`, for messages.
    pub fn display(&self) -> String {
        format!("lokadb.{}", self.name)
    }

    fn key_names(&self) -> Vec<String> {
        self.columns.iter().map(|c| c.name.clone()).collect()
    }

    /// `NEW.a, NEW.b` (or OLD).
    fn values(&self, rec: &str) -> String {
        self.columns
            .iter()
            .map(|c| format!("{rec}.{}", ident(&c.name)))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// `a = NEW.a AND b = NEW.b`.
    fn matches(&self, rec: &str) -> String {
        self.columns
            .iter()
            .map(|c| format!("{0} = {rec}.{0}", ident(&c.name)))
            .collect::<Vec<_>>()
            .join(" AND ")
    }

    /// The key is in the map only when none of its columns is NULL (a unique key lets
    /// NULLs repeat).
    fn present(&self, rec: &str) -> String {
        let nullable: Vec<String> = self
            .columns
            .iter()
            .filter(|c| !c.not_null)
            .map(|c| format!("{rec}.{} IS NOT NULL", ident(&c.name)))
            .collect();
        if nullable.is_empty() {
            "true".into()
        } else {
            nullable.join(" AND ")
        }
    }

    /// The error a duplicate key gets: SQLSTATE 23505 naming the table, the key and the
    /// value, with the constraint name an ORM maps.
    fn raise_duplicate(&self) -> String {
        let org = ident(&self.org.name);
        format!(
            "SELECT k.{org}::text INTO other FROM {km} k WHERE {matches};
      RAISE EXCEPTION 'duplicate key value violates unique constraint \"%\" of LokaDB table %', {key}, {table}
        USING ERRCODE = '23505', CONSTRAINT = {key}, TABLE = {tname}, SCHEMA = {sname},
              DETAIL = format('Key ({cols})=(%s) already exists in another organization (%s).',
                              concat_ws(', ', {vals}), other);",
            km = self.qualified(),
            matches = self
                .columns
                .iter()
                .map(|c| format!("k.{0} = NEW.{0}", ident(&c.name)))
                .collect::<Vec<_>>()
                .join(" AND "),
            key = literal(&self.key_name),
            table = literal(&format!("{}.{}", self.schema, self.table)),
            tname = literal(&self.table),
            sname = literal(&self.schema),
            cols = self.key_names().join(", ").replace('\'', "''"),
            vals = self.values("NEW"),
        )
    }

    /// The key map table, its trigger function, and the trigger on `parent`.
    pub fn create_sql(&self, parent: &str) -> Vec<String> {
        let km = self.qualified();
        let org = ident(&self.org.name);
        let cols = idents(&self.key_names());
        let defs: Vec<String> = self
            .columns
            .iter()
            .map(|c| format!("{} {} NOT NULL", ident(&c.name), c.sql_type))
            .collect();
        let table = format!(
            "CREATE TABLE {km} ({}, {org} {} NOT NULL, PRIMARY KEY ({cols}))",
            defs.join(", "),
            self.org.sql_type
        );
        let comment = format!(
            "COMMENT ON TABLE {km} IS {}",
            literal(&format!(
                "LokaDB key map of {} ({}): every key and its organization",
                qualify(&self.schema, &self.table),
                self.key_name
            ))
        );
        let insert = format!(
            "INSERT INTO {km} ({cols}, {org}) VALUES ({}, NEW.{org}) ON CONFLICT DO NOTHING;",
            self.values("NEW")
        );
        let function = format!(
            "CREATE FUNCTION {km}() RETURNS trigger LANGUAGE plpgsql {DEFINER} AS $lokadb$
DECLARE
    other text;
BEGIN
    IF TG_OP = 'DELETE' THEN
        IF {old_present} THEN
            DELETE FROM {km} WHERE {old_match};
        END IF;
        RETURN NULL;
    END IF;
    IF TG_OP = 'UPDATE' THEN
        IF ROW({old_vals}, OLD.{org}) IS NOT DISTINCT FROM ROW({new_vals}, NEW.{org}) THEN
            RETURN NULL;
        END IF;
        IF NOT ({new_present}) THEN
            IF {old_present} THEN
                DELETE FROM {km} WHERE {old_match};
            END IF;
            RETURN NULL;
        END IF;
        IF {old_present} THEN
            IF ROW({old_vals}) IS DISTINCT FROM ROW({new_vals})
               AND EXISTS (SELECT 1 FROM {km} WHERE {new_match}) THEN
                {dup}
            END IF;
            -- An UPDATE, not a delete and an insert: foreign keys that reference the key
            -- map apply their ON UPDATE action, as they did on the table.
            UPDATE {km} SET ({cols}, {org}) = ROW({new_vals}, NEW.{org}) WHERE {old_match};
            IF FOUND THEN
                RETURN NULL;
            END IF;
        END IF;
        -- The old key was not mapped yet (enable's backfill had not reached it): map the new one.
    END IF;
    IF {new_present} THEN
        {insert}
        IF NOT FOUND THEN
            {dup}
        END IF;
    END IF;
    RETURN NULL;
END
$lokadb$",
            old_present = self.present("OLD"),
            new_present = self.present("NEW"),
            old_match = self.matches("OLD"),
            new_match = self.matches("NEW"),
            old_vals = self.values("OLD"),
            new_vals = self.values("NEW"),
            dup = self.raise_duplicate(),
        );
        let trigger = format!(
            "CREATE TRIGGER {} AFTER INSERT OR UPDATE OR DELETE ON {parent} FOR EACH ROW EXECUTE FUNCTION {km}()",
            ident(&fit(&format!("lokadb_{}", self.name)))
        );
        vec![table, comment, function, trigger]
    }

    /// One backfill batch: locks up to `batch` rows of `partition` after `$1…` in key order
    /// FOR KEY SHARE (a concurrent DELETE or key UPDATE of those rows waits for this
    /// transaction, so it then finds and removes the key map row this batch adds; a row
    /// deleted before the lock is skipped) and copies their keys. Returns the rows seen, the
    /// rows added, and the last key as text (each key column), for the next batch.
    pub fn backfill_sql(&self, partition: &str, first: bool, batch: i64) -> String {
        let cols = idents(&self.key_names());
        let org = ident(&self.org.name);
        let mut filter: Vec<String> = self
            .columns
            .iter()
            .filter(|c| !c.not_null)
            .map(|c| format!("{} IS NOT NULL", ident(&c.name)))
            .collect();
        if !first {
            let params: Vec<String> = self
                .columns
                .iter()
                .enumerate()
                .map(|(i, c)| format!("${}::text::{}", i + 1, c.sql_type))
                .collect();
            filter.push(format!("ROW({cols}) > ROW({})", params.join(", ")));
        }
        let filter = if filter.is_empty() {
            String::new()
        } else {
            format!(" WHERE {}", filter.join(" AND "))
        };
        let last: Vec<String> = self
            .columns
            .iter()
            .map(|c| format!("(SELECT {}::text FROM last)", ident(&c.name)))
            .collect();
        // The batch's last key is recorded in the same statement, so a killed run's rerun
        // goes on after it ([`backfill`]).
        format!(
            "WITH batch AS (SELECT {cols}, {org} FROM ONLY {partition}{filter} ORDER BY {cols} LIMIT {batch} FOR KEY SHARE),
             added AS (INSERT INTO {km} ({cols}, {org}) SELECT {cols}, {org} FROM batch ON CONFLICT DO NOTHING RETURNING 1),
             last AS (SELECT {cols} FROM batch ORDER BY {order} LIMIT 1),
             progress AS (UPDATE lokadb.keys SET backfill_last = ARRAY[{last}]
                          WHERE keymap = {name} AND EXISTS (SELECT 1 FROM last))
             SELECT (SELECT count(*) FROM batch), (SELECT count(*) FROM added), ARRAY[{last}]",
            km = self.qualified(),
            name = super::db::literal(&self.name),
            order = self
                .columns
                .iter()
                .map(|c| format!("{} DESC", ident(&c.name)))
                .collect::<Vec<_>>()
                .join(", "),
            last = last.join(", "),
        )
    }

    /// Removes key map rows whose key no table row has any more (see [`settle`]).
    pub fn cleanup_sql(&self, parent: &str) -> String {
        let on: Vec<String> = self
            .columns
            .iter()
            .map(|c| format!("t.{0} = k.{0}", ident(&c.name)))
            .collect();
        format!(
            "DELETE FROM {} k WHERE NOT EXISTS (SELECT 1 FROM {parent} t WHERE {})",
            self.qualified(),
            on.join(" AND ")
        )
    }
}

/// How many rows a backfill batch copies.
pub const BATCH: i64 = 10_000;

/// Copies the keys of the rows of `partition` into the key map, batch by batch, each batch
/// its own transaction, showing progress on stderr. A rerun goes on after the last key a
/// killed run recorded (`lokadb.keys.backfill_last`); copying again skips what is there.
///
/// # Errors
///
/// A batch failed (what was copied stays; a rerun goes on).
pub fn backfill(
    client: &mut postgres::Client,
    km: &KeyMap,
    partition: &str,
) -> Result<(u64, u64), AdminError> {
    let estimate: f32 = client
        .query_one(
            "SELECT greatest(reltuples, 0)::float4 FROM pg_class WHERE oid = $1::text::regclass",
            &[&partition],
        )?
        .get(0);
    let progress = Progress::new(&km.name, estimate as u64);
    // Where a killed run stopped.
    let mut last: Option<Vec<String>> = client
        .query_opt(
            "SELECT backfill_last FROM lokadb.keys WHERE keymap = $1",
            &[&km.name],
        )?
        .and_then(|r| r.get(0));
    if let Some(key) = &last {
        eprintln!(
            "lokadb: key map {}: resuming the backfill after key ({})",
            km.display(),
            key.join(", ")
        );
    }
    let (mut seen, mut added) = (0u64, 0u64);
    loop {
        let sql = km.backfill_sql(partition, last.is_none(), BATCH);
        let params: Vec<&(dyn postgres::types::ToSql + Sync)> = match &last {
            Some(v) => v
                .iter()
                .map(|s| s as &(dyn postgres::types::ToSql + Sync))
                .collect(),
            None => Vec::new(),
        };
        let row = client.query_one(&sql, &params).map_err(|e| {
            AdminError::failed(format!(
                "backfill of {} failed after {seen} rows: {}\nwhat was copied stays; run lokadb enable again to go on",
                km.display(),
                super::db::describe(&e)
            ))
        })?;
        let n: i64 = row.get(0);
        if n == 0 {
            break;
        }
        seen += n as u64;
        added += row.get::<_, i64>(1) as u64;
        last = Some(row.get::<_, Vec<String>>(2));
        progress.set(seen);
        crate::failpoint::exit_at("LOKADB_ENABLE_FAILPOINT", "backfill-batch");
    }
    progress.finish(seen);
    Ok((seen, added))
}

/// Waits until every transaction that began before now has ended.
///
/// A writer in REPEATABLE READ (or SERIALIZABLE) whose snapshot predates a backfill batch
/// does not see that batch's key map rows: if it then deletes one of those rows (or changes
/// its key), its trigger finds nothing to remove, and a stale key stays in the map. Once
/// every such transaction has ended, [`KeyMap::cleanup_sql`] finds them all: a key map row
/// is committed together with its table row, so a key without a row is stale. (The same
/// wait is what CREATE INDEX CONCURRENTLY does for old snapshots.)
///
/// # Errors
///
/// The query failed.
pub fn settle(client: &mut postgres::Client) -> Result<(), AdminError> {
    let since: f64 = client
        .query_one("SELECT extract(epoch FROM clock_timestamp())::float8", &[])?
        .get(0);
    let started = Instant::now();
    let mut told = Instant::now();
    loop {
        let waiting: Vec<i32> = client
            .query(
                "SELECT pid FROM pg_stat_activity
                 WHERE pid <> pg_backend_pid() AND datname = current_database()
                   AND (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL)
                   AND extract(epoch FROM xact_start)::float8 < $1
                 UNION ALL
                 SELECT -1 FROM pg_prepared_xacts
                 WHERE database = current_database() AND extract(epoch FROM prepared)::float8 < $1",
                &[&since],
            )?
            .iter()
            .map(|r| r.get(0))
            .collect();
        if waiting.is_empty() {
            return Ok(());
        }
        if told.elapsed() > Duration::from_secs(10) {
            eprintln!(
                "lokadb: waiting {}s for transactions older than the backfill to end (backends {waiting:?}; -1 is a prepared transaction)",
                started.elapsed().as_secs()
            );
            told = Instant::now();
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Progress of a backfill: a bar on a terminal, else a line every few seconds.
struct Progress {
    bar: Option<indicatif::ProgressBar>,
    name: String,
    estimate: u64,
    started: Instant,
    last_line: std::cell::Cell<Instant>,
}

impl Progress {
    fn new(name: &str, estimate: u64) -> Progress {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = indicatif::ProgressBar::new(estimate.max(1));
            bar.set_style(
                indicatif::ProgressStyle::with_template(
                    "{msg} [{bar:30}] {human_pos}/~{human_len} rows, {per_sec}, eta {eta}",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
                .progress_chars("=> "),
            );
            bar.set_message(format!("backfill {name}"));
            bar
        });
        Progress {
            bar,
            name: name.to_owned(),
            estimate,
            started: Instant::now(),
            last_line: std::cell::Cell::new(Instant::now()),
        }
    }

    fn set(&self, done: u64) {
        if let Some(bar) = &self.bar {
            if done > bar.length().unwrap_or(0) {
                bar.set_length(done);
            }
            bar.set_position(done);
        } else if self.last_line.get().elapsed() >= Duration::from_secs(5) {
            self.last_line.set(Instant::now());
            eprintln!("lokadb: {}", self.line(done));
        }
    }

    fn line(&self, done: u64) -> String {
        let secs = self.started.elapsed().as_secs_f64().max(0.001);
        format!(
            "backfill {}: {done} of ~{} rows, {:.0} rows/s",
            self.name,
            self.estimate.max(done),
            done as f64 / secs
        )
    }

    fn finish(&self, done: u64) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
        if self.started.elapsed() >= Duration::from_secs(5) || self.bar.is_some() {
            eprintln!("lokadb: {}, done", self.line(done));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_names_fit_and_stay_distinct() {
        let a = "a".repeat(70);
        let b = format!("{}b", "a".repeat(69));
        assert_eq!(fit(&a).len(), 63);
        assert_ne!(fit(&a), fit(&b));
        assert_eq!(fit("km_documents_id"), "km_documents_id");
        let s = suffixed(&a, "__lokadb_default");
        assert_eq!(s.len(), 63);
        assert!(s.ends_with("__lokadb_default"));
        assert_ne!(s, suffixed(&b, "__lokadb_default"));
        assert_eq!(suffixed("t", "__x"), "t__x");
    }
}
