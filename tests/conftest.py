"""Shared fixtures: the embedded model folders and data, built once per machine and cached."""

import os

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    from open_instruct.data.embedded import smollm2_path

    return smollm2_path()


@pytest.fixture(scope="session")
def tiny_model_dir() -> str:
    from open_instruct.data.embedded import tiny_model_path

    return tiny_model_path()


@pytest.fixture(scope="session")
def arithmetic_data_dir() -> str:
    from open_instruct.data.embedded import arithmetic_data_path

    return arithmetic_data_path()


@pytest.fixture(scope="session")
def varied_length_model_dir(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny model with a random, large embedding for its EOS token (tied to the LM head), so that its responses
    stop at varied lengths (measured: 3..16 tokens of 16, half at the limit), as a real model's do. The tiny model's
    own EOS row is zero, so every response runs to the limit and a batch never has a long tail."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path_factory.mktemp("varied_length_model")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    embedding = model.get_input_embeddings().weight
    with torch.no_grad():
        embedding[tokenizer.eos_token_id] = 2.0 * torch.randn(embedding.shape[1], generator=torch.Generator().manual_seed(0))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)
