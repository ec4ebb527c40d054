from __future__ import annotations

import ctypes
import gc
import os
from pathlib import Path

import pytest
import torch

# Under `make test`'s pytest workers (pytest-xdist), each gets an equal share of the cores, and so do
# the processes its tests start (servers, CLI runs, torchrun nodes): more compute threads than cores
# leave OpenMP's threads spinning at barriers for a thread that waits for a core.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_SHARE = max(1, len(os.sched_getaffinity(0)) // _WORKERS)
torch.set_num_threads(_SHARE)
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(_SHARE))


_LIBC = ctypes.CDLL(None)
if not hasattr(_LIBC, "malloc_trim"):  # glibc's; other C libraries keep their own ways
    _LIBC = None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Long modules first, so that the workers, which take whole modules in this order, finish
    together rather than one waiting while the other runs a long module last."""
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)  # stable: the rest in order


@pytest.fixture(autouse=True, scope="module")
def _give_memory_back():
    """After each module, hand the heap's free pages back to the system: glibc keeps them otherwise,
    and a worker that has run the 1.5B model's float32 check (9 GB at its peak) held 2.4 GB of them
    through every later module, beside the other worker's, on a 24 GB CI machine."""
    yield
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


@pytest.fixture(scope="session")
def smollm():
    """The bundled model on the compute path `wafer serve` picks on this machine (q4 on wafer's best
    kernel variant wherever one builds), so that the engine and server tests test what runs."""
    from wafer.models.loader import load_model

    return load_model(compute="auto")


@pytest.fixture(scope="session")
def smollm_f32():
    """The float32 reference path: exact against transformers."""
    from wafer.models.loader import load_model

    return load_model(compute="f32")


@pytest.fixture(scope="session")
def smollm_hf():
    """transformers' own load of the same GGUF: the reference."""
    from tests.tiny import hf_from_gguf
    from wafer.models.loader import default_model_path

    return hf_from_gguf(default_model_path())


@pytest.fixture(scope="session")
def hf_tok():
    from tests.tiny import hf_tokenizer

    return hf_tokenizer()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    from tests.tiny import make_hf_model

    return make_hf_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


# --- a shared wafer server (tests/serving.py builds it) -------------------------------------------
from collections.abc import Iterator  # noqa: E402

from tests.serving import RunningServer, start_server  # noqa: E402
from wafer.engine.compute_threads import release_compute_threads  # noqa: E402


@pytest.fixture(scope="session")
def server(smollm) -> Iterator[RunningServer]:
    s = start_server(smollm)
    yield s
    s.stop()


@pytest.fixture()
def client(server):
    from openai import OpenAI

    release_compute_threads()  # tests that computed on this thread since would slow the server's steps

    return OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture()
def aclient(server):
    from openai import AsyncOpenAI

    release_compute_threads()

    return AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
