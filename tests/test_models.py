"""learner/models and learner/saving: what is saved (dtype, shards, digest, rounding report) and dropout off in every forward."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file as load_safetensors
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from open_instruct.learner import models, saving, single_process
from open_instruct.run import devices


def test_rounding_report_counts_updates_that_bf16_rounds_back_to_the_initial_value():
    initial = {"w": torch.tensor([1.0, 1.0, 1.0, 0.5])}
    # bf16 has 8 significant bits: near 1.0 its step is 2**-7 = 0.0078125.
    trained = {"w": torch.tensor([1.0 + 1e-4, 1.0 + 0.02, 1.0, 0.5 - 1e-5]), "not_in_initial": torch.ones(3)}
    report = saving.rounding_report(trained, initial, torch.bfloat16)
    assert report == {"changed": 3.0, "rounded_away": 2.0, "fraction_rounded_away": pytest.approx(2 / 3)}
    assert saving.rounding_report(trained, initial, torch.float32)["rounded_away"] == 0.0
    assert saving.rounding_report(initial, initial, torch.bfloat16)["fraction_rounded_away"] == 0.0


def test_weights_sha256_sees_names_dtypes_and_every_bit():
    weights = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0])}
    digest = saving.weights_sha256(weights)
    assert saving.weights_sha256(dict(reversed(weights.items()))) == digest  # order of the dict does not matter
    assert saving.weights_sha256({**weights, "a": torch.tensor([1.0, 2.0 + 2e-7])}) != digest
    assert saving.weights_sha256({**weights, "a": weights["a"].double()}) != digest
    assert saving.weights_sha256({"c": weights["a"], "b": weights["b"]}) != digest


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_folder_holds_the_weights_in_the_asked_dtype_with_a_matching_config(tiny_model_dir, tmp_path, dtype):
    model = models.load_policy(tiny_model_dir, torch.device("cpu"))
    with torch.no_grad():
        model.model.norm.weight.add_(1e-5)  # an fp32 update below bf16's resolution
    weights = dict(saving.unique_state_items(model))
    initial = saving.CheckpointReader.of(tiny_model_dir) if dtype != torch.float32 else None
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    saved_model = saving.save_hf_folder(model, tokenizer, str(tmp_path / "model"), weights.items(), dtype, initial=initial)
    saved = load_safetensors(f"{saved_model.path}/model.safetensors")
    assert "lm_head.weight" not in saved  # tied: stored once
    assert saving.weights_sha256(saved) == saved_model.weights_sha256
    assert saved_model.weights_sha256 == saving.weights_sha256({k: v.to(dtype) for k, v in weights.items()})
    assert AutoConfig.from_pretrained(saved_model.path).dtype == dtype
    reloaded = AutoModelForCausalLM.from_pretrained(saved_model.path, dtype=torch.float32)
    kept_update = torch.equal(reloaded.model.norm.weight, model.model.norm.weight)
    assert kept_update == (dtype == torch.float32), "fp32 keeps the exact update; bf16 rounds it away"
    if dtype == torch.bfloat16:  # the 128 changed norm weights, all rounded back (the report reads the initial files)
        assert saved_model.rounding == {"changed": 128.0, "rounded_away": 128.0, "fraction_rounded_away": 1.0}


def test_a_large_model_is_saved_in_shards_with_an_index_that_transformers_and_vllm_layouts_read(tiny_model_dir, tmp_path):
    """Shards of at most max_shard_bytes, named and indexed as Hugging Face does; the folder loads whole, equal."""
    model = models.load_policy(tiny_model_dir, torch.device("cpu"))
    weights = list(saving.unique_state_items(model))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    max_bytes = 2**20  # 1 MiB: the tiny model's 25 MB embedding gets a shard of its own, the rest share a few
    saved = saving.save_hf_folder(model, tokenizer, str(tmp_path / "model"), weights, torch.float32, max_shard_bytes=max_bytes)
    files = sorted(p.name for p in (tmp_path / "model").glob("*.safetensors"))
    index = json.loads((tmp_path / "model" / "model.safetensors.index.json").read_text())
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(set(index["weight_map"].values())) == files
    for file in files[1:]:  # every shard but the one holding the oversized embedding respects the cap
        assert sum(t.numel() * 4 for t in load_safetensors(tmp_path / "model" / file).values()) <= max_bytes
    on_disk = saving.read_saved_weights(str(tmp_path / "model"))
    assert saving.weights_sha256(on_disk) == saved.weights_sha256 == saving.weights_sha256(dict(weights))
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "model"), dtype=torch.float32)
    for name, param in model.named_parameters():
        assert torch.equal(reloaded.get_parameter(name), param), name


def test_non_finite_weights_are_never_written(tiny_model_dir, tmp_path):
    model = models.load_policy(tiny_model_dir, torch.device("cpu"))
    weights = dict(saving.unique_state_items(model))
    weights["model.norm.weight"] = weights["model.norm.weight"].clone().fill_(float("nan"))
    with pytest.raises(saving.NonFiniteError, match="model.norm.weight holds NaN"):
        saving.save_hf_folder(model, AutoTokenizer.from_pretrained(tiny_model_dir), str(tmp_path / "model"),
                              weights.items(), torch.float32)  # fmt: skip
    assert not (tmp_path / "model").exists() and not list(tmp_path.iterdir())  # nothing half-written is left


def test_attention_dropout_in_the_checkpoint_is_off_in_train_mode(tiny_model_dir, tmp_path):
    """Attention modules copy config.attention_dropout when built; zeroing it afterwards left it on."""
    with open(f"{tiny_model_dir}/config.json") as f:
        config = json.load(f)
    folder = tmp_path / "dropout_model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.5}))
    for name in ("model.safetensors", "generation_config.json"):
        shutil.copy(f"{tiny_model_dir}/{name}", folder / name)
    input_ids = torch.tensor([[1, 5, 9, 14, 3, 8]])
    for load in (
        lambda: models.load_policy(str(folder), torch.device("cpu")),
        lambda: models.load_model(models.ModelSpec("value model", str(folder), scalar_head=True, pad_token_id=0),
                                  torch.device("cpu")),
    ):
        model = load().train()
        with torch.no_grad():
            first, second = (model(input_ids=input_ids).logits for _ in range(2))
        assert torch.equal(first, second), "two train-mode forwards differ: dropout is still on"


def test_a_save_that_rounds_most_of_the_update_away_warns_and_is_summarised(capsys):
    from open_instruct.learner.saving import SavedModel
    from open_instruct.run.summary import report_save_rounding

    lossy = SavedModel("out/model", "bfloat16", "digest", {"changed": 10.0, "rounded_away": 9.0, "fraction_rounded_away": 0.9})
    assert report_save_rounding(lossy) == {"save/fraction_of_changed_weights_rounded_away": 0.9}
    assert "rounded 90% of the changed weights back to their initial value" in capsys.readouterr().err
    assert report_save_rounding(SavedModel("out/model", "float32", "digest")) == {}
    assert capsys.readouterr().err == ""


def test_native_bf16_flags_are_read_from_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512_vnni\n")
    assert devices.native_bf16_cpu_flags(str(cpuinfo)) == ["avx512_bf16"]
    cpuinfo.write_text("flags\t\t: fpu avx2 amx_bf16 amx_tile avx512_bf16\n")
    assert devices.native_bf16_cpu_flags(str(cpuinfo)) == ["avx512_bf16", "amx_bf16"]
    cpuinfo.write_text("flags\t\t: fpu sse avx2 fma\n")
    assert devices.native_bf16_cpu_flags(str(cpuinfo)) == []
    assert devices.native_bf16_cpu_flags(str(tmp_path / "missing")) == []


def test_learner_compute_dtype_follows_the_flag_the_cpu_and_the_probe(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert devices.learner_compute_dtype("float32", cuda)[0] == torch.float32
    assert devices.learner_compute_dtype("auto", cuda)[0] == torch.bfloat16
    assert devices.learner_compute_dtype("bfloat16", cpu)[0] == torch.bfloat16
    # auto on a CPU: the real probe on this machine decides, and the reason says what it measured.
    dtype, why = devices.learner_compute_dtype("auto", cpu)
    if not devices.native_bf16_cpu_flags():
        assert dtype == torch.float32 and "no native bf16" in why
    else:
        assert (dtype == torch.bfloat16) == ("bfloat16" in why) and "x fp32" in why
    # The decision on the machine kinds this project runs on (flags and probe results as measured on them).
    for flags, speedup, expected in [
        ([], None, torch.float32),  # AVX2 only: no probe at all
        (["avx512_bf16"], 0.52, torch.float32),  # Intel Xeon, avx512_bf16 without AMX: measured 2x slower than fp32
        (["avx512_bf16"], 3.5, torch.bfloat16),  # AMD EPYC with avx512_bf16: measured 2.7-7x faster than fp32
        (["avx512_bf16", "amx_bf16"], 3.0, torch.bfloat16),
    ]:
        monkeypatch.setattr(devices, "native_bf16_cpu_flags", lambda flags=flags: flags)
        monkeypatch.setattr(devices, "bf16_matmul_speedup", lambda speedup=speedup: speedup)
        assert devices.learner_compute_dtype("auto", cpu)[0] == expected, (flags, speedup)


def test_bf16_probe_measures_a_positive_speedup():
    assert 0.001 < devices.bf16_matmul_speedup(repeats=2) < 100  # AVX2 only (emulated bf16): ~0.015


def test_weight_snapshots_copy_into_reused_buffers_one_per_slot():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    snapshots = single_process.WeightSnapshots(slots=2)
    first = snapshots.take(model, torch.float32, slot=0)
    assert [name for name, _ in first] == [name for name, _ in model.named_parameters()]
    assert all(torch.equal(view, param) for (_, view), param in zip(first, model.parameters()))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    second = snapshots.take(model, torch.float32, slot=1)
    # Slot 0 still holds the first copy (the engine may not have loaded it yet); slot 1 the new weights.
    assert all(torch.equal(view + 1.0, param) for (_, view), param in zip(first, model.parameters()))
    assert all(torch.equal(view, param) for (_, view), param in zip(second, model.parameters()))
    assert first[0][1].untyped_storage().data_ptr() != second[0][1].untyped_storage().data_ptr()
    # Taking slot 0 again writes into the same memory (no new allocation), in the dtype asked for.
    again = snapshots.take(model, torch.float32, slot=0)
    assert again[0][1].untyped_storage().data_ptr() == first[0][1].untyped_storage().data_ptr()
    assert all(torch.equal(view, param) for (_, view), param in zip(again, model.parameters()))
    halves = snapshots.take(model, torch.bfloat16, slot=0)
    assert all(view.dtype == torch.bfloat16 for _, view in halves)


def test_a_checkpoint_missing_weights_is_said_in_one_line_of_ours(tiny_model_dir, tmp_path, capsys):
    """transformers' own load report goes to the library log; a weight the checkpoint lacks (other than a new score
    head) is restated on the console, because it starts from random values."""
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    weights = load_file(broken / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    models.load_policy(str(broken), torch.device("cpu"))
    err = capsys.readouterr().err
    assert "the policy checkpoint" in err and "lacks 1 weight(s) (model.layers.1.mlp.down_proj.weight)" in err
    value = models.ModelSpec("value model", str(tiny_model_dir), scalar_head=True, pad_token_id=0)
    models.load_model(value, torch.device("cpu"))
    assert "lacks" not in capsys.readouterr().err  # the value model's new score head is expected to be missing


def test_a_bf16_cpu_learner_against_the_fp32_engines_logprobs_is_warned_about():
    """--old_logprobs_from vllm divides the learner's probabilities by the engine's: on CPUs (fp32 engine) a bf16
    learner gets a warning naming both fixes; one dtype, the learner's own old logprobs, or a GPU: none."""
    from open_instruct.learner.experience import engine_dtype_mismatch
    from open_instruct.run.args import parse_args

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    engine_logprobs = parse_args(["--old_logprobs_from", "vllm", "--vllm_dtype", "float32"])  # auto: the same on CPUs
    warning = engine_dtype_mismatch(engine_logprobs, torch.bfloat16, cpu)
    assert "bfloat16" in warning and "float32" in warning
    assert "--learner_compute_dtype float32" in warning and "--old_logprobs_from learner" in warning
    assert engine_dtype_mismatch(engine_logprobs, torch.float32, cpu) is None
    assert engine_dtype_mismatch(engine_logprobs, torch.bfloat16, cuda) is None
    assert engine_dtype_mismatch(parse_args(["--old_logprobs_from", "learner"]), torch.bfloat16, cpu) is None
    bf16_engine = parse_args(["--old_logprobs_from", "vllm", "--vllm_dtype", "bfloat16"])
    assert engine_dtype_mismatch(bf16_engine, torch.bfloat16, cpu) is None


