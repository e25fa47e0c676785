#!/bin/sh
# The cost in the cloud of LokaDB's row triggers per inserted row: 10,000 rows inserted
# into documents (one INSERT ... SELECT, so client round trips do not count), side by side:
#   plain    the table before `lokadb enable` (native PK and FKs)
#   default  after enable, a cloud organization (DEFAULT partition: native PK/FKs + gate + key map)
#   moved    after enable, organization 2 in a partition of its own (a local table standing in for
#            a foreign one, so the organization's round trips do not count): gate + key map +
#            parent checks of 2 foreign keys (organizations, projects) + their refs
# Each case runs R times in alternation (rows deleted between runs, not timed); prints µs/row.
# Usage, as root from the repo root: research/bench/constraints.sh [R]   (needs .pg/bin and a
# built lokadb: LOKADB=target/release/lokadb by default; user lokadb-pg from scripts/setup.sh)
set -eu
R=${1:-5}
N=10000
LOKADB=${LOKADB:-target/release/lokadb}
PGBIN=$(pwd)/.pg/bin
D=$(mktemp -d /tmp/lokadb-constraints.XXXXXX)
chown lokadb-pg "$D"
PORT=55432
su -s /bin/sh lokadb-pg -c "$PGBIN/initdb -D $D/data -U postgres >/dev/null 2>&1 && $PGBIN/pg_ctl -D $D/data -o '-p $PORT -k $D -c listen_addresses= -c synchronous_commit=off' -l $D/log start >/dev/null"
trap 'su -s /bin/sh lokadb-pg -c "$PGBIN/pg_ctl -D $D/data stop -m fast >/dev/null"; rm -rf "$D"' EXIT
P="$PGBIN/psql -h $D -p $PORT -U postgres -X -q -At -v ON_ERROR_STOP=1"
$P -c "CREATE DATABASE plain" postgres
$P -c "CREATE DATABASE app" postgres
SCHEMA="
CREATE TABLE organizations (id bigint PRIMARY KEY);
CREATE TABLE projects (id bigint PRIMARY KEY, organization_id bigint REFERENCES organizations);
CREATE TABLE documents (id bigserial PRIMARY KEY, organization_id bigint NOT NULL REFERENCES organizations,
    project_id bigint REFERENCES projects ON DELETE CASCADE, title text, UNIQUE (organization_id, title));
INSERT INTO organizations VALUES (1), (2);
INSERT INTO projects VALUES (10, 1), (20, 2);"
echo "$SCHEMA" | $P plain
echo "$SCHEMA" | $P app
$LOKADB init --cloud "host=$D port=$PORT user=postgres dbname=app" >/dev/null
$LOKADB enable documents --cloud "host=$D port=$PORT user=postgres dbname=app" >/dev/null
$P app -c "CREATE TABLE documents_org2 (LIKE documents__lokadb_default INCLUDING DEFAULTS);
           ALTER TABLE documents ATTACH PARTITION documents_org2 FOR VALUES IN (2);"
run() { # db org
    $P "$1" -c "DELETE FROM documents" >/dev/null
    $P "$1" -c "VACUUM documents" >/dev/null 2>&1 || true
    $P "$1" <<SQL | sed -n 's/^Time: \([0-9.]*\) ms.*/\1/p'
\timing on
INSERT INTO documents (organization_id, project_id, title) SELECT $2, ${2}0, 't' || g FROM generate_series(1, $N) g;
SQL
}
for i in $(seq "$R"); do
    a=$(run plain 1); b=$(run app 1); c=$(run app 2)
    echo "run $i: plain $a ms, default $b ms, moved $c ms"
    echo "$a $b $c" >> "$D/times"
done
sort -n -k1 "$D/times" >/dev/null
awk -v n=$N -v r="$R" '{a[NR]=$1; b[NR]=$2; c[NR]=$3}
  function med(x,   i,j,t,k){k=0; for(i in x)k++; for(i=1;i<=k;i++)for(j=i+1;j<=k;j++)if(x[j]<x[i]){t=x[i];x[i]=x[j];x[j]=t}; return x[int((k+1)/2)]}
  END {pa=med(a); pb=med(b); pc=med(c);
       printf "median of %d runs, µs per row: plain %.1f, default %.1f (+%.1f), moved %.1f (+%.1f over plain, +%.1f over default)\n",
              r, pa*1000/n, pb*1000/n, (pb-pa)*1000/n, pc*1000/n, (pc-pa)*1000/n, (pc-pb)*1000/n}' "$D/times"
