"""Whether every part of a JSON Schema admits a finite value: a recursive `$ref` that each branch
requires (an object whose required key holds the object again, an array of at least one of itself)
or a bare `$ref` cycle admits none. The grammar compiled from such a schema can never be completed,
and working out the masks of its endless nesting held each engine step for a second or more; so such
a schema is refused before it is compiled.

A part admits a finite value (is "grounded") if the keywords it is made of allow one from grounded
parts: any branch of `anyOf`/`oneOf`, every part of `allOf`, the `$ref`'s target, and for its type
(any type if it names none) a scalar, or an object whose required keys' schemas are grounded, or an
array whose first `minItems` items' schemas are. The grounded parts are the least fixed point of
these rules, found pass by pass. What these rules do not model (`not`, `if`, `minProperties`, a
`$ref` outside the document) counts as grounded: a doubt never refuses a schema, and the engine's
grammar time budget stops at run time what is refused nowhere else.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

# Keywords whose value is one subschema, and those whose value is a list or a map of them.
_ONE = ("items", "additionalProperties", "additionalItems", "unevaluatedItems", "unevaluatedProperties",
        "contains", "propertyNames", "not", "if", "then", "else")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "dependentSchemas")
_SCALARS = {"string", "number", "integer", "boolean", "null"}
# Passes of the fixed point: one per level of references that wait on each other (a schema deeper
# than this is refused earlier, by its depth); beyond them nothing more is refused.
_MAX_PASSES = 64


def unbounded_part(schema: dict[str, Any]) -> str | None:
    """The JSON pointer of a part of `schema` that admits no finite value ("#" for the whole), or
    None if every part reachable from the root admits one."""
    nodes = _reachable(schema)
    grounded: set[int] = set()
    for _ in range(_MAX_PASSES):
        grew = False
        for node, _pointer in nodes:
            if id(node) not in grounded and _grounded(node, schema, grounded):
                grounded.add(id(node))
                grew = True
        if not grew:
            break
    else:
        return None
    stuck = [pointer for node, pointer in nodes if id(node) not in grounded]
    return min(stuck, key=lambda p: (p.count("/"), p)) if stuck else None


def _resolve(root: dict[str, Any], ref: Any) -> Any:
    """The subschema a local `$ref` ("#", "#/$defs/x") points at; None for any other reference."""
    if not isinstance(ref, str) or not ref.startswith("#") or (len(ref) > 1 and ref[1] != "/"):
        return None
    node: Any = root
    for token in ref[2:].split("/") if len(ref) > 1 else []:
        token = unquote(token).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdecimal() and int(token) < len(node):
            node = node[int(token)]
        else:
            return None
    return node if isinstance(node, (dict, bool)) else None


def _children(node: dict[str, Any]) -> list[tuple[str, Any]]:
    out = []
    for key in _ONE:
        if isinstance(node.get(key), (dict, bool)):
            out.append((key, node[key]))
    for key in _LIST:
        if isinstance(node.get(key), list):
            out += [(f"{key}/{i}", s) for i, s in enumerate(node[key]) if isinstance(s, (dict, bool))]
    for key in _MAP:
        if isinstance(node.get(key), dict):
            out += [(f"{key}/{_escape(k)}", s) for k, s in node[key].items() if isinstance(s, (dict, bool))]
    return out


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _reachable(root: dict[str, Any]) -> list[tuple[dict[str, Any], str]]:
    """Each subschema the root's value can be checked against, once, with its pointer: through the
    keywords that apply subschemas and through local `$ref`s (a definition nothing refers to is not
    reached). Children come before their parents, so that a pass sees most of what a part needs."""
    seen: set[int] = set()
    order: list[tuple[dict[str, Any], str]] = []
    stack: list[tuple[Any, str, bool]] = [(root, "#", False)]
    while stack:
        node, pointer, expanded = stack.pop()
        if expanded:
            order.append((node, pointer))
            continue
        if not isinstance(node, dict) or id(node) in seen:  # `false` is no part: a keyword's "nothing here"
            continue
        seen.add(id(node))
        stack.append((node, pointer, True))
        for key, child in _children(node):
            stack.append((child, f"{pointer}/{key}", False))
        target = _resolve(root, node.get("$ref"))
        if target is not None:
            stack.append((target, node["$ref"], False))
    return order


def _grounded(node: Any, root: dict[str, Any], grounded: set[int]) -> bool:
    """Whether `node` admits a finite value, given the parts known to (`grounded`)."""
    if isinstance(node, bool):
        return node

    def ok(s: Any) -> bool:  # what is no schema at all is not this check's to refuse
        return not isinstance(s, (dict, bool)) or s is True or (isinstance(s, dict) and id(s) in grounded)

    if "$ref" in node:
        target = _resolve(root, node["$ref"])
        if target is not None and not ok(target):
            return False
    if isinstance(node.get("allOf"), list) and not all(ok(s) for s in node["allOf"]):
        return False
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list) and node[key] and not any(ok(s) for s in node[key]):
            return False
    if "const" in node or "enum" in node:  # a value written out: the other keywords check it
        return True
    types = node.get("type")
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else None
    if types is None or any(isinstance(t, str) and t in _SCALARS for t in types):
        return True
    return ("object" in types and _object_grounded(node, ok)) or ("array" in types and _array_grounded(node, ok))


def _object_grounded(node: dict[str, Any], ok: Any) -> bool:
    props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    extra = node.get("additionalProperties", True)
    required = node.get("required")
    for key in required if isinstance(required, list) else []:
        if not isinstance(key, str):
            continue
        schema = props[key] if key in props else extra if isinstance(extra, dict) else True
        if not ok(schema):
            return False
    return True


def _array_grounded(node: dict[str, Any], ok: Any) -> bool:
    least = node.get("minItems", 0)
    if not isinstance(least, int) or least <= 0:
        return True
    prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
    items = node.get("items", True)
    if isinstance(items, list):  # draft 4-7 tuples
        prefix, items = items, node.get("additionalItems", True)
    return all(ok(prefix[i] if i < len(prefix) else items) for i in range(min(least, len(prefix) + 1)))
