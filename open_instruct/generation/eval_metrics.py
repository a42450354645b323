"""Scoring what the engine generated for people to read: the eval's greedy and sampled correct rates on the eval prompts
(graded by each row's verifier, or the --reward_function), and the sample rows logged each step.
"""

from open_instruct.data.batches import PromptBatch
from open_instruct.generation.generation_thread import Rollout
from open_instruct.rewards.manager import RewardManager


def verifiable_correct_rate(completions, prompts: PromptBatch, reward_manager: RewardManager) -> float | None:
    verifiable = [c for c in completions if prompts.ground_truths[c.prompt_index] is not None]
    if not verifiable or not reward_manager.config.apply_verifiable_reward:
        return None
    _, metrics = reward_manager.score(
        [c.text for c in verifiable],
        [prompts.ground_truths[c.prompt_index] for c in verifiable],
        [prompts.verifier_names[c.prompt_index] for c in verifiable],
        [c.finish_reason == "stop" for c in verifiable],
    )
    return metrics["objective/verifiable_correct_rate"]


def tool_use(completions, prompts: PromptBatch, reward_manager: RewardManager) -> dict[str, float]:
    """How the responses used their tools: calls per response, and the share of the correct responses (by each row's
    verifier) that called a tool at least once (0 when none is correct)."""
    calls = [(c.tool_stats or {}).get("calls", 0) for c in completions]
    graded = [i for i, c in enumerate(completions) if prompts.ground_truths[c.prompt_index] is not None]
    _, correct, _ = reward_manager.score_and_correct(
        [completions[i].text for i in graded],
        [prompts.ground_truths[completions[i].prompt_index] for i in graded],
        [prompts.verifier_names[completions[i].prompt_index] for i in graded],
        [completions[i].finish_reason == "stop" for i in graded],
    )
    right = [i for i, verdict in zip(graded, correct.tolist()) if verdict > 0.5]
    return {"calls_per_answer": sum(calls) / max(1, len(completions)),
            "correct_used_tool": sum(calls[i] > 0 for i in right) / len(right) if right else 0.0}  # fmt: skip


def tool_call_rate(completions) -> float:
    """The share of responses that called a tool at least once (0 for responses generated without tools)."""
    return sum(bool(c.tool_stats and c.tool_stats["calls"] > 0) for c in completions) / max(1, len(completions))


def agent_reward_rate(completions: list, rollouts: int) -> float:
    """The agents' mean reward over `rollouts` runs (one sample each counted: a rollout's splits share its reward; a
    dropped rollout counts 0)."""
    return sum(c.agent["reward"] for c in completions if c.agent["split"] == 0) / max(1, rollouts)


def eval_metrics(rollout: Rollout, eval_prompts: PromptBatch, reward_manager: RewardManager) -> tuple[dict, list[dict]]:
    """Eval: greedy and sampled correct rates on the eval rows that have a ground truth, greedy length.

    Rows without a ground truth (reward-model-only data) count for the length only: the reward model
    belongs to the learner, and an eval that waited for it would stall the generation thread.
    """
    completions = rollout.completions
    result = {
        # The model's tokens (a tool's output is not part of its answer's length)
        "eval/sequence_lengths": sum(len(c.token_ids) if c.sampled is None else c.sampled.count(True)
                                     for c in completions) / len(completions),  # fmt: skip
        "eval/policy_version": rollout.policy_version,
        "time/eval_generation": rollout.timings.get("eval_generation", 0.0),
        # the sampled rate's precision (--eval_samples_per_prompt, --mid_run_eval_samples_per_prompt)
        "eval/samples_per_prompt": len(rollout.sampled_completions) / max(1, len(eval_prompts.token_ids)),
    }
    if any(c.tool_stats is not None for c in completions + rollout.sampled_completions):  # a run with --tools
        result["eval/tool_call_rate"] = tool_call_rate(completions)
        # outputs cut to --tool_output_max_tokens, greedy and sampled together (BatchCollector.note_cut_outputs)
        result["eval/tool_outputs_cut"] = float(sum((c.tool_stats or {}).get("outputs_cut", 0)
                                                    for c in completions + rollout.sampled_completions))  # fmt: skip
        if rollout.sampled_completions:
            result["eval/sampled_tool_call_rate"] = tool_call_rate(rollout.sampled_completions)
    by_key = {"eval/correct_rate": completions, "eval/sampled_correct_rate": rollout.sampled_completions}
    if any(c.agent is not None for c in completions):  # --rollout_agent: the agent's reward is its verdict
        prompts = max(1, len(eval_prompts.token_ids))
        result["eval/correct_rate"] = agent_reward_rate(completions, prompts)
        runs = rollout.engine_metrics.get("sampled_rollouts_per_prompt", 0)
        result["eval/samples_per_prompt"] = float(runs)
        if runs:
            result["eval/sampled_correct_rate"] = agent_reward_rate(rollout.sampled_completions, prompts * runs)
        result.update({f"eval/{key}": value for key, value in rollout.engine_metrics.items() if key.startswith("agent/")})
        by_key = {}
    for key, eval_completions in by_key.items():
        correct_rate = verifiable_correct_rate(eval_completions, eval_prompts, reward_manager)
        if correct_rate is not None:
            result[key] = correct_rate
    samples = [
        {
            "policy_version": rollout.policy_version,
            "prompt": eval_prompts.texts[c.prompt_index],
            "ground_truth": eval_prompts.ground_truths[c.prompt_index],
            "response": c.text,
            "token_ids": c.token_ids,
        }
        for c in completions
    ]
    return result, samples


def sample_rows(prompts: PromptBatch, rollout: Rollout, scores: list[float], how_many: int) -> list[dict]:
    return [
        {
            "prompt": prompts.texts[c.prompt_index],
            "response": c.text,
            "ground_truth": prompts.ground_truths[c.prompt_index],
            "score": score,
            "finish_reason": c.finish_reason,
        }
        for c, score in list(zip(rollout.completions, scores))[:how_many]
    ]
