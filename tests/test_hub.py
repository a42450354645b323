"""Tests for open_instruct.run.hub, against the real huggingface_hub client talking to a local fake Hub."""

import json
import os

import pytest
import yaml

from open_instruct.run import hub as hub_module
from tests.support.fake_hub import INITIAL_GITATTRIBUTES, FakeHub, allow_hub_requests, fake_hub  # noqa: F401 (fixture)

TOKEN = "hf_fake_token_for_tests"


def make_model_folder(folder) -> dict[str, bytes]:
    """A folder shaped like a saved model; returns what it holds, relative path -> bytes."""
    files = {
        "config.json": json.dumps({"model_type": "llama", "hidden_size": 8}).encode(),
        "model.safetensors": bytes(range(256)) * 8,  # small binary blob with every byte value
        "tokenizer.json": json.dumps({"version": "1.0", "model": {"type": "BPE"}}).encode(),
        "tokenizer_config.json": b'{"eos_token": "<|im_end|>"}',
        "special_tokens_map.json": b'{"eos_token": "<|im_end|>"}',
        "README.md": b"---\nlibrary_name: transformers\ntags:\n- open-instruct\n---\n\n# A model\n",
        "extra/generation_config.json": b'{"do_sample": true}',
    }
    for path, data in files.items():
        os.makedirs(os.path.dirname(os.path.join(folder, path)), exist_ok=True)
        with open(os.path.join(folder, path), "wb") as f:
            f.write(data)
    return files


def push(folder, hub: FakeHub, revision: str = "run-1") -> str:
    return hub_module.push_folder_to_hub(str(folder), "entity/repo", revision, endpoint=hub.endpoint, token=TOKEN)


# ---------------------------------------------------------------- push_folder_to_hub


def test_push_creates_repo_and_branch_and_uploads_exactly_the_folder(tmp_path, fake_hub):  # noqa: F811
    files = make_model_folder(tmp_path / "model")

    url = push(tmp_path / "model", fake_hub)

    assert url == f"{fake_hub.endpoint}/entity/repo/tree/run-1"
    [create] = fake_hub.requests_to("create_repo")
    assert create.body["name"] == "repo" and create.body["organization"] == "entity"
    assert create.authorization == f"Bearer {TOKEN}"
    [branch] = fake_hub.requests_to("create_branch")
    assert branch.path == "/api/models/entity/repo/branch/run-1"
    # One commit, to run-1, with exactly the folder's files and bytes.
    [commit] = fake_hub.commits
    assert (commit.repo_id, commit.revision) == ("entity/repo", "run-1")
    assert commit.summary == "Upload model trained with open_instruct"
    assert commit.files == files
    # The branch now holds the folder on top of what main had; main is untouched.
    assert fake_hub.repos["entity/repo"]["run-1"] == {".gitattributes": INITIAL_GITATTRIBUTES, **files}
    assert fake_hub.repos["entity/repo"]["main"] == {".gitattributes": INITIAL_GITATTRIBUTES}
    # The client checked the README's metadata with the Hub before uploading.
    [validate] = fake_hub.requests_to("validate_yaml")
    assert validate.body["content"] == files["README.md"].decode()
    assert fake_hub.unhandled == []


def test_push_to_existing_repo_and_branch_and_main(tmp_path, fake_hub):  # noqa: F811
    files = make_model_folder(tmp_path / "model")
    push(tmp_path / "model", fake_hub)
    (tmp_path / "model" / "config.json").write_bytes(b'{"changed": true}')

    # Second push to the same branch: repo and branch exist (409s are accepted); only the changed file is sent.
    push(tmp_path / "model", fake_hub)
    assert fake_hub.commits[-1].files == {"config.json": b'{"changed": true}'}
    assert fake_hub.repos["entity/repo"]["run-1"]["config.json"] == b'{"changed": true}'

    # Pushing to main creates no branch.
    branches_before = len(fake_hub.requests_to("create_branch"))
    url = push(tmp_path / "model", fake_hub, "main")
    assert url.endswith("/entity/repo/tree/main")
    assert len(fake_hub.requests_to("create_branch")) == branches_before
    assert fake_hub.commits[-1].revision == "main"
    assert fake_hub.repos["entity/repo"]["main"]["model.safetensors"] == files["model.safetensors"]


