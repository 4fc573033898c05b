"""The small transformers model, data and arguments the Trainer tests train with (in the test
process and in the torchrun children of test_hf_ranks.py)."""

import copy
import os

import torch
import transformers

STEPS = 10
SAVE_AT = 5


def base_model() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=48,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        attention_dropout=0.0,
        tie_word_embeddings=True,
    )
    return transformers.LlamaForCausalLM(config)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int) -> None:
        self.x = torch.randint(0, 48, (n, 12), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def arguments(output_dir: str, **extra) -> transformers.TrainingArguments:
    """fp32, max_grad_norm 1.0, warmup + linear decay, accumulation 2, a log line every step."""
    settings = dict(
        output_dir=output_dir,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=STEPS,
        learning_rate=3e-3,
        weight_decay=0.1,
        warmup_steps=3,
        lr_scheduler_type="linear",
        max_grad_norm=1.0,
        logging_steps=1,
        report_to="none",
        seed=0,
        use_cpu=True,
        dataloader_num_workers=0,
        per_device_eval_batch_size=4,
        disable_tqdm=True,
    )
    return transformers.TrainingArguments(**{**settings, **extra})


def ds_config(nvme: str) -> dict:
    """A config written for TrainingArguments(deepspeed=...): "auto" where the Trainer fills it."""
    offload = {"device": "nvme", "nvme_path": nvme}
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {
            "stage": 3,
            "offload_param": offload,
            "offload_optimizer": offload,
            "stage3_param_persistence_threshold": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "reduce_bucket_size": "auto",
        },
    }


def train_logs(trainer) -> list[dict]:
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def copy_of(model):
    return copy.deepcopy(model)


def dirs(root: str, *names: str) -> list[str]:
    paths = [os.path.join(root, name) for name in names]
    for path in paths:
        os.makedirs(path, exist_ok=True)
    return paths
