#!/bin/sh
# As the official image does without a config file: listen on every interface, protected mode off.
set -eu
if [ "${1:-}" = "redis-server" ]; then
  shift
  exec redis-server --bind '*' --protected-mode no --dir /tmp "$@"
fi
exec "$@"
