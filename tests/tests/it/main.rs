//! LokaDB's integration tests: one binary, one module per subject.
//!
//! They start real things through the `lokadb_tests` harness: PostgreSQL clusters (PostgreSQL 18
//! from `<repo>/.pg/bin`, or `LOKADB_PG_BIN`), the latency link, the proxy binary.

// The harness's own Postgres clusters: SCRAM logins, postgres_fdw, cleanup.
mod harness_pg;
// The harness's proxy launcher, against a stand-in script that keeps the binary's contract.
mod harness_proxy;
// The latency link: delay precision, order, pipelining, backpressure, cut and restore.
mod latency_link;
// A cloud cluster with application roles and the proxy in front: the fixture of the proxy tests.
mod world;
// Protocol features through the proxy: simple and extended queries, pipelining, COPY, cursors,
// LISTEN/NOTIFY, cancel, large values, errors.
mod proxy_protocol;
// The session's identity is its cloud backend's: BackendKeyData's pid, notifications, cancel
// keys that work from any core and on either side, and cancel nothing with a wrong secret.
mod proxy_cancel;
// SCRAM with the cloud's own passwords, users_file, TLS.
mod proxy_auth;
// TLS to a cloud that accepts only hostssl: sslmode to verify-full, client certificates.
mod cloud_tls;
// TLS from the cloud and the direct path to the relay: org add's sslmode, verify-full.
mod relay_tls;
// GET /metrics: the counters follow the traffic; bad requests answered.
mod metrics;
// The console (database lokadb, admin_users): SHOW commands on live sessions, KILL.
mod console;
// SIGHUP re-reads --config: limits, admin_users, databases; bad files refused.
mod reload;
// Two proxies in front of one cloud: a metadata change and a pause reach both.
mod several_proxies;
// Two relays, one killed under load: no organization lost.
mod several_relays;
// Chaos and abuse: slow-loris clients, oversized headers, an organization database that stops
// answering, a stalled agent, a client killed mid-transaction, SCRAM iteration bombs, killed
// processes; the other organizations' clients see no error and bounded latency.
mod chaos;
// upstream_pool: reuse and the reset between clients.
mod proxy_pool;
// pool_mode "transaction": statements and settings across backends, pinning, pool_size.
mod proxy_tx_pool;
// Limits and bad input.
mod proxy_limits;
// psql, pgbench and psycopg 3 through the proxy.
mod proxy_tools;
// asyncpg's own test suite straight at the cloud and through the proxy: the same passes.
mod driver_suite;
// SIGTERM drain.
mod proxy_shutdown;
// Restarts without refusing a client: a new process takes the listening sockets.
mod handover;
// Organization databases behind agents and the relay: the fixture of the tunnel tests.
mod tunnel_world;
// postgres_fdw and direct clients through relay → tunnel → agent; refusals; agents dying.
mod tunnel_fdw;
// Relay restarts, cut links, slow readers, counters, the relay inside the proxy.
mod tunnel_ops;
// Bad input on the agent port: wrong tokens, garbage, malformed frames, silent and
// non-reading agents; refused or cut with a logged reason, nothing else affected.
mod tunnel_bad_input;
// Running the lokadb admin commands from the tests.
mod admin_cli;
// lokadb init, org, pause and resume against real clusters.
mod admin_schema;
// lokadb enable and disable: key maps, foreign keys, concurrent writers, refusals, --plan.
mod admin_enable;
// Foreign keys kept across a foreign partition (an organization moved behind the relay): parent
// checks, refs, cascades into the organization's database, round trips per write.
mod admin_foreign;
// move-org, move-back, verify, status: under writers, killed at each step, refusals.
mod moves;
// The application's migrations reach every moved organization's database, or nothing changes
// (two-phase commit); the table's owner migrates without superuser.
mod migrations;
// Routing's groundwork: the metadata watcher and the per-statement analysis (route_log).
mod routing;
// The direct path (fdw+direct): plain reads in the organization's database, the rest through
// the cloud; an unreachable organization fails only its own statements.
mod direct;
// Transactions that wrote directly and then need the cloud move there whole, or fail with
// 40001.
mod mixed;
// Names resolve as the cloud resolves them: temporary tables, search_path.
mod names;
// The direct login: only listed startup parameters, the session's transaction defaults, the
// gate of direct writes for roles that may write.
mod direct_login;
// Through the proxy as at the cloud: the proxy's refusals read as Postgres errors, system
// columns answer as the cloud's.
mod like_the_cloud;
// SET lokadb.org: a session limited to one organization, on the cloud and the direct path.
mod session_org;
// The organization of each statement, told to the cloud.
mod statement_org;
// `lokadb proxy --record FILE`: the recording format, login never recorded, bad paths.
mod traffic_record;
// Generated statements and transactions through the proxy and straight at the cloud: the same
// answers, errors and final rows (property-based, shrinking; LOKADB_DIFF_CASES for more).
mod differential;

// A Django application's own tests and migration history through the proxy (issues 22, 27).
mod django;
