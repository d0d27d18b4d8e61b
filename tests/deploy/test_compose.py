"""docker-compose.yml is parsed (no Docker engine here): its services, commands and variables must agree."""
from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from plab.cli import build_parser

REPO = Path(__file__).resolve().parents[2]


def _expand(value: str) -> str:
    """${VAR:-default} → default, as compose does with VAR unset; ${VAR:?message} → a placeholder value (compose
    refuses to start with VAR unset)."""
    value = re.sub(r"\$\{[A-Z_]+:\?[^}]*\}", "user:set-by-operator", value)
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def plab_services(compose):
    return {n: s for n, s in compose["services"].items() if s.get("build")}


def test_the_deployment_has_every_service(compose):
    assert {"postgres", "redis", "api", "worker", "flower"} <= set(compose["services"])
    assert (REPO / "Dockerfile").is_file()


def test_every_plab_service_runs_a_command_our_cli_accepts(compose):
    parser = build_parser()
    services = plab_services(compose)
    assert {"api", "worker", "flower"} <= set(services)
    for name, svc in services.items():
        cmd = [_expand(c) for c in svc["command"]]
        assert cmd[0] == "plab", f"{name}: command must be a plab command, got {cmd}"
        args = parser.parse_args(cmd[1:])  # exits (fails the test) on an unknown command or flag
        assert callable(args.func)
    assert build_parser().parse_args(_expand_all(services["api"]["command"])[1:]).command == "serve"
    assert build_parser().parse_args(_expand_all(services["worker"]["command"])[1:]).command == "worker"


def _expand_all(cmd):
    return [_expand(c) for c in cmd]


def test_services_agree_on_urls_and_variables(compose):
    services = compose["services"]
    envs = {n: s["environment"] for n, s in plab_services(compose).items()}
    first = next(iter(envs.values()))
    for name, env in envs.items():
        assert env == first, f"{name} has a different environment from the other plab services"
    db = urlparse(first["PLAB_DATABASE_URL"])
    pg = services["postgres"]["environment"]
    assert db.scheme == "postgresql+psycopg" and db.hostname == "postgres" and (db.port or 5432) == 5432
    assert (db.username, db.password, db.path.lstrip("/")) == (pg["POSTGRES_USER"], pg["POSTGRES_PASSWORD"],
                                                               pg["POSTGRES_DB"])
    broker = urlparse(first["PLAB_BROKER_URL"])
    assert broker.scheme == "redis" and broker.hostname == "redis" and (broker.port or 6379) == 6379
    api = urlparse(first["PLAB_API_URL"])
    api_args = build_parser().parse_args(_expand_all(services["api"]["command"])[1:])
    assert api.hostname == "api" and api.port == api_args.port
    assert api_args.host == "0.0.0.0"
    assert any(str(p).endswith(f":{api_args.port}") for p in services["api"]["ports"])
    flower_args = build_parser().parse_args(_expand_all(services["flower"]["command"])[1:])
    assert flower_args.port == 5555 and flower_args.host == "0.0.0.0"  # inside the compose network only
    # the API token is passed through, never baked in
    assert first["PLAB_API_TOKEN"].startswith("${PLAB_API_TOKEN")
    # workers write checkpoints where the API (and evaluation jobs) can find them
    assert any("/var/lib/plab" in v for v in services["worker"]["volumes"])
    assert first["PLAB_HOME"] == "/var/lib/plab"


def test_the_worker_reserves_gpus(compose):
    devices = compose["services"]["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in d["capabilities"] and d["driver"] == "nvidia" for d in devices)
    assert "--gpus" in compose["services"]["worker"]["command"]


def test_the_api_waits_for_migrations(compose):
    api = compose["services"]["api"]
    assert api["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert compose["services"]["migrate"]["command"] == ["plab", "db", "upgrade"]
    assert "--no-migrate" in api["command"]


def test_the_image_holds_every_package_the_plab_command_is_built_from():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["project"]["scripts"]["plab"] == "plab.cli:main"
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = {line.split()[1] for line in (REPO / "Dockerfile").read_text().splitlines()
              if line.startswith("COPY ") and len(line.split()) == 3}
    assert packages <= copied, f"the Dockerfile does not copy {sorted(packages - copied)}"


def test_the_deployment_is_closed_by_default(compose):
    """Compose refuses to start without a token; Redis persists its queue; Flower is not published and needs
    basic auth; nothing else but the API is published."""
    env = compose["x-plab-env"]
    assert env["PLAB_API_TOKEN"].startswith("${PLAB_API_TOKEN:?"), env["PLAB_API_TOKEN"]
    redis = compose["services"]["redis"]
    assert redis["command"][redis["command"].index("--appendonly") + 1] == "yes"
    assert any(v.endswith(":/data") for v in redis["volumes"])
    flower = compose["services"]["flower"]
    assert "ports" not in flower and flower.get("profiles") == ["monitoring"]
    assert any("PLAB_FLOWER_BASIC_AUTH:?" in c for c in flower["command"])
    published = {n for n, s in compose["services"].items() if s.get("ports")}
    assert published == {"api"}


def test_serve_and_flower_refuse_to_listen_beyond_loopback_unprotected(monkeypatch):
    from plab.cli import build_parser
    from plab.cli.common import UsageError

    monkeypatch.delenv("PLAB_API_TOKEN", raising=False)
    monkeypatch.delenv("PLAB_FLOWER_BASIC_AUTH", raising=False)
    parser = build_parser()
    args = parser.parse_args(["serve", "--host", "0.0.0.0"])
    with pytest.raises(UsageError, match="without PLAB_API_TOKEN"):
        args.func(args)
    assert parser.parse_args(["serve"]).host == "127.0.0.1"
    args = parser.parse_args(["flower", "--host", "0.0.0.0"])
    with pytest.raises(UsageError, match="without basic auth"):
        args.func(args)
    args = parser.parse_args(["flower", "--host", "0.0.0.0", "--basic-auth", "admin"])
    with pytest.raises(UsageError, match="USER:PASSWORD"):
        args.func(args)
    assert parser.parse_args(["flower"]).host == "127.0.0.1"
