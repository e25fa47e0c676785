#!/usr/bin/env python3
"""LokaDB benchmark of a whole application: the Django application of tests/django served by
gunicorn and driven over HTTP by 16 clients.

    LOKADB_BENCH_TARGET=/work/main/target/release /work/main/.venv/bin/python research/bench/django_app.py
        [--quick] [--out DIR] [--rtts 0,40] [--clients 16] [--seconds S] [--reps R]

The world: a cloud cluster where the application is deployed as it deploys itself (`manage.py
migrate` as its role `app`), `lokadb init`, organizations 1 and 2 with N notes each (full 5,000,
quick 1,000) and 20 tags, `lokadb enable notes`, organization 2's own cluster behind the relay and
its agent (a latency link of RTT/2 each way in front of the relay's agent port: the organization
RTT ms away from the cloud), `lokadb move-org 2 --profile fdw`.

The application (tests/django: models `Organization`, `Tag` and `Audit` in the cloud, `Note` the
LokaDB table with foreign keys to two of them) has five pages, each client picking the next at
random with these weights:

  list    30 %  GET /o/ORG/notes/         the organization's 50 newest notes
  detail  30 %  GET /o/ORG/notes/ID/      one note with its tag (select_related)
  feed    20 %  GET /o/ORG/feed/          20 newest with organization and tag (select_related,
                                          ordered, sliced)
  create  10 %  POST /o/ORG/notes/new     a form: the note and an audit row (cloud) in one
                                          transaction
  update  10 %  POST /o/ORG/notes/ID/edit a form: select_for_update, then save, in one transaction

gunicorn: 2 workers × 8 threads (gthread), each thread keeping its database connection
(`CONN_MAX_AGE`). The clients are threads of this script on HTTP/1.1 keep-alive, closed loop,
S seconds (full 20, quick 8) after 2 s of warm-up; everything shares the machine's 2 cores, so the
figures are ratios within one run.

Set-ups, per repetition (full 3, quick 1) in a rotated order:
  `cloud, org 1`          straight at the cloud, organization 1 (in the cloud)
  `lokadb, org 1`         through LokaDB, organization 1
  `cloud, org 2 fdw`      straight at the cloud, organization 2 moved (postgres_fdw alone)
  `lokadb, org 2 fdw`     through LokaDB, organization 2 on fdw
  `lokadb, org 2 fdw+direct`
at RTT 0; at a longer RTT only the organization 2 set-ups (organization 1 does not move).

Per set-up: requests/s, per page p50/p99 ms and requests, errors (any status but 200/201, and
failed connections), the proxy's CPU per request. Ratios: through LokaDB ÷ straight at the cloud
for the same organization (the reference: 5–10 % slower for organizations in the cloud).

Writes raw.json and summary.md into research/bench/results/<UTC ts>-django[-quick]/ and the
section "A whole application: Django" of charts-data.md (not with --out). Builds nothing.
"""

from __future__ import annotations

import argparse
import http.client
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import traceback
import urllib.parse
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from lib import routing_world  # noqa: E402  (start_proxy, set_profile)
from lib.binaries import AGENT_BIN, LINK_BIN, LOKADB_BIN, PG_BIN, binary_info  # noqa: E402
from lib.charts import save_png  # noqa: E402
from lib.clusters import (  # noqa: E402
    APP_PASSWORD, CLOUD_PG, ORG_DB, ORG_PG, PgCluster, cluster_root, lokadb, org_database,
)
from lib.numbers import fmt, percentile  # noqa: E402
from lib.procs import (  # noqa: E402
    CHILDREN, catch_signals, delta, free_port, log, preflight, sched_ns, stop_process, temp_dir,
)
from lib.relay import (  # noqa: E402
    prepare_tunnel, start_tunnel, stop_agents, stop_tunnel, tunnel_agent, tunnel_relay,
)
from lib.results import (  # noqa: E402
    Ctx, guarded_run, parse_rtts, rerender, result_dir, run_meta, run_rounds, summary_to_charts_data,
)

