"""The responses store: each response belongs to its tenant, and a store made before responses had
owners is brought up to date when opened."""

from __future__ import annotations

import sqlite3

from wafer.agents.store import ResponseStore


def response(rid: str, previous: str | None = None) -> dict:
    return {"id": rid, "previous_response_id": previous, "output": []}


def test_a_tenant_reads_continues_and_deletes_only_its_own(tmp_path):
    store = ResponseStore(tmp_path / "state.db")
    store.put(response("resp_a1"), [], {}, "alice")
    store.put(response("resp_a2", "resp_a1"), [], {}, "alice")
    store.put(response("resp_open"), [], {})  # a server without keys
    assert store.get("resp_a1", "bob") is None and store.get("resp_a1") is None
    assert store.get("resp_a1", "alice") is not None
    assert store.chain("resp_a2", "bob") == [] and len(store.chain("resp_a2", "alice")) == 2
    assert store.get("resp_open", "alice") is None and store.get("resp_open") is not None
    assert not store.delete("resp_a1", "bob") and store.get("resp_a1", "alice") is not None
    assert store.delete("resp_a1", "alice") and store.get("resp_a1", "alice") is None


def test_a_store_made_before_tenants_gets_the_column_and_keeps_its_responses(tmp_path):
    db = tmp_path / "state.db"
    with sqlite3.connect(db) as conn:  # the table as it was
        conn.execute("CREATE TABLE responses (id VARCHAR(64) PRIMARY KEY, created_at FLOAT, previous_response_id "
                     "VARCHAR(64), response TEXT, input_items TEXT, accounting TEXT)")
        conn.execute("INSERT INTO responses VALUES ('resp_old', 0, NULL, '{\"id\": \"resp_old\"}', '[]', '{}')")
    store = ResponseStore(db)
    assert store.get("resp_old") is not None  # the keyless server's, as before
    assert store.get("resp_old", "alice") is None
    store.put(response("resp_new"), [], {}, "alice")
    assert store.get("resp_new", "alice") is not None
