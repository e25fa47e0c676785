//! `lokadb move-org`, `move-back`, `verify`, `status` against real clusters: organization 2
//! moves to its own database behind a real relay and agent (through the latency link
//! where it matters), while writers of organizations 1 and 2 count what they wrote.

use crate::admin_cli::{lokadb, ok, stderr, stdout};
use crate::admin_enable::SCHEMA;
use crate::tunnel_world::{
    addrs, org_add, start_agent, start_relay, Certs, Org, APP_PASSWORD, APP_USER, ORG_DB,
};
use lokadb_tests::pg::Cluster;
use serde_json::json;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(crate) struct World {
    pub(crate) certs: Certs,
    _link: Option<lokadb_tests::link::LatencyLink>,
    pub(crate) org: Org,
    pub(crate) relay: lokadb_tests::proxy::Proxy,
    pub(crate) agent: Option<lokadb_tests::agent::Agent>,
    pub(crate) cloud: Cluster,
    pub(crate) dsn: String,
    /// How organization 2's database reaches the cloud (logical mode's subscription): a
    /// role with REPLICATION, not a superuser.
    sub_dsn: String,
}

/// Organization 2's database: empty but for its owner role.
pub(crate) fn org_db(id: &str, superuser: bool) -> Org {
    // Migrations are prepared in organizations' databases (two-phase commit).
    let db = Cluster::builder()
        .setting("max_connections", "100")
        .setting("max_prepared_transactions", "10")
        .start()
        .unwrap();
    db.create_role(APP_USER, APP_PASSWORD).unwrap();
    db.create_database(ORG_DB, APP_USER).unwrap();
    if superuser {
        db.psql("postgres", &format!("ALTER ROLE {APP_USER} SUPERUSER"))
            .unwrap();
    }
    Org {
        id: id.to_owned(),
        token: format!("{id}.{:032x}", rand::random::<u128>()),
        db,
    }
}

/// Cloud with the test schema enabled, `extra` rows per organization, organization 2's
/// database registered behind the relay.
fn world(extra_rows: i64, logical: bool) -> World {
    world_at(extra_rows, logical, None)
}

/// As [`world`], the agent reaching the relay through the latency link when `one_way`.
pub(crate) fn world_at(extra_rows: i64, logical: bool, one_way: Option<Duration>) -> World {
    let certs = Certs::new().unwrap();
    let org = org_db("2", logical);
    let relay = start_relay(&certs, &[&org], json!({}), &[]).unwrap();
    let link = one_way.map(|d| crate::tunnel_world::link_to(&relay, d).unwrap());
    let to = link.as_ref().map_or(addrs(&relay).agents, |l| l.addr());
    let agent = start_agent(&certs, &org, to, &[]).unwrap();
    let mut b = Cluster::builder().setting("max_connections", "100");
    if logical {
        b = b
            .setting("wal_level", "logical")
            .setting("wal_writer_delay", "10ms");
    }
    let cloud = b.start().unwrap();
    cloud.create_database("app", "postgres").unwrap();
    let dsn = cloud.superuser_dsn("app");
    ok(&lokadb(&dsn, &["init"]));
    cloud.psql("app", SCHEMA).unwrap();
    cloud
        .psql(
            "app",
            &format!(
                "INSERT INTO documents (organization_id, project_id, title)
                   SELECT 1 + g % 2, 10 * (1 + g % 2), 'bulk ' || g FROM generate_series(1, {extra_rows}) g;
                 INSERT INTO document_versions (organization_id, document_id, body)
                   SELECT organization_id, id, repeat('v', 50) FROM documents WHERE title LIKE 'bulk %';"
            ),
        )
        .unwrap();
    ok(&lokadb(&dsn, &["enable", "documents"]));
    ok(&lokadb(&dsn, &["enable", "document_versions"]));
    cloud
        .psql(
            "app",
            "CREATE ROLE lokadb_sub LOGIN REPLICATION PASSWORD 'sub-secret'",
        )
        .unwrap();
    let sub_dsn = cloud.dsn("lokadb_sub", "sub-secret", "app");
    let via = addrs(&relay).postgres.to_string();
    ok(&lokadb(
        &dsn,
        &org_add("2", std::slice::from_ref(&via), &[]),
    ));
    World {
        certs,
        _link: link,
        org,
        relay,
        agent: Some(agent),
        cloud,
        dsn,
        sub_dsn,
    }
}

fn q(c: &Cluster, sql: &str) -> String {
    c.psql("app", sql).unwrap()
}

fn org_q(w: &World, sql: &str) -> String {
    w.org.db.psql(ORG_DB, sql).unwrap()
}

fn count(c: &Cluster, db: &str, sql: &str) -> i64 {
    c.psql(db, sql).unwrap().trim().parse().unwrap()
}

/// What the writers did.
#[derive(Default, Debug)]
struct Tally {
    inserted: [i64; 3],
    errors: Vec<String>,
    /// Longest wait of one insert.
    longest: Duration,
}

/// Writers inserting documents (and a version each) for organizations 1 and 2, and
/// updating titles, until `stop`.
fn writers(dsn: &str, n: usize, stop: Arc<AtomicBool>) -> Vec<std::thread::JoinHandle<Tally>> {
    (0..n)
        .map(|w| {
            let dsn = dsn.to_owned();
            let stop = stop.clone();
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(async move {
                    let c = crate::world::connect(&dsn).await.unwrap();
                    let mut t = Tally::default();
                    let mut i = 0i64;
                    while !stop.load(Ordering::Relaxed) {
                        i += 1;
                        let org = 1 + (i + w as i64) % 2;
                        let started = Instant::now();
                        let r = async {
                            c.batch_execute("BEGIN").await?;
                            let id: i64 = c
                                .query_one(
                                    "INSERT INTO documents (organization_id, project_id, title) VALUES ($1, $2, $3) RETURNING id",
                                    &[&org, &(org * 10), &format!("w{w} {i}")],
                                )
                                .await?
                                .get(0);
                            c.execute(
                                "INSERT INTO document_versions (organization_id, document_id, body) VALUES ($1, $2, 'new')",
                                &[&org, &id],
                            )
                            .await?;
                            c.execute(
                                "UPDATE documents SET title = title || '!' WHERE organization_id = $1 AND id = $2",
                                &[&org, &id],
                            )
                            .await?;
                            c.batch_execute("COMMIT").await?;
                            Ok::<(), tokio_postgres::Error>(())
                        }
                        .await;
                        t.longest = t.longest.max(started.elapsed());
                        match r {
                            Ok(()) => t.inserted[org as usize] += 1,
                            Err(e) => {
                                let _ = c.batch_execute("ROLLBACK").await;
                                let code = e.code().map(|c| c.code().to_owned()).unwrap_or_default();
                                let msg = e.as_db_error().map_or_else(|| e.to_string(), |d| d.message().to_owned());
                                t.errors.push(format!("org {org}: {code} {msg} (writer {w}, transaction {i})"));
                            }
                        }
                    }
                    t
                })
            })
        })
        .collect()
}

