//! The metadata routing needs (`meta_cache`): the LokaDB tables and the organizations that
//! are not plain cloud ones, as of one generation of the cloud's `lokadb.meta`.
//!
//! A [`Meta`] is immutable: the watcher thread (`route::watch`) loads a new one when the
//! generation changes and hands it to every core, which swaps it in with an empty cache of
//! analyses ([`CoreMeta`]). Per statement a core reads only its own copy.

use super::analysis::{analyze, mentions, Analysis, Catalog, JoinKey, KeyMap, LokaTable, Org};
use crate::net::cloud_tls::CloudTls;
use lokadb_shared::conninfo::{SslMode, TlsOptions};
use std::cell::RefCell;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// An organization with a row in `lokadb.org`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OrgMeta {
    /// `cloud`, `moving`, `moved` or `returning`.
    pub state: String,
    /// `fdw` or `fdw+direct`.
    pub profile: crate::profile::Profile,
    /// Where the direct path reaches its database: the relays' Postgres listeners, in the
    /// order its postgres_fdw server lists them (resolved at load), and the database name
    /// there, `ORG/DBNAME`.
    pub direct: Option<DirectPath>,
    /// It owes migrations (it could not be reached when they ran, with
    /// `lokadb.migration_offline = defer`): its statements are refused until it has them.
    pub owes: bool,
}

impl OrgMeta {
    /// Whether statements of this organization may take the direct path: moved, with the
    /// fdw+direct profile, and a relay address that resolved.
    pub fn is_direct(&self) -> bool {
        self.state == "moved"
            && self.profile == crate::profile::Profile::FdwDirect
            && self.direct.is_some()
            && !self.owes
    }
}

/// An organization's database as the direct path reaches it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirectPath {
    /// Each relay, tried in this order (libpq's order for postgres_fdw too).
    pub relays: Vec<RelayEnd>,
    /// `ORG/DBNAME`.
    pub dbname: String,
}

/// One relay's Postgres listener.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelayEnd {
    pub addr: SocketAddr,
    /// How the direct path speaks TLS to it: what the organization's postgres_fdw server
    /// says (`sslmode`, `sslrootcert`), so both paths are held to the same.
    pub tls: RelayTls,
}

impl DirectPath {
    /// The relays' addresses, as one text (a pool key, a log line).
    pub fn target(&self) -> String {
        let addrs: Vec<String> = self.relays.iter().map(|r| r.addr.to_string()).collect();
        format!("{}/{}", addrs.join(","), self.dbname)
    }
}

/// The TLS of an organization's relay connection, as its postgres_fdw server's options
/// give it, set up once per load (off the cores).
#[derive(Debug, Clone, Default)]
pub struct RelayTls {
    /// `sslmode` and `sslrootcert` (the proxy's own `direct.sslrootcert` when set).
    pub options: TlsOptions,
    /// `None` when `sslmode` never asks for TLS.
    pub tls: Option<Arc<CloudTls>>,
}

impl PartialEq for RelayTls {
    fn eq(&self, other: &RelayTls) -> bool {
        self.options == other.options
    }
}

impl Eq for RelayTls {}

impl RelayTls {
    /// From the server's options; `Err` names what cannot be used (a CA file).
    fn new(
        mode: Option<&str>,
        server_rootcert: Option<&str>,
        own_rootcert: Option<&Path>,
        host: &str,
    ) -> Result<RelayTls, String> {
        let mode = SslMode::parse(mode.unwrap_or("prefer"))?;
        let rootcert = own_rootcert
            .map(Path::to_path_buf)
            .or_else(|| server_rootcert.map(std::path::PathBuf::from));
        let options = TlsOptions {
            mode,
            rootcert,
            ..TlsOptions::default()
        };
        if options.verifies_chain() && options.rootcert.is_none() {
            return Err(format!(
                "sslmode={} needs a CA: the server has no sslrootcert and direct.sslrootcert is not set",
                mode.as_str()
            ));
        }
        let tls = CloudTls::new(&options, host)
            .map_err(|e| format!("{e:#}"))?
            .map(Arc::new);
        Ok(RelayTls { options, tls })
    }
}

