"""Files and batches of the Batch API, in the database of stored responses (`--state-db`).

Three tables: files (their bytes with them), batches (the Batch object as the API returns it, its
counts aside), and a batch's lines, each with its request and, once it has run, its line of the
output or the error file. A line's result is written as it finishes, so that a batch resumed after
a restart runs only the lines that have none. Every row has an owner (the tenant of the key that
made it; None without keys), and every read names the owner: another tenant's id is not found.
Calls are synchronous and short: the server runs them in a worker thread.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from sqlalchemy import Float, Integer, LargeBinary, String, Text, delete, func, select, update
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from wafer.agents.store import open_database


class _Base(DeclarativeBase):
    pass


class _File(_Base):
    __tablename__ = "files"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    owner: Mapped[str | None] = mapped_column(String(128), nullable=True, index=True)
    created_at: Mapped[int] = mapped_column(Integer, index=True)
    filename: Mapped[str] = mapped_column(Text)
    purpose: Mapped[str] = mapped_column(String(32))
    bytes: Mapped[int] = mapped_column(Integer)
    content: Mapped[bytes] = mapped_column(LargeBinary)


class _Batch(_Base):
    __tablename__ = "batches"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    owner: Mapped[str | None] = mapped_column(String(128), nullable=True, index=True)
    created_at: Mapped[int] = mapped_column(Integer, index=True)
    status: Mapped[str] = mapped_column(String(16), index=True)
    batch: Mapped[str] = mapped_column(Text)  # the Batch object, request_counts and usage aside


class _Line(_Base):
    __tablename__ = "batch_lines"
    batch_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    line: Mapped[int] = mapped_column(Integer, primary_key=True)  # 0-based, in the input file
    custom_id: Mapped[str | None] = mapped_column(Text, nullable=True)
    request: Mapped[str | None] = mapped_column(Text, nullable=True)  # the line's body; None: the line is bad
    done_at: Mapped[float | None] = mapped_column(Float, nullable=True, index=True)
    ok: Mapped[int] = mapped_column(Integer, default=0)  # 1: its result goes to the output file
    result: Mapped[str | None] = mapped_column(Text, nullable=True)  # its line of the output or error file
    input_tokens: Mapped[int] = mapped_column(Integer, default=0)
    output_tokens: Mapped[int] = mapped_column(Integer, default=0)


def _file_object(row: _File) -> dict[str, Any]:
    return {"id": row.id, "object": "file", "bytes": row.bytes, "created_at": row.created_at,
            "filename": row.filename, "purpose": row.purpose, "status": "processed", "status_details": None,
            "expires_at": None}


class BatchStore:
    def __init__(self, where: str | Path | None = None) -> None:
        _, self.engine = open_database(where)
        _Base.metadata.create_all(self.engine)

    # --- files --------------------------------------------------------------------------------
    def put_file(self, fid: str, owner: str | None, filename: str, purpose: str, content: bytes) -> dict[str, Any]:
        row = _File(id=fid, owner=owner, created_at=int(time.time()), filename=filename, purpose=purpose,
                    bytes=len(content), content=content)
        with Session(self.engine, expire_on_commit=False) as s, s.begin():
            s.add(row)
        return _file_object(row)

    def file(self, fid: str, owner: str | None) -> dict[str, Any] | None:
        with Session(self.engine) as s:
            row = s.execute(select(_File).where(_File.id == fid, _File.owner == owner)).scalar_one_or_none()
            return None if row is None else _file_object(row)

    def content(self, fid: str, owner: str | None) -> bytes | None:
        with Session(self.engine) as s:
            return s.execute(select(_File.content).where(_File.id == fid, _File.owner == owner)).scalar_one_or_none()

    def files(self, owner: str | None, purpose: str | None, after: str | None, limit: int,
              newest_first: bool) -> tuple[list[dict[str, Any]], bool]:
        """A page of the owner's files, and whether more follow. `after`: the id of the last one seen."""
        columns = [_File.id, _File.owner, _File.created_at, _File.filename, _File.purpose, _File.bytes]
        q = select(*columns).where(_File.owner == owner)
        if purpose is not None:
            q = q.where(_File.purpose == purpose)
        return self._page(s_query=q, table=_File, after=after, limit=limit, newest_first=newest_first,
                          make=lambda r: {"id": r.id, "object": "file", "bytes": r.bytes, "created_at": r.created_at,
                                          "filename": r.filename, "purpose": r.purpose, "status": "processed",
                                          "status_details": None, "expires_at": None}, owner=owner)

    def delete_file(self, fid: str, owner: str | None) -> bool:
        with Session(self.engine) as s, s.begin():
            return s.execute(delete(_File).where(_File.id == fid, _File.owner == owner)).rowcount > 0

    def _page(self, s_query: Any, table: Any, after: str | None, limit: int, newest_first: bool, make: Any,
              owner: str | None) -> tuple[list[dict[str, Any]], bool]:
        order = (table.created_at.desc(), table.id.desc()) if newest_first else (table.created_at, table.id)
        with Session(self.engine) as s:
            if after is not None:
                mark = s.execute(select(table.created_at).where(table.id == after,
                                                                table.owner == owner)).scalar_one_or_none()
                if mark is not None:
                    if newest_first:
                        s_query = s_query.where((table.created_at < mark) | ((table.created_at == mark)
                                                                             & (table.id < after)))
                    else:
                        s_query = s_query.where((table.created_at > mark) | ((table.created_at == mark)
                                                                             & (table.id > after)))
            rows = s.execute(s_query.order_by(*order).limit(limit + 1)).all()
        return [make(r) for r in rows[:limit]], len(rows) > limit

    # --- batches ------------------------------------------------------------------------------
    def put_batch(self, batch: dict[str, Any], owner: str | None,
                  lines: list[tuple[str | None, dict[str, Any] | None, dict[str, Any] | None]]) -> None:
        """A new batch and its lines: (custom_id, request, error line), a bad line with its error
        line already (done, into the error file), a good one with its request."""
        now = time.time()
        with Session(self.engine) as s, s.begin():
            s.add(_Batch(id=batch["id"], owner=owner, created_at=batch["created_at"], status=batch["status"],
                         batch=json.dumps(batch)))
            s.add_all(_Line(batch_id=batch["id"], line=i, custom_id=custom_id,
                            request=None if request is None else json.dumps(request),
                            done_at=None if error is None else now, ok=0,
                            result=None if error is None else json.dumps(error))
                      for i, (custom_id, request, error) in enumerate(lines))

    def save_batch(self, batch: dict[str, Any]) -> None:
        with Session(self.engine) as s, s.begin():
            s.execute(update(_Batch).where(_Batch.id == batch["id"]).values(status=batch["status"],
                                                                              batch=json.dumps(batch)))

    def batch(self, bid: str, owner: str | None = None, any_owner: bool = False) -> dict[str, Any] | None:
        """The Batch object with its counts and usage; `any_owner`: the server's own read (resuming)."""
        with Session(self.engine) as s:
            q = select(_Batch.batch).where(_Batch.id == bid)
            if not any_owner:
                q = q.where(_Batch.owner == owner)
            raw = s.execute(q).scalar_one_or_none()
            return None if raw is None else self._with_counts(s, json.loads(raw))

    def owner(self, bid: str) -> str | None:
        with Session(self.engine) as s:
            return s.execute(select(_Batch.owner).where(_Batch.id == bid)).scalar_one_or_none()

    def _with_counts(self, s: Session, batch: dict[str, Any]) -> dict[str, Any]:
        total, done, ok, tin, tout = s.execute(
            select(func.count(), func.count(_Line.done_at), func.coalesce(func.sum(_Line.ok), 0),
                   func.coalesce(func.sum(_Line.input_tokens), 0), func.coalesce(func.sum(_Line.output_tokens), 0))
            .where(_Line.batch_id == batch["id"])).one()
        batch["request_counts"] = {"total": total, "completed": int(ok), "failed": done - int(ok)}
        batch["usage"] = {"input_tokens": int(tin), "output_tokens": int(tout), "total_tokens": int(tin) + int(tout),
                          "input_tokens_details": {"cached_tokens": 0},
                          "output_tokens_details": {"reasoning_tokens": 0}}
        return batch

    def batches(self, owner: str | None, after: str | None, limit: int) -> tuple[list[dict[str, Any]], bool]:
        """A page of the owner's batches, newest first, and whether more follow."""
        with Session(self.engine) as s:
            def make(r: Any) -> dict[str, Any]:
                return self._with_counts(s, json.loads(r.batch))

            return self._page(select(_Batch.batch, _Batch.id).where(_Batch.owner == owner), _Batch, after, limit,
                              True, make, owner)

    def unfinished(self) -> list[str]:
        """The batches a server stopped before they ended, oldest first."""
        with Session(self.engine) as s:
            return list(s.execute(select(_Batch.id).where(_Batch.status.in_(
                ("validating", "in_progress", "finalizing", "cancelling"))).order_by(_Batch.created_at)).scalars())

    # --- lines --------------------------------------------------------------------------------
    def pending(self, bid: str) -> list[tuple[int, str | None, dict[str, Any]]]:
        """The lines without a result yet: (line, custom_id, request), in the file's order."""
        with Session(self.engine) as s:
            rows = s.execute(select(_Line.line, _Line.custom_id, _Line.request)
                             .where(_Line.batch_id == bid, _Line.done_at.is_(None)).order_by(_Line.line)).all()
        return [(r.line, r.custom_id, json.loads(r.request)) for r in rows]

    def finish_lines(self, bid: str, rows: list[tuple[Any, ...]]) -> None:
        """Results of lines, in one transaction: each (line, ok, result line, input tokens, output tokens),
        the tokens optional."""
        now = time.time()
        with Session(self.engine) as s, s.begin():
            for line, ok, result, *tokens in rows:
                tin, tout = (tokens + [0, 0])[:2]
                s.execute(update(_Line).where(_Line.batch_id == bid, _Line.line == line, _Line.done_at.is_(None))
                          .values(done_at=now, ok=int(ok), result=json.dumps(result), input_tokens=tin,
                                  output_tokens=tout))

    def results(self, bid: str) -> tuple[bytes, bytes]:
        """The output file's and the error file's contents: the lines with a result, in the input's order."""
        out: list[str] = []
        err: list[str] = []
        with Session(self.engine) as s:
            for ok, result in s.execute(select(_Line.ok, _Line.result).where(
                    _Line.batch_id == bid, _Line.done_at.is_not(None)).order_by(_Line.line)):
                (out if ok else err).append(result + "\n")
        return "".join(out).encode(), "".join(err).encode()

    def close(self) -> None:
        self.engine.dispose()
