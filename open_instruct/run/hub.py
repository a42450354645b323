"""Hugging Face Hub: name the repo and branch of a run, write its model card, push its folder.

Each run is pushed to its own branch (`revision`, by default the run name) of one repo per experiment, so
several runs of an experiment sit side by side and `main` is never overwritten by accident.
"""

import os
import re
from typing import Any

import yaml

MODEL_CARD_TAGS = ["open-instruct", "rlvr"]  # and the algorithm's name

# Hub names (owner, repo): letters, digits, '-', '_', '.'; start and end alphanumeric; no '--' or '..'; <= 96.
_HUB_NAME = re.compile(r"^(?!.*(--|\.\.))[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?$")
_HUB_NAME_RULE = (
    "use 1-96 letters, digits, '-', '_' or '.', with no spaces, no '--' or '..', starting and ending with a letter "
    "or digit"
)
# Git branch names (the subset the Hub accepts): no spaces or ~^:?*[\, no '..', no leading '-' or '/'.
_BRANCH_NAME = re.compile(r"^(?!.*\.\.)(?![-/])[A-Za-z0-9._/-]+(?<![/.])$")
_BRANCH_NAME_RULE = (
    "use letters, digits, '-', '_', '.' or '/', with no spaces or '..', not starting with '-' or '/' and not ending "
    "with '/' or '.'"
)
# Arguments whose values must not be published in a model card.
_SECRET_ARG = re.compile(r"(^|_)(token|api_key|password|secret)$")
_NOT_SECRET_ARGS = {"stop_token", "pad_token", "eos_token", "bos_token"}


class HubPushError(RuntimeError):
    """A push to the Hub failed; the message says which repo/revision and what to do."""


def _check_name(value: str, what: str, pattern: re.Pattern, rule: str) -> None:
    if not pattern.match(value):
        raise ValueError(f"{what} {value!r} is not a valid name on the Hub; {rule}.")


def resolve_hub_repo(
    hf_entity: str | None,
    hf_repo_id: str | None,
    exp_name: str,
    hf_repo_revision: str | None,
    run_name: str,
    *,
    endpoint: str | None = None,
    token: str | None = None,
) -> tuple[str, str]:
    """Return (repo_id, revision): `{entity}/{hf_repo_id or exp_name}` at branch `hf_repo_revision or run_name`.

    `hf_repo_id` may already be `owner/name`. Without `hf_entity` the entity is the logged-in user, asked from
    the Hub (`whoami`) at `endpoint` with `token`; pass `hf_entity` to stay offline.
    """
    repo_name = hf_repo_id if hf_repo_id is not None else exp_name
    if "/" in repo_name:
        owner, _, repo_name = repo_name.partition("/")
        if hf_entity is not None and hf_entity != owner:
            raise ValueError(
                f"hf_repo_id {hf_repo_id!r} names the owner {owner!r} but hf_entity is {hf_entity!r}; drop one of "
                "them or make them agree."
            )
        hf_entity = owner
    revision = hf_repo_revision if hf_repo_revision is not None else run_name
    _check_name(repo_name, "Hub repo name (hf_repo_id, default exp_name)", _HUB_NAME, _HUB_NAME_RULE)
    _check_name(revision, "Hub revision (hf_repo_revision, default run_name)", _BRANCH_NAME, _BRANCH_NAME_RULE)
    if hf_entity is None:
        from huggingface_hub import HfApi

        hf_entity = HfApi(endpoint=endpoint, token=token).whoami()["name"]
    _check_name(hf_entity, "Hub entity (hf_entity)", _HUB_NAME, _HUB_NAME_RULE)
    return f"{hf_entity}/{repo_name}", revision