/// The host of `HOST:PORT` (`[v6]:PORT` unbracketed), as TLS verifies it.
fn host_of(relay: &str) -> &str {
    relay
        .rsplit_once(':')
        .map_or(relay, |(host, _)| host)
        .trim_start_matches('[')
        .trim_end_matches(']')
}

/// One generation of the cloud's LokaDB metadata.
#[derive(Debug, Default)]
pub struct Meta {
    /// `lokadb.meta.generation`; 0 for a cloud without the LokaDB schema.
    pub generation: i64,
    /// The LokaDB tables.
    pub catalog: Catalog,
    /// Organizations by id.
    pub orgs: HashMap<String, OrgMeta>,
    /// Per LokaDB table (catalog index), what a direct UPDATE may not change; empty when
    /// the cloud's schema predates direct writes (version 6): then none go direct.
    pub writes: Vec<DirectWrites>,
    /// How many organizations take the direct path (counted once per generation, so no
    /// statement scans the organizations).
    pub direct_orgs: usize,
    /// How many organizations owe migrations (their statements are refused).
    pub owing_orgs: usize,
    /// The cloud's pg_stat_statements counts `SET x = '…'` of every value as one statement
    /// (PostgreSQL 18+; 17 and older keep the value in the statement's identity): the proxy
    /// may set `lokadb.statement_org` with a SET in front of a Query's text without filling
    /// it with one entry per organization.
    pub set_normalized: bool,
}

/// What a direct UPDATE of one LokaDB table may not change.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct DirectWrites {
    /// Columns the cloud keeps a constraint on, as named in the catalog.
    pub constrained: std::collections::HashSet<String>,
    /// A user's UPDATE trigger runs in the cloud: no direct UPDATE at all.
    pub blocked: bool,
}

impl Meta {
    /// Whether an UPDATE of table `table` (catalog index) setting `columns` may go direct.
    pub fn may_update(&self, table: usize, columns: &[String]) -> bool {
        self.writes.get(table).is_some_and(|w| {
            !w.blocked && !columns.is_empty() && columns.iter().all(|c| !w.constrained.contains(c))
        })
    }
}

/// The direct path's write rules (schema version 6), read in the same snapshot.
const DIRECT_META_SQL: &str =
    "SELECT kind, schema_name, table_name, column_name FROM lokadb.direct_meta()";

/// The foreign keys the join rewrite may lean on (schema version 7).
const JOIN_META_SQL: &str = "SELECT schema_name, table_name, columns, target_schema, target_table, target_columns FROM lokadb.join_meta()";

/// The key maps the key-map rewrite may use (schema version 8).
const KEY_META_SQL: &str = "SELECT schema_name, table_name, column_name, column_type, org_type, keymap, row_security FROM lokadb.key_meta()";

/// Reads the whole metadata in one snapshot, so the generation and the rows agree.
pub const LOAD_SQL: &str = "\
    SELECT 'g', generation::text, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM lokadb.meta \
    UNION ALL \
    SELECT 't', schema_name::text, table_name::text, org_column::text, \
      (SELECT format_type(a.atttypid, NULL) FROM pg_catalog.pg_attribute a \
       WHERE a.attrelid = to_regclass(format('%I.%I', schema_name, table_name)) \
         AND a.attname = org_column AND NOT a.attisdropped), NULL, NULL, NULL, NULL, NULL \
    FROM lokadb.tables \
    UNION ALL \
    SELECT 'o', id, state, profile, \
      CASE WHEN relay_host LIKE '%:%' THEN '[' || relay_host || ']' ELSE relay_host END || ':' || relay_port, \
      id || '/' || dbname, \
      (SELECT substr(opt, 9) FROM pg_catalog.pg_foreign_server s, unnest(s.srvoptions) opt \
       WHERE s.srvname = o.server AND opt LIKE 'sslmode=%'), \
      (SELECT substr(opt, 13) FROM pg_catalog.pg_foreign_server s, unnest(s.srvoptions) opt \
       WHERE s.srvname = o.server AND opt LIKE 'sslrootcert=%'), \
      (SELECT substr(opt, 6) FROM pg_catalog.pg_foreign_server s, unnest(s.srvoptions) opt \
       WHERE s.srvname = o.server AND opt LIKE 'host=%'), \
      (SELECT substr(opt, 6) FROM pg_catalog.pg_foreign_server s, unnest(s.srvoptions) opt \
       WHERE s.srvname = o.server AND opt LIKE 'port=%') \
    FROM lokadb.org o";

