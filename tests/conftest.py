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
