//! A small Django application (`tests/django`): its own test suite run straight at the cloud
//! and through the proxy, organization 1 in the cloud, 2 moved with fdw+direct, 3 with fdw
//! (issue 22, "Tests"); and its migration history deployed through the proxy, one migration at
//! a time, each followed by `lokadb verify` and the application's tests (issue 27, "Tests").

use crate::admin_cli::{lokadb, ok, stderr, stdout};
use crate::tunnel_world::{moved_world, MovedWorld, APP_PASSWORD, APP_USER};
use std::path::PathBuf;
use std::process::{Command, Output};

/// The organizations' rows the application's tests expect (`notes/tests.py`, `SEEDED`), for
/// the schema at migration `state` (Django gives columns no database default).
fn seed(state: u32) -> String {
    let (extra, value) = match state {
        2..=3 => (", priority", ", 0"),
        4.. => (", rank", ", 0"),
        _ => ("", ""),
    };
    format!(
        "INSERT INTO organizations VALUES (1, 'organization 1'), (2, 'organization 2'), (3, 'organization 3');
         INSERT INTO notes (organization_id, body, n{extra})
           SELECT o, 'seed ' || o || ' ' || g, 0{value}
           FROM generate_series(1, 3) o, generate_series(1, 20) g ORDER BY o, g;"
    )
}

/// The last migration of the application.
const LAST: u32 = 9;

fn project() -> PathBuf {
    lokadb_tests::repo_root().join("tests/django")
}

/// `manage.py ARGS` with the application's database at `port` and its models at migration
/// `state`.
fn manage(port: u16, state: u32, args: &[&str]) -> Output {
    let root = lokadb_tests::repo_root();
    Command::new(root.join(".venv/bin/python"))
        .arg("manage.py")
        .args(args)
        .current_dir(project())
        .env("LOKANOTES_PORT", port.to_string())
        .env("LOKANOTES_USER", APP_USER)
        .env("LOKANOTES_PASSWORD", APP_PASSWORD)
        .env("LOKANOTES_STATE", state.to_string())
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .expect("the venv's python (scripts/setup.sh installs Django)")
}

/// Runs the application's tests; returns how many ran, asserting they passed.
#[track_caller]
fn app_tests(port: u16, state: u32, where_: &str) -> usize {
    let out = manage(port, state, &["test", "notes", "--keepdb", "-v", "2"]);
    let text = stdout(&out) + &stderr(&out);
    assert!(
        out.status.success() && text.contains("\nOK"),
        "the application's tests failed {where_} (migration {state}):\n{text}"
    );
    text.lines()
        .find_map(|l| l.strip_prefix("Ran ")?.split(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no test count in:\n{text}"))
}

/// The cloud as the application deploys it: Django's migrations up to `upto`, straight at the
/// cloud as `app`, then the organizations' rows; `notes` becomes the LokaDB table.
fn world(upto: u32) -> MovedWorld {
    moved_world(
        |cloud| {
            cloud.create_role(APP_USER, APP_PASSWORD).unwrap();
            cloud.create_database("app", APP_USER).unwrap();
            ok(&lokadb(&cloud.superuser_dsn("app"), &["init"]));
            let target = format!("{upto:04}");
            let out = manage(cloud.port(), upto, &["migrate", "notes", &target]);
            assert!(out.status.success(), "{}{}", stdout(&out), stderr(&out));
            cloud.psql("app", &seed(upto)).unwrap();
        },
        &["notes"],
    )
}

#[test]
fn the_django_apps_tests_pass_through_the_proxy_as_at_the_cloud() {
    let w = world(LAST);
    let at_cloud = app_tests(w.cloud.port(), LAST, "straight at the cloud");
    let through = app_tests(w.proxy.port(), LAST, "through the proxy");
    assert_eq!(at_cloud, through);
    assert!(through >= 13, "{through} tests ran");
    // Some of it took the direct path.
    let out = w.proxy.output();
    assert!(
        out.contains("route=\"direct\""),
        "nothing went direct:\n{out}"
    );
}

#[test]
fn the_django_apps_migrations_reach_every_organization_through_the_proxy() {
    let w = world(1);
    let dsn = w.cloud.superuser_dsn("app");
    let port = w.proxy.port();
    app_tests(port, 1, "through the proxy");
    for state in 2..=LAST {
        let target = format!("{state:04}");
        let out = manage(port, state, &["migrate", "notes", &target]);
        assert!(
            out.status.success(),
            "migration {state} through the proxy:\n{}{}",
            stdout(&out),
            stderr(&out)
        );
        let verify = ok(&lokadb(&dsn, &["verify"]));
        assert_eq!(
            verify.matches("schema equal").count(),
            2,
            "after migration {state}:\n{verify}"
        );
        app_tests(port, state, "through the proxy");
    }
    // Straight at the cloud too, at the end.
    app_tests(w.cloud.port(), LAST, "straight at the cloud");
    // The organizations' own tables followed: rank is bigint, due is gone.
    for org in &w.orgs {
        let cols = org
            .db
            .psql(
                crate::tunnel_world::ORG_DB,
                "SELECT string_agg(attname || ' ' || format_type(atttypid, atttypmod), ', ' ORDER BY attnum)
                 FROM pg_attribute WHERE attrelid = 'notes'::regclass AND attnum > 0 AND NOT attisdropped",
            )
            .unwrap();
        assert!(
            cols.contains("rank bigint"),
            "organization {}: {cols}",
            org.id
        );
        assert!(!cols.contains("due"), "organization {}: {cols}", org.id);
    }
}
