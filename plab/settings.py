"""All configuration comes from the environment (PLAB_*), read in one place, by the API, the workers and the CLI."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Settings:
    home: Path
    database_url: str
    broker_url: str
    api_token: str | None
    data_dir: Path
    api_url: str
    auth_mode: str = "writes"  # PLAB_AUTH: "writes" (reads open) or "all" (every /api/v1 request needs the token)
    max_body_bytes: int = 16 * 1024 * 1024  # PLAB_MAX_BODY_BYTES: larger request bodies are refused (413)
    allowed_paths: tuple[Path, ...] = ()  # PLAB_ALLOWED_PATHS: folders besides data_dir that API specs may name
    heartbeat_s: float = 10.0  # PLAB_HEARTBEAT_S: a running job's heartbeat interval
    stale_s: float = 60.0  # PLAB_STALE_S: a running run without a heartbeat this long has lost its worker
    reconcile_s: float = 15.0  # PLAB_RECONCILE_S: the API's reconciler interval (0: off)
    requeue_grace_s: float = 60.0  # PLAB_REQUEUE_GRACE_S: a queued run's message is looked for after this long
    max_attempts: int = 3  # PLAB_MAX_ATTEMPTS: starts of a run, evaluation or GEMM benchmark before it is failed

    @property
    def is_sqlite(self) -> bool:
        return self.database_url.startswith("sqlite")

    @property
    def broker_folder(self) -> Path:
        return self.home / "broker"


def _default_data_dir() -> Path:
    # In a development checkout the shared data sits beside the repository; a deployment sets PLAB_DATA_DIR.
    from training.config import default_data_dir  # torch-free; one default for the API, workers and training

    return default_data_dir()


def get_settings() -> Settings:
    """Read the environment now (not at import) so tests and the CLI can set variables first."""
    home = Path(os.environ.get("PLAB_HOME", "plab-data")).resolve()
    db = _database_url(os.environ.get("PLAB_DATABASE_URL") or f"sqlite:///{home / 'plab.sqlite'}")
    broker = _broker_url(os.environ.get("PLAB_BROKER_URL") or "filesystem://")
    token = os.environ.get("PLAB_API_TOKEN") or None
    data_dir = Path(os.environ["PLAB_DATA_DIR"]).resolve() if os.environ.get("PLAB_DATA_DIR") else _default_data_dir()
    api_url = os.environ.get("PLAB_API_URL", "http://127.0.0.1:8000").rstrip("/")
    return Settings(home=home, database_url=db, broker_url=broker, api_token=token, data_dir=data_dir,
                    api_url=api_url, auth_mode=_auth_mode(), max_body_bytes=_max_body(),
                    allowed_paths=tuple(Path(p).resolve() for p in os.environ.get("PLAB_ALLOWED_PATHS", "").split(
                        os.pathsep) if p.strip()),
                    heartbeat_s=_seconds("PLAB_HEARTBEAT_S", 10.0), stale_s=_seconds("PLAB_STALE_S", 60.0),
                    reconcile_s=_seconds("PLAB_RECONCILE_S", 15.0, zero_ok=True),
                    requeue_grace_s=_seconds("PLAB_REQUEUE_GRACE_S", 60.0),
                    max_attempts=_whole("PLAB_MAX_ATTEMPTS", 3))


class SettingsError(ValueError):
    """A PLAB_* variable has a value the lab cannot use; the message says which and what it takes."""


def _auth_mode() -> str:
    mode = os.environ.get("PLAB_AUTH", "writes").strip().lower() or "writes"
    if mode not in ("writes", "all"):
        raise SettingsError(f"PLAB_AUTH must be 'writes' (reads open, writes need the token) or 'all' (every API "
                            f"request needs the token), got {mode!r}")
    return mode


def _seconds(name: str, default: float, *, zero_ok: bool = False) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (value > 0 or (zero_ok and value == 0)) or value != value or value == float("inf"):
        raise SettingsError(f"{name} must be a positive number{' or 0 (off)' if zero_ok else ''}, got {raw!r}")
    return value


def _whole(name: str, default: int, minimum: int = 1) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or int(raw) < minimum:
        raise SettingsError(f"{name} must be a whole number >= {minimum}, got {raw!r}")
    return int(raw)


DATABASE_URL_HELP = "sqlite:///PATH (embedded) or postgresql+psycopg://USER:PASSWORD@HOST:5432/DB (served)"


def _database_url(url: str) -> str:
    """PLAB_DATABASE_URL checked: SQLite or PostgreSQL through psycopg 3 (the driver installed); `postgresql://` and
    `postgres://` without a driver mean psycopg 3 (SQLAlchemy would look for psycopg2, which is not installed)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError:
        raise SettingsError(f"PLAB_DATABASE_URL is not a database URL: {_hide_password(url)!r}; "
                            f"give {DATABASE_URL_HELP}") from None
    backend, _, driver = parsed.drivername.partition("+")
    if parsed.drivername == "postgresql+psycopg":
        return url
    if backend in ("postgres", "postgresql") and driver == "":
        return parsed.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)
    if backend == "sqlite" and driver in ("", "pysqlite"):
        return url
    raise SettingsError(f"PLAB_DATABASE_URL uses {parsed.drivername!r}, which the lab does not run on; give "
                        f"{DATABASE_URL_HELP}")


def _hide_password(url: str) -> str:
    head, at, tail = url.rpartition("@")
    if not at or "://" not in head:
        return url
    scheme, _, credentials = head.partition("://")
    user = credentials.split(":", 1)[0]
    return f"{scheme}://{user}:***@{tail}" if ":" in credentials else url


def _broker_url(url: str) -> str:
    """PLAB_BROKER_URL checked against the transports Celery knows (redis:// and the embedded filesystem:// are
    the tested ones; the reconciler can read only those two)."""
    from kombu.transport import TRANSPORT_ALIASES

    scheme = url.partition("://")[0]
    if "://" not in url or scheme not in TRANSPORT_ALIASES:
        raise SettingsError(f"PLAB_BROKER_URL must be a Celery broker URL such as redis://HOST:6379/0 (served) or "
                            f"filesystem:// (embedded), got {_hide_password(url)!r}")
    return url


def _max_body() -> int:
    raw = os.environ.get("PLAB_MAX_BODY_BYTES", "").strip()
    if not raw:
        return 16 * 1024 * 1024
    if not raw.isdigit() or int(raw) < 1024:
        raise SettingsError(f"PLAB_MAX_BODY_BYTES must be a whole number of bytes >= 1024, got {raw!r}")
    return int(raw)


def portable_path(path, home: Path) -> str:
    """`path` relative to PLAB_HOME `home` when it lies inside it (so the folder can move: set PLAB_HOME to its new
    place), else absolute. The inverse is `home_path`."""
    resolved = Path(path).resolve()
    try:
        return resolved.relative_to(Path(home).resolve()).as_posix()
    except ValueError:
        return str(resolved)


def home_path(path: str, home: Path) -> Path:
    """A path recorded by `portable_path`, on this machine: relative ones live under PLAB_HOME."""
    p = Path(path)
    return p if p.is_absolute() else Path(home) / p
