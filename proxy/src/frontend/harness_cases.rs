//! The routing state machine, message by message ([`super::harness`]): organization
//! `acme` is moved with fdw+direct, every other is in the cloud; a scripted read answers
//! one row naming the backend that ran it.

use super::harness::{Harness, Reply};
use lokadb_shared::wire::backend::write_frame;
use lokadb_shared::wire::frontend;
use lokadb_shared::wire::tags::FE_BIND;

const READ_ACME: &str = "SELECT * FROM notes WHERE organization_id = 'acme'";
const UPDATE_ACME: &str = "UPDATE notes SET body = 'x' WHERE organization_id = 'acme' AND id = 6";
const INSERT_ACME: &str = "INSERT INTO notes (organization_id, body) VALUES ('acme', 'audit')";

fn client(lines: &[String]) -> Vec<&str> {
    Harness::client_got(lines)
}

/// Where `line` is in `lines` (it must be there).
fn at(lines: &[String], line: &str) -> usize {
    lines
        .iter()
        .position(|l| l == line)
        .unwrap_or_else(|| panic!("{line:?} not in:\n{}", lines.join("\n")))
}

#[test]
fn a_read_of_a_direct_organization_goes_direct_and_anothers_to_the_cloud() {
    let mut h = Harness::new();
    let l = h.query(READ_ACME);
    assert_eq!(client(&l), ["T", "D acme", "C SELECT 1", "Z I"], "{l:?}");
    assert_eq!(Harness::ran(&l, "cloud"), Vec::<&str>::new());
    let l = h.query("SELECT * FROM notes WHERE organization_id = 'globex'");
    assert_eq!(client(&l), ["T", "D cloud", "C SELECT 1", "Z I"], "{l:?}");
    // The direct connection stays for the next one.
    h.query(READ_ACME);
    assert_eq!(h.opened, 1);
}

#[test]
fn update_then_insert_moves_to_the_cloud_and_commits_once() {
    let mut h = Harness::new();
    let l = h.queries(&["BEGIN", UPDATE_ACME, INSERT_ACME, "COMMIT"]);
    assert_eq!(
        client(&l),
        [
            "C BEGIN",
            "Z T",
            "C UPDATE 1",
            "Z T",
            "C INSERT 0 1",
            "Z T",
            "C COMMIT",
            "Z I"
        ],
        "{}",
        l.join("\n")
    );
    // The update ran directly behind the cloud's gate, then again on the cloud with the
    // insert; the organization's transaction was rolled back, the cloud's committed.
    assert_eq!(
        Harness::ran(&l, "acme"),
        ["(connected)", "BEGIN", UPDATE_ACME, "ROLLBACK"]
    );
    assert_eq!(
        Harness::ran(&l, "cloud"),
        [
            "BEGIN",
            "SELECT lokadb_client.direct_gate('acme')",
            UPDATE_ACME,
            INSERT_ACME,
            "COMMIT"
        ]
    );
    // Nothing reaches the cloud of the replay before the direct side was told to roll
    // back, and the insert only after the replayed update.
    assert!(
        at(&l, &format!("cloud <- {UPDATE_ACME}")) < at(&l, &format!("cloud <- {INSERT_ACME}"))
    );
    assert_eq!(
        h.exchanges.cloud.outbox.len() + h.exchanges.direct.outbox.len(),
        0
    );
}

#[test]
fn a_moved_transaction_that_answers_differently_fails_with_40001() {
    let mut h = Harness::new();
    // The read ran directly ("acme"); on the cloud it answers "cloud".
    let l = h.queries(&["BEGIN", READ_ACME, UPDATE_ACME, "SELECT 1"]);
    let got = client(&l);
    assert_eq!(got[got.len() - 2..], ["E 40001", "Z E"], "{}", l.join("\n"));
    let l = h.query("COMMIT");
    assert_eq!(client(&l), ["C ROLLBACK", "Z I"], "{}", l.join("\n"));
}

#[test]
fn a_direct_write_commits_there_first_then_the_gate_closes() {
    let mut h = Harness::new();
    let l = h.queries(&["BEGIN", UPDATE_ACME, "COMMIT"]);
    assert_eq!(
        client(&l),
        ["C BEGIN", "Z T", "C UPDATE 1", "Z T", "C COMMIT", "Z I"],
        "{}",
        l.join("\n")
    );
    assert_eq!(
        Harness::ran(&l, "cloud"),
        [
            "BEGIN",
            "SELECT lokadb_client.direct_gate('acme')",
            "COMMIT"
        ]
    );
    // The gate's transaction ends only after the organization's committed.
    assert!(at(&l, "acme <- COMMIT") < at(&l, "cloud <- COMMIT"));
}