impl Meta {
    /// Loads the metadata from the cloud; an empty one (generation 0) when the cloud has
    /// no LokaDB schema yet (`lokadb init` not run).
    ///
    /// # Errors
    ///
    /// The query failed.
    /// `relay_rootcert` is the proxy's `direct.sslrootcert`, which wins over the CA path
    /// of the organizations' postgres_fdw servers.
    pub fn load(
        client: &mut impl postgres::GenericClient,
        relay_rootcert: Option<&Path>,
    ) -> Result<Meta, postgres::Error> {
        let initialized: bool = client
            .query_one("SELECT to_regclass('lokadb.meta') IS NOT NULL", &[])?
            .get(0);
        if !initialized {
            return Ok(Meta::default());
        }
        let version: i32 = client
            .query_one("SELECT current_setting('server_version_num')::int", &[])?
            .get(0);
        let mut generation = 0;
        let mut tables = Vec::new();
        let mut orgs = HashMap::new();
        let mut resolved: HashMap<String, Option<SocketAddr>> = HashMap::new();
        type TlsKey = (String, Option<String>, Option<String>);
        let mut relay_tls: HashMap<TlsKey, Result<RelayTls, String>> = HashMap::new();
        for row in client.query(LOAD_SQL, &[])? {
            let kind: &str = row.get(0);
            let a: Option<String> = row.get(1);
            let b: Option<String> = row.get(2);
            let c: Option<String> = row.get(3);
            // An organization's relay; a table's organization column type.
            let relay: Option<String> = row.get(4);
            let dbname: Option<String> = row.get(5);
            let (sslmode, sslrootcert): (Option<String>, Option<String>) = (row.get(6), row.get(7));
            // The relays as the organization's postgres_fdw server lists them.
            let (hosts, ports): (Option<String>, Option<String>) = (row.get(8), row.get(9));
            match (kind, a, b, c) {
                ("g", Some(g), _, _) => generation = g.parse().unwrap_or(0),
                ("t", Some(schema), Some(name), Some(org_column)) => tables.push((
                    LokaTable {
                        schema,
                        name,
                        org_column,
                    },
                    relay.unwrap_or_default(),
                )),
                ("o", Some(id), Some(state), Some(profile)) => {
                    let listed = relay_list(hosts.as_deref(), ports.as_deref())
                        .or_else(|| relay.map(|r| vec![r]))
                        .unwrap_or_default();
                    let mut relays = Vec::with_capacity(listed.len());
                    for relay in &listed {
                        // Organizations share a few relays and CAs: each relay's TLS (its CA
                        // file read) and address are made once per load, not per organization.
                        let tls = relay_tls
                            .entry((relay.clone(), sslmode.clone(), sslrootcert.clone()))
                            .or_insert_with(|| {
                                RelayTls::new(
                                    sslmode.as_deref(),
                                    sslrootcert.as_deref(),
                                    relay_rootcert,
                                    host_of(relay),
                                )
                            })
                            .clone();
                        let addr = *resolved
                            .entry(relay.clone())
                            .or_insert_with(|| resolve(relay));
                        match (addr, tls) {
                            (Some(addr), Ok(tls)) => relays.push(RelayEnd { addr, tls }),
                            // Fail closed: never plain where the cloud's server verifies.
                            (_, Err(e)) if profile == "fdw+direct" => {
                                tracing::warn!(org = %id, relay = %relay, error = %e, "the direct path cannot speak TLS to this relay as the organization's postgres_fdw server does; not used")
                            }
                            (None, _) if profile == "fdw+direct" => {
                                tracing::warn!(org = %id, relay = %relay, "a relay address of an fdw+direct organization does not resolve; not used")
                            }
                            _ => {}
                        }
                    }
                    if relays.is_empty() && profile == "fdw+direct" {
                        tracing::warn!(org = %id, "no relay the direct path can use: its statements go through the cloud");
                    }
                    let direct = dbname
                        .filter(|_| !relays.is_empty())
                        .map(|dbname| DirectPath { relays, dbname });
                    // A profile this proxy does not know never takes the direct path.
                    let profile = crate::profile::Profile::parse(&profile)
                        .unwrap_or(crate::profile::Profile::Fdw);
                    orgs.insert(
                        id,
                        OrgMeta {
                            state,
                            profile,
                            direct,
                            owes: false,
                        },
                    );
                }
                _ => {}
            }
        }
        tables.sort_by(|(x, _), (y, _)| (&x.schema, &x.name).cmp(&(&y.schema, &y.name)));
        let (tables, org_types): (Vec<LokaTable>, Vec<String>) = tables.into_iter().unzip();
        // Functions of later schema versions: an older cloud schema has fewer rules.
        let versions = client.query_one(
            "SELECT to_regprocedure('lokadb.direct_meta()') IS NOT NULL, \
                    to_regprocedure('lokadb.join_meta()') IS NOT NULL, \
                    to_regprocedure('lokadb.key_meta()') IS NOT NULL, \
                    to_regprocedure('lokadb.owed_orgs()') IS NOT NULL",
            &[],
        )?;
        let (has_direct_meta, has_join_meta, has_key_meta): (bool, bool, bool) =
            (versions.get(0), versions.get(1), versions.get(2));
        if versions.get::<_, bool>(3) {
            for row in client.query(crate::migrate::OWED_ORGS_SQL, &[])? {
                if let Some(o) = orgs.get_mut(row.get::<_, &str>(0)) {
                    o.owes = true;
                }
            }
        }
        let mut writes = Vec::new();
        if has_direct_meta {
            writes = vec![DirectWrites::default(); tables.len()];
            for (i, row) in per_table(client, DIRECT_META_SQL, &tables)? {
                match row.get::<_, &str>(0) {
                    "c" => {
                        if let Some(column) = row.get::<_, Option<String>>(3) {
                            writes[i].constrained.insert(column);
                        }
                    }
                    _ => writes[i].blocked = true,
                }
            }
        }
        let mut join_keys = Vec::new();
        if has_join_meta {
            for (table, row) in per_table(client, JOIN_META_SQL, &tables)? {
                join_keys.push(JoinKey {
                    table,
                    columns: row.get(2),
                    target_schema: row.get(3),
                    target: row.get(4),
                    target_columns: row.get(5),
                });
            }
        }
        let mut key_maps = Vec::new();
        if has_key_meta {
            for (table, row) in per_table(client, KEY_META_SQL, &tables)? {
                // Row-level security: the key's organization is not looked up for it.
                if row.get::<_, bool>(6) {
                    continue;
                }
                key_maps.push(KeyMap {
                    table,
                    column: row.get(2),
                    column_type: row.get(3),
                    org_type: row.get(4),
                    keymap: row.get(5),
                });
            }
        }
        Ok(Meta {
            generation,
            catalog: Catalog::new(tables)
                .with_org_types(org_types)
                .with_join_keys(join_keys)
                .with_key_maps(key_maps),
            direct_orgs: orgs.values().filter(|o| o.is_direct()).count(),
            owing_orgs: orgs.values().filter(|o| o.owes).count(),
            orgs,
            writes,
            set_normalized: version >= 180_000,
        })
    }
}

