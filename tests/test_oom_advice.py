"""Out of memory: when the training state alone is over the GPU's memory, the one-line message says so and
proposes more GPUs (or LoRA), never a smaller --device_batch_size, which cannot help; when it fits, the
batch-size advice stands. The GPU is simulated (its total memory); the state is counted by hand.

    python -m pytest tests/test_oom_advice.py -q
"""
import types

import pytest
import torch

import train
from infra import budget, run

OOM = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def gpu(monkeypatch, gib):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=gib * 2 ** 30))


def test_state_over_the_gpu_is_named_instead_of_the_batch_size(monkeypatch, tmp_path):
    """llada8b full fine-tuning on one 80 GB GPU: float32 weights, gradients and two AdamW moments, and a
    float32 reference (beta 0.01): 8,015,581,184 x 20 B = 149.3 GiB, over 79.6."""
    gpu(monkeypatch, 79.6)
    cfg = train.parse_args(["--preset=llada8b", "--dry_run=true", "--lora_rank=0", f"--out_dir={tmp_path}"])
    msg = run.explain_failure(OOM, cfg)
    assert f"the training state alone is {8_015_581_184 * 20 / 2 ** 30:.1f} GiB per GPU (full fine-tuning on 1 GPU(s))" \
        in msg and "over this GPU's 79.6 GiB" in msg and "or LoRA (--lora_rank)" in msg, msg
    assert "--device_batch_size" not in msg and "\n" not in msg
    # LoRA on the same GPU: bf16 base 2 B + 167,772,160 float32 adapters x 16 B = 17.4 GiB, which fits
    lora = train.parse_args(["--preset=llada8b", "--dry_run=true", f"--out_dir={tmp_path}"])
    assert budget.state_over_memory(lora, 1, int(79.6 * 2 ** 30)) is None
    assert "--device_batch_size=6" in run.explain_failure(OOM, lora)
    # ... and on a 16 GB GPU it does not: more GPUs, and no LoRA advice for a LoRA run
    gpu(monkeypatch, 16)
    msg = run.explain_failure(OOM, lora)
    assert f"{(8_015_581_184 * 2 + 167_772_160 * 16) / 2 ** 30:.1f} GiB per GPU (LoRA on 1 GPU(s))" in msg, msg
    assert "--lora_rank" not in msg and "--device_batch_size" not in msg


@pytest.mark.parametrize("world, fits", [(1, False), (8, True)])
def test_the_state_is_per_gpu(world, fits, tmp_path):
    cfg = train.parse_args(["--preset=llada8b", "--dry_run=true", "--lora_rank=0", f"--out_dir={tmp_path}"])
    assert (budget.state_over_memory(cfg, world, int(79.6 * 2 ** 30)) is None) == fits
