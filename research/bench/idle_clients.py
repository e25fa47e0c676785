"""RSS of a running proxy with N idle authenticated clients (a quick A/B between builds).

Usage: .venv/bin/python research/bench/idle_clients.py "DSN through the proxy" N PROXY_PID [autocommit]

Opens N psycopg connections from 10 threads (each runs SELECT 1; in a transaction left open, or
with `autocommit` on its own, as a client of a transaction-pooling proxy that holds no backend
between its statements), waits 0.5 s, prints the
proxy's VmRSS before and with them and the difference per client, then closes them. The full
suite (run.py) measures the same with 1000 clients as part of a run.
"""
import sys
import threading
import time

import psycopg


def rss_kib(pid: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def main() -> int:
    if len(sys.argv) not in (4, 5) or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        return 0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2
    dsn, n, pid = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    autocommit = sys.argv[4:] == ["autocommit"]
    before = rss_kib(pid)
    conns = []
    lock = threading.Lock()

    def opener(k):
        for _ in range(k):
            c = psycopg.connect(dsn, autocommit=autocommit)
            c.execute("SELECT 1")
            with lock:
                conns.append(c)

    threads = [threading.Thread(target=opener, args=(n // 10,)) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(0.5)
    with_clients = rss_kib(pid)
    print(f"rss before {before} KiB, with {len(conns)} clients {with_clients} KiB, "
          f"per client {(with_clients - before) / len(conns):.1f} KiB")
    for c in conns:
        c.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
