"""Random-initialised model folders with real shapes, for GPU checks where the pretrained weights cannot go (the
memory plan depends on shapes, not values):

    python scripts/benchmark/random_models.py TOKENIZER_DIR CONFIG_JSON OUT_DIR smollm2_135m_random llama_1b_random

TOKENIZER_DIR: a folder with the SmolLM2 tokenizer (the `tiny` model's cache folder has it); CONFIG_JSON: SmolLM2-135M's
config.json, which the larger shapes (Llama-3.2-1B and -3B widths and depths, SmolLM2's vocabulary) start from."""
import json
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

tokenizer_dir, smollm_config, out = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text()), Path(sys.argv[3])
one_b = dict(smollm_config, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=8, head_dim=64)
three_b = dict(smollm_config, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8, head_dim=128)
shapes = {"smollm2_135m_random": smollm_config, "llama_1b_random": one_b, "llama_3b_random": three_b}
for name in sys.argv[4:]:
    config_dict = shapes[name]
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config_dict))
    config = AutoConfig.from_pretrained(folder)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(tokenizer_dir / file, folder / file)
    print(name, sum(p.numel() for p in model.parameters()) / 1e6, "M params", flush=True)
    del model
