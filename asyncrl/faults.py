"""Which failures the launcher's restart loop may restart from, and which stop the run.

A restart (`asyncrl.launch.run_restarting`) starts the whole run again from its last checkpoint.
That heals a process that died or hung (a killed rank, an out-of-memory Rollouter, a lost node):
the new processes do the same work and succeed. It cannot heal a programming error: a
``TypeError`` in a reward, a misspelt attribute in a loss, an assertion. Those fail the same way
on the same samples after every restart, so they stop the run at once with their traceback.
An exception of the user's code while a group is generated (env, agent loop, reward, group
filter: `asyncrl.usercode.UserCodeError`) is one too, whatever its class.

A programming error reaches the launcher in one of three shapes:

- raised in the launcher's own process (its class is the error's);
- raised inside a Ray actor (a `ray.exceptions.RayTaskError` that is also an instance of the
  original class: Ray makes it a subclass of both);
- raised while scoring a response (a reward): the Rollouter fails the group with the text
  ``"<k>: <ErrorType>: <message>"`` and the Trainer refuses it (`IncompleteGroupError`).
"""

from __future__ import annotations

import re

PROGRAMMING_ERRORS: tuple[type[BaseException], ...] = (
    TypeError, AttributeError, NameError, ImportError, AssertionError, SyntaxError, NotImplementedError,
    ZeroDivisionError, KeyError, IndexError, RecursionError,
)
"""Errors of code, not of processes: a restart would fail the same way."""

_NAMES = "|".join(sorted({cls.__name__ for cls in PROGRAMMING_ERRORS} | {"UnboundLocalError",
                                                                            "ModuleNotFoundError"}))
_IN_GROUP = re.compile(rf"\b\d+: ({_NAMES}): ")


def programming_error(error: BaseException) -> str | None:
    """The name of the programming error behind ``error``, or None when a restart may heal it."""
    from asyncrl.usercode import user_error

    if user_error(error) is not None:
        return "UserCodeError"
    if isinstance(error, PROGRAMMING_ERRORS):
        cause = getattr(error, "cause", None)  # a RayTaskError names the remote class
        return type(cause if isinstance(cause, BaseException) else error).__name__
    from asyncrl.rollouter.filters import GroupFilterStalled
    from asyncrl.trainer.batch import IncompleteGroupError

    if isinstance(error, GroupFilterStalled):  # the same filter on the same weights drops the same groups
        return GroupFilterStalled.__name__
    if isinstance(error, IncompleteGroupError):
        found = _IN_GROUP.search(str(error))
        if found:
            return found.group(1)
    return None


_ACTOR_NAMES = {"TrainerWorker": "a trainer rank", "RolloutWorker": "the Rollouter", "EngineActor": "an engine"}


def fault_line(error: BaseException) -> str:
    """One line naming what failed: for an actor that died, which process it was (Ray's error
    puts the actor's class and pid on lines of their own, after a first line that names neither)."""
    text = str(error)
    fields = dict(line.strip().split(": ", 1) for line in text.splitlines()[1:]
                  if line.startswith("\t") and ": " in line)
    first = text.splitlines()[0] if text else ""
    cls = fields.get("class_name")
    if cls:
        who = f"{_ACTOR_NAMES.get(cls, 'the actor')} ({cls}" + (f", pid {fields['pid']})" if "pid" in fields else ")")
        first = f"{who} died: {first}"
    return f"{type(error).__name__}: {first}"
