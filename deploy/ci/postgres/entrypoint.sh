#!/bin/sh
# First start: initdb with the official image's variables; then run postgres on every interface.
set -eu
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  : "${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD}"
  user="${POSTGRES_USER:-postgres}"
  pwfile=$(mktemp)
  printf '%s' "$POSTGRES_PASSWORD" > "$pwfile"
  initdb -D "$PGDATA" -U "$user" -E UTF8 --locale=C.UTF-8 --pwfile="$pwfile" --auth-local=trust --auth-host=scram-sha-256 >/dev/null
  rm -f "$pwfile"
  echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
  db="${POSTGRES_DB:-$user}"
  if [ "$db" != "postgres" ]; then
    postgres -D "$PGDATA" -c listen_addresses='' &
    pid=$!
    until pg_isready -q -h /var/run/postgresql; do sleep 0.2; done
    psql -h /var/run/postgresql -U "$user" -d postgres -qc "CREATE DATABASE \"$db\""
    kill -INT "$pid"; wait "$pid" || true
  fi
fi
if [ "${1:-}" = "postgres" ]; then
  shift
  exec postgres -D "$PGDATA" -c listen_addresses='*' "$@"
fi
exec "$@"
