"""Every metric name the run emits: who emits it and what it means (the table in docs/metrics.md).

``{i}`` stands for an engine replica's index, ``{k}`` for a histogram bucket. Names follow
verl's fully-async trainer where verl has one, so dashboards carry over.
"""

from __future__ import annotations

import re

T, R = "trainer", "rollouter"

NAMES: dict[str, tuple[str, str]] = {
    # verl's names
    "timing_s/update_actor": (T, "the step's optimizer updates on the ranks (all mini-batches)"),
    "timing_s/save_checkpoint": (T, "writing the step's checkpoint (0 when the step writes none)"),
    "fully_async/partial/age_max": (T, "most truncation rounds survived by one response of the step"),
    "fully_async/partial/truncated": (T, "responses stopped by the aggregator's truncation during the step (Rollouter)"),
    "fully_async/partial/resumed": (T, "truncated responses dispatched again during the step (Rollouter)"),
    "fully_async/partial/waiting": (T, "truncated responses waiting in the partial buffer at the step's end"),
    "timing_s/rollouter/gate_blocked": (T, "time the Rollouter's feed waited at the staleness gate during the step"),
    "timing_s/rollouter/credit_blocked": (T, "time finished groups waited for stream credit during the step (summed)"),
    "timing_s/rollouter/idle": (T, "time during the step with no request in flight on any engine (Rollouter); >= 0.2 of "
                                   "timing_s/step: the step line says `bound trainer` (`handoff` if the Trainer waited "
                                   "that long too; asyncrl.progress.bound_side)"),
    "rollouter/timed_out": (T, "requests aborted past rollout.request_timeout_s during the step"),
    "fully_async/trainer/idle_ratio": (T, "fraction of the step's wall time the Trainer waited for groups"),
    "fully_async/rollouter/idle_ratio": (R, "fraction of the poll interval with no generate call in flight on any engine"),
    "fully_async/count/stale_samples_processed": (T, "responses trained on so far whose oldest token is >= 1 version old"),
    "fully_async/count/total_generated_samples": (R, "responses sent over the stream so far (groups x n)"),
    "fully_async/count/dropped_stale_samples": (T, "groups dropped as too stale so far (max_version_gap)"),
    "fully_async/count/current_param_version": (T, "policy version (weight syncs so far) after the step"),
    "fully_async/partial/total_partial_num": (T, "responses in the step that were truncated and resumed (age >= 1)"),
    "fully_async/partial/partial_ratio": (T, "total_partial_num / responses in the step"),
    "fully_async/partial/max_partial_span": (T, "largest versions spanned by one response of the step (max - min token version)"),
    "fully_async/partial/age_mean": (T, "mean truncation rounds survived by the step's responses"),
    "fully_async/partial/age_hist/{k}": (T, "responses of the step with age k (k = 4: 4 or more)"),
    "timing_s/param_sync": (T, "wall time of the weight sync after the step (pause + transfer + resume)"),
    "timing_s/param_sync_pause": (T, "pausing every engine (keep) before the transfer"),
    "timing_s/param_sync_transfer": (T, "broadcast and load of the weights"),
    "timing_s/param_sync_resume": (T, "resuming the engines"),
    "timing_s/step": (T, "wall time of the train step, waiting for groups included"),
    "timing_s/wait_data": (T, "time the step waited for groups from the stream; >= 0.2 of timing_s/step: the step line "
                              "says `bound engine` (`handoff` if the engines idled that long too)"),
    # throughput
    "throughput/trained_tokens_per_s": (T, "response tokens trained in the step / its wall time"),
    "throughput/generated_tokens_per_s": (R, "tokens the engines generated over the poll interval, per second"),
    # stream
    "stream/depth": (T, "groups received by the Trainer's consumer and not yet taken"),
    "stream/received": (T, "groups the consumer received so far (duplicates included)"),
    "stream/acked": (T, "groups the consumer acked so far"),
    "stream/committed_kept": (T, "ids the committed set keeps one by one (above its watermark): stays small however long the run"),
    "stream/credit": (R, "groups the Rollouter's producer may send now"),
    "stream/unacked": (R, "groups sent and not yet acked (bounded by the window)"),
    # faults
    "fault/engine_restarts": (T, "engine replicas started again so far (engine.max_restarts each)"),
    # rollouter
    "rollouter/admitted": (R, "prompts admitted through the staleness gate so far"),
    "agent/episodes": (R, "conversations an env loop started so far"),
    "agent/turns": (R, "model turns answered by an env so far (an endpoint agent: answers sampled)"),
    "agent/tool_calls": (R, "tool calls the envs made so far (Step.tool_calls; an endpoint agent: tool_calls in its answers)"),
    "agent/tool_errors": (R, "of those, calls that ended in an error observation"),
    "agent/env_step_s": (R, "seconds spent in Env.step so far (tool calls included), over all conversations"),
    "agent/http_calls": (R, "calls endpoint agents made so far (rollout.agent.function / command)"),
    "agent/http_forks": (R, "endpoint calls whose history diverged from every recorded branch (a new branch)"),
    "agent/http_trajectories": (R, "trajectories endpoint episodes returned (their branches; rollout.agent.endpoint_branches)"),
    "agent/http_tool_call_turns": (R, "endpoint answers that carried at least one tool call"),
    "agent/http_limit_ended": (R, "endpoint episodes ended by a call refused at a limit (max_turns, max_context_tokens) that the agent raised on"),
    "agent/http_failed_episodes": (R, "endpoint episodes that failed their group (no call, no reward, wall time)"),
    "rollouter/in_flight": (R, "prompts admitted and not yet sent"),
    "rollouter/failed_groups": (R, "groups sent as failed so far"),
    "rollouter/filtered_groups": (R, "groups the group filter dropped so far (rollout.group_filter)"),
    "rollouter/version": (R, "policy version the Rollouter was last told the engines serve"),
    # engines
    "engine/running": (R, "requests running on all engines"),
    "engine/queued": (R, "requests queued on all engines"),
    "engine/kv_tokens": (R, "tokens held in KV caches on all engines"),
    "engine/{i}/running": (R, "requests running on replica i (per-replica load)"),
    "engine/{i}/queued": (R, "requests queued on replica i"),
    "engine/{i}/kv_tokens": (R, "tokens in replica i's KV cache"),
    "engine/{i}/requests": (R, "requests replica i's engine accepted so far (a restarted replica counts from 0)"),
    "engine/{i}/tokens_generated": (R, "tokens replica i's engine generated so far (a restarted replica counts from 0)"),
    "engine/reprefill_tokens": (R, "tokens prefilled again after a pause, all engines, so far"),
    "engine/session_live": (R, "conversations whose last turn's KV the built-in engines keep for their next turn, now"),
    "engine/session_blocks": (R, "KV blocks those kept turns hold, all engines, now"),
    "engine/session_kept": (R, "turns whose KV the built-in engines kept for the conversation's next turn, so far"),
    "engine/session_hits": (R, "turns that reused their conversation's kept KV (prefilled only their new tokens), so far"),
    "engine/session_tokens_reused": (R, "prompt tokens those turns did not prefill, so far"),
    "engine/session_misses": (R, "kept turns released unused: the next turn's prompt did not extend them, so far"),
    "engine/session_evicted": (R, "kept turns freed for the block budget (session_max_blocks) or after session_idle_s, so far"),
    "engine/session_dropped": (R, "kept turns freed at a weight update or a cleared cache, so far"),
    "engine/requests_spread": (R, "(max - min) / mean of the requests sent to each live engine replica so far (0: even)"),
    "engine/prefill_tokens_per_group": (R, "prompt tokens the built-in engine prefilled per group call (mean over the calls "
                                           "ended in the interval; equals prompt_tokens_per_group when each group's "
                                           "prompt is prefilled once)"),
    "engine/prompt_tokens_per_group": (R, "tokens of the distinct prompts of each group call (mean over the same calls)"),
    "engine/prefix_cache_hit_rate": (R, "vLLM: prompt tokens served from the prefix cache / prompt tokens (interval)"),
    "engine/preempted": (R, "requests vLLM preempted (and so prefilled again, e.g. at a sync that drops the KV cache), all engines, so far"),
    # the step's samples
    "staleness/mean": (T, "mean per-token version gap of the step (train version - token version)"),
    "staleness/max": (T, "largest per-token version gap of the step"),
    "staleness/hist/{k}": (T, "responses of the step whose oldest token is k versions old (k = 8: 8 or more)"),
    "response_length/mean": (T, "mean response length of the step (tokens)"),
    "response_length/p50": (T, "median response length of the step"),
    "response_length/p90": (T, "90th percentile response length"),
    "response_length/p99": (T, "99th percentile response length"),
    "response_length/max": (T, "longest response of the step"),
    "response_length/truncated": (T, "responses of the step that hit max_tokens (finish_reason length)"),
    "response_length/truncated_ratio": (T, "truncated / responses in the step"),
    "train/replayed_groups": (T, "groups of the step the skip role replayed from dumps (no engine request)"),
    "train/reward_mean": (T, "mean reward of the step's responses"),
    "agent/turns_mean": (T, "model turns per conversation in the step (agent loops only)"),
    "agent/turns_max": (T, "most model turns of one conversation in the step (agent loops only)"),
    "agent/step_turns": (T, "model turns an env answered during the step (Rollouter)"),
    "agent/step_tool_calls": (T, "tool calls the envs made during the step (Rollouter)"),
    "agent/tool_calls_per_turn": (T, "agent/step_tool_calls / agent/step_turns (noisy step to step: a step's window may hold "
                                     "mostly first turns or mostly last ones; over several steps, divide the sums)"),
    "agent/tool_errors_per_call": (T, "share of the step's tool calls that ended in an error observation (Rollouter)"),
    "agent/env_step_s_per_turn": (T, "seconds in Env.step (tool calls included) per turn answered during the step"),
    "train/loss": (T, "policy loss"),
    "train/grad_norm": (T, "gradient norm before clipping"),
    "train/lr": (T, "learning rate"),
    "train/clip_frac": (T, "fraction of tokens whose PPO ratio was clipped"),
    "train/tis_truncated_frac": (T, "fraction of tokens whose importance weight was truncated"),
    "train/is_ratio_mean": (T, "mean importance ratio (train / behaviour policy)"),
    "train/is_ratio_max": (T, "largest importance ratio"),
    "train/is_ratio_min": (T, "smallest importance ratio"),
    "train/kl": (T, "KL to the reference policy"),
    "train/entropy": (T, "mean token entropy"),
    "train/groups": (T, "groups trained in the step"),
    "train/dropped_incomplete": (T, "groups dropped as incomplete in the step"),
    "train/dropped_stale": (T, "groups dropped as too stale in the step"),
    # dynamic sampling (rollout.group_filter)
    "filter/dropped_groups": (T, "groups the Rollouter's group filter dropped, received during the step"),
    "filter/kept_ratio": (T, "trained / (trained + filtered) groups of the step (1 without a filter)"),
    "filter/prompts_per_trained_group": (T, "groups received during the step (trained or dropped for any reason) "
                                            "per trained group"),
    "user_errors/dropped_groups": (T, "groups dropped for an error of the user's code (rollout.on_user_error=drop), "
                                      "received during the step"),
    "train/step": (T, "the step (also in every event's step field)"),
    "val/reward_mean": (T, "greedy reward on the validation file (every data.val_every steps)"),
    "val/response_length_mean": (T, "mean validation response length"),
    "val/samples": (T, "validation prompts scored"),
    "val/turns_mean": (T, "mean model turns of a validation conversation (agent loops only)"),
}


def _pattern(name: str) -> re.Pattern:
    return re.compile("^" + re.escape(name).replace(r"\{i\}", r"\d+").replace(r"\{k\}", r"\d+") + "$")


_PATTERNS = [_pattern(n) for n in NAMES]


def is_known(name: str) -> bool:
    """True if ``name`` is in `NAMES` (placeholders matched)."""
    return any(p.match(name) for p in _PATTERNS)


def markdown_table() -> str:
    rows = ["| name | emitted by | meaning |", "| --- | --- | --- |"]
    rows += [f"| `{n}` | {src} | {meaning} |" for n, (src, meaning) in NAMES.items()]
    return "\n".join(rows)
