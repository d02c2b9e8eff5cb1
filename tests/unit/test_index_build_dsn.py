"""The concurrent build's own connection lifts the role's timeouts after the DSN's own
start-up options (relay/index_build.build_dsn), without dropping them."""

from __future__ import annotations

import pytest
from psycopg.conninfo import conninfo_to_dict

from relay.index_build import BUILD_OPTIONS, build_dsn


def test_a_dsn_without_options_gets_the_build_options(monkeypatch):
    monkeypatch.delenv("PGOPTIONS", raising=False)
    params = conninfo_to_dict(build_dsn("postgresql://app:s3cret@db.example:6432/shop?sslmode=require"))
    assert params == {"user": "app", "password": "s3cret", "host": "db.example", "port": "6432",
                      "dbname": "shop", "sslmode": "require", "options": BUILD_OPTIONS}


@pytest.mark.parametrize("dsn", ["host=db options='-c search_path=app'",
                                 "postgresql://db/shop?options=-c%20search_path%3Dapp"])
def test_the_dsn_s_own_options_are_kept_before_them(monkeypatch, dsn):
    monkeypatch.setenv("PGOPTIONS", "-c work_mem=64MB")  # an options in the DSN replaces it
    assert conninfo_to_dict(build_dsn(dsn))["options"] == f"-c search_path=app {BUILD_OPTIONS}"


def test_pgoptions_is_kept_when_the_dsn_has_none(monkeypatch):
    monkeypatch.setenv("PGOPTIONS", "-c work_mem=64MB")
    assert conninfo_to_dict(build_dsn("host=db"))["options"] == f"-c work_mem=64MB {BUILD_OPTIONS}"
