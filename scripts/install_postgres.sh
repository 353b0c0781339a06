#!/usr/bin/env bash
# Install PostgreSQL from Debian's packages, for the test of an MLflow tracking server backed by
# it (tests/test_tracking.py, which starts its own cluster with initdb and pg_ctl,
# tests/postgres_server.py; scripts/apt_install.sh: when it does nothing, and why).
# psycopg2-binary, MLflow's driver for it, is in the dev extra.
set -u
source "$(dirname "$0")/apt_install.sh"
apt_install install_postgres "the PostgreSQL test" 'have initdb || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1' postgresql
