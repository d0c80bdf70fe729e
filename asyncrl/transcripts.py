"""``python -m asyncrl.transcripts RUN_DIR``: read an agent run's conversations, masked parts marked.

The Trainer appends the first conversation of every trained group to ``<run_dir>/transcripts.jsonl``
(token ids and loss mask, `asyncrl.trainer.audit.append_transcripts`). This decodes them with the
run's tokenizer (from its ``config.yaml``: ``model.path``, else the built-in task's model) and
prints each one: the prompt, then the response with every part the loss never saw (tool
output, env replies, the chat template's markers between turns) between ``⟦`` and ``⟧``
(dimmed as well on a terminal). ``--step``, ``--sample`` and ``--last`` pick which; ``--json``
prints the decoded segments instead.

    python -m asyncrl.transcripts runs/2026-11-26_06-01-00 --last 2
    python -m asyncrl.transcripts runs/... --sample sample_0_17
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

OPEN, CLOSE = "\u27e6", "\u27e7"


def read(run_dir: str | Path) -> list[dict]:
    """Every whole line of ``<run_dir>/transcripts.jsonl``; FileNotFoundError says why there is none."""
    path = Path(run_dir) / "transcripts.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no transcripts (only an agent run's trainer writes them: rollout.agent.env "
                                "or rollout.agent.loop, e.g. --task calculator)")
    lines = path.read_text().split("\n")[:-1]  # a torn last line is left out
    return [json.loads(line) for line in lines if line]


def segments(tokenizer, record: dict) -> list[tuple[str, bool]]:
    """The response as ``(text, trained)`` runs of equal loss mask, in order."""
    out: list[tuple[str, bool]] = []
    ids, mask = record["response_ids"], record["loss_mask"]
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            out.append((tokenizer.decode(ids[start:i], skip_special_tokens=False), bool(mask[start])))
            start = i
    return out


def render(tokenizer, record: dict, *, color: bool = False) -> str:
    head = (f"== {record['sample_id']}[{record['index']}]  step {record['step']}  reward {record['reward']:.3f}  "
            f"turns {record['turns']}  finish {record['finish_reason']}")
    prompt = tokenizer.decode(record["prompt_ids"], skip_special_tokens=False)
    body = []
    for text, trained in segments(tokenizer, record):
        if trained:
            body.append(text)
        else:
            body.append(f"\x1b[2m{OPEN}{text}{CLOSE}\x1b[0m" if color else f"{OPEN}{text}{CLOSE}")
    return f"{head}\n{prompt}{''.join(body)}\n"


def pick(records: list[dict], *, step: int | None, sample: str | None, last: int) -> list[dict]:
    if sample is not None:
        return [r for r in records if r["sample_id"] == sample]
    if step is not None:
        return [r for r in records if r["step"] == step]
    return records[-last:] if last > 0 else records


def run_tokenizer(run_dir: Path):
    from asyncrl.config import load_config
    from asyncrl.models import load_tokenizer

    config = run_dir / "config.yaml"
    if not config.is_file():
        raise FileNotFoundError(f"{config}: not a run directory (no config.yaml)")
    cfg, _ = load_config([str(config)])
    return load_tokenizer(cfg.model_path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m asyncrl.transcripts", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path)
    p.add_argument("--step", type=int, help="every conversation kept of this train step")
    p.add_argument("--sample", help="the conversation of this group (sample_{epoch}_{index})")
    p.add_argument("--last", type=int, default=3, help="the last N conversations (default 3; 0: all)")
    p.add_argument("--json", action="store_true", help="decoded segments as JSON lines, [text, trained] each")
    args = p.parse_args(argv)
    try:
        records = pick(read(args.run_dir), step=args.step, sample=args.sample, last=args.last)
        tokenizer = run_tokenizer(args.run_dir)
    except (FileNotFoundError, ValueError) as e:
        print(f"asyncrl.transcripts: {e}", file=sys.stderr)
        return 2
    if not records:
        print("asyncrl.transcripts: no conversation matches", file=sys.stderr)
        return 1
    color = sys.stdout.isatty() and not args.json
    for r in records:
        if args.json:
            keep = {k: r[k] for k in ("sample_id", "index", "step", "reward", "turns", "finish_reason")}
            print(json.dumps({**keep, "prompt": tokenizer.decode(r["prompt_ids"], skip_special_tokens=False),
                              "segments": segments(tokenizer, r)}))
        else:
            print(render(tokenizer, r, color=color))
    return 0


if __name__ == "__main__":
    sys.exit(main())
