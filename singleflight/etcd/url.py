"""An etcd backend's URL, ``etcd://HOST:PORT[,HOST:PORT...][/PREFIX]``: checked once, before any
request, so a URL no member could be reached by is bad input (64), never an error later."""

from __future__ import annotations

from singleflight.core.errors import BadValue

DEFAULT_PREFIX = "pearing"
_URL_RULE = "must be etcd://HOST:PORT[,HOST:PORT...][/PREFIX]"
_PREFIX_RULE = "PREFIX is one name of [A-Za-z0-9._-], no '/' (a nested PREFIX shares keys with another tenant's scopes)"
_PREFIX_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")
# A host's label: letters, digits, '-' and '_' (container names have them; the resolver takes them).
_LABEL_CHARS = _PREFIX_CHARS - {"."}
_IPV6_CHARS = frozenset("0123456789abcdefABCDEF:.%")


def parse_url(url: str) -> tuple[list[tuple[str, int]], str]:
    """``etcd://h1:2379,h2:2379/team-a`` -> ([(h1, 2379), (h2, 2379)], "team-a").

    The prefix is the tenant: every key of every command lives under ``/PREFIX/``
    (default ``pearing``), so two teams or environments can share one cluster.
    It is one name of [A-Za-z0-9._-], not '.' or '..': without a '/', so that the first
    segment of a key is its tenant and the rest up to ``/@LOCK`` its scope. A nested
    ``acme/prod`` with scope ``web`` was tenant ``acme``'s scope ``prod/web``: the same keys,
    the same lock (issue 22, item 11). Such a URL is refused, never read another way: a
    pearing that found other keys for it would start a second line beside the old one.
    """
    if not url.startswith("etcd://"):
        raise BadValue("backend", url, _URL_RULE)
    hosts, _, prefix = url[len("etcd://") :].partition("/")
    prefix = prefix or DEFAULT_PREFIX  # none, or a trailing slash alone: the default tenant
    if len(prefix) > 200 or prefix in (".", "..") or not set(prefix) <= _PREFIX_CHARS:
        raise BadValue("backend", url, f"{_URL_RULE}; {_PREFIX_RULE}")
    out = []
    for part in hosts.split(","):
        host, _, port = part.rpartition(":")
        if not _host_ok(host) or not port.isdigit() or not 0 < int(port) < 65536:
            raise BadValue("backend", url, _URL_RULE)
        out.append((host.strip("[]"), int(port)))
    return out, prefix


def _host_ok(host: str) -> bool:
    """A name whose labels the resolver takes (1-63 characters each, no empty one: ``1..2`` was
    an internal error, 70, from the idna codec at the first request), or an ``[IPv6]``."""
    if host.startswith("[") or host.endswith("]"):
        inner = host[1:-1]
        return host.startswith("[") and host.endswith("]") and bool(inner) and set(inner) <= _IPV6_CHARS
    name = host[:-1] if host.endswith(".") else host  # one trailing dot: a fully qualified name
    if not 0 < len(name) <= 253:
        return False
    for label in name.split("."):
        if not 0 < len(label) <= 63 or label[0] == "-" or label[-1] == "-":
            return False
        spelt = label
        if not label.isascii():
            try:  # a name in another script: checked as the resolver will spell it
                spelt = label.encode("idna").decode("ascii")
            except UnicodeError:
                return False
        if not set(spelt) <= _LABEL_CHARS:
            return False
    return True