@pytest.mark.parametrize("name", ["ppo_arithmetic_cpu.yaml", "grpo_arithmetic_cpu.yaml", "ppo_word_problems_cpu.yaml",
                                  "grpo_tools_cpu.yaml", "ppo_tools_cpu.yaml"])  # fmt: skip
def test_cpu_recipes_with_engine_logprobs_compute_in_the_engines_dtype(name):
    """A CPU recipe never divides a bf16 learner's probabilities by the fp32 engine's (docs/speed.md, "Learner dtype":
    that collapsed in 2 of 3 seeds): it pins an fp32 learner with the engine's logprobs, or lets `auto` choose both,
    which on either dtype the probe may pick takes the engine's logprobs only with an fp32 learner."""
    from pathlib import Path

    from open_instruct.learner.experience import engine_dtype_mismatch
    from open_instruct.run.args import old_logprobs_source, parse_args

    args = parse_args([str(Path(__file__).resolve().parents[1] / "configs" / "train_configs" / name)])
    cpu = torch.device("cpu")
    if args.ppo.old_logprobs_from == "auto":
        assert args.model.learner_compute_dtype == "auto"
        for learner_dtype in ("float32", "bfloat16"):  # whatever this CPU's probe would say
            source, cap, _ = old_logprobs_source(args, learner_dtype, "float32", "cpu")  # a CPU engine: fp32
            assert (source == "vllm") == (learner_dtype == "float32") and (cap > 0) == (learner_dtype == "bfloat16")
        return
    assert args.ppo.old_logprobs_from == "vllm" and args.model.learner_compute_dtype == "float32"
    learner_dtype = devices.learner_compute_dtype(args.model.learner_compute_dtype, cpu)[0]
    assert engine_dtype_mismatch(args, learner_dtype, cpu) is None


