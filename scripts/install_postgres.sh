#!/usr/bin/env bash
# Install PostgreSQL from the distribution's packages, for the test of an MLflow tracking server
# backed by it (tests/test_tracking.py, which starts its own cluster with initdb and pg_ctl,
# tests/postgres_server.py). psycopg2-binary, MLflow's driver for it, is in the dev extra.
#
# Idempotent and never fatal: when the tools are already there, when we are not root, or when
# apt-get is missing, it says why it did nothing and exits 0, and the test then skips with the
# exact reason. Only the package is installed; no cluster is started or enabled.
set -u

if command -v initdb >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
    echo "install_postgres: postgresql already installed"
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "install_postgres: not root, not installing postgresql; the PostgreSQL test will skip"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_postgres: no apt-get on this machine; the PostgreSQL test will skip"
    exit 0
fi

echo "install_postgres: installing postgresql"
export DEBIAN_FRONTEND=noninteractive
log=/tmp/install_postgres.$$.log
if ! apt-get install -y --no-install-recommends postgresql >"$log" 2>&1; then
    # A stale package index is the usual cause; refresh it once and retry.
    apt-get update >>"$log" 2>&1
    if ! apt-get install -y --no-install-recommends postgresql >>"$log" 2>&1; then
        echo "install_postgres: apt-get install failed (log: $log); the PostgreSQL test will skip"
        exit 0
    fi
fi
rm -f "$log"
echo "install_postgres: installed $(dpkg-query -W -f='postgresql ${Version}' postgresql 2>/dev/null)"
