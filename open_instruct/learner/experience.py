"""A rollout as the learner's tensors (`Experience`), and the checks between the engine and the learner (their
logprobs' agreement, their dtypes).

Layout of every learner batch (the PPO detail "left-pad the prompts"):

    query_response = [pad pad q q q q | r r r r pad pad]    # [batch, context_length + response_len]
                      ^ left-padded    ^ response, right-padded after its stop token

so the response always starts at column `context_length`, and the logits that predict response
token j sit at column `context_length - 1 + j`.

With --tools a response also holds tool outputs the engine appended (docs/tools.md): the model reads them, so they are
in `attention_mask`, but it never sampled them, so `response_mask` (the tokens every loss, KL, entropy, value, GAE,
logprob check, length and token count is taken over) leaves them out. A stop token inside a tool's output does not
end the response: only a sampled one does.
"""

import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from open_instruct import rl
from open_instruct.data.batches import PromptBatch, left_pad
from open_instruct.generation.vllm_engine import Completion, engine_dtype
from open_instruct.rl.packing import PackedRows, pack_rows, plan_micro_batches
from open_instruct.run import devices


@dataclass
class RolloutTensors:
    """A rollout laid out as the learner's tensors (the layout is in the module doc), on the learner's device."""

    query_response: torch.Tensor  # [batch, context_length + response_len], left-padded queries
    attention_mask: torch.Tensor  # [batch, context_length + response_len]
    context_length: int
    # [batch, response_len]: the tokens the policy sampled, up to and including the first stop token (tool outputs:
    # False)
    response_mask: torch.Tensor
    response_length: torch.Tensor  # [batch]: every token of the response, the tools' included (the budget they share)
    engine_logprob: torch.Tensor  # [batch, response_len]: the engine's logprob of each sampled token, NaN where none
    stopped: list[bool]  # the response ended on a stop token or string (else it ran out of --response_length)

    @property
    def engine_scored(self) -> torch.Tensor:
        """[batch, response_len]: the real tokens the engine gave a logprob for."""
        return self.response_mask & torch.isfinite(self.engine_logprob)


def layout_rollout(
    prompts: PromptBatch, completions: list[Completion], pad_token_id: int, stop_token_ids: list[int], device
) -> RolloutTensors:
    """Each completion after its left-padded prompt, truncated at its first stop token (PPO detail), as tensors."""
    # An agent's sample has its own prompt (its first call's); a dataset sample's is its prompt's.
    query, query_mask = left_pad([prompts.token_ids[c.prompt_index] if c.prompt_token_ids is None else c.prompt_token_ids
                                  for c in completions], pad_token_id)  # fmt: skip
    generated_length = torch.tensor([len(c.token_ids) for c in completions])
    # As wide as the longest response in this batch, not --response_length: no compute on padding.
    width = max(int(generated_length.max()), 1)
    raw_response = torch.full((len(completions), width), pad_token_id, dtype=torch.long)
    for row, completion in enumerate(completions):
        raw_response[row, : len(completion.token_ids)] = torch.tensor(completion.token_ids)
    sampled = sampled_by_the_model(completions, width)
    # PPO detail: truncate at the first stop token the model sampled that ends the response (a tool's output may hold
    # one, and a native tool call's turn ends on one before the tool's turn: -1 hides both); the mask comes from
    # lengths (pad may equal eos).
    hidden = ~sampled | rl.turn_ends(sampled)
    _, stop_length = rl.truncate_response(raw_response.masked_fill(hidden, -1), stop_token_ids, pad_token_id)
    response_length = torch.minimum(stop_length, generated_length)
    real_mask = rl.response_mask_from_lengths(response_length, width)
    response = torch.where(real_mask, raw_response, pad_token_id)
    return RolloutTensors(
        query_response=torch.cat([query, response], dim=1).to(device),
        attention_mask=torch.cat([query_mask, real_mask.long()], dim=1).to(device),
        context_length=query.shape[1],
        response_mask=(real_mask & sampled).to(device),
        response_length=response_length.to(device),
        # Positions past the stop token (truncation) are padding: the engine's logprobs there are never read.
        engine_logprob=engine_logprobs(completions, width).to(device),
        stopped=[c.finish_reason == "stop" for c in completions],
    )


def sampled_by_the_model(completions: list[Completion], width: int) -> torch.Tensor:
    """[batch, width]: True where the model sampled the token, False on a tool's output (Completion.sampled); True on
    padding (the lengths mask it)."""
    sampled = torch.ones((len(completions), width), dtype=torch.bool)
    for row, completion in enumerate(completions):
        if completion.sampled is not None:
            sampled[row, : len(completion.sampled)] = torch.tensor(completion.sampled[:width], dtype=torch.bool)
    return sampled


