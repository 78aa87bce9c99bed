"""The coordinator's store settings: a bad store URL is refused by name and never echoes a
password, the URL's parts and the password file, the plaintext setting, and a file that is not a
database."""
from __future__ import annotations

import pytest

from linkpass.coordinator.store import Store, StoreError, open_store, parse_postgres_url


@pytest.mark.parametrize("url, says", [
    ("postgres://u@h/db", "not a postgresql:// URL"),
    ("postgresql://u:secret@h/db", "carries a password"),
    ("postgresql://h/db", "needs a user, a host and a database"),
    ("postgresql://u@h/", "needs a user, a host and a database"),
    ("postgresql://u@h/db?sslmode=require", "needs a user, a host and a database"),
    ("postgresql://u@h:99999/db", "port that is not a number"),
])
def test_a_bad_store_url_is_refused_by_name_and_never_echoes_a_password(url, says):
    with pytest.raises(StoreError, match=says) as err:
        parse_postgres_url(url)
    assert str(err.value).startswith("store:") and "secret" not in str(err.value)


def test_the_store_url_s_parts_and_the_password_file(tmp_path):
    assert parse_postgres_url("postgresql://link%20pass@db.example:6543/fleet") == {
        "user": "link pass", "host": "db.example", "port": 6543, "database": "fleet"}
    assert parse_postgres_url("postgresql://u@h/db")["port"] == 5432
    with pytest.raises(StoreError, match="store_password_file: .*/nope: No such file"):
        open_store("postgresql://u@127.0.0.1:1/db", str(tmp_path / "nope"), str(tmp_path))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(StoreError, match="store_password_file: .* is empty"):
        open_store("postgresql://u@127.0.0.1:1/db", str(tmp_path / "empty"), str(tmp_path))
    (tmp_path / "pw").write_text("x\n")
    with pytest.raises(StoreError, match="cannot connect to the coordinator's PostgreSQL store"):
        open_store("postgresql://u@127.0.0.1:1/db", str(tmp_path / "pw"), str(tmp_path))
    assert isinstance(open_store(None, None, str(tmp_path / "st")), Store)


@pytest.mark.parametrize("settings, says", [
    ({"store_insecure_plaintext": True}, "settings.store_insecure_plaintext: only with settings.store"),
    ({"store": "postgresql://u@h/db", "store_insecure_plaintext": "yes"},
     "settings.store_insecure_plaintext: expected true or false"),
    ({"store": "postgresql://u@h/db", "store_insecure_plaintext": True, "store_tls_ca_file": "/ca.crt"},
     "settings.store_tls_ca_file: not used with settings.store_insecure_plaintext"),
])
def test_the_plaintext_setting_is_checked_by_name(settings, says):
    from linkpass.control.errors import CoordinatorError
    from linkpass.coordinator.startup import check_settings

    with pytest.raises(CoordinatorError, match=says):
        check_settings(settings)


def test_a_file_that_is_not_a_database_is_refused_with_what_to_do(tmp_path):
    bad = tmp_path / "coordinator.db"
    bad.write_bytes(b"SQLite format 3\x00" + bytes(range(256)) * 16)
    with pytest.raises(StoreError, match="cannot open the coordinator database .*move it aside"):
        Store(str(bad))
    assert bad.read_bytes()[:16] == b"SQLite format 3\x00"  # left as it was, for whoever restores it