/// The rows of `sql`, whose columns `schema_name` and `table_name` name a LokaDB table, with
/// that table's index in `tables` (rows of other tables skipped).
fn per_table(
    client: &mut impl postgres::GenericClient,
    sql: &str,
    tables: &[LokaTable],
) -> Result<Vec<(usize, postgres::Row)>, postgres::Error> {
    Ok(client
        .query(sql, &[])?
        .into_iter()
        .filter_map(|row| {
            let (schema, name): (&str, &str) = (row.get("schema_name"), row.get("table_name"));
            let i = tables
                .iter()
                .position(|t| t.schema == schema && t.name == name)?;
            Some((i, row))
        })
        .collect())
}

/// `host:port` as the first address it resolves to (IPv6 literals in brackets).
/// `HOST:PORT` of each relay a postgres_fdw server's `host` and `port` options list
/// (libpq's lists: one port for every host, or one per host).
fn relay_list(hosts: Option<&str>, ports: Option<&str>) -> Option<Vec<String>> {
    let hosts: Vec<&str> = hosts?.split(',').map(str::trim).collect();
    let ports: Vec<&str> = ports.unwrap_or("5432").split(',').map(str::trim).collect();
    let port = |i: usize| {
        if ports.len() == 1 {
            ports[0]
        } else {
            ports.get(i).copied().unwrap_or("")
        }
    };
    Some(
        hosts
            .iter()
            .enumerate()
            .map(|(i, h)| {
                if h.contains(':') {
                    format!("[{h}]:{}", port(i))
                } else {
                    format!("{h}:{}", port(i))
                }
            })
            .collect(),
    )
}

