"""The agent settings are declared once (`asyncrl.agent.limits`): every way in refuses a bad value
with the field's name, the run's ``rollout.agent`` keys are those fields, and a run's loop and
tool runner take its checked `AgentConfig` as it is."""

import dataclasses
import inspect

import pytest

from asyncrl.agent import EnvLoop, EnvLoopConfig, ToolEnv, ToolRunner, ToolRunnerConfig, tool
from asyncrl.config import ConfigError, load_config
from asyncrl.rollouter.agents import build_agent
from asyncrl.rollouter.config import AgentConfig


@tool
def echo(text: str) -> str:
    """Echo the text.

    Args:
        text: what to echo
    """
    return text


BAD = [("max_turns", 0, ">= 1"), ("max_tokens_per_turn", 0, ">= 1"), ("max_context_tokens", -3, ">= 1"),
       ("tool_timeout_s", 0, "> 0"), ("tool_concurrency", 0, ">= 1"), ("sync_tools", "fork", "process or thread"),
       ("sync_tool_workers", 0, ">= 1")]
TURN_FIELDS = {f.name for f in dataclasses.fields(EnvLoopConfig)}
TOOL_FIELDS = {f.name for f in dataclasses.fields(ToolRunnerConfig)}


def _direct(name: str, value) -> None:
    (EnvLoopConfig if name in TURN_FIELDS else ToolRunnerConfig)(**{name: value})


@pytest.mark.parametrize("name,value,rule", BAD)
def test_each_way_in_refuses_a_bad_value_naming_the_field(name, value, rule):
    owner = "EnvLoopConfig" if name in TURN_FIELDS else "ToolRunnerConfig"
    with pytest.raises(ValueError) as agent:
        AgentConfig(env="a:B", **{name: value})
    assert str(agent.value) == f"AgentConfig.{name} must be {rule}, got {value!r}"
    with pytest.raises(ValueError) as direct:
        _direct(name, value)
    assert str(direct.value) == f"{owner}.{name} must be {rule}, got {value!r}"
    if name in TOOL_FIELDS:
        with pytest.raises(ValueError) as env:
            ToolEnv([echo], **{name: value})
        assert str(env.value) == str(direct.value)
    with pytest.raises(ConfigError) as dotted:  # the user's key: rollout.agent.<field>, unchanged
        load_config(overrides=[f"rollout.agent.{name}={value}"])
    assert str(dotted.value).startswith(f"rollout.agent.{name} must be {rule}")


def test_the_settings_are_declared_once():
    agent = [f.name for f in dataclasses.fields(AgentConfig)]
    assert len(agent) == len(set(agent)) and TURN_FIELDS | TOOL_FIELDS <= set(agent)
    # Each field's default lives on its owner only: neither AgentConfig nor ToolEnv declares one of its own.
    redeclared = set(inspect.get_annotations(AgentConfig)) & (TURN_FIELDS | TOOL_FIELDS)
    assert not redeclared, sorted(redeclared)
    assert not set(inspect.signature(ToolEnv.__init__).parameters) & TOOL_FIELDS
    assert AgentConfig().max_turns == EnvLoopConfig().max_turns == 8
    assert AgentConfig().tool_concurrency == ToolRunnerConfig().tool_concurrency == 8


def test_toolenv_settings_reach_its_runner_and_old_names_say_the_new_one():
    env = ToolEnv([echo], tool_timeout_s=2.5, tool_concurrency=3, sync_tools="thread", sync_tool_workers=2)
    assert env.runner.config == ToolRunnerConfig(tool_timeout_s=2.5, tool_concurrency=3, sync_tools="thread",
                                                 sync_tool_workers=2)
    with pytest.raises(TypeError, match="'max_concurrent': it is now tool_concurrency"):
        ToolEnv([echo], max_concurrent=3)
    with pytest.raises(TypeError, match="ToolEnv: runner given and so are tool_timeout_s"):
        ToolEnv([echo], runner=ToolRunner(), tool_timeout_s=1)


def test_a_run_hands_its_checked_record_to_the_loop_and_the_runner():
    cfg = AgentConfig(env="tests.unit.agent_envs:LookupEnv", max_turns=3, tool_timeout_s=4.0, tool_concurrency=5)
    agent = build_agent(cfg, None)
    try:
        assert isinstance(agent.loop, EnvLoop) and agent.loop.config is cfg and agent.runner.config is cfg
        assert not agent.branches  # an env's response is one trajectory, not an endpoint episode's branches
        env = agent.loop.make_env()
        assert env.runner is agent.runner  # the process's one runner: the bound holds across its episodes
    finally:
        agent.close()
