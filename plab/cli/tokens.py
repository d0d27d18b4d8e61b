"""`plab token create NAME --scope read|write|admin`, `plab token list`, `plab token revoke NAME|ID`: scoped API
tokens, written straight into the server's database (PLAB_DATABASE_URL, as `plab serve` uses it). The token is
printed once; only its hash is stored (backend/auth.py)."""
from __future__ import annotations

import argparse

from plab.cli.common import UsageError


def _session():
    from sqlalchemy.exc import OperationalError, ProgrammingError

    from backend.db import session_factory
    from backend.models import ApiToken
    from plab.settings import get_settings

    url = get_settings().database_url
    if url.startswith("sqlite"):
        from backend.migrate import upgrade
        upgrade(url)  # the embedded default migrates itself, as `plab serve` does
    session = session_factory(url)()
    try:
        session.query(ApiToken).first()
    except (OperationalError, ProgrammingError) as e:
        session.close()
        raise UsageError(f"the database at {url.split('@')[-1]} has no token table: run `plab db upgrade`") from e
    return session


def _check_name(name: str) -> None:
    """The API's rule for a token's name (backend.auth), and not digits alone (`revoke` also takes an id)."""
    import re

    from backend import auth

    if not name or len(name) > auth.TOKEN_NAME_MAX or not re.match(auth.TOKEN_NAME_PATTERN, name):
        raise UsageError(f"a token's name is 1 to {auth.TOKEN_NAME_MAX} letters, digits, '.', '_' or '-', starting "
                         f"with a letter or digit, e.g. worker-gpu1 or alice; got {name[:120]!r}")
    if name.isdigit():
        raise UsageError(f"a token's name of digits alone ({name!r}) would read as an id in `plab token revoke`; "
                         "add a letter, e.g. worker-" + name)


def cmd_token(args) -> int:
    from backend import auth
    from backend.models import ApiToken, utcnow

    with _session() as session:
        if args.action == "create":
            _check_name(args.name)
            try:
                row, raw = auth.create_token(session, args.name, args.scope)
            except ValueError as e:
                raise UsageError(str(e)) from e
            session.commit()
            print(f"token '{row.name}' (scope {row.scope}, id {row.id}); shown this once, keep it safe:\n{raw}")
        elif args.action == "list":
            rows = session.query(ApiToken).order_by(ApiToken.id).all()
            print(f"{'id':>4}  {'name':24} {'scope':6} {'prefix':13} {'created':20} {'last used':20} revoked")
            for r in rows:
                fmt = lambda t: t.strftime("%Y-%m-%d %H:%M:%S") if t else "-"  # noqa: E731
                print(f"{r.id:>4}  {r.name[:24]:24} {r.scope:6} {r.prefix:13} {fmt(r.created_at):20} "
                      f"{fmt(r.last_used_at):20} {fmt(r.revoked_at)}")
        else:
            ref = args.name
            row = session.query(ApiToken).filter(ApiToken.name == ref).one_or_none()
            if row is None and ref.isdigit():  # an id (a name of digits, made through the API, goes first)
                row = session.get(ApiToken, int(ref))
            if row is None:
                raise UsageError(f"no token named or numbered {ref!r} (see `plab token list`)")
            if row.revoked_at is None:
                row.revoked_at = utcnow()
            session.commit()
            print(f"token '{row.name}' revoked (running servers stop accepting it within a few seconds)")
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("token", help="scoped API tokens: create, list, revoke")
    actions = t.add_subparsers(dest="action", required=True)
    c = actions.add_parser("create", help="a new token, printed once")
    c.add_argument("name", help="a label, e.g. worker-gpu1 or alice")
    c.add_argument("--scope", required=True, choices=("read", "write", "admin"),
                   help="read: GET; write: + every write (what workers need); admin: + token management")
    actions.add_parser("list", help="every token (never the token itself)")
    r = actions.add_parser("revoke", help="stop a token working")
    r.add_argument("name", help="its name or id")
    t.set_defaults(func=cmd_token)
