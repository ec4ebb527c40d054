"""Stored responses: what `previous_response_id`, `GET` and `input_items` read back.

SQLAlchemy over SQLite by default (one file, created on first use); any URL SQLAlchemy speaks
(PostgreSQL, say) lets several servers share one store. Calls are synchronous and short: the
service runs them in a worker thread.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, Float, String, Text, create_engine, delete, event, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column


class _Base(DeclarativeBase):
    pass


class _Row(_Base):
    __tablename__ = "responses"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    created_at: Mapped[float] = mapped_column(Float, index=True)
    previous_response_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    response: Mapped[str] = mapped_column(Text)  # the Response object as the API returned it
    input_items: Mapped[str] = mapped_column(Text)  # this response's own input, items with ids
    # the model turns, tool calls and program runs behind it (wafer's accounting)
    accounting: Mapped[str] = mapped_column(Text, default="{}")


def default_path() -> Path:
    """$WAFER_DATA_DIR, else $XDG_DATA_HOME/wafer, else ~/.local/share/wafer."""
    base = os.environ.get("WAFER_DATA_DIR") or Path(
        os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "wafer"
    return Path(base) / "state.db"


def database_url(where: str | Path | None) -> str:
    """A SQLAlchemy URL for `--state-db`: a URL as it is, else a SQLite file path (default above)."""
    if isinstance(where, str) and "://" in where:
        return where
    path = Path(where) if where else default_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def open_database(where: str | Path | None) -> Engine:
    """The SQLAlchemy engine of `--state-db` (database_url), shared by every store of the server's state."""
    url = database_url(where)
    engine = create_engine(url)
    if url.startswith("sqlite"):
        # Several servers (or a restarted one) may open the same file: WAL lets readers in while one writes.
        @event.listens_for(engine, "connect")
        def _pragmas(conn: Any, _: Any) -> None:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA busy_timeout=5000")
    return engine


class ResponseStore:
    def __init__(self, where: str | Path | None = None) -> None:
        self.engine = open_database(where)
        self.url = database_url(where)
        _Base.metadata.create_all(self.engine)

    def put(self, response: dict[str, Any], input_items: list[dict[str, Any]],
            accounting: dict[str, Any]) -> None:
        row = _Row(id=response["id"], created_at=time.time(), previous_response_id=response.get("previous_response_id"),
                   response=json.dumps(response), input_items=json.dumps(input_items),
                   accounting=json.dumps(accounting))
        with Session(self.engine) as s, s.begin():
            s.merge(row)

    def get(self, rid: str) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]] | None:
        with Session(self.engine) as s:
            row = s.get(_Row, rid)
            if row is None:
                return None
            return json.loads(row.response), json.loads(row.input_items), json.loads(row.accounting)

    def delete(self, rid: str) -> bool:
        with Session(self.engine) as s, s.begin():
            return s.execute(delete(_Row).where(_Row.id == rid)).rowcount > 0

    def chain(self, rid: str, limit: int = 10_000) -> list[tuple[dict[str, Any], list[dict[str, Any]],
                                                                dict[str, Any]]]:
        """The responses from the first of a conversation to `rid`, oldest first; empty if `rid` is
        unknown. A link to a response deleted since ends the chain there."""
        out = []
        with Session(self.engine) as s:
            cur: str | None = rid
            while cur is not None and len(out) < limit:
                row = s.execute(select(_Row).where(_Row.id == cur)).scalar_one_or_none()
                if row is None:
                    break
                out.append((json.loads(row.response), json.loads(row.input_items), json.loads(row.accounting)))
                cur = row.previous_response_id
        return out[::-1]

    def close(self) -> None:
        self.engine.dispose()
