"""pearing-mcp's refusal of a bad tool argument: one sentence naming the argument and what it must be.

The SDK checks a call against the input schema (pydantic) before the tool runs, and its
message is pydantic's dump: several lines, the model's name, a link per error (issue 26: a
model left to guess). Here the same refusal is said in pearing-cli's words: a value of the
right JSON type goes through the rule of ``core/names.py`` that pearing-cli applies to the
same value, spelt as the MCP argument (``bad lease_seconds 0.4: must be at least 0.5
seconds``); a value of the wrong JSON type, a missing or an unknown argument get one line
in the same form. No SDK import: this works on the error's plain data.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from singleflight.core import names
from singleflight.core.const import MAX_ACTIVITY, MAX_FENCE, MAX_SLOTS, MAX_WAITING, MIN_LEASE_SECONDS
from singleflight.core.errors import BadValue, shown

MAX_PATH: Final = 4096  # PATH_MAX on Linux
_UUID: Final = "a UUID like 8-4-4-4-12 hex digits"


def token_file(value: str, what: str = "token_file") -> str:
    """The path of a token file, as verify_token takes it (whether it exists is the verdict's)."""
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_PATH or "\0" in value:
        raise BadValue(what, shown(value), f"must be the path of a token file, 1 to {MAX_PATH} characters")
    return value


Check = Callable[[Any, str], object]

# Every tool argument: its JSON type, what it must be (for a missing value or one of the wrong
# type), and the rule pearing-cli applies to the same value (None: the type is the whole rule).
ARGUMENTS: Final[Mapping[str, tuple[str, str, Check | None]]] = {
    "repo": ("string", "a scope like teams/platform/website", names.scope),
    "lock_name": ("string", f"a lock name matching {names.LOCK_NAME_PATTERN}", names.lock_name),
    "request_uuid": ("string", _UUID, names.request_uuid),
    "ticket_id": ("string", f"the ticket id acquire_lock returned, {_UUID}", names.request_uuid),
    "lease_seconds": ("number", f"a JSON number of seconds, at least {MIN_LEASE_SECONDS:g}", names.lease_seconds),
    "wait_seconds": ("number", "a JSON number of seconds, 0 or more", names.seconds),
    "max_waiting": ("integer", f"a JSON integer from 0 to {MAX_WAITING}", names.max_waiting),
    "slots": ("integer", f"a JSON integer from 1 to {MAX_SLOTS}", names.slots),
    "activity": ("string", f"text of 1 to {MAX_ACTIVITY} characters", names.activity),
    "clear": ("boolean", "true or false", None),
    "token_file": ("string", "the path of a token file", token_file),
    "thread": ("integer", "a JSON integer, the thread number, like 42", names.thread),
    "kind": ("string", f"a reply kind matching {names.REPLY_KIND_PATTERN}", names.reply_kind),
    "body": ("string", "the reply's text", names.reply_body),
    "links": ("array", 'a JSON array of KIND:TARGET strings, like ["branch:codex/thread-42"]', names.reply_links),
    "parent_id": ("string", f"a reply id, {_UUID}", names.reply_id),
    "fence": ("integer", f"a JSON integer from 1 to {MAX_FENCE}", names.fence),
    "unfenced": ("boolean", "true or false", None),
}

_JSON_TYPES: Final[Mapping[str, tuple[type, ...]]] = {
    "string": (str,),
    "number": (int, float),
    "integer": (int,),
    "boolean": (bool,),
    "array": (list,),
}


def _shown(value: object) -> str:
    """A value as the caller wrote it in JSON (``true``, ``null``), text quoted as BadValue quotes it."""
    if isinstance(value, str):
        return repr(shown(value))
    cut = shown(value)
    if isinstance(cut, str):  # a huge integer, by its size
        return cut
    text = json.dumps(value, default=repr)
    return text if len(text) <= 64 else text[:64] + "..."


def _kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


def _right_type(value: object, json_type: str) -> bool:
    if isinstance(value, bool) and json_type != "boolean":
        return False  # True is not a number, whatever Python says
    return isinstance(value, _JSON_TYPES[json_type])


def bad_argument(name: str, value: object, fallback: str) -> str:
    """The sentence for one bad value of argument ``name`` (``fallback``: pydantic's own words,
    for an argument this table does not know)."""
    known = ARGUMENTS.get(name)
    if known is None:
        return f"bad {name} {_shown(value)}: {fallback[:1].lower()}{fallback[1:]}"
    json_type, rule, check = known
    if not _right_type(value, json_type):
        return f"bad {name} {_shown(value)}: must be {rule}, not {_kind(value)}"
    if check is not None:
        try:
            check(value, name)
        except BadValue as exc:
            # pearing-cli's words, the value cut short (a lock name of 10,000 characters).
            return f"bad {exc.what} {_shown(exc.value)}: {exc.rule}"
    # pearing-cli takes it (the schema is stricter, or a check is missing here): say the rule.
    return f"bad {name} {_shown(value)}: must be {rule}"


def sentence(tool: str, arguments: Mapping[str, Any], errors: Sequence[Mapping[str, Any]], takes: Sequence[str]) -> str:
    """One sentence for a call refused by the input schema; ``errors``: pydantic's ``errors()``.

    The first argument at fault is explained; any other one is named after it, so a model
    fixing the first does not come back for the second.
    """
    bad: dict[str, str] = {}
    for err in errors:
        loc = err.get("loc") or ("arguments",)
        name = str(loc[0])
        if name in bad:
            continue  # one argument, several errors (a union's branches, a list's items)
        if err.get("type") == "extra_forbidden":
            bad[name] = f"unknown argument {name!r} ({tool} takes {', '.join(takes) or 'no arguments'})"
        elif err.get("type") == "missing":
            rule = ARGUMENTS[name][1] if name in ARGUMENTS else "it"
            bad[name] = f"missing argument {name}: give {rule}"
        else:
            bad[name] = bad_argument(name, arguments.get(name, err.get("input")), str(err.get("msg", "")))
    if not bad:
        return f"bad arguments for {tool}"
    first, *others = bad
    also = f"; also check {', '.join(others)}" if others else ""
    return bad[first] + also
