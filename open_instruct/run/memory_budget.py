"""A learner rank's memory plan, before any model loads: the items of memory_items.py (and engine_memory.py's share of
the device) summed into peaks, printed as a table, and checked against the device.

`plan_memory(args, shapes, device)` lists what one learner rank holds, item by item, at load and in steady state
(the peak of a training step), and `MemoryPlan.check` refuses a run whose peak is over the device's memory with one
line naming the biggest item and the flag that changes it. `python -m open_instruct.memory_plan CONFIG.yaml` prints
the plan of a recipe offline.

Peaks: at load, what the loaded models hold plus the largest transient of loading; in steady state, what is always
held plus the largest of four phases that never overlap: the forward passes of the rollout (no gradients), one
model's forward + backward of a micro-batch, one model's optimizer step, the weight sync.
"""

from dataclasses import dataclass, field

from open_instruct.run.args import Args, ConfigError
from open_instruct.run.engine_memory import engine_items
from open_instruct.run.memory_items import (
    CPU_PROCESS_BYTES,
    GB,
    GPU_ALLOCATOR_SLACK,
    GPU_PROCESS_BYTES,
    HELD,
    LOADING,
    PHASES,
    Item,
    dtype_label,
    frozen_items,
    layout_of,
    loading_item,
    phase_items,
    trainable_items,
    weight_sync_items,
)
from open_instruct.run.model_shapes import ModelShape, describe_count


@dataclass
class MemoryPlan:
    title: str
    device: str
    items: list[Item]
    capacity: float | None = None  # bytes of the device the plan is checked against
    notes: list[str] = field(default_factory=list)

    def held(self, column: str) -> float:
        return sum(getattr(item, column) for item in self.items if item.when == HELD)

    def phase_total(self, phase: str) -> float:
        return sum(item.steady for item in self.items if item.when == phase)

    @property
    def at_load(self) -> float:
        return self.held("at_load") + max([item.at_load for item in self.items if item.when == LOADING] or [0])

    @property
    def largest_phase(self) -> str:
        return max(PHASES, key=self.phase_total)

    @property
    def steady(self) -> float:
        return self.held("steady") + self.phase_total(self.largest_phase)

    @property
    def peak(self) -> float:
        return max(self.at_load, self.steady)

    def biggest_item(self) -> Item:
        """The item that weighs most in the peak (a transient counts when its phase is the peak's)."""
        counted = [item for item in self.items if item.when in (HELD, self.largest_phase)]
        if self.at_load > self.steady:
            counted = [item for item in self.items if item.when in (HELD, LOADING)]
            return max((item for item in counted if item.fix), key=lambda item: item.at_load)
        return max((item for item in counted if item.fix), key=lambda item: item.steady)

    def lines(self) -> list[str]:
        """The table, one console line each."""
        def gib(value: float) -> str:
            return f"{value / GB:9.1f} GB" if value else "        -   "

        width = max(len(item.name) for item in self.items) + 2
        lines = [self.title, f"  {'item':{width}}{'when':10}{'at load':>12}{'steady':>12}"]
        for item in self.items:
            lines.append(f"  {item.name:{width}}{item.when:10}{gib(item.at_load)}{gib(item.steady)}")
        lines.append(f"  {'total':{width}}{'peak':10}{gib(self.at_load)}{gib(self.steady)}")
        lines.append(f"  steady = held + the largest phase ({self.largest_phase}); phases never overlap")
        if self.capacity:
            spare = self.capacity - self.peak
            verdict = f"{spare / GB:.1f} GB to spare" if spare >= 0 else f"{-spare / GB:.1f} GB short"
            lines.append(f"  {self.device}: {self.capacity / GB:.1f} GB; peak {self.peak / GB:.1f} GB "
                         f"({self.peak / self.capacity:.0%}): {verdict}")  # fmt: skip
        return lines + [f"  {note}" for note in self.notes]

    def check(self, capacity: float, where: str) -> None:
        """ConfigError when the peak is over `capacity` bytes (`where`: the device, for the message)."""
        if self.peak <= capacity:
            return
        when = "at load" if self.at_load > self.steady else "in a training step"
        item = self.biggest_item()
        size = item.at_load if self.at_load > self.steady else item.steady
        raise ConfigError(
            f"a learner rank needs {self.peak / GB:.1f} GB {when} but {where} has {capacity / GB:.1f} GB; the "
            f"biggest item is {item.name} ({size / GB:.1f} GB): {item.fix} (python -m open_instruct.memory_plan "
            "shows the whole plan)."
        )


def plan_memory(
    args: Args,
    shapes: list[ModelShape],
    device: str,
    capacity: float | None = None,
    longest_prompt: int | None = None,
    with_engine: bool = True,
) -> MemoryPlan:
    """The plan of one learner rank of this run on `device` ("gpu"/"cpu"), `capacity` bytes when known (learner rank 0:
    it alone sends the weights). Sequences are `longest_prompt` + --response_length tokens (the data's longest prompt;
    default --max_prompt_token_length). `with_engine=False`: the learner alone, without the engine's share of its
    device and the weights handed to it (a measurement of a learner that feeds no engine)."""
    layout = layout_of(args, device, longest_prompt)
    items = []
    if device == "gpu":
        items.append(Item("process: CUDA context, NCCL, workspaces (assumed)", GPU_PROCESS_BYTES, GPU_PROCESS_BYTES,
                          HELD, ""))  # fmt: skip
    else:
        items.append(Item("process: Python, torch, transformers, DeepSpeed", CPU_PROCESS_BYTES, CPU_PROCESS_BYTES,
                          HELD, ""))  # fmt: skip
    for shape in shapes:
        items += trainable_items(shape, layout) if shape.trainable else frozen_items(shape, layout)
    loading = loading_item(shapes, layout)
    items += [loading] if loading else []
    items += phase_items(shapes, layout)
    if with_engine:
        items += weight_sync_items(args, shapes[0], layout) + engine_items(args, shapes, layout, capacity)
    if device == "gpu":  # the caching allocator's slack on everything the tensors hold
        tensors = MemoryPlan("", device, items)
        slack_load = GPU_ALLOCATOR_SLACK * (tensors.at_load - GPU_PROCESS_BYTES)
        slack_steady = GPU_ALLOCATOR_SLACK * (tensors.steady - GPU_PROCESS_BYTES)
        items.insert(1, Item(f"CUDA caching allocator slack ({GPU_ALLOCATOR_SLACK:.0%}, assumed)", slack_load,
                             slack_steady, HELD, ""))  # fmt: skip
    models = ", ".join(f"{shape.role} {describe_count(shape.num_params)}" for shape in shapes)
    how = "one process, no DeepSpeed" if layout.stage is None else f"ZeRO-{layout.stage} over {layout.ranks} rank(s)"
    title = (f"[memory] plan of one learner rank on a {device} ({how}; {models}; micro-batch {layout.micro_batch} x "
             f"{layout.seq_len} tokens; {dtype_label(layout.compute_bytes)} compute):")  # fmt: skip
    return MemoryPlan(title, device, items, capacity)