def old_logprobs(
    rollout: RolloutTensors, learner_logprob: torch.Tensor | None, source: str
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's old (behaviour) logprobs, [batch, response_len], and where they came from: the learner's forward
    (--old_logprobs_from learner), or the engine's where it gave one and the learner's where it did not (0 on
    padding; 0 also where neither exists, which `needs_learner_logprobs` rules out)."""
    if source == "learner":
        return learner_logprob, {}
    engine_scored, mask = rollout.engine_scored, rollout.response_mask
    fallback = learner_logprob if learner_logprob is not None else torch.zeros_like(rollout.engine_logprob)
    logprob = torch.where(engine_scored, rollout.engine_logprob, torch.where(mask, fallback, 0.0))
    filled = (mask & ~engine_scored).float()
    return logprob, {"debug/old_logprobs_from_learner_frac": rl.masked_mean(filled, mask).item()}


def needs_learner_logprobs(rollout: RolloutTensors, source: str, tis_cap: float) -> bool:
    """The learner's old-logprob forward runs when its logprobs are the old ones, when truncated importance sampling
    weighs them against the engine's, or when the engine left a real token without a logprob."""
    return source == "learner" or tis_cap > 0 or not bool(rollout.engine_scored[rollout.response_mask].all())


@dataclass
class Experience:
    """Everything the PPO epochs need about one rollout batch (on the learner device)."""

    query_response: torch.Tensor  # [batch, context_length + response_len], left-padded queries
    attention_mask: torch.Tensor  # [batch, context_length + response_len]
    context_length: int
    response_mask: torch.Tensor  # [batch, response_len]
    logprob: torch.Tensor  # [batch, response_len] "old" logprobs: the learner's, or the engine's (--old_logprobs_from)
    ref_logprob: torch.Tensor | None  # [batch, response_len]; None with --beta 0 (no reference model)
    # Set by `compute_advantages`: [batch, response_len] each; value and return_ stay None without a value model.
    advantage: torch.Tensor | None = None
    value: torch.Tensor | None = None  # "old" values
    return_: torch.Tensor | None = None
    # [batch, response_len] per-token weight of the policy-gradient term (truncated importance sampling), or None.
    tis_weight: torch.Tensor | None = None
    # [batch, response_len] the engine's logprobs (NaN where it gave none), kept when make_experience ran no learner
    # forward to compare them with: `train` then compares them with the first minibatch's logprobs. Else None.
    engine_logprob_to_check: torch.Tensor | None = None


@dataclass
class MicroBatch:
    """One forward/backward pass of `train`: rows of the experience, padded or packed into one row (`packed`)."""

    positions: torch.Tensor  # [rows]: the rows' places in the minibatch
    rows: torch.Tensor  # [rows]: the rows' indices in the experience
    packed: PackedRows | None  # None: the padded rows themselves
    # The whole minibatch's real response tokens and responses (every micro-batch of every rank), which each
    # micro-batch's loss sums are divided by: the micro-batches' parts add up to the minibatch's mean, so a token
    # weighs the same whichever micro-batch (padded or packed) and rank it lands in.
    whole: rl.WholeBatch
    weight: float  # the micro-batch's share of its minibatch in the means of the logged stats
    real_tokens: int  # the real tokens a model pass computes on
    token_slots: int  # the token positions it computes on (real tokens plus padding)


def micro_batches(
    exp: Experience, minibatch: torch.Tensor, rows_per_micro_batch: int, max_tokens: int, rank: int, world_size: int
) -> list[MicroBatch]:
    """This rank's micro-batches of `minibatch` (indices into the experience).

    max_tokens 0: an equal slice of the rows per rank, `rows_per_micro_batch` padded rows at a time. Else the packed
    plan (rl/packing.py: groups of at most `max_tokens` real tokens, the same number on every rank, dealt by tokens),
    the same on every rank because it depends only on the rows' lengths. Either way every micro-batch carries the
    whole minibatch's token and response counts (`WholeBatch`): its losses are its part of the minibatch's mean."""
    if max_tokens == 0:
        local = torch.arange(len(minibatch)).tensor_split(world_size)[rank]
        groups = local.split(rows_per_micro_batch)
    else:
        lengths = exp.attention_mask[minibatch].sum(dim=1).tolist()
        plan = plan_micro_batches(lengths, max_tokens, world_size)[rank]
        groups = [torch.tensor(group, dtype=torch.long) for group in plan]
    # Every rank holds the whole rollout, so it counts the minibatch's tokens over all ranks without a collective.
    # At least 1: a minibatch of empty responses has a loss of 0, as masked_mean gives for an empty mask.
    whole = rl.WholeBatch(tokens=max(1, int(exp.response_mask[minibatch].sum())), sequences=len(minibatch))
    weight = 1.0 / (len(groups) * world_size)
    micro = []
    for positions in groups:
        rows = minibatch[positions]
        if max_tokens == 0:
            packed, real, slots = None, int(exp.attention_mask[rows].sum()), rows.numel() * exp.query_response.shape[1]
        else:
            packed = pack_rows(exp.query_response[rows], exp.attention_mask[rows], exp.context_length)
            real = slots = packed.num_tokens
        micro.append(MicroBatch(positions, rows, packed, whole, weight, real, slots))
    return micro


def engine_logprobs(completions: list[Completion], width: int) -> torch.Tensor:
    """The engine's logprob of each sampled token, [batch, width]; NaN where it gave none (a stop token added back
    after generation, logprobs not asked for) and on padding."""
    engine_logprob = torch.full((len(completions), width), torch.nan)
    for row, completion in enumerate(completions):
        if completion.logprobs is not None:
            logprobs = completion.logprobs[:width]
            engine_logprob[row, : len(logprobs)] = torch.tensor([torch.nan if lp is None else lp for lp in logprobs])
    return engine_logprob


@contextmanager
def timed(timings: dict[str, float], key: str):
    """Seconds the block took, in timings[key]; on a GPU, until its kernels finished (they run asynchronously)."""
    start = time.time()
    yield
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    timings[key] = time.time() - start


def check_engine_matches_learner(metrics: dict, max_diff: float, step: int | None = None) -> None:
    """Stop before training on a rollout that the engine did not sample from the learner's weights.

    The agreement is measured in `make_experience` when it runs the learner's old-logprob forward, else (with
    --old_logprobs_from vllm) on the first minibatch in `train`, which checks it itself before its first update;
    a call without the metric does nothing.
    """
    if "debug/vllm_vs_learner_logprob_diff_mean" not in metrics:
        return
    diff = metrics["debug/vllm_vs_learner_logprob_diff_mean"]
    if max_diff > 0 and not diff <= max_diff:  # `not <=`: a NaN difference stops the run too
        where = f"Step {step}" if step is not None else "This rollout (first minibatch)"
        raise RuntimeError(
            f"{where}: vLLM and the learner disagree on the logprobs of the sampled tokens by {diff:.4g} nats "
            f"per token on average (limit --max_vllm_logprob_diff {max_diff:g}), so the engine is not sampling "
            f"from the learner's weights (a failed or partial weight sync) and the rollouts are off-policy. "
            f"Look at the debug/vllm_vs_learner_* metrics; if the gap is expected (a bf16 engine, async mode at a "
            f"high learning rate), raise --max_vllm_logprob_diff."
        )


def agreement_metrics(learner_logprob: torch.Tensor, engine_logprob: torch.Tensor, mask: torch.Tensor) -> dict:
    """The `debug/vllm_vs_learner_*` metrics (rl.logprob_agreement); inputs [batch, response_len]."""
    agreement = rl.logprob_agreement(learner_logprob, engine_logprob, mask)
    return {
        "debug/vllm_vs_learner_logprob_diff_mean": agreement["diff_mean"].item(),
        "debug/vllm_vs_learner_logprob_diff_max": agreement["diff_max"].item(),
        "debug/vllm_vs_learner_ratio_mean": agreement["ratio_mean"].item(),
        "debug/vllm_vs_learner_ratio_min": agreement["ratio_min"].item(),
        "debug/vllm_vs_learner_ratio_max": agreement["ratio_max"].item(),
    }


def engine_dtype_mismatch(args, compute_dtype: torch.dtype, device: torch.device) -> str | None:
    """A warning when PPO's ratio would divide a bf16 learner's probabilities by an fp32 CPU engine's: with
    --old_logprobs_from vllm the rounding gap enters every ratio (docs/speed.md, "Learner dtype": two CPU runs in
    three collapsed). CPU learners only: a GPU learner's engines are on GPUs, in their own dtype."""
    if device.type != "cpu" or args.ppo.old_logprobs_from != "vllm":
        return None
    engine = engine_dtype(args.gen.vllm_dtype)
    learner = devices.dtype_name(compute_dtype)
    if engine == learner:
        return None
    return (f"[learner] warning: the learner computes in {learner} and the engine in {engine}, and "
            "--old_logprobs_from vllm puts that rounding gap into every PPO ratio (on the CPU recipe it grew until "
            "two runs in three collapsed; docs/speed.md, \"Learner dtype\"): pass --learner_compute_dtype "
            f"{engine} or --old_logprobs_from learner.")  # fmt: skip
