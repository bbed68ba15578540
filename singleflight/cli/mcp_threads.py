"""pearing-mcp's thread tools: ``get_thread_tree`` and ``create_reply`` (rules/threads.py).

Their input schemas carry the same rules as pearing-cli's checks (core/names.py). A reply's
fence is the one given, else the fence of the ticket this server's identity holds on
``thread-work.N``: never one from the server's own environment, which is not a COMMAND's.
"""

# No ``from __future__ import annotations``: the SDK reads the tools' annotations at run time,
# and these name types made inside ``tools`` (cli/mcp.py says why).

from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from singleflight.backend import Opened
from singleflight.core import names
from singleflight.core.const import MAX_FENCE

# The server's one way to a backend: ``Ops._call`` (a backend opened and closed per call).
Call = Callable[[Callable[[Opened], dict[str, Any]]], dict[str, Any]]

_SPELLING = {"kind": "kind", "body": "body", "link": "links", "parent": "parent_id", "fence": "fence"}


def tree(call: Call, repo: str, thread: int) -> dict[str, Any]:
    from singleflight.rules import threads

    return call(lambda b: threads.tree(b.backend, repo, thread))


def reply(  # noqa: PLR0917 - one parameter per tool argument
    call: Call,
    identity: str,
    repo: str,
    thread: int,
    kind: str,
    body: str,
    links: list[str],
    parent_id: str | None,
    fence: int | None,
    unfenced: bool,
) -> dict[str, Any]:
    from singleflight.rules import threads

    return call(
        lambda b: threads.reply(
            b.backend,
            repo,
            thread,
            kind=kind,
            body=body,
            links=links,
            parent=parent_id,
            fence=fence,
            unfenced=unfenced,
            identity=identity,
            env={},
            spelling=_SPELLING,
        )
    )


def tools(
    call: Call, identity: str, run: Callable[..., Awaitable[Any]], repo_t: Any
) -> list[tuple[Callable[..., Any], str]]:
    """The two tools; ``repo_t`` is the scope's annotated type, as pearing-mcp's other tools take it."""
    from pydantic import Field, Strict

    thread_t = Annotated[int, Strict(), Field(ge=1, le=names.MAX_THREAD, description="Thread number, e.g. 42.")]

    async def get_thread_tree(repo: repo_t, thread: thread_t) -> dict[str, Any]:
        return dict(await run(tree, call, repo, thread))

    async def create_reply(  # noqa: PLR0917 - one parameter per tool argument
        repo: repo_t,
        thread: thread_t,
        kind: Annotated[str, Strict(), Field(pattern=names.REPLY_KIND_PATTERN, description="e.g. implementation.")],
        body: Annotated[str, Strict(), Field(min_length=1, max_length=names.MAX_REPLY_BODY, description="The text.")],
        links: Annotated[
            list[Annotated[str, Strict(), Field(min_length=3, max_length=names.MAX_LINK)]],
            Field(max_length=names.MAX_LINKS, description="KIND:TARGET each, e.g. branch:codex/thread-42."),
        ] = [],  # noqa: B006 - pydantic copies defaults; the SDK needs a literal here
        parent_id: Annotated[str, Strict(), Field(pattern=names.UUID_PATTERN, description="Reply to answer.")]
        | None = None,
        fence: Annotated[
            int, Strict(), Field(ge=1, le=MAX_FENCE, description="Your held ticket's fence (default: looked up).")
        ]
        | None = None,
        unfenced: Annotated[bool, Strict(), Field(description="A note with no fence (a person's).")] = False,
    ) -> dict[str, Any]:
        return dict(await run(reply, call, identity, repo, thread, kind, body, list(links), parent_id, fence, unfenced))

    return [
        (
            get_thread_tree,
            "Read thread N of a scope: its replies nested under their parents, in the order accepted, and the "
            "highest fence it accepted. Read it after you hold thread-work.N and before you act: the work "
            "may be done already.",
        ),
        (
            create_reply,
            "Reply on thread N under your fence: accepted only if your fence is >= the thread's highest, so a "
            "holder that lost its lease cannot reply after a newer one. Hold thread-work.N first (its fence is "
            "looked up), or pass fence; unfenced=true for a note that needs none.",
        ),
    ]
