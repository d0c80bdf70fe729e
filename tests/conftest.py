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