#[test]
fn a_refused_gate_sends_the_write_through_the_cloud() {
    let mut h = Harness::new();
    h.cloud.reply("direct_gate", Reply::Error("55P03"));
    let l = h.query(UPDATE_ACME);
    assert_eq!(client(&l), ["C UPDATE 1", "Z I"], "{}", l.join("\n"));
    assert!(!Harness::ran(&l, "acme").contains(&UPDATE_ACME));
    assert_eq!(
        Harness::ran(&l, "cloud"),
        [
            "BEGIN",
            "SELECT lokadb_client.direct_gate('acme')",
            "ROLLBACK",
            UPDATE_ACME
        ]
    );
    // Its writes keep going through the cloud for a while: the gate is not asked again.
    let l = h.query(UPDATE_ACME);
    assert_eq!(Harness::ran(&l, "cloud"), [UPDATE_ACME]);
}

#[test]
fn an_unreachable_organization_database_sends_its_statements_to_the_cloud() {
    let mut h = Harness::new();
    h.orgs.get_mut("acme").expect("acme").down = true;
    let l = h.query(READ_ACME);
    assert_eq!(client(&l), ["T", "D cloud", "C SELECT 1", "Z I"], "{l:?}");
    h.orgs.get_mut("acme").expect("acme").down = false;
    // Marked unavailable for a while: no new attempt.
    let l = h.query(READ_ACME);
    assert_eq!(client(&l), ["T", "D cloud", "C SELECT 1", "Z I"], "{l:?}");
    assert_eq!(h.opened, 0);
}

#[test]
fn a_pipelined_read_goes_direct_only_once_the_cloud_answered_what_came_before() {
    let mut h = Harness::new();
    let mut both = Vec::new();
    frontend::query(&mut both, "SELECT 1");
    frontend::query(&mut both, READ_ACME);
    let l = h.send(&both);
    assert_eq!(
        client(&l),
        [
            "T",
            "D cloud",
            "C SELECT 1",
            "Z I",
            "T",
            "D acme",
            "C SELECT 1",
            "Z I"
        ],
        "{}",
        l.join("\n")
    );
    // Message by message: the client had the cloud's ReadyForQuery before the
    // organization's database saw the read.
    let first_ready = at(&l, "client <- Z I");
    assert!(first_ready < at(&l, &format!("acme <- {READ_ACME}")));
}

/// Parse, Bind (text or binary parameter), Execute, Sync of statement `name`.
fn extended(name: &str, sql: &str, param: &str, binary: bool, parse: bool) -> Vec<u8> {
    let mut m = Vec::new();
    if parse {
        frontend::parse(&mut m, name, sql);
    }
    if binary {
        write_frame(&mut m, FE_BIND, |b| {
            b.extend_from_slice(b"\0");
            b.extend_from_slice(name.as_bytes());
            b.push(0);
            b.extend_from_slice(&1i16.to_be_bytes());
            b.extend_from_slice(&1i16.to_be_bytes()); // binary
            b.extend_from_slice(&1i16.to_be_bytes());
            b.extend_from_slice(&(param.len() as i32).to_be_bytes());
            b.extend_from_slice(param.as_bytes());
            b.extend_from_slice(&0i16.to_be_bytes());
        });
    } else {
        frontend::bind_text(&mut m, name, &[Some(param)]);
    }
    frontend::execute(&mut m);
    frontend::sync(&mut m);
    m
}

#[test]
fn a_prepared_read_is_parsed_again_directly_and_its_answers_come_once() {
    let mut h = Harness::new();
    let sql = "SELECT * FROM notes WHERE organization_id = $1";
    // Prepared as drivers do, in a batch of its own: on the cloud, where statements live.
    let mut prepare = Vec::new();
    frontend::parse(&mut prepare, "s1", sql);
    frontend::describe_statement(&mut prepare, "s1");
    frontend::sync(&mut prepare);
    let l = h.send(&prepare);
    assert_eq!(client(&l), ["1", "n", "Z I"], "{}", l.join("\n"));
    assert_eq!(Harness::ran(&l, "cloud"), [format!("Parse \"s1\": {sql}")]);
    // Its first Bind for acme: parsed again on the direct side first, whose answer to
    // that Parse the client does not see.
    let l = h.send(&extended("s1", sql, "acme", false, false));
    assert_eq!(
        client(&l),
        ["2", "D acme", "C SELECT 1", "Z I"],
        "{}",
        l.join("\n")
    );
    assert!(Harness::ran(&l, "acme").contains(&format!("Parse \"s1\": {sql}").as_str()));
    // Bound again: no second Parse anywhere.
    let l = h.send(&extended("s1", sql, "acme", false, false));
    assert_eq!(
        client(&l),
        ["2", "D acme", "C SELECT 1", "Z I"],
        "{}",
        l.join("\n")
    );
    assert!(!l.iter().any(|line| line.contains("Parse")), "{l:?}");
    // Another organization's value of the same statement: the cloud.
    let l = h.send(&extended("s1", sql, "globex", false, false));
    assert_eq!(
        client(&l),
        ["2", "D cloud", "C SELECT 1", "Z I"],
        "{}",
        l.join("\n")
    );
}