fn join(handles: Vec<std::thread::JoinHandle<Tally>>) -> Tally {
    let mut all = Tally::default();
    for h in handles {
        let t = h.join().unwrap();
        for o in 0..3 {
            all.inserted[o] += t.inserted[o];
        }
        all.errors.extend(t.errors);
        all.longest = all.longest.max(t.longest);
    }
    all
}

/// Stops the writers (after letting them write a moment more) and returns what they did
/// and the counts `counts` should give: `before` plus their inserts.
fn stop_writers(
    stop: &AtomicBool,
    handles: Vec<std::thread::JoinHandle<Tally>>,
    before: (i64, i64, i64),
) -> (Tally, (i64, i64, i64)) {
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    let tally = join(handles);
    let expect = (
        before.0 + tally.inserted[2],
        before.1 + tally.inserted[2],
        before.2 + tally.inserted[1],
    );
    (tally, expect)
}

/// A write of organization 2 refused by the check a killed split left on DEFAULT, until a
/// rerun or `--abort` removes it (docs/moving.md).
fn split_check_error(e: &str) -> bool {
    e.starts_with("org 2: 23514") && e.contains("__lokadb_") && e.contains("_s\"")
}

/// Organization 2 is entirely in its database, organization 1 entirely in the cloud.
#[track_caller]
fn assert_moved(w: &World, docs2: i64, versions2: i64, docs1: i64) {
    // move-org ANALYZEd its foreign partitions (autovacuum never does): both have statistics
    // (reltuples is -1 until a table's first ANALYZE).
    assert_eq!(
        q(
            &w.cloud,
            "SELECT count(*) FILTER (WHERE c.reltuples >= 0) || '/' || count(*) FROM pg_foreign_table f JOIN pg_class c ON c.oid = f.ftrelid"
        )
        .trim(),
        "2/2"
    );
    assert_eq!(
        count(
            &w.org.db,
            ORG_DB,
            "SELECT count(*) FROM documents WHERE organization_id = 2"
        ),
        docs2
    );
    assert_eq!(
        count(
            &w.org.db,
            ORG_DB,
            "SELECT count(*) FROM document_versions WHERE organization_id = 2"
        ),
        versions2
    );
    assert_eq!(
        count(
            &w.org.db,
            ORG_DB,
            "SELECT count(*) FROM documents WHERE organization_id <> 2"
        ) + count(
            &w.org.db,
            ORG_DB,
            "SELECT count(*) FROM document_versions WHERE organization_id <> 2"
        ),
        0,
        "another organization's rows in organization 2's database"
    );
    // Nothing of organization 2 stays in the cloud: no row in DEFAULT, no cloud partition.
    assert_eq!(
        count(
            &w.cloud,
            "app",
            "SELECT count(*) FROM ONLY documents__lokadb_default WHERE organization_id = 2"
        ),
        0
    );
    assert_eq!(
        q(
            &w.cloud,
            "SELECT count(*) FROM pg_class WHERE relname LIKE '%__lokadb_2_c'"
        ),
        "0"
    );
    // Through the cloud (postgres_fdw), the same rows.
    assert_eq!(
        count(
            &w.cloud,
            "app",
            "SELECT count(*) FROM documents WHERE organization_id = 2"
        ),
        docs2
    );
    assert_eq!(
        count(
            &w.cloud,
            "app",
            "SELECT count(*) FROM documents WHERE organization_id = 1"
        ),
        docs1
    );
    assert_eq!(
        q(&w.cloud, "SELECT state FROM lokadb.org WHERE id = '2'"),
        "moved"
    );
    // Nothing the move created is left: journal, triggers, records, publications, slots.
    assert_no_move_left(w);
    assert_eq!(q(&w.cloud, "SELECT count(*) FROM pg_publication"), "0");
    assert_eq!(
        q(&w.cloud, "SELECT count(*) FROM pg_replication_slots"),
        "0"
    );
    assert_eq!(org_q(w, "SELECT count(*) FROM pg_subscription"), "0");
    // The pause is over.
    assert_eq!(q(&w.cloud, "SELECT count(*) FROM lokadb.pause p WHERE EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.pid = p.holder_pid)"), "0");
}

/// No journal row, change record or capture trigger in the cloud.
#[track_caller]
fn assert_no_move_left(w: &World) {
    assert_eq!(q(&w.cloud, "SELECT count(*) FROM lokadb.moves"), "0");
    assert_eq!(q(&w.cloud, "SELECT count(*) FROM lokadb.changes"), "0");
    assert_eq!(
        q(
            &w.cloud,
            "SELECT count(*) FROM pg_trigger WHERE tgname LIKE 'lokadb_capture%'"
        ),
        "0"
    );
}

fn counts(w: &World) -> (i64, i64, i64) {
    (
        count(
            &w.cloud,
            "app",
            "SELECT count(*) FROM documents WHERE organization_id = 2",
        ),
        count(
            &w.cloud,
            "app",
            "SELECT count(*) FROM document_versions WHERE organization_id = 2",
        ),
        count(
            &w.cloud,
            "app",
            "SELECT count(*) FROM documents WHERE organization_id = 1",
        ),
    )
}