def test_a_smaller_critic_is_its_inits_first_layers_with_a_new_head_and_the_plan_counts_it(tiny_model_dir):
    """--value_model_num_layers N: the value model is the first N decoder layers of its init, their weights exactly
    the checkpoint's, plus a new score head; the memory plan's shape of it has N layers and its parameter count."""
    from open_instruct.run.args import parse_args
    from open_instruct.run.model_shapes import run_model_shapes

    policy = models.load_policy(str(tiny_model_dir), torch.device("cpu"))
    assert policy.config.num_hidden_layers == 2
    spec = models.ModelSpec("value model", str(tiny_model_dir), scalar_head=True, pad_token_id=0, num_layers=1)
    critic = models.load_model(spec, torch.device("cpu"))
    assert critic.config.num_hidden_layers == 1 and len(critic.model.layers) == 1
    policy_weights = policy.state_dict()
    for name, tensor in critic.model.state_dict().items():
        assert torch.equal(tensor, policy_weights[f"model.{name}"]), name
    assert critic.score.weight.std() > 0  # the new head, PPO's init
    full = models.load_model(models.ModelSpec("value model", str(tiny_model_dir), scalar_head=True, pad_token_id=0),
                             torch.device("cpu"))  # fmt: skip
    shapes = {s.role: s for s in run_model_shapes(parse_args(["--model_name_or_path", str(tiny_model_dir),
                                                              "--value_model_num_layers", "1"]))}  # fmt: skip
    assert shapes["value model"].num_layers == 1
    assert shapes["value model"].num_params == sum(p.numel() for p in critic.parameters())
    assert shapes["value model"].num_params < sum(p.numel() for p in full.parameters())
    # A recipe's N deeper than a smaller model (the CPU recipe's 8 on the 2-layer test model): all its layers.
    deep = models.ModelSpec("value model", str(tiny_model_dir), scalar_head=True, pad_token_id=0, num_layers=8)
    assert models.load_model(deep, torch.device("cpu")).config.num_hidden_layers == 2


