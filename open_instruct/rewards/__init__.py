"""rewards: how a response is scored. The verifiers that grade a response's text against its row's ground truth
(verifiers, answer_extraction; IFEval's instructions in ifeval and ifeval_checks; code against its tests in
code_tests, call_tests, code_runner and code_harness, run in the sandbox), a user's `--reward_function file.py:fn`
(reward_function), the process that runs them off the trainer's process (worker) and what a failure is counted as
(failures), the reward flags' settings (config), and the manager that turns all of it into one score per response
(manager: `RewardManager`, the `Scorer` seam the learner calls).
May import: math_verify, langdetect and torch (the manager's score tensors), and open_instruct.sandbox (through its
exports); nothing else of open_instruct. Model-written code never runs in our processes: only in the sandbox.
"""
