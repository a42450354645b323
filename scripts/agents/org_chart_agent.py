"""An agent for the embedded org-chart task, written only against the `openai` package: it asks the model, answers
each `manager_of` call from the row's own org chart, and grades the final answer. `--rollout_agent
scripts/agents/org_chart_agent.py:run` trains it (configs/train_configs/grpo_agent_cpu.yaml, docs/agents.md)."""

import json

TOOLS = [{"type": "function", "function": {
    "name": "manager_of", "description": "The name of a person's manager in the org chart.",
    "parameters": {"type": "object", "properties": {"person": {"type": "string", "description": "a first name"}},
                   "required": ["person"]}}}]  # fmt: skip
MAX_TOOL_TURNS = 3


def manager_of(managers: dict, person) -> str:
    if person in managers:
        return managers[person]
    if person in managers.values():
        return f"{person} has no manager."
    return f"Error: no one named {person!r} is in the org chart."


def run(row, client):
    managers = json.loads(row["managers"])
    messages = list(row["messages"])
    for _ in range(MAX_TOOL_TURNS + 1):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS).choices[0]
        messages.append(reply.message.model_dump(exclude_none=True))
        if not reply.message.tool_calls:  # the model answered
            answer = reply.message.content or ""
            return {"reward": float(reply.finish_reason == "stop" and f"The answer is {row['ground_truth']}." in answer),
                    "tool_calls": (len(messages) - len(row["messages"]) - 1) / 2}  # fmt: skip
        for call in reply.message.tool_calls:
            try:
                result = manager_of(managers, json.loads(call.function.arguments).get("person"))
            except (ValueError, AttributeError):
                result = "Error: the arguments are not a JSON object."
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return {"reward": 0.0, "tool_calls": float(MAX_TOOL_TURNS)}  # still calling after its last turn
