"""A real PostgreSQL server for the tests: made in a temporary directory, run as the user the
tests run as (as root: the `postgres` system user, since the server refuses root), on 127.0.0.1
at a free port, with a password; stopped and removed when the block ends, also when it fails."""
from __future__ import annotations

import glob
import os
import secrets
import shutil
import subprocess
import tempfile

from helpers import free_port

USER, DATABASE = "linkpass", "linkpass"


def _give(path: str, owner: str) -> None:
    """Make the server's user the owner (only root has to: otherwise the server runs as us)."""
    if os.geteuid() == 0:
        shutil.chown(path, owner)


def _bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), key=lambda p: int(p.split("/")[4]))
    if not found:
        raise RuntimeError(f"{name}: no PostgreSQL server here; deploy/install-test-deps.sh installs it (postgresql)")
    return found[-1]


class PostgresServer:
    """`with PostgresServer() as pg:` pg.url (postgresql://linkpass@127.0.0.1:PORT/linkpass) and
    pg.password_file (mode 0600, root's). `tls=True`: the server also speaks TLS, with a
    certificate for 127.0.0.1 from a lab CA made here (pg.ca_file)."""

    def __init__(self, tls: bool = False):
        self.dir = None
        self.port = free_port()
        self.tls = tls
        self.ca_file = None

    def _as_postgres(self, *cmd: str) -> None:
        runas = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        done = subprocess.run([*runas, *cmd], cwd="/", capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[:2])} exited {done.returncode}: {done.stderr.strip()[-1500:]}\n"
                               f"{self.log()}")

    def __enter__(self) -> "PostgresServer":
        self.dir = tempfile.mkdtemp(prefix="lp-pg-")
        try:
            password = secrets.token_hex(16)
            _give(self.dir, "postgres")  # initdb makes the data directory in it
            pw_for_initdb = os.path.join(self.dir, "initdb.pw")
            with open(pw_for_initdb, "w") as f:
                f.write(password + "\n")
            _give(pw_for_initdb, "postgres")
            os.chmod(pw_for_initdb, 0o600)
            data, sock = os.path.join(self.dir, "data"), os.path.join(self.dir, "sock")
            os.mkdir(sock)
            _give(sock, "postgres")
            self._as_postgres(_bin("initdb"), "-D", data, "-U", USER, f"--pwfile={pw_for_initdb}",
                              "--auth=scram-sha-256", "-E", "UTF8")
            os.unlink(pw_for_initdb)
            if self.tls:
                self._make_certificate(data)
            self._start()
            self.password_file = os.path.join(self.dir, "password")
            with open(os.open(self.password_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
                f.write(password + "\n")
            self.url = f"postgresql://{USER}@127.0.0.1:{self.port}/postgres"
            self._sql(f"CREATE DATABASE {DATABASE}")
            self.url = f"postgresql://{USER}@127.0.0.1:{self.port}/{DATABASE}"
        except BaseException:
            self.__exit__()
            raise
        return self

    def _sql(self, statement: str) -> None:
        import pg8000.dbapi

        with open(self.password_file) as f:
            password = f.read().strip()
        conn = pg8000.dbapi.connect(user=USER, password=password, host="127.0.0.1", port=self.port,
                                    database=self.url.rsplit("/", 1)[1])
        conn.autocommit = True
        try:
            conn.cursor().execute(statement)
        finally:
            conn.close()

    def _make_certificate(self, data: str) -> None:
        from linkpass.coordinator import lab_ca
        from linkpass.coordinator.tls import SERVER, lab_paths

        ca_dir = os.path.join(self.dir, "ca")
        lab_ca.ensure(ca_dir, sans=["127.0.0.1"])
        self.ca_file = lab_paths(ca_dir, "ca")[0]
        for src, dst in zip(lab_paths(ca_dir, SERVER), ("server.crt", "server.key")):
            shutil.copyfile(src, os.path.join(data, dst))
            _give(os.path.join(data, dst), "postgres")
            os.chmod(os.path.join(data, dst), 0o600)

    def _start(self) -> None:
        options = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {os.path.join(self.dir, 'sock')} -c fsync=off"
        if self.tls:
            options += " -c ssl=on"  # server.crt and server.key in the data directory
        self._as_postgres(_bin("pg_ctl"), "-D", os.path.join(self.dir, "data"), "-l",
                          os.path.join(self.dir, "server.log"), "-w", "-o", options, "start")

    def restart(self) -> None:
        """Stop the server at once (every connection dropped) and start it again."""
        self._as_postgres(_bin("pg_ctl"), "-D", os.path.join(self.dir, "data"), "-m", "immediate", "-w", "stop")
        self._start()

    def log(self) -> str:
        try:
            with open(os.path.join(self.dir, "server.log")) as f:
                return f.read()[-3000:]
        except OSError:
            return ""

    def __exit__(self, *exc) -> None:
        if self.dir is None:
            return
        data = os.path.join(self.dir, "data")
        if os.path.exists(os.path.join(data, "postmaster.pid")):
            try:
                self._as_postgres(_bin("pg_ctl"), "-D", data, "-m", "immediate", "-w", "stop")
            except RuntimeError:
                pass  # not running (it failed to start): nothing to stop
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir = None
