"""The engine's side of vLLM's own weight-transfer engines (nccl, ipc), on a CPU: run by tests/test_weight_transfer.py
as a subprocess (one vLLM engine per process), prints one JSON line.

vLLM's NCCL and IPC transfer engines need CUDA, so this registers a stand-in transfer engine with vLLM's factory
whose `receive_weights` hands the update's tensors to the model's `load_weights`, as the IPC engine does with the
tensors it maps (the NCCL one with those it receives). Everything around it is the trainer's: the engine built from
EngineConfig with our worker extension and `weight_transfer_config`, weight_transfer.join's checksum wrapper around
`load_weights`, start_update / vLLM's update_weights / finish_update (vLLM's layer-wise reload) and the report.

    python tests/support/vllm_transfer_glue.py MODEL_DIR
"""

import json
import os
import sys
from dataclasses import dataclass

import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process, where the stand-in is

from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo  # noqa: E402
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory  # noqa: E402

from open_instruct.run import console  # noqa: E402


@dataclass
class StandInInit(WeightTransferInitInfo):
    pass


@dataclass
class StandInUpdate(WeightTransferUpdateInfo):
    names: list
    tensors: list


class StandInTransferEngine(WeightTransferEngine):
    """vLLM's IPC engine without CUDA: the tensors arrive in the update itself."""

    init_info_cls, update_info_cls = StandInInit, StandInUpdate

    def init_transfer_engine(self, init_info) -> None:
        pass

    def start_weight_update(self) -> None:  # as vLLM's NCCL and IPC engines do
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, update_info) -> None:
        self.model.load_weights(list(zip(update_info.names, update_info.tensors)))

    def shutdown(self) -> None:
        pass


def main(model_dir: str) -> dict:
    from transformers import AutoModelForCausalLM

    from open_instruct.generation import vllm_engine, weight_broadcast, weight_transfer

    WeightTransferEngineFactory.register_engine("stand_in", StandInTransferEngine)
    original = vllm_engine.vllm_transfer_backend
    vllm_engine.vllm_transfer_backend = lambda *args: "stand_in"  # what a GPU engine would build: nccl or ipc
    llm = vllm_engine.create_engine(vllm_engine.EngineConfig(model_dir, max_model_len=256, weight_sync="auto"))
    vllm_engine.vllm_transfer_backend = original
    reports = weight_transfer.engine_device_reports(llm)
    plan = weight_broadcast.plan_buckets([("unused", (1,))], torch.float32, 1)
    for _ in range(2):  # joined twice, as after an engine restart re-forms the group: its loads are summed once
        weight_transfer.join(llm, weight_transfer.WeightTransfer("ipc", "", 0, 2, plan, 1, 60), first_rank=1)
    prompt = [[1, 2, 3, 4, 5]]
    greedy = vllm_engine.sampling_params(n=1, temperature=0.0, max_tokens=8, stop_token_ids=[])
    before = vllm_engine.generate(llm, prompt, greedy)[0].token_ids

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    named = [(name, (p.detach() + 0.05 * torch.randn(p.shape, generator=generator)).contiguous())
             for name, p in model.named_parameters()]  # fmt: skip
    weight_transfer.start_update(llm)
    llm.update_weights({"update_info": {"names": [n for n, _ in named], "tensors": [t for _, t in named]}})
    per_worker = weight_transfer.finish_update(llm)

    new = dict(named)

    def holds_the_new_weights(engine_model) -> bool:
        params = dict(engine_model.named_parameters())
        q_rows = new["model.layers.0.self_attn.q_proj.weight"].shape[0]
        return bool(torch.equal(params["model.embed_tokens.weight"], new["model.embed_tokens.weight"])
                    and torch.equal(params["model.layers.0.self_attn.qkv_proj.weight"][:q_rows],
                                    new["model.layers.0.self_attn.q_proj.weight"]))  # fmt: skip

    return {
        "reports": reports,
        "sent": weight_broadcast.weights_checksum(t for _, t in named),
        "received": per_worker,
        "holds_the_new_weights": all(llm.apply_model(holds_the_new_weights)),
        "greedy_changed": vllm_engine.generate(llm, prompt, greedy)[0].token_ids != before,
    }


if __name__ == "__main__":
    result = main(sys.argv[1])
    # The result is printed; the teardown at exit would take seconds (console.exit_without_teardown).
    console.exit_without_teardown(lambda: print(json.dumps(result)))
