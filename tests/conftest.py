import asyncio
import os

import pytest


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _quiet_threads():
    # Two cores are shared by every process a test starts; one torch thread each keeps
    # multi-process tests from oversubscribing the machine.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    yield


@pytest.fixture(params=["accelerated", "pure-python"])
def codec_path(request, monkeypatch):
    """Run a test on both paths of the group codec: the C accelerator and pure Python.

    Modules opt in with ``pytestmark = pytest.mark.usefixtures("codec_path")``.
    """
    from asyncrl.queue import group_codec as codec

    if request.param == "accelerated":
        if codec._fast is None:
            pytest.skip("asyncrl.queue._fastgroups is not built (or ASYNCRL_PURE_PYTHON is set)")
    else:
        monkeypatch.setattr(codec, "_fast", None)
    return request.param


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """``tiny_model(seed=0, **overrides) -> path``: the tiny model built once per set of settings."""
    from asyncrl.models.tiny import build_tiny_model

    built = {}

    def get(seed: int = 0, **overrides):
        key = (seed, tuple(sorted(overrides.items())))
        if key not in built:
            built[key] = build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=seed, **overrides)
        return built[key]

    return get


@pytest.fixture(scope="session")
def model_path(tiny_model):
    """The default tiny model (seed 0); a test module may override it with its own settings."""
    return tiny_model()


async def _until(predicate, timeout: float = 60.0, what: str = "the condition") -> None:
    """Wait until ``predicate()`` holds, re-checking every 10 ms; AssertionError after ``timeout`` s."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


@pytest.fixture
def until():
    """``await until(predicate, timeout=60, what=...)`` (see `_until`)."""
    return _until
