"""The docs: the site builds with `mkdocs build --strict` (a broken link or anchor fails it), every
`wafer.toml` key and every command-line flag is in the user guide, and the README's examples run as
written against real servers on loopback.

The README's examples name `http://localhost:8000`, where `make serve` listens; the tests run them
with that port replaced by a free one, and nothing else changed."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.serving import free_port, serve_process

# A long module: `make serve`'s three tiers load in a server process of their own, and examples decode on sol.
pytestmark = pytest.mark.heavy

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
CONFIG_PAGE = DOCS / "guide" / "configuration.md"
DOCUMENTED_URL = "http://localhost:8000"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def section(markdown: str, heading: str) -> str:
    """The text under the heading named `heading` (any level), up to the next heading of its level
    or above. Fails when the page has no such heading, so that a renamed section fails its test."""
    m = re.search(rf"^(#+) {re.escape(heading)}\n", markdown, re.MULTILINE)
    assert m is not None, f"no heading {heading!r}"
    level = len(m.group(1))
    end = re.compile(rf"^#{{1,{level}}} ", re.MULTILINE).search(markdown, m.end())
    return markdown[m.end():end.start() if end else len(markdown)]


def blocks(text: str) -> list[tuple[str, str]]:
    """The fenced code blocks of `text`: (language, code)."""
    return FENCE.findall(text)


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], capture_output=True, text=True, timeout=120)


# --- the site --------------------------------------------------------------------------------------

def test_the_site_builds_with_strict_checks(tmp_path):
    done = mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "guide" / "configuration" / "index.html").exists()


@pytest.mark.parametrize("broken", ["[a page](guide/no-such-page.md)", "[a section](guide/api.md#no-such-section)"])
def test_a_broken_link_fails_the_build(tmp_path, broken):
    """The strict build is what stops a broken link: the same docs with one added must fail."""
    shutil.copytree(DOCS, tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    index = tmp_path / "docs" / "index.md"
    index.write_text(index.read_text() + f"\nSee {broken}.\n")
    done = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0
    assert broken.split("(")[1].rstrip(")").split("#")[-1] in done.stdout + done.stderr


def test_the_readme_links_resolve():
    """The README is not part of the site, so its links are checked here: each relative one names
    a file of the repository, and a `#section` a heading of that page."""
    from markdown.extensions.toc import slugify

    links = re.findall(r"\]\(([^)\s]+)\)", README.read_text())
    relative = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert relative, "the README links into docs/"
    for link in relative:
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.is_file(), f"README links to {link}, which is not a file"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", target.read_text(), re.MULTILINE)
            assert anchor in {slugify(h, "-") for h in headings}, f"README links to {link}: no such heading"


def test_the_modules_and_functions_the_docs_name_exist():
    """`python -m wafer...` commands run a module that exists (a package, its __main__), and a
    function named as `wafer.module.function()` is there: modules move, and the docs must follow."""
    import importlib
    import importlib.util

    texts = [README.read_text(), *(page.read_text() for page in DOCS.rglob("*.md"))]
    modules = {m for text in texts for m in re.findall(r"-m (wafer(?:\.\w+)+)", text)}
    functions = {f for text in texts for f in re.findall(r"`(wafer(?:\.\w+)+)\(\)`", text)}
    assert modules and functions
    for name in modules:
        spec = importlib.util.find_spec(name)
        assert spec is not None, f"the docs run `-m {name}`, which does not exist"
        if spec.submodule_search_locations is not None:
            assert importlib.util.find_spec(name + ".__main__") is not None, f"`-m {name}`: a package without __main__"
    for dotted in functions:
        module, _, attr = dotted.rpartition(".")
        found = getattr(importlib.import_module(module), attr, None)
        assert callable(found), f"the docs name {dotted}(), which is gone"


# --- every setting ---------------------------------------------------------------------------------

def config_keys() -> dict[str, set[str]]:
    """What the `wafer.toml` parser accepts, by table, read from the code: the option lists it
    checks keys against and the dataclasses it fills. A field added to ServeConfig counts as a
    top-level key until it is placed in a table here."""
    from wafer.models.generation_defaults import NEUTRAL
    from wafer.router import config

    def fields(cls: type) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    tables = {"models", "upstreams", "tiers", "aliases", "routing", "reasoning"}
    agents = {"subagent_model"}  # ServeConfig's fields that [agents] sets
    sandbox = {"program_limits", "programs"}  # ServeConfig's fields that [sandbox] sets
    return {
        "top level": fields(config.ServeConfig) - tables - agents - sandbox,
        # `name` is the table's own name, `options` holds the ENGINE_OPTIONS
        "[models.NAME]": fields(config.LocalModelConfig) - {"name", "options"} | {*config.MODEL_SETTINGS,
                                                                                    *config.ENGINE_OPTIONS},
        "[models.NAME.sampling]": set(NEUTRAL),
        "[upstreams.NAME]": fields(config.UpstreamConfig) - {"name"} | set(config.UPSTREAM_OPTIONS),
        "[tiers]": set(config.TIERS),
        "[routing]": fields(config.RoutingConfig),
        "[routing.tiers]": set(config.RoutingConfig().tiers),
        "[reasoning]": set(config.REASONING_BUDGETS),
        "[agents]": agents & fields(config.ServeConfig),
        "[sandbox]": set(config.SANDBOX_KEYS) if sandbox <= fields(config.ServeConfig) else set(),
    }


def test_every_wafer_toml_key_is_in_the_configuration_page():
    page = CONFIG_PAGE.read_text()
    keys = config_keys()
    assert all(keys.values()), keys  # an empty table would pass whatever the page says
    for table, names in keys.items():
        rows = set(re.findall(r"^\| `([a-z_0-9]+)` \|", section(page, f"`{table}`" if "[" in table else "Top level"),
                              re.MULTILINE))
        missing = names - rows
        assert not missing, f"{table}: no row for {sorted(missing)} in {CONFIG_PAGE.name}"


def test_the_complete_example_is_a_valid_wafer_toml_with_every_key(tmp_path):
    """The page's complete example loads, so that every key it shows is one the parser takes, and
    it has every key the parser takes."""
    from wafer.router.config import load_config

    (lang, example), = blocks(section(CONFIG_PAGE.read_text(), "A complete example"))
    assert lang == "toml"
    path = tmp_path / "wafer.toml"
    path.write_text(example)
    load_config(path)
    raw = tomllib.loads(example)
    shown = {
        "top level": {k for k, v in raw.items() if not isinstance(v, dict)},
        "[models.NAME]": set().union(*map(set, raw["models"].values())),
        "[models.NAME.sampling]": set().union(*(set(m.get("sampling", {})) for m in raw["models"].values())),
        "[upstreams.NAME]": set().union(*map(set, raw["upstreams"].values())),
        "[tiers]": set(raw["tiers"]),
        "[routing]": set(raw["routing"]),
        "[routing.tiers]": set(raw["routing"]["tiers"]),
        "[reasoning]": set(raw["reasoning"]),
        "[agents]": set(raw["agents"]),
        "[sandbox]": set(raw["sandbox"]),
    }
    for table, names in config_keys().items():
        assert names <= shown[table], f"{table}: the example lacks {sorted(names - shown[table])}"


def test_every_wafer_toml_in_the_docs_loads(tmp_path):
    """Each ```toml block of the docs is a whole wafer.toml that `wafer serve --config` accepts."""
    from wafer.router.config import load_config

    found = [(page, code) for page in sorted(DOCS.rglob("*.md")) for lang, code in blocks(page.read_text())
             if lang == "toml"]
    assert len(found) >= 2  # the complete example and the replicas' front
    for page, code in found:
        path = tmp_path / "wafer.toml"
        path.write_text(code)
        load_config(path)


# The page that lists each command's flags.
FLAG_PAGES = {"bench": DOCS / "guide" / "benchmarks.md"}


def test_every_command_and_flag_is_in_the_user_guide():
    import argparse

    from wafer.cli import build_parser

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    models_page = (DOCS / "guide" / "models.md").read_text()
    assert commands.choices
    for name, parser in commands.choices.items():
        assert f"`wafer {name}" in models_page, f"wafer {name} is not in the command table"
        page = FLAG_PAGES.get(name, DOCS / "guide" / "models.md").read_text()
        flags = [o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"]
        missing = [f for f in flags if f"`{f}" not in page]
        assert not missing, f"wafer {name}: {missing} not in docs/guide/{FLAG_PAGES.get(name, Path('models.md')).name}"


# --- the README's examples, run --------------------------------------------------------------------

def at(base: str, code: str) -> str:
    """`code` with the documented address's port replaced by the test server's (`base`)."""
    assert DOCUMENTED_URL in code, f"an example that does not name {DOCUMENTED_URL}:\n{code}"
    return code.replace(DOCUMENTED_URL, base)


def run_block(lang: str, code: str, timeout: float = 300) -> str:
    """Runs a README block as a user would paste it; returns what it printed. A block in a language
    the test cannot run fails, rather than being skipped."""
    if lang == "sh":
        argv = ["bash", "-eu", "-o", "pipefail", "-c", code]
    elif lang == "python":
        argv = [sys.executable, "-c", code]
    else:
        raise AssertionError(f"a README example in {lang!r}, which the test cannot run")
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert done.returncode == 0, f"exit status {done.returncode}\n{code}\n{done.stdout}\n{done.stderr}"
    assert done.stdout.strip(), f"printed nothing:\n{code}\n{done.stderr}"
    return done.stdout


def serve_command() -> list[str]:
    """What `make serve` runs once set up: the last command of its dry run (the ones before it, if
    any, set up .venv, which the suite runs in already)."""
    done = subprocess.run(["make", "--no-print-directory", "-n", "serve"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    command = shlex.split(done.stdout.strip().splitlines()[-1])
    assert Path(command[0]).name == "wafer" and command[1] == "serve", command
    return command


@pytest.fixture(scope="module")
def make_serve(tmp_path_factory) -> Iterator[str]:
    """`make serve`'s server, the three tiers' models, on a free port; its base URL, as the README
    writes it (localhost) with that port."""
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with serve_process([*serve_command(), "--port", str(port)], port, log, 240, cwd=ROOT):
        yield f"http://localhost:{port}"


def test_the_quick_start_runs_as_written(make_serve):
    quick = blocks(section(README.read_text(), "Quick start"))
    server, *clients = quick
    assert server == ("sh", "make serve\n"), "the quick start starts with `make serve`, which the fixture runs"
    assert clients, "the quick start has examples to run"
    for lang, code in clients:
        out = run_block(lang, at(make_serve, code))
        if lang == "sh":  # curl, which prints the body whatever the status: it must be an answer
            body = json.loads(out)
            assert "error" not in body, body
            assert body["choices"][0]["message"]["content"].strip(), body


def example(title: str) -> tuple[str, str]:
    """The README's agents example that follows the paragraph starting with **title**."""
    text = section(README.read_text(), "Agents")
    start = text.index(f"**{title}**")
    (lang, code), *_ = blocks(text[start:])
    return lang, code


def example_at(title: str, base: str) -> tuple[str, str]:
    lang, code = example(title)
    return lang, at(base, code)


def test_the_max_example_reasons_then_answers(make_serve):
    out = run_block(*example_at("Max", make_serve))
    reasoning, answer = out.split("reasoning:", 1)[1].split("answer:", 1)
    assert reasoning.strip() and answer.strip(), out


# Programmatic tool calling and Ultra on a scripted model: what the README teaches there is the
# client's side (the items, the loop that sends tool outputs back, the fields it reads), and a
# script makes each turn known, so that the test can check that the example's loop feeds the
# program and prints its result. The Max example above and the quick start run on the real models.

@pytest.fixture(scope="module")
def scripted(smollm, tmp_path_factory):
    from tests.agents.scripted import ScriptedChat
    from tests.serving import start_server
    from wafer.agents.responses import ResponsesService
    from wafer.agents.store import ResponseStore

    script = ScriptedChat([])
    service = ResponsesService(script, ResponseStore(tmp_path_factory.mktemp("state") / "state.db"))
    server = start_server(smollm, names=["sol"], responses=service)
    yield server.base_url.replace("127.0.0.1", "localhost"), script
    server.stop()


PROGRAM = """
total = 0
for sku in ["A7", "B2", "C9"]:
    total += (await get_stock(sku=sku))["units"]
text(total)
"""


def test_the_programmatic_tool_calling_example_feeds_the_program(scripted):
    from wafer.agents.sandbox import check_sandbox

    if check_sandbox() is not None:
        pytest.skip(f"no sandbox here: {check_sandbox()}")
    base, script = scripted

    def answer(body):
        results = json.dumps(body["messages"])
        assert "12" in results, results  # the program's output: 3 + 5 + 4 from the example's STOCK
        return "There are 12 units in stock."

    script.bodies.clear()
    script.turns[:] = [[("run_program", {"code": PROGRAM})], answer]
    out = run_block(*example_at("Programmatic tool calling", base)).splitlines()
    assert out == ["program completed 12", "There are 12 units in stock."]


def test_the_ultra_example_plans_runs_agents_and_synthesises(scripted):
    base, script = scripted
    parts = ["Python", "Go", "Rust"]

    def team(body):
        if body.get("response_format"):  # the plan, of as many parts as the example asks for
            assert body["response_format"]["json_schema"]["schema"]["properties"]["subtasks"]["maxItems"] == len(parts)
            return json.dumps({"subtasks": [f"a paragraph on {p}" for p in parts]})
        first = next(m["content"] for m in body["messages"] if m["role"] == "user")
        if first.startswith("You are agent_"):
            return "Notes on " + first.split("a paragraph on ", 1)[1]
        return "Verdict: Go for a quick tool, Rust for a fast one."

    script.turns[:] = []
    script.policy = team
    try:
        out = run_block(*example_at("Ultra", base)).splitlines()
    finally:
        script.policy = None
    assert out[-1] == "Verdict: Go for a quick tool, Rust for a fast one."
    assert [line.split()[0] for line in out[:-1]] == ["root", "agent_1", "agent_2", "agent_3"], out


def test_the_batch_example_runs_as_written(make_serve):
    (lang, code), = blocks(section(README.read_text(), "Batch API"))
    out = run_block(lang, at(make_serve, code)).splitlines()
    assert out[0].startswith("completed ") and "completed=3, failed=0, total=3" in out[0], out
    # Each custom id with its answer after it (an answer may run over several lines, blank ones too).
    ids = [i for i, line in enumerate(out) if line.split()[:1] in (["q1"], ["q2"], ["q3"])]
    assert [out[i].split()[0] for i in ids] == ["q1", "q2", "q3"] and ids[0] == 1, out
    answers = ["\n".join(out[i:j]).split(None, 1)[1:] for i, j in zip(ids, ids[1:] + [len(out)])]
    assert all(a and a[0].strip() for a in answers), out


def test_every_readme_example_is_run_by_a_test():
    """A new example in the README's quick start or agents section needs a test here."""
    readme = README.read_text()
    assert len(blocks(section(readme, "Quick start"))) == 3  # make serve, curl, the SDK
    titles = re.findall(r"^\*\*([^*]+)\*\*", section(readme, "Agents"), re.MULTILINE)
    assert titles == ["Programmatic tool calling", "Ultra", "Max"]
    assert len(blocks(section(readme, "Agents"))) == len(titles)
    assert len(blocks(section(readme, "Batch API"))) == 1