fn move_under_writers(mode: &str, logical: bool) {
    // 20 ms round trips to the organization's database.
    let w = world_at(20_000, logical, Some(Duration::from_millis(10)));
    let (docs2, versions2, docs1) = counts(&w);
    let stop = Arc::new(AtomicBool::new(false));
    const WRITERS: usize = 4;
    let handles = writers(&w.dsn, WRITERS, stop.clone());
    std::thread::sleep(Duration::from_millis(500));
    let out = std::process::Command::new(lokadb_tests::proxy::find_binary().unwrap())
        // Parts of 128 kB: each table is copied in several, under one snapshot.
        .args(["move-org", "2", "--mode", mode, "--part-size", "128kB"])
        .env("LOKADB_CLOUD", &w.dsn)
        .env("LOKADB_CLOUD_FROM_ORG", &w.sub_dsn)
        .env("LOKADB_MOVE_COPY_STALL_S", "20")
        .output()
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::Relaxed);
    let tally = join(handles);
    let report = format!("{}\n{}", stdout(&out), stderr(&out));
    let logs = || {
        let tail = |s: String| {
            s.lines()
                .filter(|l| l.contains("ERROR"))
                .take(20)
                .collect::<Vec<_>>()
                .join("\n")
        };
        format!(
            "org log:\n{}\ncloud log:\n{}",
            tail(w.org.db.log_contents()),
            tail(w.cloud.log_contents())
        )
    };
    assert!(out.status.success(), "{report}\n{}", logs());
    assert!(report.contains("checksum equal"), "{report}");
    assert!(!report.contains("DIFFERS"), "{report}");
    if !logical {
        assert!(report.contains(" parts)"), "not copied in parts: {report}");
    }
    assert!(tally.inserted[1] > 0 && tally.inserted[2] > 0, "{tally:?}");
    // Organization 1 never saw an error; organization 2's writers only the split's
    // documented retry (40001) for writes waiting at that moment.
    for e in &tally.errors {
        assert!(e.starts_with("org 2: 40001"), "{e}\n{report}");
    }
    // The split evicts the writes that wait while it attaches. A writer retries at once,
    // and its retry waits again if the attach is still running: a writer can be evicted
    // about once per 50 ms step of the gate's wait (write_gate) while the split's writes
    // are paused — none is failed over and over. The bound has room for the time around
    // the pause the split does not count (a loaded machine: 5 evictions in a 180 ms pause
    // once, 3 in 418 ms another time): twice the steps, and 4 more.
    let attempts = 1 + report.matches("retrying").count();
    let paused_ms: u64 = report
        .split("its writes paused ")
        .nth(1)
        .and_then(|r| r.split(" ms").next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    let per_writer = attempts as u64 * (4 + 2 * (paused_ms / 50));
    for writer in 0..WRITERS {
        let mine = tally
            .errors
            .iter()
            .filter(|e| e.contains(&format!("(writer {writer},")))
            .count() as u64;
        assert!(
            mine <= per_writer,
            "writer {writer}: {mine} evictions, at most {per_writer} in {attempts} attempts with writes paused {paused_ms} ms: {:?}\n{report}",
            tally.errors
        );
    }
    assert_moved(
        &w,
        docs2 + tally.inserted[2],
        versions2 + tally.inserted[2],
        docs1 + tally.inserted[1],
    );
    let v = ok(&lokadb(&w.dsn, &["verify", "2"]));
    assert!(v.contains("verified"), "{v}");
    // The application keeps working on the moved organization, through the cloud.
    q(
        &w.cloud,
        "INSERT INTO documents (organization_id, project_id, title) VALUES (2, 20, 'after')",
    );
    assert_eq!(
        org_q(&w, "SELECT count(*) FROM documents WHERE title = 'after'"),
        "1"
    );
    // The cloud's foreign keys hold across the move: deleting a project cascades into the
    // organization's database, and on to those documents' versions. (A small project: each
    // cascaded row is a round trip through postgres_fdw.)
    q(
        &w.cloud,
        "INSERT INTO projects VALUES (21, 2);
         INSERT INTO documents (organization_id, project_id, title)
           VALUES (2, 21, 'doomed a'), (2, 21, 'doomed b');
         INSERT INTO document_versions (organization_id, document_id, body)
           SELECT 2, id, 'v' FROM documents WHERE organization_id = 2 AND project_id = 21",
    );
    let doomed = "SELECT count(*) FROM document_versions v JOIN documents d ON d.id = v.document_id
                  WHERE d.project_id = 21";
    assert_eq!(org_q(&w, doomed), "2");
    let org_docs = org_q(&w, "SELECT count(*) FROM documents");
    q(&w.cloud, "DELETE FROM projects WHERE id = 21");
    assert_eq!(org_q(&w, doomed), "0");
    assert_eq!(
        org_q(&w, "SELECT count(*) FROM documents")
            .trim()
            .parse::<i64>()
            .unwrap(),
        org_docs.trim().parse::<i64>().unwrap() - 2
    );
    assert_eq!(
        count(
            &w.cloud,
            "app",
            "SELECT count(*) FROM documents WHERE organization_id = 1"
        ),
        docs1 + tally.inserted[1]
    );
    eprintln!("{report}\nwriters: {tally:?}");
}

#[test]
fn move_org_in_trigger_mode_under_writers() {
    move_under_writers("trigger", false);
}

#[test]
fn move_org_in_logical_mode_under_writers() {
    move_under_writers("logical", true);
}