def test_push_private_repo(tmp_path, fake_hub):  # noqa: F811
    make_model_folder(tmp_path / "model")
    hub_module.push_folder_to_hub(
        str(tmp_path / "model"), "entity/secret", "run-1", private=True, endpoint=fake_hub.endpoint, token=TOKEN
    )
    assert fake_hub.private["entity/secret"] is True


def test_push_missing_folder(tmp_path, fake_hub):  # noqa: F811
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        push(tmp_path / "does-not-exist", fake_hub)
    assert fake_hub.requests == []  # failed before any request


def test_push_unauthorized_explains_login(tmp_path, fake_hub):  # noqa: F811
    make_model_folder(tmp_path / "model")
    fake_hub.fail_with(401, message="Invalid username or password.")
    with pytest.raises(hub_module.HubPushError) as info:
        push(tmp_path / "model", fake_hub)
    message = str(info.value)
    assert "\n" not in message
    assert "'entity/repo'" in message and "'run-1'" in message and "HTTP 401" in message
    assert "hf auth login" in message and "HF_TOKEN" in message
    assert fake_hub.commits == []


def test_push_server_error_names_step(tmp_path, fake_hub):  # noqa: F811
    make_model_folder(tmp_path / "model")
    fake_hub.fail_with(500, route="create_branch", message="Internal Error")
    with pytest.raises(hub_module.HubPushError) as info:
        push(tmp_path / "model", fake_hub)
    message = str(info.value)
    assert message.startswith("creating the branch for 'entity/repo' at revision 'run-1'")
    assert "HTTP 500" in message and "Internal Error" in message and "\n" not in message
    assert fake_hub.commits == []


def test_push_unreachable_hub(tmp_path, monkeypatch):
    allow_hub_requests(monkeypatch)
    make_model_folder(tmp_path / "model")
    with FakeHub() as hub:
        endpoint = hub.endpoint  # a loopback port that is closed once the server stops
    with pytest.raises(hub_module.HubPushError, match="creating the repo.*HF_ENDPOINT"):
        hub_module.push_folder_to_hub(str(tmp_path / "model"), "entity/repo", "run-1", endpoint=endpoint, token=TOKEN)


def test_push_in_offline_mode_says_how_to_leave_it(tmp_path, fake_hub, monkeypatch):  # noqa: F811
    import huggingface_hub.constants

    make_model_folder(tmp_path / "model")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(hub_module.HubPushError, match="HF_HUB_OFFLINE"):
        push(tmp_path / "model", fake_hub)
    assert fake_hub.requests == []


def test_push_with_card_whose_base_model_is_a_path_is_refused_by_the_hub(tmp_path, fake_hub):  # noqa: F811
    # The fake Hub refuses a base_model that is not a repo id, as the real one does; write_model_card leaves it out.
    folder = tmp_path / "model"
    make_model_folder(folder)
    (folder / "README.md").write_text("---\nbase_model: /tmp/local/model\n---\n# x\n")
    with pytest.raises(hub_module.HubPushError, match="README.md"):
        push(folder, fake_hub)

    hub_module.write_model_card(
        str(folder), repo_id="entity/repo", base_model=str(tmp_path), dataset_names=[], wandb_url=None,
        training_args={}, metrics=None,
    )
    push(folder, fake_hub)
    assert fake_hub.commits[-1].files["README.md"] == (folder / "README.md").read_bytes()


# ---------------------------------------------------------------- resolve_hub_repo


def test_resolve_hub_repo_defaults_and_explicit_values():
    assert hub_module.resolve_hub_repo("me", None, "ppo_gsm8k", None, "ppo_gsm8k__1__1700000000") == (
        "me/ppo_gsm8k",
        "ppo_gsm8k__1__1700000000",
    )
    assert hub_module.resolve_hub_repo("org", "my-model", "exp", "v1.0", "run") == ("org/my-model", "v1.0")
    assert hub_module.resolve_hub_repo(None, "org/my-model", "exp", None, "run") == ("org/my-model", "run")


