"""A real PostgreSQL server for the tests and the chaos soak (bench/reliability.py): made in
a temporary directory, run as the user the caller runs as (as root: the `postgres` system user,
since the server refuses root), on 127.0.0.1 at a free port, with a password; stopped and
removed when the block ends, also when it fails."""
from __future__ import annotations

import datetime as dt
import glob
import ipaddress
import os
import secrets
import shutil
import subprocess
import tempfile

from support.ports import free_port

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


AUTH_METHODS = ("scram-sha-256", "password", "md5")  # pg_hba.conf's, for connections over TCP


class PostgresServer:
    """`with PostgresServer(tls=True) as pg:` pg.url (postgresql://linkpass@127.0.0.1:PORT/linkpass),
    pg.password_file (mode 0600, root's) and pg.ca_file: the server speaks TLS with a certificate
    for `cert_names` (default 127.0.0.1 and localhost) from a CA made here. pg.settings: the
    coordinator's settings that reach it. Without `tls` the server has no TLS at all (ssl = off).
    `auth`: the pg_hba.conf method of connections over TCP (scram-sha-256; password asks for the
    password in cleartext, md5 for its MD5 hash, the password then stored as MD5)."""

    def __init__(self, tls: bool = False, auth: str = "scram-sha-256", cert_names=("127.0.0.1", "localhost")):
        if auth not in AUTH_METHODS:
            raise ValueError(f"auth: one of {', '.join(AUTH_METHODS)}, not {auth!r}")
        self.dir = None
        self.port = free_port()
        self.tls = tls
        self.auth = auth
        self.cert_names = tuple(cert_names)
        self.ca_file = None

    @property
    def settings(self) -> dict:
        """The coordinator's store settings for this server: over TLS verified with its CA, or for a
        server without TLS, the plaintext asked for by name."""
        s = {"store": self.url, "store_password_file": self.password_file}
        return {**s, "store_tls_ca_file": self.ca_file} if self.tls else {**s, "store_insecure_plaintext": True}

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
                              "--auth-local=scram-sha-256", f"--auth-host={self.auth}", "-E", "UTF8")
            os.unlink(pw_for_initdb)
            if self.tls:
                self._make_certificate(data)
            self._start()
            self.password_file = os.path.join(self.dir, "password")
            with open(os.open(self.password_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
                f.write(password + "\n")
            self.url = f"postgresql://{USER}@127.0.0.1:{self.port}/postgres"
            self._sql(f"CREATE DATABASE {DATABASE}")
            if self.auth == "md5":  # stored as SCRAM, md5 in pg_hba.conf would still ask for SCRAM
                self._sql("SET password_encryption = 'md5'", f"ALTER ROLE {USER} PASSWORD '{password}'")
            self.url = f"postgresql://{USER}@127.0.0.1:{self.port}/{DATABASE}"
        except BaseException:
            self.__exit__()
            raise
        return self

    def _sql(self, *statements: str) -> None:
        """Statements run by the test harness itself, in one session (pg8000 as it comes: TLS
        unverified when offered, any password method; never the coordinator's store)."""
        import pg8000.dbapi

        with open(self.password_file) as f:
            password = f.read().strip()
        conn = pg8000.dbapi.connect(user=USER, password=password, host="127.0.0.1", port=self.port,
                                    database=self.url.rsplit("/", 1)[1], timeout=30)
        conn.autocommit = True
        try:
            for statement in statements:
                conn.cursor().execute(statement)
        finally:
            conn.close()

    def _make_certificate(self, data: str) -> None:
        """A CA (ca.crt, pg.ca_file) and the server's certificate from it for `cert_names`, in the
        data directory as server.crt and server.key."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        now = dt.datetime.now(dt.timezone.utc)

        def cert(subject: str, key, issuer: str, signer, ca: bool):
            b = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                 .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
                 .public_key(key.public_key()).serial_number(x509.random_serial_number())
                 .not_valid_before(now - dt.timedelta(hours=1)).not_valid_after(now + dt.timedelta(days=1))
                 .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
            if ca:
                b = b.add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                  content_commitment=False, key_encipherment=False,
                                                  data_encipherment=False, key_agreement=False,
                                                  encipher_only=False, decipher_only=False), critical=True)
            else:
                names = []
                for n in self.cert_names:
                    try:
                        names.append(x509.IPAddress(ipaddress.ip_address(n)))
                    except ValueError:
                        names.append(x509.DNSName(n))
                b = (b.add_extension(x509.SubjectAlternativeName(names), critical=False)
                     .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False))
            return b.sign(signer, hashes.SHA256())

        ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
        ca_cert = cert("linkpass test PostgreSQL CA", ca_key, "linkpass test PostgreSQL CA", ca_key, ca=True)
        server_cert = cert(self.cert_names[0], key, "linkpass test PostgreSQL CA", ca_key, ca=False)
        self.ca_file = os.path.join(self.dir, "ca.crt")
        with open(self.ca_file, "wb") as f:
            f.write(ca_cert.public_bytes(serialization.Encoding.PEM))
        pem = {"server.crt": server_cert.public_bytes(serialization.Encoding.PEM),
               "server.key": key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption())}
        for name, content in pem.items():
            path = os.path.join(data, name)
            with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
                f.write(content)
            _give(path, "postgres")

    def _start(self) -> None:
        options = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {os.path.join(self.dir, 'sock')} -c fsync=off"
        options += " -c ssl=on" if self.tls else " -c ssl=off"  # on: server.crt and server.key in the data directory
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
