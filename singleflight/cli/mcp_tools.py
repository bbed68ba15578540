"""What pearing-mcp's tools say of themselves (descriptions, annotations), and the SDK glue it
needs beyond the SDK's own: tools that refuse unknown arguments, in one sentence."""

# No ``from __future__ import annotations``: see cli/mcp.py.

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mcp.server.mcpserver.tools import Tool

# MCP tool annotations (hints to a client): (read-only, destructive, idempotent). A release ends a
# ticket (destructive) but again is a no-op (idempotent); a reply is new every time.
HINTS: dict[str, tuple[bool, bool, bool]] = {
    "acquire_lock": (False, False, True),
    "get_lock_ticket": (True, False, True),
    "heartbeat_lock_ticket": (False, False, True),
    "release_lock_ticket": (False, True, True),
    "update_user_activity": (False, False, True),
    "list_locks": (True, False, True),
    "verify_token": (True, False, True),
    "get_thread_tree": (True, False, True),
    "create_reply": (False, False, False),
}

# What each of pearing-mcp's own tools says of itself: the protocol, in two or three sentences.
DESCRIPTIONS: dict[str, str] = {
    "acquire_lock": (
        "Take a lock or queue for it in FIFO order, one ticket per request_uuid (a retry with the same "
        "uuid returns the same ticket). State 'waiting' is not an error: do not act until state is 'held' "
        "(retry with the same request_uuid, or heartbeat the waiting ticket to keep its place). Once held, "
        "heartbeat within every lease_seconds, give its fence to every write, and release it when done."
    ),
    "get_lock_ticket": "Show one ticket: state, fence, lease expiry, holder, queue position. Read-only.",
    "heartbeat_lock_ticket": (
        "Renew the lease of a held or waiting ticket, within every lease_seconds. An error means the "
        "ticket is no longer yours: stop the contested work at once and write nothing more."
    ),
    "release_lock_ticket": (
        "Release a held ticket (the next waiter is promoted with a larger fence) or leave the queue. "
        "Idempotent; release every ticket you hold once the contested step is done or unnecessary."
    ),
    "update_user_activity": "Set (activity) or clear (clear=true) what this identity is doing, shown on its tickets.",
    "list_locks": "Which locks of a scope are in use: holder, fence, lease left, waiters in order. Read-only.",
    "verify_token": (
        "Whether a token file belongs to the live holder of its lock right now (ok, reason): check it "
        "right before a side effect. Read-only."
    ),
}


def closed_tool(fn: Callable[..., Any], description: str, hints: tuple[bool, bool, bool]) -> "Tool":
    """The SDK's Tool for ``fn``, refusing arguments it does not name.

    MCPServer builds each tool's arguments model on ``ArgModelBase``, whose pydantic config
    keeps the default ``extra="ignore"``: a misspelt ``lease_second`` would be dropped and the
    call would run with the default lease. No option turns that off per tool
    (modelcontextprotocol/python-sdk#3067), so the generated model is subclassed with
    ``extra="forbid"``, and the published schema is rebuilt from it (``additionalProperties:
    false``). Both are public fields the SDK reads on every call (FuncMetadata documents its
    fields as read live), and ``MCPServer(tools=...)`` takes ready-made tools.
    """
    import types

    from mcp.types import ToolAnnotations
    from pydantic import BaseModel, ConfigDict

    read_only, destructive, idempotent = hints
    annotations = ToolAnnotations(
        read_only_hint=read_only, destructive_hint=destructive, idempotent_hint=idempotent, open_world_hint=False
    )
    tool = _plain_spoken().from_function(fn, description=description, annotations=annotations)
    loose = tool.fn_metadata.arg_model
    closed: type[BaseModel] = types.new_class(
        loose.__name__, (loose,), exec_body=lambda ns: ns.update(model_config=ConfigDict(extra="forbid"))
    )
    metadata = tool.fn_metadata.model_copy(update={"arg_model": closed})
    return tool.model_copy(update={"fn_metadata": metadata, "parameters": closed.model_json_schema(by_alias=True)})


@functools.cache
def _plain_spoken() -> "type[Tool]":
    """The SDK's Tool, saying a call its input schema refused in one sentence (cli/mcp_errors.py).

    ``Tool.run`` reports such a call as a ToolError whose text is pydantic's dump (several
    lines, a link per error) and whose cause is the ValidationError; no option changes that
    text. Only that case is reworded, under the SDK's own "Error executing tool NAME: " that
    starts every other tool error too; the cause stays the ValidationError, so the SDK still
    logs only the names of the fields refused. A failure of the tool itself is left as it is.
    """
    from mcp.server.mcpserver.exceptions import ToolError, UnexpectedToolError
    from mcp.server.mcpserver.tools import Tool
    from pydantic import ValidationError

    from singleflight.cli import mcp_errors

    class PlainSpokenTool(Tool):
        async def run(self, arguments: dict[str, Any], context: Any, convert_result: bool = False) -> Any:
            try:
                return await super().run(arguments, context, convert_result)
            except ToolError as exc:
                cause = exc.__cause__
                if isinstance(exc, UnexpectedToolError) or not isinstance(cause, ValidationError):
                    raise
                takes = list(self.parameters.get("properties", {}))
                said = mcp_errors.sentence(self.name, arguments, cause.errors(include_url=False), takes)
                raise ToolError(f"Error executing tool {self.name}: {said}") from cause

    return PlainSpokenTool