fn resolve(relay: &str) -> Option<SocketAddr> {
    use std::net::ToSocketAddrs;
    relay.to_socket_addrs().ok()?.next()
}

/// The most analyses a core keeps per database; past it the cache starts over (an
/// application with more distinct statement texts than this inlines values into them,
/// and caching those gains little).
const MAX_CACHED: usize = 10_000;

/// The longest statement text kept in the cache: longer ones (bulk inserts, mostly) are
/// rarely sent twice.
const MAX_CACHED_BYTES: usize = 16 << 10;

/// The most bytes a core's analyses of one database may hold (texts and an estimate of each
/// entry's own size); past it the cache starts over. Without it 10,000 texts of 16 KiB
/// would hold 160 MB per core and database.
const MAX_CACHE_BYTES: usize = 8 << 20;

/// What an entry costs besides its text: the map's slot and the analysis (its organization
/// and table names are short).
const ENTRY_BYTES: usize = std::mem::size_of::<(Box<str>, Analysis)>() + 64;

/// A core's analyses by statement text, bounded in entries and in bytes.
#[derive(Default)]
struct Analyses {
    map: HashMap<Box<str>, Analysis>,
    bytes: usize,
}

/// Where the analysis placed a statement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placement {
    NoLokaTable,
    /// One organization.
    Org(Org),
    /// LokaDB tables, in no one organization the analysis could name.
    Unplaced,
}

impl Placement {
    /// What an analysis says of where its statement goes.
    pub fn of(a: &Analysis) -> Placement {
        match a {
            Analysis::NoLokaTable => Placement::NoLokaTable,
            Analysis::Org { org, .. } => Placement::Org(org.clone()),
            Analysis::Unplaced(_) | Analysis::Keyed(_) => Placement::Unplaced,
        }
    }
}

/// A core's copy of one database's metadata and its analyses by statement text.
pub struct CoreMeta {
    pub meta: Arc<Meta>,
    analyses: RefCell<Analyses>,
    /// Statements that opened a direct transaction which then had to move to the cloud,
    /// and until when the next such transaction starts on the cloud instead
    /// ([`CoreMeta::opens_on_cloud`]).
    moved_openers: RefCell<HashMap<Box<str>, Instant>>,
}

/// How long a transaction opener that moved keeps its transactions on the cloud before one
/// tries the direct path again (the application may have changed what follows it).
pub const MOVED_OPENER_FOR: Duration = Duration::from_secs(30);

/// The most openers a core remembers (past it, it starts over).
const MAX_MOVED_OPENERS: usize = 1024;

impl CoreMeta {
    pub fn new(meta: Arc<Meta>) -> CoreMeta {
        CoreMeta {
            meta,
            analyses: RefCell::new(Analyses::default()),
            moved_openers: RefCell::new(HashMap::new()),
        }
    }

