"""Tool calls that are right, not only well-formed: four cases of the Berkeley Function Calling
Leaderboard (BFCL v4, `simple_python` 0-1 and `multiple` 0-1) on terra, greedy, `tool_choice` auto,
as bench/bfcl.py sends them, each judged as BFCL's AST checker judges a call: the function the
question needs, every required argument with one of its accepted values, an optional one left out
or right, nothing else. terra answered all four right in bench/bfcl.py (before and after the calls
were laid out as the model writes them), so the threshold is all four.

The cases are written out here (tools already in the OpenAI form bench/bfcl.py gives them, `.` in
names as `_`) so that the suite does not need the bench's `bfcl-eval`."""

from __future__ import annotations

import json

import pytest

from tests.serving import start_server
from wafer.models import catalog

pytestmark = pytest.mark.heavy


def fn(name: str, description: str, props: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description + (
        " Note that the provided function is in Python 3 syntax."), "parameters": {
        "type": "object", "properties": props, "required": required}}}


def integer(description: str) -> dict:
    return {"type": "integer", "description": description}


FLAG = {"type": "boolean", "default": True}
TRIANGLE = fn("triangle_properties_get", "Retrieve the dimensions, such as area and perimeter, of a triangle if lengths "
              "of three sides are given.",
              {"side1": integer("The length of first side of the triangle."),
               "side2": integer("The length of second side of the triangle."),
               "side3": integer("The length of third side of the triangle."),
               "get_area": {**FLAG, "description": "A flag to determine whether to calculate the area of triangle. "
                                                   "Default is true."},
               "get_perimeter": {**FLAG, "description": "A flag to determine whether to calculate the perimeter of "
                                                        "triangle. Default is true."},
               "get_angles": {**FLAG, "description": "A flag to determine whether to calculate the internal angles "
                                                     "of triangle. Default is true."}}, ["side1", "side2", "side3"])
CIRCLE = fn("circle_properties_get", "Retrieve the dimensions, such as area and circumference, of a circle if radius "
            "is given.",
            {"radius": {"type": "number", "description": "The length of radius of the circle. This is a float type "
                                                         "value."},
             "get_area": {**FLAG, "description": "A flag to determine whether to calculate the area of circle. "
                                                 "Default is true."},
             "get_circumference": {**FLAG, "description": "A flag to determine whether to calculate the "
                                                          "circumference of circle. Default is true."}}, ["radius"])
FLOAT = {"type": "number"}
# (question, tools, the function due, its arguments' accepted values; "" where it may be left out)
CASES = [
    ("Find the area of a triangle with a base of 10 units and height of 5 units.",
     [fn("calculate_triangle_area", "Calculate the area of a triangle given its base and height.",
         {"base": integer("The base of the triangle."), "height": integer("The height of the triangle."),
          "unit": {"type": "string", "description": "The unit of measure (defaults to 'units' if not specified)"}},
         ["base", "height"])],
     "calculate_triangle_area", {"base": [10], "height": [5], "unit": ["units", ""]}),
    ("Calculate the factorial of 5 using math functions.",
     [fn("math_factorial", "Calculate the factorial of a given number.",
         {"number": integer("The number for which factorial needs to be calculated.")}, ["number"])],
     "math_factorial", {"number": [5]}),
    ("Can I find the dimensions and properties of a triangle, if I know its three sides are 5 units, 4 units and 3 "
     "units long?", [TRIANGLE, CIRCLE],
     "triangle_properties_get", {"side1": [5], "side2": [4], "side3": [3], "get_area": ["", True],
                                 "get_perimeter": ["", True], "get_angles": ["", True]}),
    ("Calculate the area of a triangle, given the lengths of its three sides: 3, 4, and 5.",
     [fn("math_triangle_area_heron", "Calculates the area of a triangle using Heron's formula, given the lengths of "
         "its three sides.", {"side1": integer("Length of the first side of the triangle."),
                              "side2": integer("Length of the second side of the triangle."),
                              "side3": integer("Length of the third side of the triangle.")},
         ["side1", "side2", "side3"]),
      fn("math_circle_area", "Calculates the area of a circle given its radius.",
         {"radius": {**FLOAT, "description": "The radius of the circle. This is a float type value."}}, ["radius"]),
      fn("math_triangle_area_base_height", "Calculates the area of a triangle using the formula (1/2)base*height.",
         {"base": {**FLOAT, "description": "The base length of the triangle. This is a float type value."},
          "height": {**FLOAT, "description": "The height of the triangle. This is a float type value."}},
         ["base", "height"])],
     "math_triangle_area_heron", {"side1": [3], "side2": [4], "side3": [5]}),
]
RIGHT = 4  # of 4: terra's score in bench/bfcl.py


def right(calls: list[tuple[str, str]], name: str, accepted: dict) -> bool:
    """BFCL's verdict on a case owed one call: that function, each argument one of its accepted
    values (bool is not int, as its checker has it), those that may be left out left out or right,
    and no argument it does not know."""
    if len(calls) != 1 or calls[0][0] != name:
        return False
    args = json.loads(calls[0][1])
    if set(args) - set(accepted):
        return False
    for key, values in accepted.items():
        if key not in args:
            if "" not in values:
                return False
        elif not any(args[key] == v and type(args[key]) is type(v) for v in values if v != ""):
            return False
    return True


@pytest.mark.timeout(600)
def test_terra_keeps_its_bfcl_subset():
    model = catalog.find("terra")
    if catalog.installed_path(model) is None:
        pytest.skip(f"{model.name} is not installed (`wafer models install`)")
    from openai import OpenAI

    from wafer.models.loader import load_model

    server = start_server(load_model("terra", compute="auto"), names=["terra"], max_running=4)
    try:
        client = OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=300)
        verdicts = []
        for question, tools, name, accepted in CASES:
            reply = client.chat.completions.create(model="terra", messages=[{"role": "user", "content": question}],
                                                   tools=tools, tool_choice="auto", temperature=0, max_tokens=128)
            calls = [(c.function.name, c.function.arguments) for c in reply.choices[0].message.tool_calls or []]
            verdicts.append((right(calls, name, accepted), calls or reply.choices[0].message.content))
    finally:
        server.stop()
    assert sum(ok for ok, _ in verdicts) >= RIGHT, verdicts
