"""The package's layers import one way: models <- kernels <- engine <- server, router, agents <- cli, and no
module imports another that (through any chain) imports it back. Read from the source, imports
inside functions included: a lazy import in a circle is still a circle."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import wafer

ROOT = Path(wafer.__file__).parent


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_nodes(tree: ast.AST):
    """Every node but those under `if TYPE_CHECKING:` (imports for annotations only)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and getattr(child.test, "id", getattr(child.test, "attr", None)) == "TYPE_CHECKING":
                stack.extend(child.orelse)
                continue
            stack.append(child)


def _imports() -> dict[str, set[str]]:
    """Each wafer module -> the wafer modules it imports (a package's import counts as its __init__)."""
    modules = {_module(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for t in targets:
                if t in modules and t != name:
                    found.add(t)
        graph[name] = found
    return graph


def test_no_module_imports_in_a_circle():
    graph = _imports()
    cycles = []
    for start in graph:
        stack, seen = [(start, [start])], set()
        while stack:
            node, trail = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    cycles.append(" -> ".join(trail + [start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, trail + [nxt]))
    # a package's __init__ importing its own submodules is not a circle of code
    cycles = [c for c in cycles if not all(m.startswith(c.split(" -> ")[0]) for m in c.split(" -> "))]
    assert not cycles, "\n".join(sorted(set(cycles)))


UPPER = ("wafer.server", "wafer.router", "wafer.agents", "wafer.benchmark", "wafer.cli")
# The model layers whose forward pass calls a kernel (BlockLinear, GGUFEmbedding) and the compute
# path's choice, which asks whether the kernels build: the only models that import wafer.kernels.
MODELS_ON_KERNELS = ("wafer.models.quant", "wafer.models.gguf_blocks")


def test_the_layers_import_one_way():
    graph = _imports()
    wrong = []
    for name, deps in graph.items():
        for dep in deps:
            if name.startswith("wafer.models") and dep.startswith(("wafer.engine", *UPPER)):
                wrong.append(f"{name} imports {dep}")
            if name.startswith("wafer.models") and dep.startswith("wafer.kernels") and name not in MODELS_ON_KERNELS:
                wrong.append(f"{name} imports {dep}")
            if name.startswith("wafer.kernels") and dep.startswith(("wafer.engine", *UPPER)):
                wrong.append(f"{name} imports {dep}")
            if name.startswith("wafer.engine") and dep.startswith(UPPER):
                wrong.append(f"{name} imports {dep}")
            if name.startswith(UPPER) and dep.startswith("wafer.cli") and name != "wafer.cli":
                wrong.append(f"{name} imports {dep}")
    assert not wrong, "\n".join(sorted(wrong))


# Where the engine decides what runs (which sequences, which blocks, how much prompt work) and the
# parts that run it (the model runner, its executors, CUDA graphs, pipeline stages, the KV tensors).
DECIDES = ("wafer.engine.scheduler", "wafer.engine.block_manager", "wafer.engine.block_pool",
           "wafer.engine.kv_layout", "wafer.engine.prompt_budget", "wafer.engine.step_cost", "wafer.engine.sequence")
RUNS = ("wafer.engine.model_runner", "wafer.engine.executor", "wafer.engine.cuda_graph", "wafer.engine.pipeline",
        "wafer.engine.kv_cache")


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, stack = set(), [start]
    while stack:
        for nxt in graph[stack.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return seen


def test_the_scheduler_and_the_block_manager_do_not_reach_the_runner():
    """The scheduler, the block manager and what they use know sequences and blocks, not tensors or
    how a step is computed: nothing they import, through any chain, is the runner's."""
    graph = _imports()
    wrong = [f"{name} reaches {dep}" for name in DECIDES for dep in _reachable(graph, name) if dep.startswith(RUNS)]
    assert not wrong, "\n".join(sorted(wrong))


def test_the_engines_parts_do_not_import_the_engine():
    """LLMEngine puts the parts together; only AsyncEngine, which steps it, imports it."""
    graph = _imports()
    wrong = [name for name, deps in graph.items() if name.startswith("wafer.engine") and "wafer.engine.engine" in deps
             and name not in ("wafer.engine.engine", "wafer.engine.async_engine")]
    assert not wrong, "\n".join(sorted(wrong))


INSIDES = re.compile(r"\bengine\.(engine|kv|blocks|scheduler|runner|executor|speculator|picker|outputs|budget|constraints)\b"
                     r"|\.constraints\.")


def test_the_server_reaches_the_engine_through_its_interface():
    """Nothing above the engine reads an engine's insides (`.engine.engine`, its KV cache and blocks,
    its scheduler, runner, executor, speculator, token picker, output processor, prompt budget, its
    grammar constraints): AsyncEngine is the boundary."""
    found = []
    for path in ROOT.rglob("*.py"):
        if _module(path).startswith(("wafer.server", "wafer.router", "wafer.agents")):
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if INSIDES.search(line) and not line.lstrip().startswith(("from ", "import ")):
                    found.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not found, "\n".join(found)


def test_the_settings_import_nothing_of_wafer():
    """wafer.config holds the defaults every layer reads, the models' and the engine's included, so it
    imports no other wafer module: one that did would put its layer below the models."""
    graph = _imports()
    wrong = [f"{name} imports {dep}" for name, deps in graph.items() if name.startswith("wafer.config")
             for dep in deps if not dep.startswith("wafer.config")]
    assert any(name.startswith("wafer.config") for name in graph)
    assert not wrong, "\n".join(sorted(wrong))


def test_the_server_reads_its_settings_from_wafer_config():
    """The server's defaults (reasoning budgets, engine settings) come from wafer.config, not from the
    router's wafer.toml parser: only main.py, which loads the configuration, and app.py, which routes,
    import the router."""
    graph = _imports()
    wrong = [f"{name} imports {dep}" for name, deps in graph.items() if name.startswith("wafer.server")
             and name not in ("wafer.server.main", "wafer.server.app") for dep in deps if dep.startswith("wafer.router")]
    assert not wrong, "\n".join(sorted(wrong))
