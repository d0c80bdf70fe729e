"""Built-in verifiable tasks: the addition task (`asyncrl.tasks.arithmetic`, exported here) and the
calculator tool-use task (`asyncrl.tasks.calculator`, ``--task calculator``: import it by name;
it needs `asyncrl.agent`)."""

from asyncrl.tasks.arithmetic import (
    ArithmeticTaskConfig,
    decode_response,
    encode_prompt,
    generate_dataset,
    reward,
    solve,
)

__all__ = ["ArithmeticTaskConfig", "decode_response", "encode_prompt", "generate_dataset", "reward", "solve"]
