"""The backends, named once: a URL's scheme, the module and class that implement it, and the
function that checks such a URL without opening it. ``backend.open_backend`` opens them from
this table and ``tokens`` accepts a token file's backend only if it is in it; adding a
backend is its own package and one line here.

Modules are named, not imported: a pearing-run on the lock dir never loads etcd's client.
"""

from __future__ import annotations

from singleflight.core.const import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any, Final


class Scheme:
    __slots__ = ("aliases", "check", "form", "module", "name", "prefix", "setup")

    def __init__(
        self,
        name: str,
        prefix: str,
        module: str,
        *,
        form: str,
        check: str | None = None,
        aliases: tuple[str, ...] = (),
        setup: str | None = None,
    ) -> None:
        self.name, self.prefix, self.module, self.form, self.check = name, prefix, module, form, check
        self.aliases, self.setup = aliases, setup

    def matches(self, url: str) -> bool:
        return url == self.prefix if not self.prefix.endswith("://") else url.startswith((self.prefix, *self.aliases))

    def backend_class(self) -> Any:
        """The class implementing this backend (``module:Class``)."""
        module, _, cls = self.module.partition(":")
        # __import__ with a fromlist returns the submodule itself; importlib would load warnings
        # on every start for the same lookup.
        return getattr(__import__(module, fromlist=[cls]), cls)

    def validate(self, url: str) -> None:
        """Check ``url`` as this backend reads it (BadValue), opening nothing."""
        if self.check is not None:
            _named(self.check)(url)

    def setup_sql(self, url: str) -> str | None:
        """The statements that set up ``url``'s store, for a DBA (``pearing-cli init-db
        --print-sql``); None for a store that needs no set-up."""
        return None if self.setup is None else str(_named(self.setup)(url))


def _named(where: str) -> Any:
    """The function ``module:function`` names, imported only now."""
    module, _, fn = where.partition(":")
    return getattr(__import__(module, fromlist=[fn]), fn)


# name, URL, implementation; then its form, the function that checks such a URL, the URL's other
# spellings and the function that prints a store's set-up for a DBA, where there are.
SCHEMES: Final = (
    Scheme("local", "local", "singleflight.local.backend:LocalBackend", form="local"),
    Scheme(
        "etcd",
        "etcd://",
        "singleflight.etcd.backend:EtcdBackend",
        form="etcd://HOST:PORT[,HOST:PORT...][/PREFIX]",
        check="singleflight.etcd.client:parse_url",
    ),
    Scheme(
        "postgres",
        "postgresql://",
        "singleflight.postgres.backend:PgBackend",
        form="postgresql://USER[:PASS]@HOST[:PORT]/DB[?schema=NAME]",
        check="singleflight.postgres.url:parse_url",
        aliases=("postgres://",),  # libpq's other spelling
        setup="singleflight.postgres.backend:setup_sql",
    ),
)
DEFAULT: Final = SCHEMES[0]


def scheme_of(url: str) -> Scheme | None:
    return next((s for s in SCHEMES if s.matches(url)), None)


def forms() -> str:
    """Every backend URL's form, for the one line that refuses another."""
    return " or ".join(s.form for s in SCHEMES)


def help_text(default: str = "PEARING_BACKEND, else local") -> str:
    """``--backend``'s help, the same in every front end: every form, and the default."""
    return f"{forms()} (default {default})"
