"""Child of test_endpoint_resume: a function agent trained through its endpoint (the Rollouter, one
Trainer rank with checkpoints, the built-in engine, a tiny random chat model, all in this process),
run twice on one run directory:

    EP_RESUME_DIR=RUN_DIR python -m tests.integration.endpoint_resume_child MODEL ATTEMPT

Attempt 1 holds both episodes of prompt ``q3`` after their first call (the agent waits, as in a
slow tool); after the first checkpoint whose Rollouter snapshot lists that group in flight, the
process kills itself with SIGKILL: a crash, with nothing stopped, drained or flushed. Attempt 2
restores as the launcher does (`checkpoint.load_latest`; the engine gets the restored weights at
the restored version; `RolloutState.resume` from the checkpoint's ``rollouter_state`` and committed
set) and trains until every group admitted before the crash is trained.

What the test reads, under RUN_DIR: ``agent.jsonl`` (each run of the agent, each call, each
booking, attempt 2's probes of the interrupted episodes' old URL and key), ``ledger.jsonl`` (the
agent's side effect, one line per key: ``{client.episode_key}/c{call}``), ``sent.jsonl`` (each group
sent on the stream: per trajectory its decoded text, turns and the versions of its sampled
tokens), and the Trainer's ``samples.jsonl``, ``transcripts.jsonl`` and ``checkpoints/``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import numpy as np
import openai

GATE = "q3"
"""The prompt whose episodes attempt 1 holds in flight until the crash."""
ROWS = 8
MAX_STEPS = 12


def hold(key: str) -> None:
    """Note an episode held now (attempt 1; a file: the agent runs in the endpoint's process)."""
    with open(_dir() / "held.txt", "a") as f:
        f.write(key + "\n")


def held_now() -> set[str]:
    path = _dir() / "held.txt"
    return set(path.read_text().split()) if path.exists() else set()


def _dir() -> Path:
    return Path(os.environ["EP_RESUME_DIR"])


def note(**record) -> None:
    with open(_dir() / "agent.jsonl", "a") as f:
        f.write(json.dumps({"attempt": int(os.environ["EP_RESUME_ATTEMPT"]), **record}) + "\n")


def book(key: str, what: str) -> bool:
    """The agent's side effect, made idempotent by its key: True if it ran now, False if an earlier run
    of the episode (before the crash) made it already."""
    ledger = _dir() / "ledger.jsonl"
    done = {json.loads(line)["key"] for line in ledger.read_text().splitlines()} if ledger.exists() else set()
    if key in done:
        return False
    with open(ledger, "a") as f:
        f.write(json.dumps({"key": key, "what": what}) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return True


async def probe(base_url: str, api_key: str) -> int | str:
    """What a call to ``base_url`` with ``api_key`` gets: an HTTP status, or ``refused`` (nothing listens)."""
    c = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=10)
    try:
        await c.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    except openai.APIStatusError as e:
        return e.status_code
    except openai.APIConnectionError:
        return "refused"
    return 200


async def probe_old(client) -> None:
    """Attempt 2: call the interrupted run of this episode at its old URL, at its old path on the new
    server, and this episode with the old key; note what each got."""
    old = [r for r in map(json.loads, (_dir() / "agent.jsonl").read_text().splitlines())
           if r["event"] == "start" and r["attempt"] == 1 and r["key"] == client.episode_key]
    for r in old:
        server = client.base_url.split("/s/")[0]
        old_path = r["base_url"].split("/s/")[1]
        note(event="probe", key=client.episode_key, old_url=await probe(r["base_url"], r["api_key"]),
             old_path_here=await probe(f"{server}/s/{old_path}", r["api_key"]),
             old_key_here=await probe(client.base_url, r["api_key"]))


async def agent(row, client):
    """Two calls, the first answer echoed back; a booking after the first call (keyed by the episode)."""
    attempt = int(os.environ["EP_RESUME_ATTEMPT"])
    note(event="start", key=client.episode_key, prompt=row["prompt"], base_url=client.base_url, api_key=client.api_key)
    c = openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0)
    msgs = [{"role": "user", "content": f"{row['prompt']} attempt {attempt}"}]
    r = await c.chat.completions.create(model=client.model, messages=msgs, max_tokens=4)
    note(event="call", key=client.episode_key)
    note(event="booked", key=client.episode_key, now=book(f"{client.episode_key}/c0", row["prompt"]))
    if row["prompt"] == GATE:
        if attempt == 1:
            hold(client.episode_key)
            await asyncio.Event().wait()  # the crash lands while the episode waits here
        await probe_old(client)
    msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "go on"}]
    r = await c.chat.completions.create(model=client.model, messages=msgs, max_tokens=4)
    note(event="call", key=client.episode_key)
    return float(len(r.choices[0].message.content or "") % 2)