def _explain_push_failure(error: Exception, action: str, repo_id: str, revision: str, endpoint: str) -> str:
    """One sentence: what failed, why (as far as the client knows), and what to do about it."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    where = f"{action} for {repo_id!r} at revision {revision!r} on {endpoint}"
    if isinstance(error, OfflineModeIsEnabled):
        return f"{where} was blocked because huggingface_hub is in offline mode; unset HF_HUB_OFFLINE to push."
    if isinstance(error, HfHubHTTPError):
        status = error.response.status_code
        reason = " ".join((error.server_message or error.response.reason_phrase or "no message").split())
        if status in (401, 403):
            fix = (
                "log in with a token that has write access to "
                f"{repo_id.split('/')[0]!r} (`hf auth login`, or set HF_TOKEN) and retry"
            )
        elif status == 404:
            fix = "check that the owner exists and your token can write to it (`hf auth whoami`)"
        else:
            fix = "retry later, or check the Hub status and the endpoint (HF_ENDPOINT)"
        return f"{where} failed with HTTP {status} ({reason}); {fix}."
    cause = " ".join(str(error).split())  # the client's messages span several lines; keep it on one
    if isinstance(error, ValueError):
        return f"{where} was refused ({cause}); fix the file it names (for README.md, its YAML front matter) and retry."
    return (
        f"{where} failed ({type(error).__name__}: {cause}); check the network connection and the endpoint "
        "(HF_ENDPOINT), then retry."
    )


def push_folder_to_hub(
    folder: str,
    repo_id: str,
    revision: str,
    commit_message: str = "Upload model trained with open_instruct",
    private: bool = False,
    endpoint: str | None = None,
    token: str | None = None,
) -> str:
    """Create `repo_id` (if needed) and the branch `revision` (if not main), upload `folder` there.

    Returns the URL of the uploaded tree, `{endpoint}/{repo_id}/tree/{revision}`. The token defaults to
    HF_TOKEN or the one saved by `hf auth login`; the endpoint to HF_ENDPOINT or huggingface.co.
    """
    if not os.path.isdir(folder):
        raise FileNotFoundError(
            f"folder to push {folder!r} does not exist or is not a directory; save the model there first or pass "
            "the output directory that holds it."
        )
    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint, token=token)
    action = "creating the repo"
    try:
        api.create_repo(repo_id, exist_ok=True, private=private)
        if revision != "main":
            action = "creating the branch"
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        action = f"uploading {folder!r}"
        api.upload_folder(folder_path=folder, repo_id=repo_id, revision=revision, commit_message=commit_message)
    # Any failure here is a failed push (HTTP status, connection, refused metadata, unreadable file); the HTTP
    # library under huggingface_hub has changed between major versions, so its error types are not named here.
    except Exception as e:
        raise HubPushError(_explain_push_failure(e, action, repo_id, revision, api.endpoint)) from e
    return f"{api.endpoint}/{repo_id}/tree/{revision}"


def looks_like_hub_id(name: str) -> bool:
    """`owner/name` with valid Hub names, and no such path here (an existing folder of that name wins, as in
    transformers)."""
    owner, slash, repo = name.partition("/")
    return bool(slash) and bool(_HUB_NAME.match(owner)) and bool(_HUB_NAME.match(repo)) and not os.path.exists(name)


def _card_value(value: Any) -> Any:
    """Values YAML can write safely: containers kept, numbers/strings/bools/None as is, anything else as str."""
    if isinstance(value, dict):
        return {str(key): _card_value(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_card_value(item) for item in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _public_args(training_args: dict) -> dict:
    """The training arguments as YAML-safe values, with secrets (a set token or API key) replaced."""
    return {
        key: "<redacted>" if value and _SECRET_ARG.search(key) and key not in _NOT_SECRET_ARGS else _card_value(value)
        for key, value in training_args.items()
    }


def _format_metric(value: Any) -> str:
    if hasattr(value, "item"):  # a torch or numpy scalar
        value = value.item()
    if isinstance(value, float):
        return f"{value:.4g}"
    return "n/a" if value is None else str(value)


def write_model_card(
    folder: str,
    *,
    repo_id: str,
    base_model: str,
    dataset_names: list[str],
    wandb_url: str | None,
    training_args: dict,
    metrics: dict | None,
    weights_dtype: str | None = None,
    command: str | None = None,
    algorithm: str = "ppo",
) -> str:
    """Write `{folder}/README.md`: Hub metadata (front matter), what was trained and how, final metrics, wandb link.

    `base_model` goes into the metadata only when it is a Hub id (`owner/name`): the Hub rejects a local path
    there. Arguments named like secrets (`hf_token`, `*_api_key`, ...) are written as `<redacted>`.
    Returns the path of the README.
    """
    os.makedirs(folder, exist_ok=True)
    base_is_hub_id = looks_like_hub_id(base_model)
    front_matter: dict[str, Any] = {"library_name": "transformers"}
    if base_is_hub_id:
        front_matter["base_model"] = base_model
    front_matter["tags"] = [MODEL_CARD_TAGS[0], algorithm, *MODEL_CARD_TAGS[1:]]
    if dataset_names:
        front_matter["datasets"] = list(dataset_names)

    args = _public_args(training_args)
    base_link = f"[{base_model}](https://huggingface.co/{base_model})" if base_is_hub_id else f"`{base_model}`"
    datasets_text = ", ".join(f"`{name}`" for name in dataset_names) if dataset_names else "(not recorded)"

    lines = [
        "---",
        yaml.safe_dump(front_matter, sort_keys=False).rstrip(),
        "---",
        "",
        f"# {repo_id.split('/')[-1]}",
        "",
        f"This model is {base_link} fine-tuned with {algorithm.upper()} from verifiable rewards (RLVR) using open_instruct.",
        "",
        f"- Datasets: {datasets_text}",
    ]
    if weights_dtype:
        lines.append(f"- Weights: saved in {weights_dtype} (the `dtype` in config.json)")
    if wandb_url:
        lines.append(f"- Training run (metrics, sample completions): [{wandb_url}]({wandb_url})")
    lines += ["", "## Training configuration", ""]
    if command:
        lines += ["Command:", "", "```bash", command, "```", ""]
    lines += ["```yaml", yaml.safe_dump(args, sort_keys=False).rstrip() if args else "{}", "```", ""]
    lines += ["## Final metrics", ""]
    if metrics:
        lines += ["| metric | value |", "| --- | --- |"]
        lines += [f"| {name} | {_format_metric(value)} |" for name, value in metrics.items()]
    else:
        lines.append("No final metrics were recorded.")
    lines.append("")

    path = os.path.join(folder, "README.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    return path
