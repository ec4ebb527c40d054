import json

import pytest

from wafer.untrusted_json import MAX_DEPTH, TooDeep, loads, too_deep


def nested(depth: int, opener: str = "[", closer: str = "]") -> str:
    return opener * depth + "1" + closer * depth


def test_the_bound_is_exact_for_arrays_objects_and_both():
    for opener, closer in (("[", "]"), ('{"a":', "}"), ('[{"a":', "}]")):
        per = opener.count("[") + opener.count("{")
        at = MAX_DEPTH // per
        assert json.dumps(loads(nested(at, opener, closer))).count(opener[0]) == at * opener.count(opener[0])
        with pytest.raises(TooDeep, match=f"more than {MAX_DEPTH} levels"):
            loads(nested(at + 1, opener, closer))
    assert issubclass(TooDeep, ValueError)  # callers that refuse bad JSON refuse this too


def test_brackets_in_strings_and_siblings_do_not_count():
    text = json.dumps({"code": "[" * 5000 + '\\"{' * 500, "list": [[1], [2]] * 3000})
    assert not too_deep(text) and loads(text)["code"].startswith("[[[")
    assert not too_deep(text.encode())
    # An escaped quote does not end a string: what follows it is still inside
    assert loads('{"a": "\\"' + "[" * 300 + '"}') == {"a": '"' + "[" * 300}
    assert too_deep('{"a": "x", "b": ' + nested(MAX_DEPTH)[:-MAX_DEPTH] + "]" * MAX_DEPTH + "}")


def test_not_json_is_refused_as_json_refuses_it():
    with pytest.raises(ValueError):
        loads("[" * 200)  # unbalanced and deep: refused, whichever check sees it first
    with pytest.raises(ValueError):
        loads('{"a": ')
    assert loads(b'{"a": [1, 2]}') == {"a": [1, 2]}
    with pytest.raises(TypeError):  # not text: json.loads's own refusal, as callers expect
        loads({"a": 1})
