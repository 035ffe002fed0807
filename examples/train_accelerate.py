"""A DeepCompile ZeRO-3 training loop under `accelerate launch`, with hf_zero3's memory plan.

    accelerate launch --config_file examples/accelerate_deepcompile.yaml examples/train_accelerate.py

The model is a Llama built in code (EXAMPLE_LAYERS / EXAMPLE_HIDDEN resize it; nothing is
downloaded). Zero3DeepSpeedPlugin reads the DeepSpeed config accelerate launch points to
(ACCELERATE_DEEPSPEED_CONFIG_FILE), resolves its "hf_zero3.memory_plan" section and makes sure
the engine is compiled with the plan's schedule.
"""

import os

import torch
from accelerate import Accelerator
from accelerate.utils import DummyOptim
from transformers import AutoModelForCausalLM, LlamaConfig

import hf_zero3
from hf_zero3.compile.gate import counters


def main():
    accelerator = Accelerator(deepspeed_plugin=hf_zero3.Zero3DeepSpeedPlugin())
    hidden = int(os.environ.get("EXAMPLE_HIDDEN", 1024))
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=int(os.environ.get("EXAMPLE_LAYERS", 4)),
        num_attention_heads=16,
        num_key_value_heads=8,
        attn_implementation="sdpa",
    )
    model = AutoModelForCausalLM.from_config(config)  # zero3_init_flag: partitioned as it is built
    data = torch.utils.data.DataLoader(torch.randint(3, 32000, (64, 128)), batch_size=2)
    engine, _, data = accelerator.prepare(model, DummyOptim(model.parameters()), data)
    for step, ids in enumerate(data):
        loss = engine(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)  # accelerate's DeepSpeed wrapper also steps the engine
        accelerator.print(
            f"step {step} loss {loss.item():.4f} (rank {accelerator.process_index} of {accelerator.num_processes})"
        )
        if step == 9:
            break
    plan = hf_zero3.runtime_of(engine).memory.plan
    accelerator.print("memory plan:", plan.summary() if plan else None, "gate:", counters())
    accelerator.end_training()  # destroys the process group while the interpreter is whole


if __name__ == "__main__":
    main()
