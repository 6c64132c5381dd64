#!/bin/sh
# Make PostgreSQL's server binaries available for tests/service/test_postgres.py
# (the service's state on PostgreSQL), from the distribution's packages. The
# test starts its own throwaway server; nothing is left running. Quiet, and
# never fails the caller: without the binaries that test skips and says why.
#
#   sh infra/ensure-postgres.sh        # `make test` calls it before the suite

have_postgres() {
    ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null 2>&1
}

have_postgres && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure-postgres: no PostgreSQL server here and cannot install one (needs root and apt-get); its test will skip" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
log="${TMPDIR:-/tmp}/ensure-postgres.log"
if ! apt-get install -y -qq postgresql >"$log" 2>&1; then
    apt-get update -qq >>"$log" 2>&1 && apt-get install -y -qq postgresql >>"$log" 2>&1
fi
have_postgres && echo "ensure-postgres: installed PostgreSQL server binaries" || \
    echo "ensure-postgres: could not install postgresql (see $log); its test will skip" >&2
exit 0