import matplotlib.pyplot as plt  # noqa: E402  (lib set the Agg backend)


REPO = HERE.parent.parent
APP_DIR = REPO / "tests" / "django"
PYTHON = REPO / ".venv" / "bin" / "python"
GUNICORN = REPO / ".venv" / "bin" / "gunicorn"
ORG, OTHER = routing_world.ORG, routing_world.OTHER
PAGES = [("list", 30), ("detail", 30), ("feed", 20), ("create", 10), ("update", 10)]
SETUPS = [
    # key, label, target, org, profile
    ("cloud-1", "cloud, org 1", "cloud", OTHER, None),
    ("lokadb-1", "lokadb, org 1", "proxy", OTHER, None),
    ("cloud-2-fdw", "cloud, org 2 fdw", "cloud", ORG, "fdw"),
    ("lokadb-2-fdw", "lokadb, org 2 fdw", "proxy", ORG, "fdw"),
    ("lokadb-2-direct", "lokadb, org 2 fdw+direct", "proxy", ORG, "fdw+direct"),
]
RATIOS = [("lokadb-1", "cloud-1", "organization in the cloud: through LokaDB ÷ straight"),
          ("lokadb-2-fdw", "cloud-2-fdw", "organization on fdw: through LokaDB ÷ straight"),
          ("lokadb-2-direct", "cloud-2-fdw", "organization on fdw+direct through LokaDB ÷ on fdw straight"),
          ("lokadb-2-direct", "cloud-1", "organization on fdw+direct through LokaDB ÷ in the cloud straight")]


class Mode:
    def __init__(self, quick: bool):
        self.quick = quick
        self.name = "quick" if quick else "full"
        self.rtts_ms = [0.0] if quick else [0.0, 40.0]
        self.notes = 1_000 if quick else 5_000
        self.clients = 16
        self.seconds = 8.0 if quick else 20.0
        self.warmup = 2.0
        self.reps = 1 if quick else 3
        self.workers = 2
        self.threads = 8


# --------------------------------------------------------------------------------------
# The world


