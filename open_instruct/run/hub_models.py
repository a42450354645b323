"""Models named by a hub id become local folders before anything loads.

Every model a run names (the policy and its reference, --reward_model_path, --value_model_path) goes through
`with_local_models` on the driver before Ray starts or any model loads: a local folder (or an embedded alias) stays;
a hub id is downloaded with huggingface_hub at its revision (--model_revision, --reward_model_revision,
--value_model_revision; default `main`) into the HF cache, weights as safetensors plus the json and tokenizer files
only, and from then on the run reads that snapshot folder. Why a folder and not the id: ZeRO-3 ranks read their share
of each tensor straight from the safetensors files (learner/zero3_loading.py), and every other loader (tokenizer,
config, vLLM) then reads the same commit, so nothing moves under a run when a branch gains a commit.

Across a resume too: a checkpoint records the commit each hub id resolved to (`resolved_commits`, the snapshot
folder's name), and a resumed run loads those commits (`with_local_models(args, pinned)`), not what the branches
point to by then. The reference policy (the policy's folder again) and the tokenizer (the policy's files) are the
run's first ones, whatever was pushed to the branch in between.

What cannot work fails here in one line (ConfigError: exit code 2): no such repo or revision, a repo without
safetensors weights, or HF_HUB_OFFLINE set and the snapshot not in the cache (the line says what to download).

Several nodes: the snapshot folder is `<HF cache>/models--{owner}--{name}/snapshots/{commit}`. Where a node does
not see the driver's folder (no shared HF cache), `folder_on_this_node` downloads that same commit into the node's
own HF cache before its learner rank or engine loads; huggingface_hub locks each file in the cache, so the ranks
of a node download it once between them. With a shared HF_HOME (or one pre-filled on each node) nothing is fetched.
"""

import os
from dataclasses import replace

from open_instruct.data.embedded import resolve_model_path
from open_instruct.run.args import Args, ConfigError, ModelArgs
from open_instruct.run.hub import looks_like_hub_id

# Weights (safetensors only: what ZeRO-3 reads partitioned), config and generation config, and the tokenizer's files.
HUB_MODEL_FILES = ["*.safetensors", "*.json", "tokenizer.model", "*.txt", "*.jinja"]
SAFETENSORS_FILES = ("model.safetensors", "model.safetensors.index.json")


# Each model flag and the flag of its revision.
MODEL_FLAGS = {
    "model_name_or_path": "model_revision",
    "reward_model_path": "reward_model_revision",
    "value_model_path": "value_model_revision",
}


def with_local_models(args: Args, pinned: dict[str, dict] | None = None) -> Args:
    """`args` with every model flag a local folder (hub ids downloaded, at their revisions) and no revisions left:
    the folder is the revision. What the learners, the engines and the start-up checks load. `pinned`: a checkpoint's
    `resolved_commits`; a hub id it names is loaded at that commit instead of its revision (a resumed run)."""
    model, folders = args.model, {}
    for flag, revision_flag in MODEL_FLAGS.items():
        name_or_path, revision = getattr(model, flag), getattr(model, revision_flag)
        if name_or_path is None:
            folders[flag], folders[revision_flag] = None, None
            continue
        pin = (pinned or {}).get(f"--{flag}")
        if pin is not None and pin["repo"] == name_or_path and looks_like_hub_id(name_or_path):
            folders[flag] = download_snapshot(name_or_path, pin["commit"], f"--{flag}")
        else:
            folders[flag] = local_model_folder(name_or_path, revision, f"--{flag}")
        folders[revision_flag] = None
    return replace(args, model=replace(model, **folders))


def resolved_commits(args: Args, local: Args) -> dict[str, dict]:
    """Per model flag named by a hub id: the repo, the revision asked for and the commit it resolved to (`local`'s
    snapshot folder is `.../snapshots/{commit}`). What a checkpoint keeps, so a resume loads the same commits."""
    commits = {}
    for flag, revision_flag in MODEL_FLAGS.items():
        name_or_path = getattr(args.model, flag)
        if name_or_path is not None and looks_like_hub_id(name_or_path):
            commits[f"--{flag}"] = {"repo": name_or_path, "revision": getattr(args.model, revision_flag) or "main",
                                    "commit": os.path.basename(getattr(local.model, flag))}  # fmt: skip
    return commits


