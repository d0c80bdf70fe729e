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
