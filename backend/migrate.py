"""Alembic, driven from code so `plab db upgrade` needs no alembic.ini in the working directory."""
from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

MIGRATIONS = Path(__file__).resolve().parent / "migrations"


def alembic_config(database_url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return cfg


def upgrade(database_url: str, revision: str = "head") -> None:
    from backend.db import get_engine

    get_engine(database_url)  # creates the SQLite file's folder
    command.upgrade(alembic_config(database_url), revision)
