"""What an agent needs from a model: chat completions, whole or streamed.

The server provides one over its own chat path (every local model and upstream the router knows);
tests provide scripted ones. The agents never see the engine or model code behind it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol


class ChatBackend(Protocol):
    def stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """The chunks (`chat.completion.chunk` objects) of the chat completion asked for by `body`,
        an OpenAI request body with `stream` set. A failure, before or during the stream, raises
        `wafer.errors.APIError`; closing the iterator early cancels the generation. Besides OpenAI's
        finish reasons, a turn that the server's shutdown cut may end with "interrupted"."""
        ...


class CheckedBackend(ChatBackend, Protocol):
    """A backend that can tell up front which model names it serves (the server's own can; a
    scripted one need not): a request naming another fails before its first turn, not minutes in."""

    def check_model(self, name: str) -> None:
        """Raises the `wafer.errors.APIError` (a 404, model_not_found) for a name it does not serve."""
        ...
