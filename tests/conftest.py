import asyncio
import contextlib
import json
import os
from pathlib import Path

import pytest

from asyncrl.skip import SkipManager

# Ray renices its workers to 15 (asyncrl.placement.same_priority): beside the suite's other processes
# (three pytest workers on two cores) a Ray actor then took minutes to start, and tests timed out.
# Every Ray a test starts, in process or in a launched child (which inherits this), keeps one priority.
os.environ.setdefault("RAY_worker_niceness", "0")


FILE_SECONDS = Path(__file__).with_name("file_seconds.json")
"""Seconds each test file took in a full run (files under 20 s left out), 2026-11-29 on the 2-core
machine: the test durations of ``python -m pytest --durations=0`` summed per file."""


def _longest_files_first(items: list) -> None:
    """Order the files longest first (a stable sort; files not listed keep their order, after them).
    With ``--dist loadfile --no-loadscope-reorder`` xdist hands the files out in this order, so the
    workers start on the long runs and the short files fill in at the end, instead of a 10-minute
    file starting when the others are nearly done (the suite's 25-minute budget)."""
    seconds = json.loads(FILE_SECONDS.read_text()) if FILE_SECONDS.is_file() else {}
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], 0))


def pytest_collection_modifyitems(config, items):
    _longest_files_first(items)
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


@pytest.fixture(scope="module")
def ray_cluster(request):
    """A local Ray of the module's own (`asyncrl.placement.start_local_ray`: 2 CPUs, no log
    forwarding; a module's ``RAY_INIT`` dict adds to or overrides those arguments), shut down
    after the module's last test."""
    import ray

    from asyncrl.placement import start_local_ray

    start_local_ray(**{"num_cpus": 2, "log_to_driver": False, **getattr(request.module, "RAY_INIT", {})})
    yield
    ray.shutdown()


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


@SkipManager.annotate(role="rollout")
async def _rollout_batch(engine, tokenizer, rows: list[dict], *, first_index: int, n: int, temperature: float,
                         max_tokens: int, seed: int) -> list:
    """``n`` scored responses for each built-in task row, as groups ``sample_0_{first_index + i}``
    in feed order: the package's `Rollouter` with its gate wide open, collected instead of
    streamed. Annotated with the ``rollout`` skip role (one dump per `SkipManager.set_step`)."""
    from asyncrl.queue.memory import MemorySink
    from asyncrl.rollouter.rollouter import RolloutConfig, Rollouter, RolloutState, encode_prompts
    from asyncrl.tasks import arithmetic
    from asyncrl.types import parse_sample_id

    collected = MemorySink()
    cfg = RolloutConfig(n=n, max_tokens=max_tokens, temperature=temperature, groups_per_sync=len(rows),
                        max_concurrent=len(rows), seed=seed)

    def reward(prompt, response_ids) -> float:
        return arithmetic.reward(prompt.text, arithmetic.decode_response(tokenizer, response_ids))

    prompts = encode_prompts(tokenizer, rows, encode=arithmetic.encode_prompt)
    rollouter = Rollouter(cfg, [engine], collected, prompts, reward, state=RolloutState(next_index=first_index))
    await rollouter.run(num_groups=len(rows))
    return sorted(collected.groups, key=lambda g: parse_sample_id(g.sample_id)[1])


@pytest.fixture
def rollout_batch():
    """``await rollout_batch(engine, tokenizer, rows, first_index=, n=, temperature=, max_tokens=, seed=)``
    (see `_rollout_batch`)."""
    return _rollout_batch


def _run_launch(*args, timeout: float = 420.0) -> str:
    """``python -m asyncrl.launch *args`` in a child process (one torch thread); returns its output
    (stdout and stderr) after asserting exit 0. Past ``timeout`` it is killed by pid."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = tuple(map(str, args))
    if not any(a.startswith("trainer.rank_start_timeout_s=") for a in args):
        # A rank start takes 10-40 s here; one that does not come up (CI saw one stuck for 300 s,
        # cause unknown) is named and restarted by the launcher within the test's own deadline.
        args += ("trainer.rank_start_timeout_s=150",)
    proc = subprocess.Popen([sys.executable, "-m", "asyncrl.launch", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=root, env=env)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as e:  # say where it was: the output's tail, not its first line
        tail = e.output.decode(errors="replace") if isinstance(e.output, bytes) else e.output or ""
        tail = tail[-4000:]
        raise AssertionError(f"the launcher ran past {timeout:g} s; its output ended with:\n{tail}") from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out[-3000:]
    return out


@pytest.fixture
def run_launch():
    """``run_launch(*args, timeout=420) -> output``: the launcher in a child process, exit 0 asserted."""
    return _run_launch


@contextlib.contextmanager
def _two_ray_nodes(num_cpus: int):
    """Two Ray nodes on this machine (``ray.cluster_utils.Cluster``), ``num_cpus`` each; shut down on exit."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": num_cpus})
    try:
        cluster.add_node(num_cpus=num_cpus)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()


@pytest.fixture
def two_ray_nodes():
    """``with two_ray_nodes(num_cpus) as cluster:`` (see `_two_ray_nodes`)."""
    return _two_ray_nodes
