"""psycopg 3 through the LokaDB proxy: each check asserts a specific outcome.

Usage: psycopg_check.py "host=… port=… user=… password=… dbname=…"
"""
import sys
import threading
import time

import psycopg

dsn = sys.argv[1]
passed = 0


def check(fn):
    global passed
    fn()
    passed += 1
    print(f"ok {fn.__name__}")


@check
def parameter_status_and_types():
    with psycopg.connect(dsn) as conn:
        assert conn.info.parameter_status("server_encoding") == "UTF8"
        assert conn.info.parameter_status("integer_datetimes") == "on"
        conn.execute("SET application_name = 'psycopg-check'")
        assert conn.info.parameter_status("application_name") == "psycopg-check"
        row = conn.execute("SELECT %s::int + 1, %s::text, %s::numeric", (41, "x", "1.5")).fetchone()
        assert row == (42, "x", __import__("decimal").Decimal("1.5")), row


@check
def pipeline_mode():
    with psycopg.connect(dsn) as conn:
        conn.execute("CREATE TEMP TABLE p (id int primary key, v text)")
        with conn.pipeline():
            for i in range(500):
                conn.execute("INSERT INTO p VALUES (%s, %s)", (i, f"v{i}"))
            cur = conn.execute("SELECT count(*), sum(id) FROM p")
        assert cur.fetchone() == (500, sum(range(500)))


@check
def copy_both_ways():
    with psycopg.connect(dsn) as conn:
        conn.execute("CREATE TEMP TABLE c (id int, name text)")
        with conn.cursor().copy("COPY c FROM STDIN") as copy:
            for i in range(20000):
                copy.write_row((i, f"name {i}"))
        assert conn.execute("SELECT count(*) FROM c").fetchone()[0] == 20000
        rows = 0
        with conn.cursor().copy("COPY (SELECT * FROM c) TO STDOUT") as copy:
            for _ in copy.rows():
                rows += 1
        assert rows == 20000, rows


@check
def server_side_cursor():
    with psycopg.connect(dsn) as conn:
        with conn.transaction():
            with conn.cursor(name="big") as cur:
                cur.itersize = 1000
                cur.execute("SELECT g FROM generate_series(1, 5000) g")
                total = sum(r[0] for r in cur)
        assert total == 5000 * 5001 // 2


@check
def notifications_while_idle():
    got = []
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute("LISTEN events")

        def notify():
            with psycopg.connect(dsn, autocommit=True) as other:
                other.execute("NOTIFY events, 'hello'")

        t = threading.Thread(target=notify)
        t.start()
        for n in listener.notifies(timeout=5, stop_after=1):
            got.append((n.channel, n.payload))
        t.join()
    assert got == [("events", "hello")], got


@check
def notices_arrive_with_their_fields():
    notices = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.add_notice_handler(lambda d: notices.append((d.severity_nonlocalized, d.sqlstate, d.message_primary)))
        conn.execute("DO $$ BEGIN RAISE NOTICE 'careful: %', 42; RAISE WARNING 'watch out' USING ERRCODE = '01000'; END $$")
    assert notices == [("NOTICE", "00000", "careful: 42"), ("WARNING", "01000", "watch out")], notices


@check
def errors_keep_the_session():
    with psycopg.connect(dsn, autocommit=True) as conn:
        try:
            conn.execute("SELECT 1/0")
            raise AssertionError("no error")
        except psycopg.errors.DivisionByZero as e:
            assert e.sqlstate == "22012"
        assert conn.execute("SELECT 'alive'").fetchone() == ("alive",)


@check
def the_reported_pid_is_the_sessions():
    # psycopg's backend_pid is BackendKeyData's: the driver tells its own notifications
    # from others' by it.
    got = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.add_notify_handler(lambda n: got.append((n.pid, n.channel, n.payload)))
        pid = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
        assert conn.info.backend_pid == pid, (conn.info.backend_pid, pid)
        conn.execute("LISTEN mine")
        conn.execute("NOTIFY mine, 'self'")
        conn.execute("SELECT 1")
    assert got == [(pid, "mine", "self")], got


@check
def cancel_stops_the_statement():
    with psycopg.connect(dsn, autocommit=True) as conn:
        pid = conn.info.backend_pid

        def cancel_when_sleeping():
            with psycopg.connect(dsn, autocommit=True) as watcher:
                for _ in range(2000):
                    row = watcher.execute(
                        "SELECT wait_event FROM pg_stat_activity WHERE pid = %s", (pid,)
                    ).fetchone()
                    if row and row[0] == "PgSleep":
                        conn.cancel()
                        return
                    time.sleep(0.01)

        t = threading.Thread(target=cancel_when_sleeping)
        t.start()
        try:
            conn.execute("SELECT pg_sleep(60)")
            raise AssertionError("not cancelled")
        except psycopg.errors.QueryCanceled as e:
            assert e.sqlstate == "57014"
        t.join()
        # Postgres signals a cancelled backend twice: the second can land on the next
        # statement, once.
        try:
            row = conn.execute("SELECT 'alive'").fetchone()
        except psycopg.errors.QueryCanceled:
            row = conn.execute("SELECT 'alive'").fetchone()
        assert row == ("alive",), row


print(f"psycopg checks passed: {passed}")