class LoggedStream:
    """`QueueStream` that writes each group it is sent to ``sent.jsonl`` (decoded, with versions)."""

    def __init__(self, tok):
        from tests.unit.inprocess import QueueStream

        self.inner, self.tok = QueueStream(), tok

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def send(self, group):
        trajectories = [{"text": self.tok.decode(np.concatenate([t.prompt_ids, t.response_ids]).tolist()),
                         "turns": t.turns, "sampled_versions": sorted(set(t.versions[_mask(t) == 1].tolist()))}
                        for t in group.trajectories] if group.status == "ok" else []
        with open(_dir() / "sent.jsonl", "a") as f:
            f.write(json.dumps({"attempt": int(os.environ["EP_RESUME_ATTEMPT"]), "sample_id": group.sample_id,
                                "status": group.status, "trajectories": trajectories}) + "\n")
        await self.inner.send(group)


def _mask(t) -> np.ndarray:
    return t.loss_mask if t.loss_mask is not None else np.ones(len(t.response_ids))


async def main(model: str, attempt: int) -> None:
    import torch

    from asyncrl.models import load_tokenizer
    from asyncrl.rollouter.agents import build_agent
    from asyncrl.rollouter.config import AgentConfig
    from asyncrl.rollouter.engines.builtin.engine import TorchEngine
    from asyncrl.rollouter.feed import Prompt, RolloutState
    from asyncrl.rollouter.rollouter import RolloutConfig, Rollouter
    from asyncrl.sync.inprocess import InProcessSyncer
    from asyncrl.trainer import checkpoint
    from asyncrl.trainer.config import OptimConfig, TrainerConfig, WorkerConfig
    from asyncrl.trainer.ranks import RankGroup
    from asyncrl.trainer.trainer import Trainer
    from asyncrl.types import CommittedSet
    from tests.unit.inprocess import NotifyingSyncer

    torch.set_num_threads(1)
    run = _dir()
    tok = load_tokenizer(model)
    prompts = [Prompt(text=f"q{i}", prompt_ids=np.asarray(tok.encode(f"q{i}"), np.int64), meta={}) for i in range(ROWS)]
    agent = build_agent(AgentConfig(function="tests.integration.endpoint_resume_child:agent", max_turns=2,
                                    max_tokens_per_turn=4, max_context_tokens=256), tok)
    tcfg = TrainerConfig(worker=WorkerConfig(model_path=model, pad_token_id=tok.pad_token_id, optim=OptimConfig(lr=1e-3)),
                         groups_per_batch=2, recv_timeout_s=120, checkpoint_dir=str(run / "checkpoints"),
                         samples_path=str(run / "samples.jsonl"), transcripts_path=str(run / "transcripts.jsonl"))
    rcfg = RolloutConfig(n=2, max_tokens=4, groups_per_sync=tcfg.groups_per_sync, staleness_threshold=1.0)
    engine = TorchEngine(model, seed=0)
    ranks = RankGroup.start_local(tcfg)
    syncer = InProcessSyncer(ranks, [engine])
    state = await checkpoint.load_latest(tcfg, ranks)
    feed = None
    if attempt == 2 and state is None:
        raise SystemExit("attempt 2 found no checkpoint to resume from")
    if state is not None:  # the launcher's resume: restored weights on the engines at the restored version
        syncer.version = state.version - 1
        await syncer.sync()
        feed = RolloutState.resume(state.rollouter_state, CommittedSet.from_json(state.committed), state.dropped,
                                   rows=len(prompts))
    stream = LoggedStream(tok)
    rollouter = Rollouter(rcfg, [engine], stream, prompts, lambda p, ids: 0.0, state=feed, agent=agent)
    saved: list[tuple[dict, set[str]]] = []

    def rollouter_state() -> dict:  # what each checkpoint stores, and which episodes were held then
        snap = rollouter.snapshot()
        saved.append((snap, held_now()))
        return snap

    notifying = NotifyingSyncer(syncer, rollouter)
    trainer = Trainer(tcfg, ranks, stream, notifying, rollouter_state=rollouter_state,
                      on_dropped=rollouter.on_dropped, restored=state)
    await trainer.catch_up_sync(notifying)
    await rollouter.on_sync(trainer.version)
    feeding = asyncio.create_task(rollouter.run())
    try:
        if attempt == 1:
            for _ in range(MAX_STEPS):
                await asyncio.wait_for(trainer.train_step(), 120)
                snap, held = saved[-1]
                if "sample_0_3" in snap["in_flight"] and held == {"sample_0_3/0", "sample_0_3/1"}:
                    os.kill(os.getpid(), signal.SIGKILL)  # the crash: right after that checkpoint was published
            raise SystemExit(f"no checkpoint held {GATE}'s episodes in flight in {MAX_STEPS} steps")
        before = state.rollouter_state["next_index"]
        for _ in range(MAX_STEPS):
            if not trainer.committed.missing(before):
                break
            await asyncio.wait_for(trainer.train_step(), 120)
        if trainer.committed.missing(before):
            raise SystemExit(f"groups admitted before the crash still untrained: {trainer.committed.missing(before)}")
        print(json.dumps({"step": trainer.step, "restored_step": state.step}), flush=True)
    finally:
        feeding.cancel()
        await asyncio.gather(feeding, return_exceptions=True)
        await agent.aclose()
        await engine.close()
        ranks.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
