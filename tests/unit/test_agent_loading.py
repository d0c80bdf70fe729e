"""Loading user code as ``module:Name`` and the launcher's preflight: one clear line per mistake."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from asyncrl.agent import (AgentSpecError, check_tool_template, load_agent_loop_class, load_env_class,
                           load_object)
from asyncrl.models.tiny_chat import build_chat_tokenizer

USER_CODE = """
from asyncrl.agent import AgentLoop, Env, Step

class GoodEnv(Env):
    async def reset(self, prompt):
        return prompt
    async def step(self, text):
        return Step(done=True)

class DuckEnv:  # no base class: duck typing is enough
    async def reset(self, prompt):
        return prompt
    async def step(self, text):
        return Step(done=True)

class NoStep:
    async def reset(self, prompt):
        return prompt

class SyncReset:
    def reset(self, prompt):
        return prompt
    async def step(self, text):
        return Step(done=True)

class HalfEnv(Env):
    async def reset(self, prompt):
        return prompt

class Loop(AgentLoop):
    async def run(self, prompt, llm):
        return []

class NotALoop:
    async def go(self, prompt, llm):
        return []

def not_a_class():
    pass
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "agent_user_mod.py").write_text(USER_CODE)
    (tmp_path / "agent_broken_mod.py").write_text("import does_not_exist_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "agent_user_mod"
    for name in ("agent_user_mod", "agent_broken_mod"):
        sys.modules.pop(name, None)


def test_load_object_and_its_errors(user_module):
    assert load_object(f"{user_module}:GoodEnv").__name__ == "GoodEnv"
    cases = {
        "no_colon": "expected 'module:Name'",
        "a:b:c": "expected 'module:Name'",
        "agent_missing_mod:X": "module 'agent_missing_mod' does not import (ModuleNotFoundError",
        "agent_broken_mod:X": "module 'agent_broken_mod' does not import (ModuleNotFoundError: No module named "
                              "'does_not_exist_anywhere')",
        f"{user_module}:Missing": "'agent_user_mod' has no attribute 'Missing'",
    }
    for path, message in cases.items():
        with pytest.raises(AgentSpecError) as e:
            load_object(path, field="rollout.agent.env")
        assert str(e.value).startswith(f"rollout.agent.env={path!r}: ") and message in str(e.value)
        assert "\n" not in str(e.value)


def test_env_and_loop_classes_are_checked(user_module):
    assert load_env_class(f"{user_module}:GoodEnv").__name__ == "GoodEnv"
    assert load_env_class(f"{user_module}:DuckEnv").__name__ == "DuckEnv"
    assert load_agent_loop_class(f"{user_module}:Loop").__name__ == "Loop"
    errors = {
        (load_env_class, "NoStep"): "class NoStep has no step method; an Env needs async def reset(...) and "
                                    "async def step(...)",
        (load_env_class, "SyncReset"): "SyncReset.reset must be 'async def' (an Env)",
        (load_env_class, "HalfEnv"): "class HalfEnv leaves step abstract",
        (load_env_class, "not_a_class"): "is a function, not a class (an Env)",
        (load_agent_loop_class, "NotALoop"): "class NotALoop has no run method; an AgentLoop needs async def run(...)",
    }
    for (load, name), message in errors.items():
        with pytest.raises(AgentSpecError, match="^rollout.agent.(env|loop)=") as e:
            load(f"{user_module}:{name}")
        assert message in str(e.value), str(e.value)


def test_tool_template_check():
    tok = build_chat_tokenizer()
    check_tool_template(tok)  # the ChatML template with a tools section passes
    tok.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    with pytest.raises(AgentSpecError, match="ignores tools"):
        check_tool_template(tok)
    tok.chat_template = ("{% for t in tools %}{{ t | tojson }}{% endfor %}"
                         "{% for m in messages if m.role != 'tool' %}{{ m.content }}{% endfor %}")
    with pytest.raises(AgentSpecError, match="drops 'tool' messages"):
        check_tool_template(tok)
    tok.chat_template = None
    with pytest.raises(AgentSpecError, match="^model: the tokenizer has no chat template"):
        check_tool_template(tok)


def test_the_package_imports_without_torch_or_ray():
    code = textwrap.dedent("""
        import sys
        from asyncrl.agent import AgentLoop, Env, Step, ToolEnv, tool
        from asyncrl.agent import EnvLoop, SingleTurnLoop, load_object
        heavy = sorted(m for m in ("torch", "ray", "transformers") if m in sys.modules)
        assert not heavy, heavy
    """)
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_a_saved_tiny_chat_model_keeps_its_tokenizer(tmp_path):
    """transformers 5 loads a qwen2 model's generic tokenizer as Qwen2Tokenizer, which drops the
    tiny chat tokenizer's spaces; `load_tokenizer` honours the class the checkpoint declares."""
    from transformers import AutoTokenizer

    from asyncrl.models.tiny_chat import build_chat_model, build_chat_tokenizer
    from asyncrl.models import load_tokenizer

    path = build_chat_model(tmp_path / "m")
    text = "Call add, then answer."
    want = build_chat_tokenizer().encode(text, add_special_tokens=False)
    assert AutoTokenizer.from_pretrained(path).encode(text, add_special_tokens=False) != want  # the trap
    tok = load_tokenizer(path)
    assert tok.encode(text, add_special_tokens=False) == want and tok.decode(want) == text
    assert tok.chat_template == build_chat_tokenizer().chat_template
