"""A PostgreSQL database for tests, found or made, never silently skipped.

Order: TEST_DATABASE_URL; else the server on 127.0.0.1:5432 (a fresh database per test run);
else a throwaway cluster from the local PostgreSQL binaries (run as the `postgres` user, since
initdb and pg_ctl refuse root); else fail with what to install.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg

from devtools.launch import free_port

LOCAL_SERVER = "postgresql://postgres@127.0.0.1:5432/postgres"
INSTALL_HINT = (
    "PostgreSQL is required for the postgres-marked tests: set TEST_DATABASE_URL, run a server "
    "on 127.0.0.1:5432 (user postgres, trust auth), or install the server binaries "
    "(apt-get install postgresql) so a throwaway cluster can be started"
)


def _as_sqlalchemy(url: str) -> str:
    return url.replace("postgresql://", "postgresql+psycopg://", 1)


def _reachable(url: str) -> bool:
    try:
        with psycopg.connect(url, connect_timeout=3):
            return True
    except psycopg.Error:
        return False


@contextlib.contextmanager
def _fresh_database(server_url: str) -> Iterator[str]:
    name = f"fedllm_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield _as_sqlalchemy(server_url.rsplit("/", 1)[0] + f"/{name}")
    finally:
        with psycopg.connect(server_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _run_as_postgres(args: list[str]) -> None:
    if os.geteuid() == 0:
        args = ["runuser", "-u", "postgres", "--", *args]
    subprocess.run(args, check=True, capture_output=True, timeout=120)


@contextlib.contextmanager
def _throwaway_cluster() -> Iterator[str]:
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    initdb = shutil.which("initdb") or (candidates[-1] if candidates else None)
    if initdb is None:
        raise RuntimeError(INSTALL_HINT)
    bin_dir = Path(initdb).parent
    root = Path(tempfile.mkdtemp(prefix="fedllm-pg-"))
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
    data, port = root / "data", free_port()
    _run_as_postgres([str(bin_dir / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust"])
    options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1"
    _run_as_postgres([str(bin_dir / "pg_ctl"), "-D", str(data), "-o", options, "-w", "start"])
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        _run_as_postgres([str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"])
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def postgres_database() -> Iterator[str]:
    """Yields a SQLAlchemy URL (postgresql+psycopg) of an empty database."""
    explicit = os.environ.get("TEST_DATABASE_URL")
    if explicit:
        yield _as_sqlalchemy(explicit)
        return
    if _reachable(LOCAL_SERVER):
        with _fresh_database(LOCAL_SERVER) as url:
            yield url
        return
    with _throwaway_cluster() as server, _fresh_database(server) as url:
        yield url
