"""Built-in verifiable tasks: the addition task (`asyncrl.tasks.arithmetic`)."""

from asyncrl.tasks.arithmetic import (
    ArithmeticTaskConfig,
    decode_response,
    encode_prompt,
    generate_dataset,
    reward,
    solve,
)

__all__ = ["ArithmeticTaskConfig", "decode_response", "encode_prompt", "generate_dataset", "reward", "solve"]
