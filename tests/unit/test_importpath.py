"""`asyncrl.importpath.load_path`: every setting that names code as ``module:name`` loads it the same
way and fails in the same one line (the setting, the module, the name)."""

import pytest

from asyncrl import data
from asyncrl.agent.loading import AgentSpecError, load_object
from asyncrl.importpath import load_path
from asyncrl.rollouter import filters


def test_a_path_loads_the_object_and_a_dotted_name_walks_attributes():
    assert load_path("asyncrl.tasks.arithmetic:reward", "data.reward", want_callable=True) is data.load_reward(
        "asyncrl.tasks.arithmetic:reward").fn
    assert load_path("asyncrl.importpath:load_path.__name__", "x") == "load_path"


@pytest.mark.parametrize("spec, message", [
    ("nocolon", "s='nocolon': expected 'module:Name'"),
    ("a:b:c", "s='a:b:c': expected 'module:Name'"),
    ("no_such_mod_q:f", "s='no_such_mod_q:f': module 'no_such_mod_q' does not import (ModuleNotFoundError: "),
    ("asyncrl.importpath:nothing", "s='asyncrl.importpath:nothing': module 'asyncrl.importpath' has no callable 'nothing'"),
    ("asyncrl.importpath:__doc__", "s='asyncrl.importpath:__doc__': module 'asyncrl.importpath' has no callable "
                                   "'__doc__' (its value is of type str)"),
])
def test_each_failure_is_one_line_naming_the_setting_the_module_and_the_name(spec, message):
    with pytest.raises(KeyError) as e:
        load_path(spec, "s", KeyError, want_callable=True)
    assert e.value.args[0].startswith(message) and "\n" not in e.value.args[0]


def test_the_reward_the_filter_and_the_agent_fail_in_the_same_words():
    """Three settings, one loader: only the setting's name and the error's type differ."""
    with pytest.raises(data.DataError) as reward:
        data.load_reward("no_such_mod_q:f")
    with pytest.raises(ValueError) as group_filter:
        filters.load("no_such_mod_q:f")
    with pytest.raises(AgentSpecError) as agent:
        load_object("no_such_mod_q:f", field="rollout.agent.env")
    tails = {str(e.value).split(": ", 1)[1] for e in (reward, group_filter, agent)}
    assert len(tails) == 1 and next(iter(tails)).startswith("module 'no_such_mod_q' does not import")
    assert str(reward.value).startswith("data.reward=") and str(agent.value).startswith("rollout.agent.env=")
    assert str(group_filter.value).startswith("rollout.group_filter=")
