"""The SDK glue pearing-mcp needs beyond the SDK's own: tools that refuse unknown arguments."""

# No ``from __future__ import annotations``: see cli/mcp.py.

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mcp.server.mcpserver.tools import Tool


def closed_tool(fn: Callable[..., Any], description: str) -> "Tool":
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

    from mcp.server.mcpserver.tools import Tool
    from pydantic import BaseModel, ConfigDict

    tool = Tool.from_function(fn, description=description)
    loose = tool.fn_metadata.arg_model
    closed: type[BaseModel] = types.new_class(
        loose.__name__, (loose,), exec_body=lambda ns: ns.update(model_config=ConfigDict(extra="forbid"))
    )
    metadata = tool.fn_metadata.model_copy(update={"arg_model": closed})
    return tool.model_copy(update={"fn_metadata": metadata, "parameters": closed.model_json_schema(by_alias=True)})
