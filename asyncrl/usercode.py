"""`UserCodeError`: an exception raised by the user's code while a group was generated.

A user's env, agent loop (or its tools' schemas, built when an env is), reward function or group
filter that raises does so again on the same prompt after any restart: until its author changes
the code it is deterministic, not a fault of a process. So it never spends a restart
(`asyncrl.faults`). What happens instead is ``rollout.on_user_error``:

- ``stop`` (the default): the Rollouter stops the run at once; the launcher prints one line
  naming what raised and the prompt (``sample_id`` and its text), then the user's traceback,
  and exits 1 without restarting. ``--resume`` after the fix generates that prompt again.
- ``drop``: the group is dropped, not trained, recorded in ``samples.jsonl`` with reason
  ``user_error: ...``; the Rollouter prints the first such error with its traceback, and each
  step's ``user_errors/dropped_groups`` counts them.

A tool that raises is not a user error of this kind: its error is the model's observation for
that call (`asyncrl.agent.tool_env`).
"""

from __future__ import annotations

import sys
import traceback
from typing import Any

ON_USER_ERROR = ("stop", "drop")

USER_ERROR_KEY = "user_error_dropped"
"""Meta key of a group dropped for a user error (``rollout.on_user_error=drop``); the value is
the error's line. The Trainer trains none of it and records it as dropped (``user_error: ...``)."""


class UserCodeError(RuntimeError):
    """The user's code raised while generating a group: ``where`` names the code (a setting),
    ``sample_id`` and ``prompt`` the prompt, ``user_traceback`` the user's traceback as text (kept
    as text: it crosses processes, where a traceback object does not)."""

    def __init__(self, message: str = "", *, where: str = "", sample_id: str | None = None,
                 prompt: str | None = None, user_traceback: str = ""):
        super().__init__(message)
        self.where, self.sample_id, self.prompt, self.user_traceback = where, sample_id, prompt, user_traceback

    @classmethod
    def of(cls, error: BaseException, where: str, sample_id: str | None = None,
           prompt: str | None = None) -> UserCodeError:
        """``error`` (raised by the code ``where`` names) with the prompt it raised on."""
        if isinstance(error, UserCodeError):  # already named: add the prompt it lacked
            error.sample_id = error.sample_id or sample_id
            error.prompt = error.prompt if error.prompt is not None else prompt
            return error
        return cls(f"{where} raised {type(error).__name__}: {error}", where=where, sample_id=sample_id,
                   prompt=prompt, user_traceback="".join(traceback.format_exception(error)))

    def line(self) -> str:
        """One line: what raised, the error, and the prompt (its id and the start of its text)."""
        shown = [x for x in (self.sample_id, None if self.prompt is None else repr(_short(self.prompt))) if x]
        return f"{self} (on prompt {' '.join(shown)})" if shown else str(self)


def _short(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def user_error(error: BaseException) -> UserCodeError | None:
    """The `UserCodeError` behind ``error`` (itself, or the cause of a Ray error that wraps one)."""
    cause = getattr(error, "cause", None)  # a RayTaskError carries the remote exception as .cause
    if isinstance(cause, UserCodeError):
        return cause
    return error if isinstance(error, UserCodeError) else None


def stop_message(error: UserCodeError, run_dir: Any) -> str:
    """What the launcher prints when ``error`` stops the run: one line naming it and the prompt,
    the user's traceback, and how to go on."""
    return (f"asyncrl: stopped, not restarting (your code raised; a restart would meet it again): {error.line()}\n"
            f"{error.user_traceback.rstrip()}\n"
            f"asyncrl: fix it, then continue with: python -m asyncrl.launch --resume {run_dir} (or set "
            "rollout.on_user_error=drop to drop such groups, counted, and go on)")


class UserErrors:
    """``rollout.on_user_error`` in the Rollouter, with the count of groups it dropped."""

    def __init__(self, policy: str):
        if policy not in ON_USER_ERROR:
            raise ValueError(f"rollout.on_user_error must be stop or drop, got {policy!r}")
        self.policy, self.dropped = policy, 0

    def group(self, error: UserCodeError, sample_id: str, prompt: Any, generated: Any, expected: int) -> Any:
        """``error`` raised on ``prompt`` (a `Prompt`). ``stop``: raises it. ``drop``: counts it, prints
        the first one with its traceback, and returns the group, failed, marked with `USER_ERROR_KEY`
        (with the trajectories of ``generated``, the group a filter raised on; None when generation raised)."""
        from asyncrl.types import Group

        error = UserCodeError.of(error, error.where, sample_id, prompt.text)
        if self.policy == "stop":
            raise error
        self.dropped += 1
        if self.dropped == 1:
            print(f"asyncrl: rollout.on_user_error=drop: dropped a group: {error.line()}; further ones are counted "
                  f"(user_errors/dropped_groups), not printed\n{error.user_traceback}", file=sys.stderr, flush=True)
        return Group(sample_id=sample_id, trajectories=list(generated.trajectories) if generated else [],
                     expected=expected, status="failed", error=error.line(),
                     meta={"prompt": prompt.text, **prompt.meta, USER_ERROR_KEY: error.line()})
