"""The dry-run budget: parameters, memory per GPU and FLOPs per RL step, without loading any weights; and
the start-up disk check sized from the same numbers.

    python train.py --preset llada8b --dry_run
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

import tasks
from infra.episodes import IMAGE_TASKS, task_list
from model import ModelConfig, Transformer, num_params

def budget(model_config, n_params: int, *, world_size: int, lora_params: int, seqs_per_rank: int,
           seq_len: int, steps: int, num_iterations: int, beta: float, activation_checkpointing: bool,
           bytes_per_param: int = 2) -> dict:
    """Back-of-the-envelope memory per GPU (GB) and FLOPs per RL step, for --dry_run. Estimates, not
    measurements: they leave out the CUDA context, allocator fragmentation and NCCL buffers (a few GB).

    Full fine-tuning: float32 master weights, float32 gradients and AdamW's two float32 moments (16 B per
    parameter) plus a float32 reference copy (4 B, when beta > 0), sharded over the ranks by FSDP2;
    compute uses bf16 copies gathered one block at a time.
    LoRA: the frozen bf16 base (2 B/param, sharded too) plus float32 adapters with gradients and moments
    (16 B/param); its reference policy is the base itself. An update chunk adds its activations (per token and
    layer, checkpointing keeps the block input, d_model values, and recomputes one block at a time;
    without it a LLaDA block keeps about 16 d_model + 3 mlp_hidden values) and its float32 logits with
    their log-softmax (seq x vocab, the largest tensor at a 126k vocabulary). A rollout holds the whole
    model unsharded (scale.full_weights) beside the sharded state, plus float64 Gumbel noise over the
    logits."""
    c = model_config
    gb = 1024 ** 3
    weights = n_params * bytes_per_param / world_size
    per_tok_layer = c.d_model if activation_checkpointing else 16 * c.d_model + 3 * c.mlp_hidden_size
    acts = seqs_per_rank * seq_len * c.n_layers * per_tok_layer * bytes_per_param
    if activation_checkpointing:  # one block is recomputed at a time, with its full activations
        acts += seqs_per_rank * seq_len * (16 * c.d_model + 3 * c.mlp_hidden_size) * bytes_per_param
    logits = seqs_per_rank * seq_len * c.vocab_size * 4 * 2  # float32 logits and their log-softmax
    # float32 weights, gradients and AdamW moments, and the frozen reference copy (float32) when beta > 0
    state_full = n_params * (16 + 4 * (beta > 0)) / world_size
    state_lora = weights + lora_params * 16 / world_size
    # Rollouts gather the whole model in bf16 (full_weights) beside the sharded state, and draw float64
    # Gumbel noise over the logits; they keep no activations for backward.
    gather = n_params * bytes_per_param * (world_size > 1) + seqs_per_rank * seq_len * c.vocab_size * 8
    # FLOPs: 2 N per token forward, 6 N forward+backward; attention adds 4 L d per layer per token.
    fwd_tok = 2 * n_params + 4 * seq_len * c.d_model * c.n_layers
    seqs = seqs_per_rank * world_size
    flops_rollout = seqs * steps * seq_len * fwd_tok  # no KV cache: every step re-runs the sequence
    flops_scoring = seqs * num_iterations * seq_len * fwd_tok * (1 + (beta > 0))  # old + ref passes
    flops_update = seqs * num_iterations * seq_len * 3 * fwd_tok
    return {"weights_gb": weights / gb, "full_ft_gb": (state_full + acts + logits) / gb,
            "full_ft_rollout_gb": (state_full + gather) / gb, "lora_gb": (state_lora + acts + logits) / gb,
            "lora_rollout_gb": (state_lora + gather) / gb, "activations_gb": acts / gb, "logits_gb": logits / gb,
            "flops_rollout": flops_rollout, "flops_scoring": flops_scoring, "flops_update": flops_update,
            "flops_total": flops_rollout + flops_scoring + flops_update}


def print_budget(mc, *, seqs: int, seq_len: int, steps: int, lora_rank: int, num_iterations: int, beta: float,
            device_batch_size: int, activation_checkpointing: bool, gpus: int) -> dict:
    """Build the model on the meta device (no memory), count its parameters and LoRA's, and print the
    budget table for 1, 8, 16 and `gpus` GPUs; returns the numbers (tests, README)."""
    from infra.lora import LORA_TARGETS

    with torch.device("meta"):
        model = Transformer(mc)
    n = num_params(model)
    per_block = sum(m.in_features + m.out_features for name, m in model.blocks[0].named_children()
                    if name in LORA_TARGETS)
    n_lora = lora_rank * per_block * mc.n_layers
    cols = sorted({1, 8, 16, gpus})
    rows = [budget(mc, n, world_size=w, lora_params=n_lora, seqs_per_rank=device_batch_size or max(1, seqs // w),
                   seq_len=seq_len, steps=steps, num_iterations=num_iterations, beta=beta,
                   activation_checkpointing=activation_checkpointing) for w in cols]
    print(f"model: {n:,} parameters ({mc.n_layers} layers, d_model {mc.d_model}, vocab {mc.vocab_size}); "
          f"LoRA r={lora_rank}: {n_lora:,} adapter parameters")
    print(f"RL step: {seqs} sequences of {seq_len} tokens, {steps} denoising steps, mu={num_iterations}, "
          f"device_batch_size {device_batch_size or 'all'}, activation checkpointing "
          f"{'on' if activation_checkpointing else 'off'}")
    print("| GB per GPU (estimate) | " + " | ".join(f"{w} GPU{'s' * (w > 1)}" for w in cols) + " |")
    print("|---|" + "---|" * len(cols))
    for key, label in (("weights_gb", "bf16 weights, sharded"), ("full_ft_gb", "full fine-tuning, update"),
                       ("full_ft_rollout_gb", "full fine-tuning, rollout"), ("lora_gb", f"LoRA r={lora_rank}, update"),
                       ("lora_rollout_gb", f"LoRA r={lora_rank}, rollout"),
                       ("activations_gb", "activations per update chunk"), ("logits_gb", "logits per log-prob chunk")):
        print(f"| {label} | " + " | ".join(f"{r[key]:.1f}" for r in rows) + " |")
    r = rows[0]
    print(f"FLOPs per RL step: rollouts {r['flops_rollout']:.2e}, old/ref scoring {r['flops_scoring']:.2e}, "
          f"updates {r['flops_update']:.2e}, total {r['flops_total']:.2e}")
    return {"params": n, "lora_params": n_lora, "budget": dict(zip(cols, rows))}


def dry_run(cfg) -> dict:
    """--dry_run: the model on the meta device (no memory), its parameter count, and budget's
    memory per GPU and FLOPs per RL step at the preset's batch sizes (print_budget prints the table)."""
    from infra.run import scratch_config  # infra/run.py imports this module
    cfg_file = Path(cfg.init_from) / "config.json" if cfg.init_from not in ("", "scratch") else None
    if cfg_file is not None and cfg_file.is_file():
        mc = ModelConfig.from_hf(json.loads(cfg_file.read_text()))
    else:
        vocab = cfg.vocab_size or tasks.model_config_overrides(tasks.build_tokenizer())["vocab_size"]
        mc = scratch_config(cfg, vocab_size=vocab, mask_token_id=vocab - 1)
    image = any(t in IMAGE_TASKS for t in task_list(cfg))
    seq_len = (cfg.image_text_len or 32) + cfg.image_width ** 2 + 2 if image else cfg.max_prompt_len + cfg.gen_length
    return print_budget(mc, seqs=cfg.prompts_per_step * cfg.group_size * len(task_list(cfg)), seq_len=seq_len,
                         steps=cfg.image_steps if image else cfg.steps, lora_rank=cfg.lora_rank,
                         num_iterations=cfg.num_iterations, beta=cfg.beta, device_batch_size=cfg.device_batch_size,
                         activation_checkpointing=cfg.activation_checkpointing, gpus=cfg.dry_run_gpus)


def check_disk(cfg, out: Path, mc) -> None:
    """Refuse to start when out_dir cannot hold the checkpoints the run will write."""
    with torch.device("meta"):
        n = num_params(Transformer(mc))
    # float32 weights + AdamW moments (an upper bound; LoRA saves far less), twice for the rotation.
    size = 2 * n * 12
    free = shutil.disk_usage(out).free
    if free < size:
        raise ValueError(f"out_dir {out} has {free / 2**30:.1f} GB free, but a checkpoint needs about "
                         f"{size / 2**30:.1f} GB; free space, pick another --out_dir or set --checkpoint_every=0")