def test_old_logprobs_auto_takes_the_engines_only_where_they_are_the_learners():
    """--old_logprobs_from auto: the engine's logprobs where engine and learner both compute in fp32 on a CPU and the
    data is one version old; anywhere else the learner's own, with the truncated importance weight to the engine's
    (cap 2 unless set). Explicit choices pass through."""
    from open_instruct.run.args import old_logprobs_source, parse_args

    auto = parse_args(["--old_logprobs_from", "auto"])
    assert old_logprobs_source(auto, "float32", "float32", "cpu")[:2] == ("vllm", 0.0)
    source, cap, why = old_logprobs_source(auto, "bfloat16", "float32", "cpu")
    assert (source, cap) == ("learner", 2.0) and "bfloat16" in why and "float32" in why
    assert old_logprobs_source(auto, "bfloat16", "bfloat16", "cuda")[:2] == ("learner", 2.0)
    assert old_logprobs_source(auto, "float32", "float32", "cuda")[:2] == ("learner", 2.0)  # a GPU's kernels differ
    lagged = parse_args(["--old_logprobs_from", "auto", "--async_steps", "2"])
    assert old_logprobs_source(lagged, "float32", "float32", "cpu")[:2] == ("learner", 2.0)
    capped = parse_args(["--old_logprobs_from", "auto", "--truncated_importance_sampling_ratio_cap", "3"])
    assert old_logprobs_source(capped, "float32", "float32", "cpu")[:2] == ("learner", 3.0)
    uncorrected = parse_args(["--old_logprobs_from", "auto", "--truncated_importance_sampling_ratio_cap", "0"])
    assert old_logprobs_source(uncorrected, "bfloat16", "float32", "cpu")[:2] == ("learner", 0.0)
    explicit = parse_args(["--old_logprobs_from", "vllm"])
    assert old_logprobs_source(explicit, "bfloat16", "float32", "cpu")[:2] == ("vllm", 0.0)
