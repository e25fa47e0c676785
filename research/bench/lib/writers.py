"""Writers: threads inserting documents and versions of organizations 1 and 2 on the cloud,
every transaction's end, outcome and latency kept (moves.py, enable.py)."""

from __future__ import annotations

import math
import threading
import time

import psycopg

from .clusters import PgCluster
from .numbers import percentile


class Writers:
    """n threads, each its own cloud connection: BEGIN; INSERT a document of organization 1 or 2
    (alternately); INSERT a version of it; COMMIT. Every transaction's end time, org, outcome,
    latency is kept."""

    def __init__(self, cloud: PgCluster, n: int, tag: str):
        self.cloud, self.n, self.tag = cloud, n, tag
        self.stop = threading.Event()
        self.events: list[tuple] = []  # (t_end monotonic, org, ok, latency s, sqlstate/None)
        self.messages: dict[str, str] = {}
        self.threads = [threading.Thread(target=self._run, args=(w,), daemon=True) for w in range(n)]
        self.reconnects = 0

    def start(self):
        for t in self.threads:
            t.start()

    def _connect(self):
        return self.cloud.conn("app", autocommit=False)

    def _run(self, w: int):
        conn = None
        i = 0
        while not self.stop.is_set():
            if conn is None or conn.closed:
                try:
                    conn = self._connect()
                except psycopg.Error as e:
                    self._err(0, "connect", e, 0.0, time.monotonic())
                    time.sleep(0.2)
                    continue
            i += 1
            org = 1 + (i + w) % 2
            t0 = time.monotonic()
            try:
                cur = conn.execute(
                    "INSERT INTO documents (organization_id, project_id, title) VALUES (%s, %s, %s) RETURNING id",
                    (org, org * 10, f"{self.tag} w{w} {i}"))
                doc = cur.fetchone()[0]
                conn.execute(
                    "INSERT INTO document_versions (organization_id, document_id, body) VALUES (%s, %s, 'new')",
                    (org, doc))
                conn.commit()
                t1 = time.monotonic()
                self.events.append((t1, org, True, t1 - t0, None))
            except psycopg.Error as e:
                t1 = time.monotonic()
                self._err(org, e.sqlstate or type(e).__name__, e, t1 - t0, t1)
                try:
                    conn.rollback()
                except psycopg.Error:
                    pass
                if conn.closed or conn.broken:
                    self.reconnects += 1
                    try:
                        conn.close()
                    except psycopg.Error:
                        pass
                    conn = None
        if conn is not None:
            try:
                conn.close()
            except psycopg.Error:
                pass

    def _err(self, org, code, e, lat, t1):
        self.events.append((t1, org, False, lat, code))
        key = f"org {org}: {code}"
        if key not in self.messages:
            self.messages[key] = str(e).strip().splitlines()[0][:300] if str(e).strip() else repr(e)

    def finish(self):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)

    def tally(self, t_move0: float, t_move1: float, t_start: float, t_stop: float) -> dict:
        ev = sorted(self.events)
        ok = {1: 0, 2: 0}
        errors: dict[str, int] = {}
        for t, org, good, lat, code in ev:
            if good:
                ok[org] += 1
            else:
                k = f"org {org}: {code}"
                errors[k] = errors.get(k, 0) + 1

        def rate(a, b, org=None):
            if b <= a:
                return None
            n = sum(1 for t, o, good, _, _ in ev if good and a <= t < b and (org is None or o == org))
            return n / (b - a)

        def lat_stats(a, b, org):
            # transactions that ended during [a, b] or were in flight across it
            ls = sorted(lat for t, o, good, lat, _ in ev if good and o == org and t >= a and t - lat <= b)
            return {"n": len(ls), "max_ms": round(ls[-1] * 1e3, 1) if ls else None,
                    "p50_ms": round(percentile(ls, 0.5) * 1e3, 2) if ls else None,
                    "p99_ms": round(percentile(ls, 0.99) * 1e3, 1) if ls else None}

        b0 = t_start + 1.0  # the writers' first second (connecting) is left out
        out = {
            "writers": self.n, "ok": {str(k): v for k, v in ok.items()}, "errors": errors,
            "error_messages": self.messages, "reconnects": self.reconnects,
            "rate": {
                "before": {"all": rate(b0, t_move0), "org1": rate(b0, t_move0, 1), "org2": rate(b0, t_move0, 2)},
                "during": {"all": rate(t_move0, t_move1), "org1": rate(t_move0, t_move1, 1),
                           "org2": rate(t_move0, t_move1, 2)},
                "after": {"all": rate(t_move1, t_stop), "org1": rate(t_move1, t_stop, 1),
                          "org2": rate(t_move1, t_stop, 2)},
            },
            "latency_during_move": {"org1": lat_stats(t_move0, t_move1, 1), "org2": lat_stats(t_move0, t_move1, 2)},
            "latency_before": {"org1": lat_stats(b0, t_move0, 1), "org2": lat_stats(b0, t_move0, 2)},
            "latency_after": {"org1": lat_stats(t_move1, t_stop, 1), "org2": lat_stats(t_move1, t_stop, 2)},
            "windows_s": {"before": round(t_move0 - b0, 2), "during": round(t_move1 - t_move0, 2),
                          "after": round(t_stop - t_move1, 2)},
        }
        # Per-second successes per organization, seconds relative to the move's start.
        lo = math.floor(t_start - t_move0)
        hi = math.ceil(t_stop - t_move0)
        series = {"t": list(range(lo, hi)), "org1": [0] * (hi - lo), "org2": [0] * (hi - lo),
                  "errors": [0] * (hi - lo)}
        for t, org, good, _, _ in ev:
            k = math.floor(t - t_move0) - lo
            if 0 <= k < hi - lo:
                if good:
                    series[f"org{org}" if org in (1, 2) else "org1"][k] += 1
                else:
                    series["errors"][k] += 1
        out["per_second"] = series
        # The longest org-2 transaction and when it ended (relative to the move's start).
        l2 = [(lat, t) for t, o, good, lat, _ in ev if o == 2]
        if l2:
            lat, t = max(l2)
            out["longest_org2"] = {"ms": round(lat * 1e3, 1), "ended_at_s": round(t - t_move0, 2)}
        l1 = [(lat, t) for t, o, good, lat, _ in ev if o == 1]
        if l1:
            lat, t = max(l1)
            out["longest_org1"] = {"ms": round(lat * 1e3, 1), "ended_at_s": round(t - t_move0, 2)}
        return out
