"""``python -m asyncrl.agent.tiny_chat OUT_DIR``, as the README prints it: the tiny chat model now
lives with the other tiny models, `asyncrl.models.tiny_chat` (import it from there)."""

from asyncrl.models.tiny_chat import (  # noqa: F401 - the names this module had
    CHARS,
    CHATML_TOOL_NAMES_TEMPLATE,
    CHATML_TOOLS_TEMPLATE,
    EOS,
    IM_END,
    IM_START,
    PAD,
    TAGS,
    build_chat_model,
    build_chat_tokenizer,
    main,
)

if __name__ == "__main__":
    main()