/// `lokadb status --watch`, run apart from the move (as from another machine: it reads only
/// the cloud), shows the copy's rows, bytes, rate and ETA, then the catch-up's lag; refreshes
/// as often as told; and refuses a bad interval or a count without --watch.
#[test]
fn status_watch_follows_a_move_from_another_process() {
    let w = world(3_000, false);
    let watch = |expect: &[&str]| {
        let out = ok(&lokadb(
            &w.dsn,
            &["status", "--watch", "0.2", "--count", "2"],
        ));
        eprintln!("{out}");
        assert_eq!(out.matches("lokadb status at ").count(), 2, "{out}");
        for e in expect {
            assert!(out.contains(e), "no {e:?} in\n{out}");
        }
        out
    };
    // Stalled after its first table is copied: the copy's figures so far.
    let (mut child, go) = crate::migrations::stalled_at(
        &w.dsn,
        w.cloud.port(),
        &["move-org", "2"],
        "after-copy-table",
    );
    let out = watch(&["2: copy: ", " rows, ", " MB/s", "(updated "]);
    assert!(
        out.lines()
            .any(|l| l.starts_with("2 ") && l.contains(" move-org ") && l.contains(" copy ")),
        "{out}"
    );
    // Killed there, a rerun finishes the copy and stalls after its catch-up: its lag.
    child.kill().unwrap();
    child.wait().unwrap();
    let _ = std::fs::remove_file(&go);
    let (child, go) =
        crate::migrations::stalled_at(&w.dsn, w.cloud.port(), &["move-org", "2"], "catchup");
    watch(&["2: catch-up: lag ", " applied, ", " records/s"]);
    let out = crate::migrations::go_on_output(child, &go);
    assert!(out.status.success(), "{}", stderr(&out));
    // Done: no move line is left.
    let out = ok(&lokadb(&w.dsn, &["status"]));
    assert!(!out.contains("2: "), "{out}");
    for (args, expect) in [
        (&["status", "--watch", "0"][..], "is not an interval"),
        (&["status", "--watch", "soon"][..], "is not an interval"),
        (&["status", "--count", "3"][..], "--watch"),
        (&["status", "--watch", "1", "--count", "0"][..], "--count"),
    ] {
        let out = lokadb(&w.dsn, args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(stderr(&out).contains(expect), "{args:?}: {}", stderr(&out));
    }
}

/// Rows written straight into the organization's database (not through the cloud): one
/// with a key organization 1 holds, then a version of a document the cloud lacks. Each
/// makes move-back refuse, naming the key, with nothing switched; fixed there, the rerun
/// takes the rest back, and the key maps learn the keys written there.
#[test]
fn move_back_refuses_rows_the_cloud_would_refuse() {
    let w = world(200, false);
    ok(&lokadb(&w.dsn, &["move-org", "2"]));
    let taken = q(
        &w.cloud,
        "SELECT min(id) FROM documents WHERE organization_id = 1",
    );
    org_q(
        &w,
        &format!("INSERT INTO documents (id, organization_id, project_id, title) VALUES ({taken}, 2, 20, 'straight')"),
    );
    let refused = |expect: &str| {
        let out = lokadb(&w.dsn, &["move-back", "2"]);
        assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
        assert!(stderr(&out).contains(expect), "{}", stderr(&out));
        assert!(
            stderr(&out).contains("nothing was switched"),
            "{}",
            stderr(&out)
        );
        assert_eq!(
            q(&w.cloud, "SELECT state FROM lokadb.org WHERE id = '2'"),
            "returning"
        );
    };
    refused(&format!(
        "hold keys of public.documents that another organization holds (key map lokadb.km_documents_id): (id)=({taken})"
    ));
    // Organization 2's reads still come from its database, as before the attempt.
    assert_eq!(
        count(
            &w.cloud,
            "app",
            "SELECT count(*) FROM documents WHERE title = 'straight'"
        ),
        1
    );
    org_q(&w, "DELETE FROM documents WHERE title = 'straight'");
    org_q(
        &w,
        "INSERT INTO documents (id, organization_id, project_id, title) VALUES (900001, 2, 20, 'fresh');
         INSERT INTO document_versions (id, organization_id, document_id, body) VALUES (900001, 2, 900002, 'orphan')",
    );
    refused("break public.document_versions's foreign key document_versions_document_id_fkey");
    org_q(&w, "DELETE FROM document_versions WHERE id = 900001");
    // Written after the check of the whole copy, before the switch's lock: the last changes
    // are checked under it.
    let (child, go) = crate::migrations::stalled_at(
        &w.dsn,
        w.cloud.port(),
        &["move-back", "2", "--fold-max-rows", "0"],
        "switch-checked",
    );
    org_q(
        &w,
        &format!("UPDATE documents SET id = {taken} WHERE id = 900001"),
    );
    let out = crate::migrations::go_on_output(child, &go);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    for expect in [
        format!("(key map lokadb.km_documents_id): (id)=({taken})"),
        "nothing was switched".to_owned(),
    ] {
        assert!(stderr(&out).contains(&expect), "{}", stderr(&out));
    }
    org_q(
        &w,
        &format!("UPDATE documents SET id = 900001 WHERE id = {taken}"),
    );
    let out = lokadb(&w.dsn, &["move-back", "2", "--fold-max-rows", "0"]);
    let said = format!("{}{}", stdout(&out), stderr(&out));
    assert!(out.status.success(), "{said}");
    // The check before the lock of the refused run above taught the key maps key 900001
    // already (committed: it is the organization's key wherever its rows are).
    assert_eq!(
        q(&w.cloud, "SELECT state FROM lokadb.org WHERE id = '2'"),
        "cloud"
    );
    assert_eq!(
        q(
            &w.cloud,
            "SELECT organization_id FROM lokadb.km_documents_id WHERE id = 900001"
        ),
        "2"
    );
    // The key is the organization's now: another may not take it.
    let e = w
        .cloud
        .psql(
            "app",
            "INSERT INTO documents (id, organization_id, project_id, title) VALUES (900001, 1, 10, 'clash')",
        )
        .unwrap_err();
    assert!(format!("{e:#}").contains("duplicate key"), "{e:#}");
    ok(&lokadb(&w.dsn, &["verify", "2"]));
}

#[test]
fn move_back_returns_every_row_under_writers() {
    let w = world(5_000, false);
    ok(&lokadb(&w.dsn, &["move-org", "2"]));
    let (docs2, versions2, docs1) = counts(&w);
    let stop = Arc::new(AtomicBool::new(false));
    let handles = writers(&w.dsn, 2, stop.clone());
    std::thread::sleep(Duration::from_millis(300));
    // Kept in its own partition (the fold has a test of its own); copied back in parts,
    // read from the organization's database under one snapshot.
    let out = lokadb(
        &w.dsn,
        &[
            "move-back",
            "2",
            "--fold-max-rows",
            "0",
            "--part-size",
            "32kB",
        ],
    );
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    let tally = join(handles);
    let report = format!("{}\n{}", stdout(&out), stderr(&out));
    assert!(out.status.success(), "{report}");
    assert!(report.contains(" parts)"), "not copied in parts: {report}");
    assert!(tally.errors.is_empty(), "{:?}\n{report}", tally.errors);
    assert_eq!(
        q(&w.cloud, "SELECT state FROM lokadb.org WHERE id = '2'"),
        "cloud"
    );
    assert_eq!(
        counts(&w),
        (
            docs2 + tally.inserted[2],
            versions2 + tally.inserted[2],
            docs1 + tally.inserted[1]
        )
    );
    // Its rows are in its own cloud partition; its database keeps none of them.
    assert_eq!(
        count(
            &w.cloud,
            "app",
            "SELECT count(*) FROM documents__lokadb_2_c"
        ),
        docs2 + tally.inserted[2]
    );
    assert_eq!(
        org_q(
            &w,
            "SELECT count(*) FROM pg_tables WHERE tablename IN ('documents', 'document_versions')"
        ),
        "0"
    );
    assert_eq!(org_q(&w, "SELECT count(*) FROM lokadb.changes"), "0");
    assert_eq!(
        q(
            &w.cloud,
            "SELECT count(*) FROM pg_class WHERE relname LIKE '%__lokadb_2_f'"
        ),
        "0"
    );
    let v = ok(&lokadb(&w.dsn, &["verify", "2"]));
    assert!(v.contains("own partition") && v.contains("verified"), "{v}");
    // And out again: no split this time.
    let out = ok(&lokadb(&w.dsn, &["move-org", "2"]));
    assert!(out.contains("verified"), "{out}");
    assert_eq!(
        q(&w.cloud, "SELECT state FROM lokadb.org WHERE id = '2'"),
        "moved"
    );
}

/// Organization 2's own relations in the cloud (its partitions and their indexes).
const OWN_RELATIONS: &str = "SELECT count(*) FROM pg_class WHERE relname ~ '__lokadb_2($|_)'";

/// References the guards recorded for organization 2's rows.
fn refs_of_2(w: &World) -> i64 {
    let sum = q(
        &w.cloud,
        "SELECT 'SELECT ' || string_agg(format('(SELECT count(*) FROM lokadb.%I WHERE org = %L)', refs, '2'), ' + ')
         FROM lokadb.guards",
    );
    count(&w.cloud, "app", &sum)
}

/// A moved-back organization goes back into DEFAULT: kept in its own partitions when bigger
/// than `--fold-max-rows`, folded by `lokadb fold` while both organizations write, folded at
/// once by a move back when small. Nothing is lost, its rows are DEFAULT's (the guards' refs
/// of it gone, the native foreign keys at work), and it moves out again (a split).
#[test]
fn a_moved_back_organization_folds_into_default_under_writers() {
    let w = world(2_000, false);
    ok(&lokadb(&w.dsn, &["move-org", "2"]));
    assert_ne!(refs_of_2(&w), 0);
    let out = lokadb(&w.dsn, &["fold", "2"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("organization 2 is moved"),
        "{}",
        stderr(&out)
    );
    let (docs2, versions2, docs1) = counts(&w);
    let stop = Arc::new(AtomicBool::new(false));
    let handles = writers(&w.dsn, 2, stop.clone());
    std::thread::sleep(Duration::from_millis(200));
    let back = lokadb(&w.dsn, &["move-back", "2", "--fold-max-rows", "100"]);
    assert!(back.status.success(), "{}", stderr(&back));
    assert!(
        stderr(&back).contains("kept 2's partitions: more than 100 rows"),
        "{}",
        stderr(&back)
    );
    let own = count(&w.cloud, "app", OWN_RELATIONS);
    assert_ne!(own, 0);
    // Removing it now would orphan its partitions.
    let out = lokadb(&w.dsn, &["org", "remove", "2"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("lokadb fold 2"), "{}", stderr(&out));
    // A trigger that would see the rows arrive in DEFAULT: refused, nothing changed.
    q(
        &w.cloud,
        "ALTER TABLE documents__lokadb_default ENABLE ALWAYS TRIGGER documents_audit",
    );
    let out = lokadb(&w.dsn, &["fold", "2"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("trigger documents_audit on"),
        "{}",
        stderr(&out)
    );
    q(
        &w.cloud,
        "ALTER TABLE documents__lokadb_default ENABLE TRIGGER documents_audit",
    );
    assert_eq!(count(&w.cloud, "app", OWN_RELATIONS), own);
    // A long transaction on the table: the fold gives up (each wait short, everyone queues
    // behind it), says so, and changes nothing.
    std::thread::scope(|s| {
        let holder = s.spawn(|| {
            w.cloud.psql(
                "app",
                "BEGIN; SELECT count(*) FROM documents; SELECT pg_sleep(7); COMMIT",
            )
        });
        std::thread::sleep(Duration::from_millis(300));
        let out = lokadb(&w.dsn, &["fold", "2"]);
        assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
        assert!(
            stderr(&out).contains("a lock was not granted within 500ms, 5 times"),
            "{}",
            stderr(&out)
        );
        assert_eq!(count(&w.cloud, "app", OWN_RELATIONS), own);
        holder.join().unwrap().unwrap();
    });
    let folded = ok(&lokadb(&w.dsn, &["fold", "2"]));
    assert!(
        folded.contains("folded organization 2 into DEFAULT"),
        "{folded}"
    );
    eprintln!("{folded}");
    std::thread::sleep(Duration::from_millis(200));
    stop.store(true, Ordering::Relaxed);
    let tally = join(handles);
    assert!(tally.errors.is_empty(), "{:?}", tally.errors);
    assert!(tally.inserted[1] > 0 && tally.inserted[2] > 0, "{tally:?}");
    let (docs2, versions2, docs1) = (
        docs2 + tally.inserted[2],
        versions2 + tally.inserted[2],
        docs1 + tally.inserted[1],
    );
    assert_eq!(counts(&w), (docs2, versions2, docs1));
    assert_eq!(count(&w.cloud, "app", OWN_RELATIONS), 0);
    assert_eq!(refs_of_2(&w), 0);
    assert_eq!(
        count(
            &w.cloud,
            "app",
            "SELECT count(*) FROM ONLY documents__lokadb_default WHERE organization_id = 2"
        ),
        docs2
    );
    let v = ok(&lokadb(&w.dsn, &["verify", "2"]));
    assert!(
        v.contains("DEFAULT partition") && v.contains("verified"),
        "{v}"
    );
    assert!(ok(&lokadb(&w.dsn, &["fold", "2"])).contains("nothing to fold"));
    // Out again (a split), and back: folded at once (the writers above made it bigger than
    // the default limit).
    let out = ok(&lokadb(&w.dsn, &["move-org", "2"]));
    assert!(out.contains("verified"), "{out}");
    assert_eq!(
        org_q(&w, "SELECT count(*) FROM documents"),
        docs2.to_string()
    );
    // The fold at the end of move-back ANALYZEs DEFAULT, as `lokadb fold` does: a manual
    // ANALYZE (autovacuum's counts apart) after the move began.
    const ANALYZED: &str = "SELECT analyze_count FROM pg_stat_user_tables WHERE relid = 'documents__lokadb_default'::regclass";
    let analyzed = count(&w.cloud, "app", ANALYZED);
    let back = lokadb(&w.dsn, &["move-back", "2", "--fold-max-rows", "100000"]);
    assert!(back.status.success(), "{}", stderr(&back));
    assert!(
        stderr(&back).contains("folded organization 2 into DEFAULT"),
        "{}",
        stderr(&back)
    );
    assert!(count(&w.cloud, "app", ANALYZED) > analyzed);
    assert_eq!(count(&w.cloud, "app", OWN_RELATIONS), 0);
    assert_eq!(refs_of_2(&w), 0);
    assert_eq!(counts(&w), (docs2, versions2, docs1));
    // Its rows are under DEFAULT's own foreign keys again: deleting its project cascades to
    // its documents and, through the key map, their versions.
    q(&w.cloud, "DELETE FROM projects WHERE id = 20");
    assert_eq!(counts(&w), (0, 0, docs1));
}

/// Runs `lokadb ARGS` killed at failpoint `point` (exit 99), and checks that afterwards
/// organization 2 is not paused and `lokadb status` shows the move as interrupted.
/// The failpoints between the split putting its check on DEFAULT and committing the attach.
const SPLIT_CHECK_WINDOW: &[&str] = &["split-check", "split-switch"];

fn killed_at(w: &World, args: &[&str], point: &str) {
    let out = std::process::Command::new(lokadb_tests::proxy::find_binary().unwrap())
        .args(args)
        .env("LOKADB_CLOUD", &w.dsn)
        .env("LOKADB_CLOUD_FROM_ORG", &w.sub_dsn)
        .env("LOKADB_MOVE_FAILPOINT", point)
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(99),
        "{point}: {}\n{}",
        stdout(&out),
        stderr(&out)
    );
    // Not paused: organization 2 takes a write at once. Killed between putting its check
    // on DEFAULT and attaching, the split leaves the check, which refuses the
    // organization's writes there, naming it, until a rerun or --abort (docs/moving.md).
    let started = Instant::now();
    let write = w.cloud.psql(
        "app",
        "SET lock_timeout = '3s'; UPDATE documents SET title = title WHERE organization_id = 2 AND id = (SELECT min(id) FROM documents WHERE organization_id = 2)",
    );
    if SPLIT_CHECK_WINDOW.contains(&point) {
        let e = format!("{:#}", write.unwrap_err());
        assert!(
            e.contains("violates check constraint \"documents__lokadb_2_s\""),
            "{e}"
        );
    } else {
        write.unwrap();
    }
    assert!(started.elapsed() < Duration::from_secs(3), "{point}");
    // The killed command's cloud backend lets go of the move's lock when it notices its
    // client is gone, which on a loaded machine can take a moment.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let status = ok(&lokadb(&w.dsn, &["status"]));
        if status.contains("interrupted") {
            break;
        }
        assert!(Instant::now() < deadline, "{point}: {status}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Killed at every step in turn (each rerun resumes and is killed at the next one), with
/// writers running throughout; the last rerun finishes. After each crash the
/// organization is not paused and its rows are where they were; at the end every row is
/// where it belongs and nothing the move created is left.
fn killed_at_each_step(args: &[&str], logical: bool, points: &[&str]) {
    let w = world(3_000, logical);
    let back = args[0] == "move-back";
    let with_sub: Vec<&str>;
    let args = if logical {
        // The subscription's role is named and not a superuser, or nothing starts.
        let refused = |extra: &[&str], expect: &str| {
            let out = lokadb(&w.dsn, &[args, extra].concat());
            assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
            assert!(stderr(&out).contains(expect), "{}", stderr(&out));
        };
        refused(&[], "needs --cloud-from-org");
        refused(&["--cloud-from-org", &w.dsn], "is a superuser of the cloud");
        assert_eq!(q(&w.cloud, "SELECT count(*) FROM lokadb.moves"), "0");
        with_sub = [args, &["--cloud-from-org", &w.sub_dsn]].concat();
        &with_sub[..]
    } else {
        args
    };
    if back {
        ok(&lokadb(&w.dsn, &["move-org", "2"]));
    }
    let (docs2, versions2, docs1) = counts(&w);
    let stop = Arc::new(AtomicBool::new(false));
    let handles = writers(&w.dsn, 2, stop.clone());
    for point in points {
        killed_at(&w, args, point);
    }
    let out = ok(&lokadb(&w.dsn, args));
    assert!(out.contains("verified"), "{out}");
    let (tally, expect) = stop_writers(&stop, handles, (docs2, versions2, docs1));
    for e in &tally.errors {
        let split_check =
            points.iter().any(|p| SPLIT_CHECK_WINDOW.contains(p)) && split_check_error(e);
        assert!(
            !back && (e.starts_with("org 2: 40001") || split_check),
            "{e}\nall errors: {:?}",
            tally.errors
        );
    }
    if back {
        assert_eq!(counts(&w), expect);
        assert_eq!(
            q(&w.cloud, "SELECT state FROM lokadb.org WHERE id = '2'"),
            "cloud"
        );
        assert_eq!(
            org_q(
                &w,
                "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'"
            ),
            "0"
        );
        assert_eq!(
            org_q(&w, "SELECT count(*) FROM pg_trigger WHERE NOT tgisinternal"),
            "0"
        );
        assert_eq!(q(&w.cloud, "SELECT count(*) FROM lokadb.moves"), "0");
        ok(&lokadb(&w.dsn, &["verify", "2"]));
    } else {
        assert_moved(&w, expect.0, expect.1, expect.2);
    }
}

#[test]
fn move_org_killed_at_each_step_resumes_cleanly() {
    killed_at_each_step(
        &["move-org", "2"],
        false,
        &[
            "split-copy",
            "split-check",
            "split-switch",
            "after-split",
            "after-prepare",
            "copy",
            "after-copy-table",
            "catchup",
            "switch",
            "after-switch",
            "verify",
            "cleanup",
        ],
    );
}

#[test]
fn logical_move_killed_at_each_step_resumes_cleanly() {
    killed_at_each_step(
        &["move-org", "2", "--mode", "logical"],
        true,
        &[
            "after-prepare",
            "catchup",
            "switch-renamed",
            "switch",
            "after-switch",
            "verify",
            "cleanup",
        ],
    );
}

#[test]
fn move_back_killed_at_each_step_resumes_cleanly() {
    killed_at_each_step(
        &["move-back", "2"],
        false,
        &[
            "after-prepare",
            "copy",
            "after-copy-table",
            "catchup",
            "switch",
            "after-switch",
            "verify",
            "cleanup",
        ],
    );
}

/// The first move attaches the organization's table next to DEFAULT without scanning DEFAULT
/// under its lock (which every other organization would wait for): the split's check,
/// validated while they read and write on, is Postgres' proof (it says so at DEBUG1). No
/// check is left on DEFAULT, and DEFAULT takes the other organizations' rows as before.
#[test]
fn the_first_move_attaches_without_scanning_default() {
    let w = world(3_000, false);
    q(&w.cloud, "ALTER SYSTEM SET log_min_messages = 'debug1'");
    q(&w.cloud, "SELECT pg_reload_conf()");
    let (docs2, versions2, docs1) = counts(&w);
    ok(&lokadb(&w.dsn, &["move-org", "2"]));
    let log = w.cloud.log_contents();
    for table in ["documents", "document_versions"] {
        let proof = format!(
            "updated partition constraint for default partition \"{table}__lokadb_default\" is implied by existing constraints"
        );
        assert!(log.contains(&proof), "no {proof:?} in the cloud's log");
    }
    q(&w.cloud, "ALTER SYSTEM RESET log_min_messages");
    q(&w.cloud, "SELECT pg_reload_conf()");
    assert_eq!(
        q(
            &w.cloud,
            "SELECT count(*) FROM pg_constraint WHERE contype = 'c' AND conname LIKE '%\\_s' \
             AND conrelid IN ('documents__lokadb_default'::regclass, 'document_versions__lokadb_default'::regclass)"
        ),
        "0"
    );
    q(
        &w.cloud,
        "INSERT INTO documents (organization_id, project_id, title) VALUES (1, 10, 'after')",
    );
    assert_moved(&w, docs2, versions2, docs1 + 1);
}

/// An application through the proxy, ORM-style (prepared statements, a transaction per
/// request: insert, read back, count), while organization 2 moves back and out again:
/// no error, and no request waits longer than the documented pause.
#[test]
fn an_orm_client_through_the_proxy_sees_no_error_during_moves() {
    let w = world(5_000, false);
    crate::world::create_auth_role(&w.cloud).unwrap();
    let proxy = crate::world::start_proxy(&w.cloud, json!({}), &[]).unwrap();
    // The first move (with its split out of DEFAULT) before the clients start.
    ok(&lokadb(&w.dsn, &["move-org", "2"]));
    let before = counts(&w);
    let via_proxy = format!(
        "host=127.0.0.1 port={} user={} password={} dbname=app",
        proxy.port(),
        lokadb_tests::pg::SUPERUSER,
        lokadb_tests::pg::SUPERUSER_PASSWORD
    );
    let stop = Arc::new(AtomicBool::new(false));
    let handles = writers(&via_proxy, 4, stop.clone());
    std::thread::sleep(Duration::from_millis(300));
    // Its partitions kept: a fold would make the next move split again, which tells the
    // writers waiting at that instant to retry (40001).
    let back = ok(&lokadb(&w.dsn, &["move-back", "2", "--fold-max-rows", "0"]));
    let out = ok(&lokadb(&w.dsn, &["move-org", "2"]));
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    let tally = join(handles);
    assert!(tally.errors.is_empty(), "{:?}", tally.errors);
    assert!(tally.inserted[2] > 0, "{tally:?}");
    assert!(
        tally.longest < Duration::from_secs(20),
        "a request waited {:?}\n{back}\n{out}",
        tally.longest
    );
    assert_moved(
        &w,
        before.0 + tally.inserted[2],
        before.1 + tally.inserted[2],
        before.2 + tally.inserted[1],
    );
}

#[test]
fn an_aborted_move_leaves_nothing_behind() {
    let w = world(2_000, false);
    let before = counts(&w);
    let bin = lokadb_tests::proxy::find_binary().unwrap();
    let out = std::process::Command::new(&bin)
        .args(["move-org", "2"])
        .env("LOKADB_CLOUD", &w.dsn)
        .env("LOKADB_MOVE_FAILPOINT", "catchup")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(99), "{}", stderr(&out));
    // A second move of the same organization while one is interrupted: told to resume.
    let out = lokadb(&w.dsn, &["move-back", "2"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("a move-org of organization 2 is in progress"),
        "{}",
        stderr(&out)
    );
    let out = ok(&lokadb(&w.dsn, &["move-org", "2", "--abort"]));
    assert!(out.contains("rolled back"), "{out}");
    assert_eq!(counts(&w), before);
    assert_eq!(
        q(&w.cloud, "SELECT state FROM lokadb.org WHERE id = '2'"),
        "cloud"
    );
    assert_no_move_left(&w);
    assert_eq!(
        q(
            &w.cloud,
            "SELECT count(*) FROM pg_class WHERE relname LIKE '%__lokadb_2_f'"
        ),
        "0"
    );
    assert_eq!(
        org_q(
            &w,
            "SELECT count(*) FROM pg_tables WHERE tablename IN ('documents', 'document_versions')"
        ),
        "0"
    );
    // The split (done before the crash) stays: organization 2 in its own cloud partition.
    let v = ok(&lokadb(&w.dsn, &["verify", "2"]));
    assert!(v.contains("own partition"), "{v}");
    // And a new move goes through.
    ok(&lokadb(&w.dsn, &["move-org", "2"]));
    let (d2, v2, d1) = before;
    assert_moved(&w, d2, v2, d1);
}

/// A split killed after putting its check on DEFAULT, then `--abort`: the check is gone
/// (organization 2 writes into DEFAULT again), and so is everything else the split made.
#[test]
fn an_aborted_split_removes_its_check_of_default() {
    let w = world(500, false);
    let before = counts(&w);
    let out = std::process::Command::new(lokadb_tests::proxy::find_binary().unwrap())
        .args(["move-org", "2"])
        .env("LOKADB_CLOUD", &w.dsn)
        .env("LOKADB_MOVE_FAILPOINT", "split-check")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(99), "{}", stderr(&out));
    let checks = "SELECT count(*) FROM pg_constraint WHERE conname LIKE '%\\_\\_lokadb\\_2\\_s'";
    assert_eq!(q(&w.cloud, checks), "2");
    let out = ok(&lokadb(&w.dsn, &["move-org", "2", "--abort"]));
    assert!(out.contains("rolled back"), "{out}");
    assert_eq!(q(&w.cloud, checks), "0");
    q(
        &w.cloud,
        "INSERT INTO documents (organization_id, project_id, title) VALUES (2, 20, 'after abort')",
    );
    let (d2, v2, d1) = before;
    assert_eq!(counts(&w), (d2 + 1, v2, d1));
    assert_eq!(
        q(
            &w.cloud,
            "SELECT count(*) FROM pg_class WHERE relname LIKE '%\\_\\_lokadb\\_2%'"
        ),
        "0"
    );
    assert_eq!(q(&w.cloud, "SELECT count(*) FROM lokadb.moves"), "0");
}

/// `lokadb split`: organization 2 gets partitions of its own in the cloud ahead of its move,
/// under writers of organizations 1 and 2, killed at each of the split's steps and rerun;
/// nothing is lost, it stays in the cloud, and its move then has no split. An interrupted
/// split blocks a move and a fold until it is finished, and `--abort` removes it.
#[test]
fn a_split_ahead_leaves_the_move_only_its_switch() {
    let w = world(3_000, false);
    let checks = "SELECT count(*) FROM pg_constraint WHERE conname LIKE '%\\_\\_lokadb\\_2\\_s'";
    // Killed after putting its check on DEFAULT, then aborted: nothing of it stays.
    killed_at(&w, &["split", "2"], "split-check");
    let out = lokadb(&w.dsn, &["move-org", "2"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("a split of organization 2 is in progress (step split)"),
        "{}",
        stderr(&out)
    );
    let out = lokadb(&w.dsn, &["fold", "2"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("lokadb split 2"), "{}", stderr(&out));
    assert!(ok(&lokadb(&w.dsn, &["split", "2", "--abort"])).contains("split of 2 rolled back"));
    assert_eq!(q(&w.cloud, checks), "0");
    assert_eq!(count(&w.cloud, "app", OWN_RELATIONS), 0);
    assert_eq!(q(&w.cloud, "SELECT count(*) FROM lokadb.moves"), "0");
    let out = lokadb(&w.dsn, &["split", "2", "--abort"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("no split of organization 2 is in progress"));

    let (docs2, versions2, docs1) = counts(&w);
    let stop = Arc::new(AtomicBool::new(false));
    let handles = writers(&w.dsn, 2, stop.clone());
    for point in ["split-copy", "split-check", "split-switch", "after-split"] {
        killed_at(&w, &["split", "2"], point);
    }
    let out = lokadb(&w.dsn, &["split", "2"]);
    assert!(out.status.success(), "{}", stderr(&out));
    // Killed after the attach: the rerun only ends the journal.
    assert!(
        stderr(&out).contains("the split of 2 was done"),
        "{}",
        stderr(&out)
    );
    assert!(ok(&lokadb(&w.dsn, &["split", "2"])).contains("nothing to split"));
    let (tally, expect) = stop_writers(&stop, handles, (docs2, versions2, docs1));
    for e in &tally.errors {
        // As at a move's split: 40001 for writers waiting at its pause.
        assert!(
            e.starts_with("org 2: 40001") || split_check_error(e),
            "{e}\nall errors: {:?}",
            tally.errors
        );
    }
    assert_eq!(counts(&w), expect);
    assert_eq!(
        q(&w.cloud, "SELECT state FROM lokadb.org WHERE id = '2'"),
        "cloud"
    );
    assert_eq!(q(&w.cloud, checks), "0");
    assert_no_move_left(&w);
    assert_eq!(
        count(
            &w.cloud,
            "app",
            "SELECT count(*) FROM ONLY documents__lokadb_default WHERE organization_id = 2"
        ),
        0
    );
    assert_ne!(refs_of_2(&w), 0);
    let v = ok(&lokadb(&w.dsn, &["verify", "2"]));
    assert!(v.contains("own partition"), "{v}");
    // Its move has no split: the only pause is the switch's.
    let out = lokadb(&w.dsn, &["move-org", "2"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!stderr(&out).contains("split of 2"), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("switched 2 to its database: its writes paused"),
        "{}",
        stderr(&out)
    );
    assert_moved(&w, expect.0, expect.1, expect.2);
    // A moved organization is not split.
    let out = lokadb(&w.dsn, &["split", "2"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("organization 2 is moved"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn bad_moves_are_refused_and_change_nothing() {
    let mut w = world(100, false);
    let d = w.dsn.clone();
    let refused = |args: &[&str], code: i32, expect: &str| {
        let out = lokadb(&d, args);
        assert_eq!(out.status.code(), Some(code), "{args:?}: {}", stderr(&out));
        assert!(stderr(&out).contains(expect), "{args:?}: {}", stderr(&out));
    };
    refused(&["move-org", "7"], 2, "organization 7 is not registered");
    refused(&["move-back", "2"], 2, "organization 2 is in the cloud");
    refused(
        &["move-org", "2", "--mode", "fast"],
        2,
        "invalid value 'fast' for '--mode <MODE>'\n  [possible values: trigger, logical]",
    );
    refused(
        &["move-org", "2", "--profile", "direct"],
        2,
        "invalid value 'direct' for '--profile <PROFILE>'\n  [possible values: fdw, fdw+direct]",
    );
    refused(
        &["move-org", "2", "--abort"],
        2,
        "no move-org of organization 2 is in progress",
    );
    refused(
        &["move-org", "2", "--resume"],
        2,
        "no move-org of organization 2 is in progress; nothing to resume",
    );
    // wal_level is replica in this cloud.
    refused(
        &["move-org", "2", "--mode", "logical"],
        2,
        "needs wal_level = logical",
    );
    // A conflicting table in the organization's database.
    org_q(&w, "CREATE TABLE documents (x int)");
    refused(
        &["move-org", "2"],
        2,
        "already has a table public.documents",
    );
    org_q(&w, "DROP TABLE documents");
    // A trigger that would see the split's DELETE from DEFAULT.
    q(
        &w.cloud,
        "CREATE FUNCTION noop() RETURNS trigger LANGUAGE plpgsql AS 'BEGIN RETURN NULL; END';
         CREATE TRIGGER audit AFTER DELETE ON documents__lokadb_default FOR EACH ROW EXECUTE FUNCTION noop();
         ALTER TABLE documents__lokadb_default ENABLE ALWAYS TRIGGER audit",
    );
    refused(&["move-org", "2"], 2, "trigger audit on");
    q(&w.cloud, "DROP TRIGGER audit ON documents__lokadb_default");
    // A generated column.
    q(
        &w.cloud,
        "ALTER TABLE documents ADD COLUMN g int GENERATED ALWAYS AS (1) STORED",
    );
    refused(&["move-org", "2"], 2, "documents.g is a generated column");
    q(&w.cloud, "ALTER TABLE documents DROP COLUMN g");
    // Another organization's database (its lokadb.info says so).
    org_q(&w, "SET ROLE app; CREATE SCHEMA lokadb; CREATE TABLE lokadb.info (singleton boolean PRIMARY KEY DEFAULT true, org text, version int); INSERT INTO lokadb.info (org, version) VALUES ('9', 1)");
    refused(&["move-org", "2"], 2, "belongs to organization 9");
    org_q(&w, "UPDATE lokadb.info SET org = '2', version = 99");
    refused(&["move-org", "2"], 2, "schema version 99");
    org_q(&w, "DROP SCHEMA lokadb CASCADE");
    assert_eq!(
        q(&w.cloud, "SELECT state FROM lokadb.org WHERE id = '2'"),
        "cloud"
    );
    assert_eq!(q(&w.cloud, "SELECT count(*) FROM lokadb.moves"), "0");
    // A second move of the same organization while one runs: held by a session here.
    let dsn = w.dsn.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let t = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let c = crate::world::connect(&dsn).await.unwrap();
            c.batch_execute("SELECT pg_advisory_lock(hashtextextended('lokadb.move:2', 0))")
                .await
                .unwrap();
            tx.send(()).unwrap();
            let _ = done_rx.recv();
        });
    });
    rx.recv().unwrap();
    refused(
        &["move-org", "2"],
        2,
        "a move of organization 2 is already running",
    );
    done_tx.send(()).unwrap();
    t.join().unwrap();
    // The holder's backend lets go of the lock once it sees its client gone, not at once.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while q(
        &w.cloud,
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted",
    ) != "0"
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the advisory lock stays held"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    // An unreachable agent: the organization's database does not answer.
    w.agent.take();
    refused(&["move-org", "2"], 1, "does not answer");
    assert_eq!(
        q(&w.cloud, "SELECT state FROM lokadb.org WHERE id = '2'"),
        "cloud"
    );
    assert_eq!(q(&w.cloud, "SELECT count(*) FROM lokadb.moves"), "0");
}

/// Rows of many types go through the catch-up (JSON at the destination) unchanged: the
/// verification's checksums compare every column's text on both sides.
#[test]
fn every_column_type_survives_the_catch_up() {
    let w = world(10, false);
    q(
        &w.cloud,
        r#"CREATE TABLE typed (
               id bigint PRIMARY KEY, organization_id bigint NOT NULL,
               n numeric(20, 6), f float8, r real, ts timestamptz, d date, iv interval,
               b bytea, j jsonb, js json, a int[], ta text[], t text, u uuid, bo boolean, c char(3));
           INSERT INTO typed
             SELECT g, 1 + g % 2, g * 1.000001, 1.0 / g, 0.1 * g, '2026-01-01 12:00+02'::timestamptz + g * interval '1 hour',
                    '2026-01-01'::date + g, g * interval '1 minute 3 seconds', decode(md5(g::text), 'hex'),
                    jsonb_build_object('k', g, 'quote', 'it''s "x"', 'nested', jsonb_build_array(1, 'two', null)),
                    json_build_object('g', g), ARRAY[g, -g], ARRAY['a,b', 'c"d', NULL, E'back\\slash'],
                    E'line\nbreak\ttab ''q'' "dq" \\ ü', gen_random_uuid(), g % 3 = 0, 'ab'
             FROM generate_series(1, 200) g;
           INSERT INTO typed (id, organization_id) VALUES (1000, 2);
           -- An index whose name holds ` USING `: rebuilt in the organization's database
           -- from the catalog, never by cutting the definition's text at the first one.
           CREATE INDEX "x USING btree (id); DROP TABLE projects; --" ON typed (t);"#,
    );
    ok(&lokadb(&w.dsn, &["enable", "typed"]));
    killed_at(&w, &["move-org", "2"], "after-prepare");
    // Written after the capture began: these rows reach the destination by the catch-up.
    q(
        &w.cloud,
        r#"UPDATE typed SET f = f * 3, t = t || E' \\ updated ''again''', j = j || '{"u": [true, null, 1.5e300]}',
                            b = b || '\x00ff'::bytea, a = a || 7, ts = ts + interval '1 microsecond'
           WHERE organization_id = 2;
           INSERT INTO typed (id, organization_id, f, t) VALUES (1001, 2, 'NaN', NULL), (1002, 2, '-Infinity', '');
           DELETE FROM typed WHERE id = 3;"#,
    );
    let out = lokadb(&w.dsn, &["move-org", "2"]);
    let report = stderr(&out);
    assert!(
        out.status.success(),
        "{report}\n{}",
        w.org
            .db
            .log_contents()
            .lines()
            .filter(|l| l.contains("ERROR") || l.contains("STATEMENT"))
            .map(|l| &l[..l.len().min(600)])
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(
        report.contains("public.typed") && !report.contains("DIFFERS"),
        "{report}"
    );
    assert_eq!(
        count(&w.org.db, ORG_DB, "SELECT count(*) FROM typed"),
        100 + 3 - 1
    );
    assert_eq!(
        org_q(&w, "SELECT t FROM typed WHERE id = 5"),
        q(&w.cloud, "SELECT t FROM typed WHERE id = 5")
    );
    assert_eq!(q(&w.cloud, "SELECT count(*) FROM projects"), "2");
    assert_eq!(
        org_q(
            &w,
            "SELECT string_agg((pg_get_indexdef(indexrelid) LIKE '%USING btree (t)')::text, ',' ORDER BY indexrelid) FROM pg_index WHERE indrelid = 'typed'::regclass"
        ),
        "false,true"
    );
}
