"""The launcher and ``rollout.agent``: the settings, and one clear line before Ray starts for each
mistake (an env path that does not import, a class without reset/step, a tool without type hints,
a tokenizer whose chat template cannot show tools when a ToolEnv is used)."""

from __future__ import annotations

import pytest

from asyncrl import launch
from asyncrl.config import ConfigError, load_config

ENVS = "tests.unit.agent_envs"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    from asyncrl.models.tiny_chat import build_chat_model

    return str(build_chat_model(tmp_path_factory.mktemp("chat") / "m"))


def test_agent_settings_on_the_command_line():
    cfg, _ = load_config([], [f"rollout.agent.env={ENVS}:LookupEnv", "rollout.agent.max_turns=3",
                              "rollout.agent.max_context_tokens=512", "rollout.agent.tool_timeout_s=2.5",
                              "rollout.agent.tool_concurrency=4"])
    a = cfg.rollout.agent
    assert (a.env, a.loop, a.max_turns, a.max_context_tokens, a.tool_timeout_s, a.tool_concurrency) == (
        f"{ENVS}:LookupEnv", None, 3, 512, 2.5, 4) and a.enabled
    assert not load_config()[0].rollout.agent.enabled  # plain generation by default


@pytest.mark.parametrize("setting, error", [
    ("rollout.agent.env=nope.mod:X", "rollout.agent.env='nope.mod:X': module 'nope.mod' does not import "
                                     "(ModuleNotFoundError: No module named 'nope')"),
    (f"rollout.agent.env={ENVS}:NoStep", f"rollout.agent.env='{ENVS}:NoStep': class NoStep has no step method"),
    (f"rollout.agent.loop={ENVS}:LookupEnv", f"rollout.agent.loop='{ENVS}:LookupEnv': class LookupEnv has no run method"),
    (f"rollout.agent.env={ENVS}:UnhintedToolEnv", f"rollout.agent.env='{ENVS}:UnhintedToolEnv': UnhintedToolEnv() "
                                                  "fails (ToolDefinitionError: @tool _no_hints: parameter 'key' has "
                                                  "no type hint"),
    (f"rollout.agent.env={ENVS}:LookupEnv rollout.agent.loop={ENVS}:TwoSessions", "set one of them"),
])
def test_each_mistake_is_refused_before_ray_starts(chat_model, setting, error):
    with pytest.raises(ConfigError) as e:
        launch.preflight(load_config([], ["model.path=" + chat_model, *setting.split()])[0])
    assert error in str(e.value) and "\n" not in str(e.value)


def test_a_tool_env_needs_a_chat_template_with_tools():
    # The demo model's tokenizer has no chat template at all.
    with pytest.raises(ConfigError, match=f"rollout.agent.env={ENVS}:LookupEnv with model .*: the tokenizer has no "
                                          "chat template; a ToolEnv needs one with tool support"):
        launch.preflight(load_config([], [f"rollout.agent.env={ENVS}:LookupEnv"])[0])


def test_the_launcher_prints_the_mistake_in_one_line(chat_model, capsys):
    # --dry-run: were the mistake let through, Ray would start and the plan print, exit 0.
    assert launch.main(["--model", chat_model, "--dry-run", f"rollout.agent.env={ENVS}:NoStep"]) == launch.EXIT_USAGE
    err = capsys.readouterr().err
    assert err == (f"asyncrl: error: rollout.agent.env='{ENVS}:NoStep': class NoStep has no step method; an Env "
                   "needs async def reset(...) and async def step(...)\n")


def test_per_prompt_budgets_of_the_long_tail_task_are_refused_with_an_agent_loop():
    with pytest.raises(ConfigError, match="data.long_tail sets single-turn response budgets; it does not apply"):
        load_config([], [f"rollout.agent.env={ENVS}:LookupEnv", "data.long_tail=4"])