    /// Notes that a direct transaction opened by `sql` had to move to the cloud.
    pub fn opener_moved(&self, sql: &str) {
        let mut m = self.moved_openers.borrow_mut();
        if m.len() >= MAX_MOVED_OPENERS {
            m.clear();
        }
        m.insert(sql.into(), Instant::now() + MOVED_OPENER_FOR);
    }

    /// Whether a transaction opened by `sql` starts on the cloud: the last one it opened
    /// directly had to move there, not long ago. A move costs the direct round trips and a
    /// rollback; an application runs the same transactions again and again.
    pub fn opens_on_cloud(&self, sql: &str) -> bool {
        let m = self.moved_openers.borrow();
        if m.is_empty() {
            return false;
        }
        m.get(sql).is_some_and(|until| Instant::now() < *until)
    }

    /// The next generation: `meta`, keeping this one's analyses when the LokaDB tables are
    /// (and join keys) are the same. An analysis depends only on them (organizations are placed by value,
    /// not looked up), so a move, which changes only `lokadb.org`, costs no re-analysis —
    /// with thousands of organizations moving, no parse storm on every core.
    pub fn next(&self, meta: Arc<Meta>) -> CoreMeta {
        let analyses = if meta.catalog.same_as(&self.meta.catalog) {
            // Taken, not copied: the old generation is being replaced.
            std::mem::take(&mut *self.analyses.borrow_mut())
        } else {
            Analyses::default()
        };
        CoreMeta {
            meta,
            analyses: RefCell::new(analyses),
            moved_openers: RefCell::new(std::mem::take(&mut *self.moved_openers.borrow_mut())),
        }
    }

    /// The analysis of `sql`: from the cache, else analysed (and cached when it needed a
    /// parse; the fast path is cheaper than a lookup).
    pub fn analyze(&self, sql: &str) -> Analysis {
        if !self.meta.catalog.may_touch(sql) {
            return Analysis::NoLokaTable;
        }
        if let Some(a) = self.analyses.borrow().map.get(sql) {
            return a.clone();
        }
        let a = analyze(sql, &self.meta.catalog);
        if sql.len() > MAX_CACHED_BYTES {
            return a;
        }
        let cost = sql.len() + ENTRY_BYTES;
        let mut cache = self.analyses.borrow_mut();
        if cache.map.len() >= MAX_CACHED || cache.bytes + cost > MAX_CACHE_BYTES {
            *cache = Analyses::default();
        }
        cache.map.insert(sql.into(), a.clone());
        cache.bytes += cost;
        a
    }

    /// The organization of a statement, from the analysis of its text with the constants
    /// taken out ([`super::literals`]): statements that differ only in their values (a
    /// simple query's) share one analysis in the cache, where each of their texts would
    /// cost a parse. A form the scan does not follow is analysed as it is.
    pub fn place(&self, sql: &str) -> Placement {
        if !self.meta.catalog.may_touch(sql) {
            return Placement::NoLokaTable;
        }
        // The one constant the analysis reads is the session's setting's name.
        let normalized = (!mentions(sql, b"'lokadb.org'"))
            .then(|| super::literals::normalize(sql))
            .flatten();
        let Some((key, values)) = normalized else {
            return Placement::of(&self.analyze(sql));
        };
        match Placement::of(&self.analyze(&key)) {
            // Every constant of `key` is an index into `values` (a negative number keeps
            // its sign).
            Placement::Org(Org::Literal(v)) => {
                let (sign, index) = v.strip_prefix('-').map_or(("", &*v), |i| ("-", i));
                match index.parse::<usize>().ok().and_then(|i| values.get(i)) {
                    // A number the analysis reads otherwise than its text (`8.4::bigint`
                    // is 8, `05` is 5; their index is a plain integer): analysed as it is.
                    Some(value)
                        if value.contains('.') || (value.starts_with('0') && value.len() > 1) =>
                    {
                        Placement::of(&self.analyze(sql))
                    }
                    Some(value) => Placement::Org(Org::Literal(format!("{sign}{value}"))),
                    None => Placement::Unplaced,
                }
            }
            // A key map's name is a constant too: the text's own analysis has it.
            Placement::Org(Org::Key(_)) => Placement::of(&self.analyze(sql)),
            p => p,
        }
    }

