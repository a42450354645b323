"""Where the learner's GPU memory goes, phase by phase, beside the memory plan's items: one model per process, the
memory_plan check's learner step (scripts/check_gpu.py) run twice, the allocator's peak and holding recorded around every
backward and optimizer step. Prints JSON.

    python scripts/benchmark/gpu_memory_breakdown.py MODEL_FOLDER
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import check_gpu  # noqa: E402
import torch  # noqa: E402

from open_instruct.data.tokenizer import load_tokenizer, stop_token_ids_for  # noqa: E402
from open_instruct.learner import single_process  # noqa: E402
from open_instruct.learner.ppo import PPOLearner  # noqa: E402
from open_instruct.rewards.manager import RewardManager  # noqa: E402
from open_instruct.run.args import compute_batch_sizes  # noqa: E402

GB = 1e9
path = sys.argv[1]
out = {"model": path}
torch.zeros(1, device="cuda")
free, total = torch.cuda.mem_get_info()
out["context_after_init"] = (total - free - torch.cuda.memory_reserved()) / GB
tokenizer = load_tokenizer(path)
args = check_gpu.memory_plan_args(path)
prompts, completions = check_gpu.synthetic_rollout(tokenizer, 8, 512)
plan = check_gpu.planned_learner_step(args, max(len(ids) for ids in prompts.token_ids))
out["plan_items"] = {item.name: round(item.steady / GB, 3) for item in plan.items}
out["plan_peak"] = plan.peak / GB
torch.manual_seed(0)
learner = PPOLearner(args, compute_batch_sizes(args), tokenizer, path, stop_token_ids_for(tokenizer, "eos"))
torch.cuda.synchronize()
out["allocated_after_load"] = torch.cuda.memory_allocated() / GB
out["peak_during_load"] = torch.cuda.max_memory_allocated() / GB
torch.cuda.reset_peak_memory_stats()
base = torch.cuda.memory_allocated()
experience, _, _ = learner.make_experience(prompts, completions, RewardManager(args.reward))
out["make_experience_peak_over_load"] = (torch.cuda.max_memory_allocated() - base) / GB
out["experience_held"] = (torch.cuda.memory_allocated() - base) / GB
phases = []
original_step, original_backward = single_process.AdamWTrainer.step, single_process.AdamWTrainer.backward


def step(self, apply=True):
    phases.append(("before_step_peak", torch.cuda.max_memory_allocated() / GB, torch.cuda.memory_allocated() / GB))
    torch.cuda.reset_peak_memory_stats()
    result = original_step(self, apply)
    phases.append(("step_peak", torch.cuda.max_memory_allocated() / GB, torch.cuda.memory_allocated() / GB))
    torch.cuda.reset_peak_memory_stats()
    return result


def backward(self, loss, last):
    phases.append(("before_backward", torch.cuda.max_memory_allocated() / GB, torch.cuda.memory_allocated() / GB))
    torch.cuda.reset_peak_memory_stats()
    original_backward(self, loss, last)
    phases.append(("backward_peak", torch.cuda.max_memory_allocated() / GB, torch.cuda.memory_allocated() / GB))


single_process.AdamWTrainer.step, single_process.AdamWTrainer.backward = step, backward
for number in range(2):
    if number:
        experience, _, _ = learner.make_experience(prompts, completions, RewardManager(args.reward))
        out["make_experience_2_peak"] = torch.cuda.max_memory_allocated() / GB
    torch.cuda.reset_peak_memory_stats()
    learner.train(experience)
    torch.cuda.synchronize()
    out[f"step{number + 1} phases(name, peak, allocated)"] = list(phases)
    phases.clear()
out["allocated_after_train"] = torch.cuda.memory_allocated() / GB
free, total = torch.cuda.mem_get_info()
out["reserved_now"] = torch.cuda.memory_reserved() / GB
out["outside_allocator_now"] = (total - free - torch.cuda.memory_reserved()) / GB
print(json.dumps(out, indent=1))
