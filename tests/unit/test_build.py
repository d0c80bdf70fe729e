"""What the installation built: the group codec's optional C accelerator."""

from __future__ import annotations

import os

import pytest


def test_the_codec_accelerator_is_built_where_ci_runs():
    # The extension is optional (no compiler: the codec runs pure Python), so a failed build
    # would not fail the install. CI has a compiler: there it must have been built, or the
    # suite would quietly test one of the codec's two paths.
    if not os.environ.get("CI"):
        pytest.skip("outside CI the accelerator is optional")
    if os.environ.get("ASYNCRL_PURE_PYTHON"):
        pytest.skip("ASYNCRL_PURE_PYTHON turns the accelerator off")
    import asyncrl.queue._fastgroups  # noqa: F401  (ImportError: it was not built)
    from asyncrl.queue import group_codec as codec

    assert codec._fast is not None
