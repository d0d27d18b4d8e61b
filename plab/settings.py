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
    db = os.environ.get("PLAB_DATABASE_URL") or f"sqlite:///{home / 'plab.sqlite'}"
    broker = os.environ.get("PLAB_BROKER_URL") or "filesystem://"
    token = os.environ.get("PLAB_API_TOKEN") or None
    data_dir = Path(os.environ["PLAB_DATA_DIR"]).resolve() if os.environ.get("PLAB_DATA_DIR") else _default_data_dir()
    api_url = os.environ.get("PLAB_API_URL", "http://127.0.0.1:8000").rstrip("/")
    return Settings(home=home, database_url=db, broker_url=broker, api_token=token, data_dir=data_dir,
                    api_url=api_url, auth_mode=_auth_mode(), max_body_bytes=_max_body(),
                    allowed_paths=tuple(Path(p).resolve() for p in os.environ.get("PLAB_ALLOWED_PATHS", "").split(
                        os.pathsep) if p.strip()))


class SettingsError(ValueError):
    """A PLAB_* variable has a value the lab cannot use; the message says which and what it takes."""


def _auth_mode() -> str:
    mode = os.environ.get("PLAB_AUTH", "writes").strip().lower() or "writes"
    if mode not in ("writes", "all"):
        raise SettingsError(f"PLAB_AUTH must be 'writes' (reads open, writes need the token) or 'all' (every API "
                            f"request needs the token), got {mode!r}")
    return mode


def _max_body() -> int:
    raw = os.environ.get("PLAB_MAX_BODY_BYTES", "").strip()
    if not raw:
        return 16 * 1024 * 1024
    if not raw.isdigit() or int(raw) < 1024:
        raise SettingsError(f"PLAB_MAX_BODY_BYTES must be a whole number of bytes >= 1024, got {raw!r}")
    return int(raw)
