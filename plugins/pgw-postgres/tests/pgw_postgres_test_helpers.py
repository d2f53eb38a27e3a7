"""Helpers of the pgw-postgres suite: databases of its own, a PostgreSQL server of its own.

Same rule as the repository's other suites: a missing service skips the test, unless
``PGW_REQUIRE_SERVICES=1`` (CI), which turns the skip into a failure.
"""

from __future__ import annotations

import asyncio
import glob
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import asyncpg
from polygateway.testing.services import free_port, reachable
from polygateway.testing.services import missing as shared_missing

__all__ = ["free_port", "reachable"]

MACHINE_HOST, MACHINE_PORT = "127.0.0.1", 5432
MACHINE_ADMIN = f"postgresql://postgres@{MACHINE_HOST}:{MACHINE_PORT}/postgres"
OWN_USER, OWN_PASSWORD = "pgw", "s3cret-Pa55word"
MESSAGES = [{"role": "user", "content": "hello"}]


def services_required() -> bool:
    return os.environ.get("PGW_REQUIRE_SERVICES") == "1"


def missing(message: str) -> NoReturn:
    shared_missing(message, required=services_required())


async def admin_execute(admin_dsn: str, sql: str) -> None:
    conn = await asyncpg.connect(admin_dsn, timeout=10)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def new_database(admin_dsn: str) -> str:
    """A fresh database on the server of ``admin_dsn``; its name."""
    name = f"pgw_test_{uuid.uuid4().hex[:12]}"
    asyncio.run(admin_execute(admin_dsn, f'CREATE DATABASE "{name}"'))
    return name


def drop_database(admin_dsn: str, name: str) -> None:
    asyncio.run(admin_execute(admin_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def with_database(dsn: str, name: str) -> str:
    return f"{dsn.rsplit('/', 1)[0]}/{name}"


async def fetch_rows(dsn: str, table: str = "pgw_calls") -> list[dict[str, Any]]:
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        return [dict(r) for r in await conn.fetch(f"SELECT * FROM {table} ORDER BY created_at")]
    finally:
        await conn.close()


async def count_rows(dsn: str, table: str = "pgw_calls") -> int:
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        return int(await conn.fetchval(f"SELECT count(*) FROM {table}"))
    finally:
        await conn.close()


async def wait_until(
    condition: Callable[[], Awaitable[bool]], *, timeout_s: float = 20.0, what: str = ""
) -> None:
    """Poll ``condition`` (a real state: rows, locks, counters) until true or fail."""
    deadline = time.monotonic() + timeout_s
    while not await condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or condition}")
        await asyncio.sleep(0.01)


# --------------------------------------------------------------------------- a server of our own


def _binaries_dir() -> str | None:
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"),
        key=lambda p: [int(x) for x in Path(p).parts[-3].split(".") if x.isdigit()],
    )
    if found:
        return str(Path(found[-1]).parent)
    pg_ctl = shutil.which("pg_ctl")
    return str(Path(pg_ctl).parent) if pg_ctl else None


@dataclass
class PostgresServer:
    """A PostgreSQL cluster this suite runs itself on a spare port (password login on TCP).

    ``initdb`` refuses to run as root: as root, the cluster belongs to the ``postgres`` user.
    Durability is off (fsync, synchronous commit): it only lives for the test session.
    """

    port: int = field(default_factory=free_port)
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="pgw-pg-")))

    def __post_init__(self) -> None:
        bindir = _binaries_dir()
        if bindir is None:
            missing("PostgreSQL server binaries (initdb, pg_ctl) are not installed")
        self.bindir = str(bindir)
        self.data = self.workdir / "data"
        self.log = self.workdir / "server.log"

    @property
    def admin_dsn(self) -> str:
        return self.dsn("postgres")

    def dsn(self, database: str, *, user: str = OWN_USER, password: str = OWN_PASSWORD) -> str:
        return f"postgresql://{user}:{password}@127.0.0.1:{self.port}/{database}"

    def _run(self, *args: str, timeout: float = 120) -> None:
        command = [os.path.join(self.bindir, args[0]), *args[1:]]
        if os.geteuid() == 0:
            command = ["runuser", "-u", "postgres", "--", *command]
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            log = self.log.read_text() if self.log.exists() else ""
            raise RuntimeError(f"{args[0]} failed: {result.stderr}{result.stdout}\n{log}")

    def init(self) -> None:
        password_file = self.workdir / "password"
        password_file.write_text(OWN_PASSWORD + "\n")
        if os.geteuid() == 0:
            shutil.chown(self.workdir, "postgres")
            shutil.chown(password_file, "postgres")
        self._run(
            "initdb", "-D", str(self.data), "-U", OWN_USER, "-E", "UTF8", "--no-sync",
            "--auth-local=trust", "--auth-host=scram-sha-256", f"--pwfile={password_file}",
        )  # fmt: skip

    def start(self) -> None:
        options = (
            f"-p {self.port} -k {self.workdir} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c synchronous_commit=off -c full_page_writes=off"
        )
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "start")

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def destroy(self) -> None:
        try:
            if (self.data / "postmaster.pid").exists():
                self.stop()
        finally:
            shutil.rmtree(self.workdir, ignore_errors=True)