def describe_pins(commits: dict[str, dict]) -> str:
    """'--model_name_or_path org/policy at commit 0123abcd (its revision main then)', one per flag."""
    return "; ".join(f"{flag} {pin['repo']} at commit {pin['commit'][:12]} (its revision {pin['revision']} then)"
                     for flag, pin in commits.items())  # fmt: skip


def local_model_folder(name_or_path: str, revision: str | None, flag: str) -> str:
    """The local folder of one model flag's value: a folder (or embedded alias) as it is, a hub id's snapshot."""
    if not looks_like_hub_id(name_or_path):
        if revision is not None:
            raise ConfigError(
                f"{flag} {name_or_path} is a local folder and has no revisions, yet one was given ({revision!r}); "
                "drop the revision flag, or give the hub id."
            )
        return resolve_model_path(name_or_path)
    return download_snapshot(name_or_path, revision or "main", flag)


def download_snapshot(repo_id: str, revision: str, flag: str) -> str:
    """`repo_id` at `revision` in the HF cache (cache first: an immutable commit already there is not asked for);
    one-line ConfigErrors for what cannot work."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    what = f"{flag} {repo_id} (revision {revision})"
    download = (
        f"`hf download {repo_id} --revision {revision} --include {' '.join(repr(p) for p in HUB_MODEL_FILES)}` "
        f"(with this run's HF_HOME) on every node"
    )
    try:
        folder = snapshot_download(repo_id, revision=revision, allow_patterns=HUB_MODEL_FILES)
    except RevisionNotFoundError:
        raise ConfigError(f"{what}: the repo has no revision {revision!r}; give a branch, tag or commit of it."
                          ) from None  # fmt: skip
    except RepositoryNotFoundError:
        raise ConfigError(
            f"{what}: no such local folder, and no such model repo on {constants.ENDPOINT} (or it is private or gated "
            "and the token cannot see it); check the path or id, or log in with `hf auth login`."
        ) from None
    except LocalEntryNotFoundError as error:
        if constants.HF_HUB_OFFLINE:
            raise ConfigError(f"{what} is no local folder, nor in the HF cache, and HF_HUB_OFFLINE is set; run "
                              f"{download}, or unset HF_HUB_OFFLINE.") from error  # fmt: skip
        raise ConfigError(f"{what} is no local folder, nor in the HF cache, and the Hub at {constants.ENDPOINT} could "
                          f"not be reached; check the network, or run {download}.") from error  # fmt: skip
    except HfHubHTTPError as error:
        cause = " ".join(str(error).split())[:200]
        raise ConfigError(f"{what}: the Hub refused the download ({cause}); check the id and the token.") from error
    if not any(os.path.isfile(os.path.join(folder, name)) for name in SAFETENSORS_FILES):
        raise ConfigError(
            f"{what} holds no safetensors weights ({' or '.join(SAFETENSORS_FILES)}), the only format the learner "
            "loads; convert its weights to safetensors in a local folder and give that folder."
        )
    return folder


def folder_on_this_node(folder: str) -> str:
    """`folder` where it exists on this node; for a hub snapshot the driver resolved (`.../models--{owner}--{name}/
    snapshots/{commit}`) and this node lacks, the same commit downloaded into this node's HF cache."""
    if os.path.isdir(folder):
        return folder
    snapshots = os.path.dirname(folder)
    repo_folder = os.path.basename(os.path.dirname(snapshots))
    if os.path.basename(snapshots) != "snapshots" or not repo_folder.startswith("models--"):
        raise ConfigError(
            f"the model folder {folder} does not exist on the node {os.uname().nodename}; put it on a filesystem "
            "every node sees, or give a hub id (each node then fetches it)."
        )
    repo_id = repo_folder.removeprefix("models--").replace("--", "/", 1)
    return download_snapshot(repo_id, os.path.basename(folder), "the model")


def models_on_this_node(model: ModelArgs) -> ModelArgs:
    """`with_local_models`' folders as this node has them (see `folder_on_this_node`)."""
    reward, value = model.reward_model_path, model.value_model_path
    return replace(
        model,
        model_name_or_path=folder_on_this_node(model.model_name_or_path),
        reward_model_path=None if reward is None else folder_on_this_node(reward),
        value_model_path=None if value is None else folder_on_this_node(value),
    )