    /// Whether any organization takes the direct path (else no statement is held to
    /// decide it).
    pub fn has_direct_orgs(&self) -> bool {
        self.meta.direct_orgs > 0
    }

    /// Whether some organization owes migrations.
    pub fn has_owing(&self) -> bool {
        self.meta.owing_orgs > 0
    }

    /// Whether organization `org` owes migrations: its statements are refused.
    pub fn owes(&self, org: &str) -> bool {
        self.has_owing() && self.meta.orgs.get(org).is_some_and(|o| o.owes)
    }

    /// Whether the database has LokaDB tables at all.
    pub fn has_tables(&self) -> bool {
        !self.meta.catalog.tables().is_empty()
    }

    /// How many analyses are cached (tests, metrics).
    pub fn cached(&self) -> usize {
        self.analyses.borrow().map.len()
    }

    /// What the cached analyses are counted to hold (tests, metrics).
    pub fn cached_bytes(&self) -> usize {
        self.analyses.borrow().bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::route::analysis::Org;

    fn meta() -> CoreMeta {
        CoreMeta::new(Arc::new(Meta {
            generation: 3,
            catalog: Catalog::new(vec![LokaTable {
                schema: "public".into(),
                name: "documents".into(),
                org_column: "organization_id".into(),
            }]),
            orgs: HashMap::new(),
            writes: Vec::new(),
            direct_orgs: 0,
            owing_orgs: 0,
            set_normalized: true,
        }))
    }

    #[test]
    fn the_cache_is_bounded_in_bytes() {
        let m = meta();
        let pad = "x".repeat(10_000);
        for i in 0..2_000 {
            let sql =
                format!("SELECT * FROM documents WHERE organization_id = $1 AND body = '{pad}{i}'");
            m.analyze(&sql);
            assert!(m.cached_bytes() <= MAX_CACHE_BYTES, "{}", m.cached_bytes());
        }
        // 2,000 texts of 10 kB were analysed; the cache holds what fits in its bytes.
        assert!(m.cached() > 100 && m.cached() < 1_000, "{}", m.cached());
    }

    #[test]
    fn a_repeated_statement_is_analysed_once_and_others_not_cached() {
        let m = meta();
        let sql = "SELECT * FROM documents WHERE organization_id = $1 AND id = $2";
        for _ in 0..3 {
            assert!(matches!(
                m.analyze(sql),
                Analysis::Org {
                    org: Org::Param(1),
                    ..
                }
            ));
        }
        assert_eq!(m.cached(), 1);
        assert_eq!(m.analyze("SELECT 1"), Analysis::NoLokaTable);
        assert_eq!(m.cached(), 1, "the fast path caches nothing");

        // An organization moved: same tables, the analyses stay.
        let mut orgs = HashMap::new();
        orgs.insert(
            "2".to_owned(),
            OrgMeta {
                state: "moved".into(),
                profile: crate::profile::Profile::Fdw,
                direct: None,
                owes: false,
            },
        );
        let moved = m.next(Arc::new(Meta {
            generation: 4,
            catalog: m.meta.catalog.clone(),
            orgs,
            writes: Vec::new(),
            direct_orgs: 0,
            owing_orgs: 0,
            set_normalized: true,
        }));
        assert_eq!(moved.cached(), 1);
        // A table enabled: the indexes in the analyses may mean other tables now.
        let mut tables = moved.meta.catalog.tables().to_vec();
        tables.insert(
            0,
            LokaTable {
                schema: "public".into(),
                name: "comments".into(),
                org_column: "organization_id".into(),
            },
        );
        let enabled = moved.next(Arc::new(Meta {
            generation: 5,
            catalog: Catalog::new(tables),
            orgs: HashMap::new(),
            writes: Vec::new(),
            direct_orgs: 0,
            owing_orgs: 0,
            set_normalized: true,
        }));
        assert_eq!(enabled.cached(), 0);
    }
}