def app_env(port: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOKANOTES_")}
    env.update({"LOKANOTES_PORT": str(port), "LOKANOTES_USER": "app", "LOKANOTES_PASSWORD": APP_PASSWORD,
                "LOKANOTES_CONN_MAX_AGE": "600", "PYTHONDONTWRITEBYTECODE": "1",
                "DJANGO_SETTINGS_MODULE": "lokanotes.settings"})
    return env


def build_world(ctx) -> dict:
    mode = ctx.mode
    info = {"timings_s": {}}
    t0 = time.time()
    root = cluster_root(ctx.tmp / "world")
    ctx.org = org = PgCluster(root, "org", ctx.commands)
    org.create(ORG_PG)
    info["postgres_version"] = org_database(org)
    ctx.cloud = cloud = PgCluster(root, "cloud", ctx.commands)
    cloud.create(CLOUD_PG)
    with cloud.conn() as c:
        c.execute(f"CREATE ROLE app LOGIN PASSWORD '{APP_PASSWORD}'")
        c.execute("CREATE DATABASE app OWNER app")
        c.execute(f"CREATE ROLE lokadb_auth LOGIN SUPERUSER PASSWORD '{routing_world.AUTH_PASSWORD}'")
    ctx.commands.append("(cloud) CREATE ROLE app LOGIN PASSWORD '***'; CREATE DATABASE app OWNER app; "
                        "CREATE ROLE lokadb_auth LOGIN SUPERUSER PASSWORD '***'")
    dsn = cloud.dsn()
    lokadb(ctx, ["init"], dsn)
    cmd = [str(PYTHON), "manage.py", "migrate", "notes"]
    ctx.commands.append(f"(tests/django, as app at the cloud) {' '.join(cmd)}")
    r = subprocess.run(cmd, cwd=APP_DIR, env=app_env(cloud.port), capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"manage.py migrate failed:\n{r.stdout}\n{r.stderr}")
    seed = f"""
INSERT INTO organizations VALUES ({OTHER}, 'organization {OTHER}'), ({ORG}, 'organization {ORG}');
INSERT INTO tags (label) SELECT 'tag ' || g FROM generate_series(1, 20) g;
INSERT INTO notes (organization_id, tag_id, body, n, rank)
  SELECT o, (SELECT min(id) FROM tags) + (g % 20), 'note ' || o || ' ' || g || ' ' || repeat('x', 80), 0, 0
  FROM generate_series(1, {mode.notes}) g, (VALUES ({OTHER}), ({ORG})) v(o) ORDER BY g, o;
ANALYZE;"""
    with cloud.conn("app", user="app", password=APP_PASSWORD) as c:
        c.execute(seed)
    ctx.commands.append("(cloud, as app) " + " ".join(seed.split()))
    info["timings_s"]["deploy_seed"] = round(time.time() - t0, 1)
    relay = tunnel_relay(ctx, ORG, "relay-setup")
    agent = tunnel_agent(ctx, relay.agents_port, org.addr())
    try:
        relay.wait_connected(1)
        t = time.time()
        lokadb(ctx, ["enable", "notes"], dsn)
        lokadb(ctx, ["org", "add", ORG, "--via-relay", f"127.0.0.1:{ctx.relay_pg_port}", "--dbname", ORG_DB,
                     "--user", "app", "--password", APP_PASSWORD], dsn)
        lokadb(ctx, ["move-org", ORG, "--profile", "fdw"], dsn, timeout=900)
        info["timings_s"]["enable_move"] = round(time.time() - t, 1)
        # The notes the pages show and update (organization 2's through the relay, still up).
        with cloud.conn("app") as c:
            ctx.ids = {o: [r[0] for r in c.execute(
                "SELECT id FROM notes WHERE organization_id = %s ORDER BY id LIMIT 1000", (int(o),)).fetchall()]
                for o in (OTHER, ORG)}
            info["rows"] = dict(c.execute(
                "SELECT organization_id::text, count(*) FROM notes GROUP BY 1 ORDER BY 1").fetchall())
    finally:
        stop_agents([agent])
        relay.stop()
    info["timings_s"]["total"] = round(time.time() - t0, 1)
    log(f"  world ready in {info['timings_s']['total']} s: notes per organization {info['rows']}")
    return info


class App:
    """gunicorn serving the application with its database at `db_port`."""

    def __init__(self, ctx, db_port: int, tag: str):
        mode = ctx.mode
        self.port = free_port()
        cmd = [str(GUNICORN), "--chdir", str(APP_DIR), "-k", "gthread", "-w", str(mode.workers),
               "--threads", str(mode.threads), "-b", f"127.0.0.1:{self.port}", "--log-level", "warning",
               "--keep-alive", "30", "lokanotes.wsgi"]
        ctx.commands.append(f"(LOKANOTES_PORT={db_port}) {' '.join(cmd)}")
        self.stderr_path = ctx.tmp / f"gunicorn-{tag}.log"
        self.proc = subprocess.Popen(cmd, env=app_env(db_port), stdout=subprocess.DEVNULL,
                                     stderr=open(self.stderr_path, "ab"), stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        CHILDREN.append(self.proc)
        deadline = time.time() + 60
        while True:
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
                c.request("GET", f"/o/{OTHER}/notes/")
                if c.getresponse().status == 200:
                    c.close()
                    return
            except OSError:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("the application did not start:\n"
                                   + self.stderr_path.read_text(errors="replace")[-3000:])
            time.sleep(0.2)

    def stop(self):
        stop_process(self.proc)
        if self.proc in CHILDREN:
            CHILDREN.remove(self.proc)


# --------------------------------------------------------------------------------------
# The clients


def client_loop(port: int, org: str, ids: list[int], until_warm: float, until: float, seed: int, out: dict):
    rnd = random.Random(seed)
    names = [p for p, _ in PAGES]
    weights = [w for _, w in PAGES]
    lat = {p: [] for p in names}
    errors: dict[str, int] = {}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    headers = {"Content-Type": "application/x-www-form-urlencoded"}
    n = 0
    while True:
        now = time.perf_counter()
        if now >= until:
            break
        page = rnd.choices(names, weights)[0]
        nid = rnd.choice(ids)
        n += 1
        if page == "list":
            req = ("GET", f"/o/{org}/notes/", None)
        elif page == "detail":
            req = ("GET", f"/o/{org}/notes/{nid}/", None)
        elif page == "feed":
            req = ("GET", f"/o/{org}/feed/", None)
        elif page == "create":
            req = ("POST", f"/o/{org}/notes/new",
                   urllib.parse.urlencode({"body": f"bench {seed} {n}", "n": "1"}))
        else:
            req = ("POST", f"/o/{org}/notes/{nid}/edit",
                   urllib.parse.urlencode({"body": f"edited {seed} {n}", "n": str(n % 100)}))
        t = time.perf_counter()
        try:
            conn.request(req[0], req[1], body=req[2], headers=headers if req[2] else {})
            r = conn.getresponse()
            body = r.read()
            ok = r.status in (200, 201)
            if not ok:
                key = f"{page} {r.status}: {body[:120].decode(errors='replace')}"
                errors[key] = errors.get(key, 0) + 1
        except (OSError, http.client.HTTPException) as e:
            ok = False
            key = f"{page} {type(e).__name__}: {e}"[:200]
            errors[key] = errors.get(key, 0) + 1
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        end = time.perf_counter()
        if ok and t >= until_warm:
            lat[page].append((end - t) * 1e3)
    conn.close()
    out["lat"] = lat
    out["errors"] = errors


def drive(ctx, port: int, org: str) -> dict:
    mode = ctx.mode
    start = time.perf_counter()
    until_warm = start + mode.warmup
    until = until_warm + mode.seconds
    outs = [{} for _ in range(mode.clients)]
    threads = [threading.Thread(target=client_loop, daemon=True,
                                args=(port, org, ctx.ids[org], until_warm, until, i * 7919 + 1, outs[i]))
               for i in range(mode.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=mode.warmup + mode.seconds + 120)
    rec = {"pages": {}, "errors": {}}
    total = 0
    for p, _ in PAGES:
        lat = sorted(x for o in outs for x in o.get("lat", {}).get(p, []))
        total += len(lat)
        rec["pages"][p] = {"requests": len(lat), "per_s": round(len(lat) / mode.seconds, 1),
                           "p50_ms": round(percentile(lat, 0.5), 2) if lat else None,
                           "p99_ms": round(percentile(lat, 0.99), 2) if lat else None}
    for o in outs:
        for k, v in o.get("errors", {}).items():
            rec["errors"][k] = rec["errors"].get(k, 0) + v
    rec["requests"] = total
    rec["per_s"] = round(total / mode.seconds, 1)
    return rec


def one_setup(ctx, rtt: float, key: str, label: str, target: str, org: str, profile: str | None) -> dict:
    rec = {"key": key, "label": label, "target": target, "org": org, "profile": profile, "rtt_ms": rtt}
    if profile is not None:
        routing_world.set_profile(ctx, profile)
    db_port = ctx.proxy.port if target == "proxy" else ctx.cloud.port
    app = App(ctx, db_port, f"{key}-{rtt:g}")
    try:
        cpu0 = sched_ns(ctx.proxy.proc.pid)
        rec.update(drive(ctx, app.port, org))
        cpu = delta(cpu0, sched_ns(ctx.proxy.proc.pid))
        if target == "proxy" and cpu and rec["requests"]:
            rec["proxy_us_per_request"] = round(cpu / 1e3 / rec["requests"], 1)
        if ctx.proxy.proc.poll() is not None:
            raise RuntimeError(f"the proxy exited ({ctx.proxy.proc.returncode})")
    finally:
        app.stop()
    errs = sum(rec["errors"].values())
    log(f"    RTT {rtt:g} {label:<26} {rec['per_s']:8.1f} req/s  "
        + "  ".join(f"{p} p50 {fmt(rec['pages'][p]['p50_ms'], 1)}" for p, _ in PAGES)
        + f"  errors {errs}")
    return rec


def rtt_round(ctx, rtt: float) -> dict:
    rec = {"rtt_ms": rtt, "setups": [], "errors": []}
    ctx.relay = ctx.link = ctx.agent = ctx.proxy = None
    setups = [s for s in SETUPS if rtt == 0 or s[3] == ORG]
    try:
        start_tunnel(ctx, ORG, f"relay-rtt{rtt:g}", rtt)
        rec["relay_select1_ms"] = routing_world.relay_rtt_ms(ctx)
        ctx.proxy = routing_world.start_proxy(ctx, f"django-rtt{rtt:g}")
        log(f"  RTT {rtt:g} ms: SELECT 1 through relay + link {rec['relay_select1_ms']} ms")
        for rep in range(ctx.mode.reps):
            # Rotated: no set-up always runs first or last.
            k = rep % len(setups)
            for s in setups[k:] + setups[:k]:
                try:
                    r = one_setup(ctx, rtt, *s)
                    r["rep"] = rep
                    rec["setups"].append(r)
                except Exception as e:  # noqa: BLE001
                    rec["errors"].append(f"{s[1]}: {e!r}")
                    ctx.errors.append(f"RTT {rtt:g} {s[1]}: {e!r}")
                    log(f"    RTT {rtt:g} {s[1]} FAILED: {e!r}")
                    traceback.print_exc()
    finally:
        stop_tunnel(ctx, rec)
    return rec


# --------------------------------------------------------------------------------------
# Summary


def medians(rnd: dict) -> dict:
    """Per set-up key: the median over repetitions of req/s, per page p50/p99, errors."""
    by: dict[str, list] = {}
    for s in rnd["setups"]:
        by.setdefault(s["key"], []).append(s)
    out = {}
    for key, runs in by.items():
        m = {"label": runs[0]["label"], "reps": len(runs),
             "per_s": statistics.median(r["per_s"] for r in runs),
             "per_s_all": [r["per_s"] for r in runs],
             "errors": sum(sum(r["errors"].values()) for r in runs),
             "requests": sum(r["requests"] for r in runs), "pages": {}}
        cpu = [r["proxy_us_per_request"] for r in runs if r.get("proxy_us_per_request")]
        m["proxy_us_per_request"] = statistics.median(cpu) if cpu else None
        for p, _ in PAGES:
            vals = [r["pages"][p] for r in runs if r["pages"][p]["p50_ms"] is not None]
            m["pages"][p] = {k: (statistics.median(v[k] for v in vals) if vals else None)
                             for k in ("per_s", "p50_ms", "p99_ms")}
        out[key] = m
    return out


def render(raw: dict, outdir: Path, charts_data: bool) -> str:
    meta = raw["meta"]
    ms = meta["mode_settings"]
    L = [f"# A whole application: Django ({meta['mode']}), run `{meta['run_id']}`", "",
         f"Command: `{meta['command']}`", "",
         f"{ms['clients']} HTTP clients, {ms['seconds']:g} s per set-up after {ms['warmup']:g} s of warm-up, "
         f"gunicorn {ms['workers']} workers × {ms['threads']} threads, {ms['notes']:,} notes per organization; "
         f"medians of {ms['reps']} repetition(s) in rotated order. Pages: "
         + ", ".join(f"{p} {w} %" for p, w in PAGES) + ".", ""]
    for rnd in raw["rounds"]:
        m = medians(rnd)
        L += [f"## RTT {rnd['rtt_ms']:g} ms to organization 2's database "
              f"(SELECT 1 through relay + link: {rnd.get('relay_select1_ms')} ms)", "",
              "| set-up | req/s (each repetition) | " + " | ".join(f"{p} p50 / p99 ms" for p, _ in PAGES)
              + " | errors | proxy µs CPU / request |",
              "|---|---:|" + "---:|" * len(PAGES) + "---:|---:|"]
        for key, *_ in SETUPS:
            r = m.get(key)
            if r is None:
                continue
            L.append(f"| {r['label']} | {fmt(r['per_s'], 1)} ({', '.join(fmt(x, 0) for x in r['per_s_all'])}) | "
                     + " | ".join(f"{fmt(r['pages'][p]['p50_ms'], 1)} / {fmt(r['pages'][p]['p99_ms'], 1)}"
                                  for p, _ in PAGES)
                     + f" | {r['errors']} of {r['requests']:,} | {fmt(r['proxy_us_per_request'], 0)} |")
        rows = [(a, b, label) for a, b, label in RATIOS if a in m and b in m]
        if rows:
            L += ["", "| ratio | req/s | " + " | ".join(f"{p} p50" for p, _ in PAGES) + " |",
                  "|---|---:|" + "---:|" * len(PAGES)]
            for a, b, label in rows:
                ra, rb = m[a], m[b]

                def q(x, y):
                    return fmt(x / y, 2) if x and y else "—"
                L.append(f"| {label} | {q(ra['per_s'], rb['per_s'])} | "
                         + " | ".join(q(ra['pages'][p]['p50_ms'], rb['pages'][p]['p50_ms']) for p, _ in PAGES) + " |")
        errors = {}
        for s in rnd["setups"]:
            for k, v in s["errors"].items():
                errors[f"{s['label']}: {k}"] = errors.get(f"{s['label']}: {k}", 0) + v
        if errors:
            L += ["", "Failed requests: " + "; ".join(f"{k} ×{v}" for k, v in sorted(errors.items())[:20])]
        if rnd["errors"]:
            L += ["", "Errors: " + "; ".join(rnd["errors"])]
        L.append("")
    text = "\n".join(L)
    chart = None
    try:
        chart = draw_chart(raw, outdir)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    if chart:
        text += f"\n![requests per second by set-up]({chart})\n"
    (outdir / "summary.md").write_text(text)
    if charts_data:
        summary_to_charts_data(
            "django", text.replace(f"]({chart})", f"](results/{meta['run_id']}/{chart})") if chart else text)
    return text


# Through LokaDB ÷ straight, organization in the cloud: the reference was 5–10 % slower
# (shared/seed/performance-reference.txt, "Organizations that stay in the cloud": read 2,008–2,127
# against 2,239 ops/s, feed 2,830 against 3,030; RESULTS.md's overview, row "Django"). No goal is
# stated for this area.
REFERENCE_CLOUD_RATIO = (0.90, 0.95)


def draw_chart(raw: dict, outdir: Path) -> str | None:
    """django-requests.png: per RTT, each set-up's requests/s (median, whiskers the spread over
    repetitions), and through LokaDB ÷ straight for the organization in the cloud with the
    reference's 0.90–0.95 drawn."""
    rounds = [(rnd["rtt_ms"], medians(rnd)) for rnd in raw["rounds"] if rnd["setups"]]
    if not rounds:
        return None
    colors = {"cloud-1": "#8b949e", "lokadb-1": "#1f6feb", "cloud-2-fdw": "#d29922",
              "lokadb-2-fdw": "#bf8700", "lokadb-2-direct": "#2da44e"}
    fig, axes = plt.subplots(1, len(rounds), figsize=(4.2 * len(rounds) + 1, 4.2), squeeze=False)
    for ax, (rtt, m) in zip(axes[0], rounds):
        keys = [k for k, *_ in SETUPS if k in m]
        for i, k in enumerate(keys):
            r = m[k]
            lo, hi = min(r["per_s_all"]), max(r["per_s_all"])
            ax.bar(i, r["per_s"], 0.7, yerr=[[r["per_s"] - lo], [hi - r["per_s"]]], capsize=3,
                   color=colors.get(k, "#57606a"))
            ax.text(i, r["per_s"] * 0.5, f"{r['per_s']:.0f}", ha="center", fontsize=8, color="white")
        ax.set_xticks(range(len(keys)))
        ax.set_xticklabels([m[k]["label"].replace(", ", "\n") for k in keys], fontsize=7)
        ax.set_title(f"organization 2 at RTT {rtt:g} ms", fontsize=9)
        ax.set_ylabel("requests/s (median, whiskers min–max)", fontsize=8)
        if "lokadb-1" in m and "cloud-1" in m:
            ratio = m["lokadb-1"]["per_s"] / m["cloud-1"]["per_s"]
            top = max(r["per_s"] for r in m.values())
            ax.set_ylim(0, top * 1.3)
            lo, hi = REFERENCE_CLOUD_RATIO
            ax.text(0.5, top * 1.18, f"org in the cloud: LokaDB ÷ straight {ratio:.2f}\n"
                    f"(reference {lo:.2f}–{hi:.2f})", ha="center", fontsize=7)
            # The reference's figure for an organization in the cloud, over LokaDB's bar.
            straight = m["cloud-1"]["per_s"]
            ax.fill_between([0.6, 1.4], straight * lo, straight * hi, color="grey", alpha=0.35,
                            label=f"reference: {lo:.2f}–{hi:.2f} of straight")
            ax.legend(fontsize=7, loc="upper right")
    fig.suptitle(f"Django application: requests per second by set-up, "
                 f"{raw['meta']['mode_settings']['clients']} HTTP clients "
                 f"({raw['meta']['mode']} mode, run {raw['meta']['run_id']})", fontsize=9)
    fig.tight_layout()
    save_png(fig, outdir / "django-requests.png", 80)
    plt.close(fig)
    return "django-requests.png"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="RTT 0, 8 s per set-up, 1 repetition (≈ 3 min)")
    ap.add_argument("--out", type=Path, help="result folder; a trial run: charts-data.md is left alone")
    ap.add_argument("--rtts", help="comma-separated RTTs in ms (default: quick 0, full 0,40)")
    ap.add_argument("--clients", type=int, help="HTTP clients (default 16)")
    ap.add_argument("--seconds", type=float, help="measured seconds per set-up")
    ap.add_argument("--reps", type=int, help="repetitions")
    ap.add_argument("--render", type=Path, help="only rebuild summary.md from this raw.json or raw.json.gz")
    args = ap.parse_args()
    if args.render:
        return rerender(args.render, render, False)
    preflight("django_app.py", (PG_BIN / "postgres", LOKADB_BIN, AGENT_BIN, LINK_BIN, GUNICORN),
              hint="run scripts/setup.sh, `.venv/bin/pip install -r research/bench/requirements.txt` and the "
                   "cargo build in the README first")
    mode = Mode(args.quick)
    if args.rtts:
        mode.rtts_ms = parse_rtts(args.rtts, "0,40")
    for name, lo in (("clients", 1), ("seconds", 0.5), ("reps", 1)):
        v = getattr(args, name)
        if v is not None:
            if v < lo:
                sys.exit(f"--{name} {v}: must be at least {lo}")
            setattr(mode, name, v)
    started, run_id, outdir = result_dir(args.out, "-django", mode.quick)
    catch_signals()
    ctx = Ctx(mode)
    meta = run_meta("django_app.py", run_id, started, mode,
                    binaries={b.name: binary_info(b) for b in (LOKADB_BIN, AGENT_BIN, LINK_BIN)},
                    setups=[{"key": k, "label": lab, "target": t, "org": o, "profile": p}
                            for k, lab, t, o, p in SETUPS],
                    setup_commands=ctx.commands, errors=ctx.errors)
    raw = {"meta": meta, "world": None, "rounds": []}

    def body():
        ctx.tmp = temp_dir("lokadb-django-bench-")
        prepare_tunnel(ctx, ORG)
        log(f"mode={mode.name} RTTs={mode.rtts_ms} ms clients={mode.clients} out={outdir}")
        raw["world"] = build_world(ctx)
        return run_rounds(ctx, raw, outdir, rtt_round)

    return guarded_run(ctx, raw, outdir, render, not args.out, body,
                       binaries=(LOKADB_BIN, AGENT_BIN, LINK_BIN))

if __name__ == "__main__":
    sys.exit(main())