def test_resolve_hub_repo_asks_whoami_without_entity(fake_hub):  # noqa: F811
    repo_id, revision = hub_module.resolve_hub_repo(
        None, None, "exp", None, "run-1", endpoint=fake_hub.endpoint, token=TOKEN
    )
    assert (repo_id, revision) == ("test-user/exp", "run-1")
    assert [r.path for r in fake_hub.requests] == ["/api/whoami-v2"]


@pytest.mark.parametrize(
    "args, bad",
    [
        (("my org", None, "exp", None, "run"), "hf_entity"),
        (("org", "my model", "exp", None, "run"), "hf_repo_id"),
        (("org", None, "exp name", None, "run"), "exp_name"),
        (("org", None, "exp", "run 1", "run"), "hf_repo_revision"),
        (("org", None, "exp", None, "bad..name"), "run_name"),
        (("org", None, "-exp", None, "run"), "exp_name"),
    ],
)
def test_resolve_hub_repo_rejects_bad_names(args, bad):
    with pytest.raises(ValueError, match=bad):
        hub_module.resolve_hub_repo(*args)


def test_resolve_hub_repo_conflicting_owner():
    with pytest.raises(ValueError, match="'other'.*'me'"):
        hub_module.resolve_hub_repo("me", "other/model", "exp", None, "run")


# ---------------------------------------------------------------- write_model_card


def split_card(text: str) -> tuple[dict, str]:
    assert text.startswith("---\n")
    front, body = text[4:].split("\n---\n", 1)
    return yaml.safe_load(front), body


def test_model_card_front_matter_body_and_link(tmp_path):
    path = hub_module.write_model_card(
        str(tmp_path / "out"),
        repo_id="entity/ppo-addition",
        base_model="HuggingFaceTB/SmolLM2-135M-Instruct",
        dataset_names=["entity/addition-train"],
        wandb_url="https://wandb.ai/team/open_instruct/runs/abc123",
        training_args={
            "learning_rate": 3e-6,
            "kl_coef": 0.05,
            "stop_token": "eos",
            "hf_token": "hf_secret",
            "wandb_api_key": "key",
            "output_dir": tmp_path / "out",
            "stop_strings": ["</answer>"],
        },
        metrics={"eval/correct_rate": 0.8125, "objective/kl": 0.00321, "episodes": 4096, "missing": None},
        command="python open_instruct/ppo.py --config configs/train_configs/ppo_addition.yaml",
    )
    assert path == str(tmp_path / "out" / "README.md")
    metadata, body = split_card(open(path).read())
    assert metadata == {
        "library_name": "transformers",
        "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "tags": ["open-instruct", "ppo", "rlvr"],
        "datasets": ["entity/addition-train"],
    }
    assert "# ppo-addition" in body
    assert "(https://wandb.ai/team/open_instruct/runs/abc123)" in body
    assert "python open_instruct/ppo.py --config configs/train_configs/ppo_addition.yaml" in body
    args_block = body.split("```yaml\n", 1)[1].split("```", 1)[0]
    args = yaml.safe_load(args_block)
    assert args["learning_rate"] == 3e-6 and args["stop_token"] == "eos" and args["output_dir"] == str(tmp_path / "out")
    assert args["hf_token"] == "<redacted>" and args["wandb_api_key"] == "<redacted>"
    assert "hf_secret" not in body
    assert "| eval/correct_rate | 0.8125 |" in body
    assert "| objective/kl | 0.00321 |" in body
    assert "| episodes | 4096 |" in body
    assert "| missing | n/a |" in body


def test_model_card_local_base_model_and_no_wandb(tmp_path):
    path = hub_module.write_model_card(
        str(tmp_path),
        repo_id="entity/repo",
        base_model=str(tmp_path),
        dataset_names=[],
        wandb_url=None,
        training_args={},
        metrics=None,
    )
    metadata, body = split_card(open(path).read())
    assert "base_model" not in metadata and "datasets" not in metadata
    assert f"`{tmp_path}`" in body
    assert "wandb" not in body
    assert "No final metrics were recorded." in body