#[test]
fn a_binary_text_parameter_is_read_as_text_not_as_an_integer() {
    // "acme" is four bytes: read as an int4 it would be organization 1633905509.
    let mut h = Harness::new();
    let sql = "SELECT * FROM notes WHERE organization_id = $1";
    let l = h.send(&extended("", sql, "acme", true, true));
    assert_eq!(
        client(&l),
        ["1", "2", "D acme", "C SELECT 1", "Z I"],
        "{}",
        l.join("\n")
    );
}

#[test]
fn a_failing_statement_in_a_direct_read_transaction_fails_it_there() {
    let mut h = Harness::new();
    h.orgs
        .get_mut("acme")
        .expect("acme")
        .reply("body = 'boom'", Reply::Error("22012"));
    let l = h.queries(&[
        "BEGIN",
        READ_ACME,
        "SELECT * FROM notes WHERE organization_id = 'acme' AND body = 'boom'",
        READ_ACME,
        "ROLLBACK",
    ]);
    assert_eq!(
        client(&l),
        [
            "C BEGIN",
            "Z T",
            "T",
            "D acme",
            "C SELECT 1",
            "Z T",
            "E 22012",
            "Z E",
            "E 25P02",
            "Z E",
            "C ROLLBACK",
            "Z I"
        ],
        "{}",
        l.join("\n")
    );
    // The cloud saw nothing of it.
    assert_eq!(Harness::ran(&l, "cloud"), Vec::<&str>::new());
}

/// A client step of the differential property.
#[derive(Debug, Clone)]
enum Step {
    Query(&'static str),
    /// Parse (unnamed), Bind with one text parameter, Execute, Sync.
    Extended(&'static str, &'static str),
}

const FAILING: &str = "SELECT * FROM notes WHERE organization_id = 'acme' AND body = 'boom'";

fn step() -> impl proptest::strategy::Strategy<Value = Step> {
    use proptest::prelude::*;
    prop_oneof![
        Just(Step::Query("BEGIN")),
        Just(Step::Query("COMMIT")),
        Just(Step::Query("ROLLBACK")),
        Just(Step::Query(READ_ACME)),
        Just(Step::Query(
            "SELECT * FROM notes WHERE organization_id = 'globex'"
        )),
        Just(Step::Query("SELECT 1")),
        Just(Step::Query(UPDATE_ACME)),
        Just(Step::Query(
            "UPDATE notes SET body = 'y' WHERE organization_id = 'globex' AND id = 7"
        )),
        Just(Step::Query(INSERT_ACME)),
        Just(Step::Query(FAILING)),
        Just(Step::Extended(
            "SELECT * FROM notes WHERE organization_id = $1",
            "acme"
        )),
        Just(Step::Extended(
            "UPDATE notes SET body = 'z' WHERE organization_id = $1 AND id = 6",
            "acme"
        )),
        Just(Step::Extended(
            "SELECT * FROM notes WHERE organization_id = $1",
            "globex"
        )),
    ]
}

/// Both backends answer alike (a replay then always matches), and the failing statement
/// fails on both.
fn scripted(h: &mut Harness) {
    for db in std::iter::once(&mut h.cloud).chain(h.orgs.values_mut()) {
        db.reply("body = 'boom'", Reply::Error("22012"));
        db.reply("SELECT * FROM notes", Reply::Rows(vec!["row".into()]));
    }
}

/// Cases of the property: 400, or `LOKADB_HARNESS_CASES`.
fn cases() -> u32 {
    std::env::var("LOKADB_HARNESS_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(400)
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(cases()))]

    /// Whatever the client runs, through the direct path it gets exactly what it gets
    /// with its organization in the cloud: no refusal, no answer missing or doubled, the
    /// same transaction status at every ReadyForQuery; and the session is left with
    /// nothing queued and, between transactions, the gate of direct writes closed.
    #[test]
    fn the_direct_path_answers_as_the_cloud(steps in proptest::collection::vec(step(), 1..14)) {
        let mut direct = Harness::new();
        let mut cloud = Harness::cloud_only();
        scripted(&mut direct);
        scripted(&mut cloud);
        for (i, s) in steps.iter().enumerate() {
            let bytes = match s {
                Step::Query(sql) => {
                    let mut q = Vec::new();
                    frontend::query(&mut q, sql);
                    q
                }
                Step::Extended(sql, p) => extended("", sql, p, false, true),
            };
            let (a, b) = (direct.send(&bytes), cloud.send(&bytes));
            proptest::prop_assert_eq!(
                client(&a),
                client(&b),
                "step {} of {:?}:\n{}",
                i,
                steps,
                a.join("\n")
            );
            proptest::prop_assert!(direct.exchanges.cloud.outbox.is_empty());
            proptest::prop_assert!(direct.exchanges.direct.outbox.is_empty());
            if client(&a).last() == Some(&"Z I") {
                proptest::prop_assert!(direct.router.gate.is_closed());
            }
        }
    }
}
