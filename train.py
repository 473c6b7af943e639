"""MaskGRPO training: masked-diffusion SFT, then RL with the MaskGRPO importance estimator.

    python train.py --preset toy                       # laptop CPU: SFT + RL on toy text and image tasks
    python train.py --preset toy --estimator=d1        # any Config field can be overridden: --field=value
    torchrun --nproc_per_node=8 train.py --preset llada8b --init_from=DIR --train_data=gsm8k=train.jsonl
    python train.py --preset llada8b --dry_run         # parameters, memory per GPU and FLOPs, no weights

Stage 1 (SFT) trains the toy model from scratch with the masked-diffusion loss (LLaDA / MDLM: mask each
completion token with probability t ~ U(0, 1), cross-entropy on the masked tokens weighted by 1/t). It is
cached in out_dir/sft, so a second run goes straight to RL. Stage 2 (RL) is MaskGRPO (arXiv:2510.02880):

    1. rollouts        episodes.rollout: G completions per prompt, LLaDA block sampler (text), emerge
                       sampler + CFG (image)
    2. rewards         episodes.score: rewards.py / tasks.py verifiers or the remote image scorer, [0, 1]
    3. advantages      grpo.group_advantages: (R - mean) / (std + eps) within each group
    4. masks           importance.build_masks: mu masked versions of every completion (AR-like reversing
                       for text, random for images, truncated ratio schedule, seeds from (seed, step, index))
    5. old/ref logp    importance.token_logprobs under no_grad, on those same masked inputs
    6. mu updates      inner iteration j re-scores mask j with the current policy and takes one optimizer step
                       on grpo.policy_loss (clipped surrogate + beta * k3 KL to the SFT reference)

Everything is written to out_dir: log.jsonl (one line per RL step), summary.json (held-out mean reward
before/after RL per task), final/ (the RL model in the Hugging Face LLaDA layout, with tokenizer.json; with
LoRA also final/adapters.*), checkpoints/ (checkpoint.py; --resume=true continues), curves.png and
images.png. Under torchrun the rollouts are sharded by global prompt index and the model by FSDP2
(scale.py); every random draw is seeded by (seed, step, global index), so the world size does not change
the result. How tasks become token batches, rollouts and rewards, and the held-out evaluation, live in
episodes.py.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import json
import math
import os
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from infra import budget, checkpoint
from infra import data
import grpo
import importance
from infra import lora
from infra import scale
import tasks
from infra.episodes import (IMAGE_TASKS, TOY_TASKS, Batch, data_paths, derive_seed, draw_prompts, evaluate_all,
                      generator, image_snapshot, load_data, make_batch, make_example, model_specials, rollout,
                      score, show, task_list, vocab_slice, write_pictures)
from model import ModelConfig, Transformer, load_tokenizer, num_params
from infra.scale import print0
from infra.scorer import RemoteScorer

# -----------------------------------------------------------------------------------------------------
# config


@dataclass
class Config:
    # io / system
    out_dir: str = "out/toy"          # everything this run writes goes here
    seed: int = 0                     # every random draw derives from (seed, step, index)
    device: str = "auto"              # auto | cpu | cuda | cuda:N
    dtype: str = "auto"               # auto (float32 on CPU, bfloat16 on CUDA) | float32 | bfloat16
    threads: int = 0                  # torch CPU threads (0 = torch's default)
    # model
    init_from: str = "scratch"        # "scratch" (toy model below, trained by SFT) or a checkpoint directory
    sft_dir: str = ""                 # where the SFT model is cached ("" = out_dir/sft); share it across runs
    d_model: int = 128                # scratch model dims (and --dry_run's, when init_from has no config.json)
    n_layers: int = 4
    n_heads: int = 4
    mlp_hidden_size: int = 384
    vocab_size: int = 0               # --dry_run only: embedding rows (0 = the toy tokenizer's)
    lora_rank: int = 0                # > 0: train LoRA adapters only (lora.py); the reference is adapters-off
    lora_alpha: float = 64.0
    lora_dropout: float = 0.0
    activation_checkpointing: bool = False  # recompute each block in backward (needed at 8B)
    # tasks and data
    tasks: str = "text,image"         # RL tasks, comma separated: toy text, image; or gsm8k, math, mbpp,
                                      # countdown, sudoku (text) and geneval (image) with --train_data
    train_data: str = ""              # task=path[,task=path]: local files in their public format (data.py)
    eval_data: str = ""               # task=path[,...]: held-out sets scored before and after RL
    max_prompt_len: int = 256         # real text prompts keep their last max_prompt_len tokens
    image_text_len: int = 0           # t2i text part, left-padded with [iPAD] (0 = longest toy caption; MMaDA 257)
    image_scorer_url: str = ""        # geneval rewards: POST to this scorer (scorer.RemoteScorer)
    text_max_steps: int = 1           # arithmetic steps per word problem (1 or 2)
    text_noise: float = 0.4           # fraction of SFT text targets with the box off by one (tasks.py)
    image_noise: float = 0.4          # fraction of SFT images with one colour drawn as its look-alike
    image_width: int = 4              # images are image_width x image_width tokens (MMaDA 512 px: 32)
    # stage 1: masked-diffusion SFT
    sft_steps: int = 600
    sft_batch_size: int = 64          # sequences per SFT step and task
    sft_lr: float = 2e-3
    sft_warmup: int = 50
    image_loss_weight: float = 3.0    # images stall beside text at weight 1 (measured, tasks.py calibration)
    cond_dropout: float = 0.1         # caption dropped for CFG (MMaDA trains with 0.1)
    # text rollouts (LLaDA low-confidence block sampler)
    gen_length: int = 12
    block_length: int = 12
    steps: int = 12
    temperature: float = 1.0          # rollout temperature (official default 0.9)
    kv_cache: str = "none"            # none (exact) | prefix | dual: Fast-dLLM block KV cache for text rollouts
    threshold: float = 0.0            # > 0: also commit every masked token more confident than this (Fast-dLLM)
    # image rollouts
    image_sampler: str = "emerge"     # emerge (MaskGRPO) | maskgit (MMaDA default, baseline)
    image_steps: int = 12             # MaskGRPO rollouts use 12 emerge steps (method.md §4.3)
    cfg_scale: float = 0.0            # guidance weight w; (1 + w) cond - w uncond
    # importance estimator
    estimator: str = "maskgrpo"       # maskgrpo | d1 | unigrpo (baselines for ablation)
    text_reversing: str = "arlike"    # arlike (paper, text) | random
    gamma_text: float = 0.6           # truncation: mask ratios live in (gamma, 1) (paper: 0.6 text)
    gamma_image: float = 0.8          # (paper: 0.8 image)
    num_iterations: int = 4           # mu: inner updates per rollout batch, one mask ratio each (paper: 12)
    p_mask_prompt: float = 0.15       # d1 only: prompt-token masking probability
    # GRPO
    rl_steps: int = 50                # rollout batches (each gives num_iterations optimizer steps)
    prompts_per_step: int = 8         # per task
    group_size: int = 8               # G completions per prompt
    clip_eps: float = 0.2
    beta: float = 0.01                # k3 KL coefficient against the SFT reference (0 skips the ref pass)
    loss_norm: str = "token"          # token (official code) | sequence (paper's 1/|o_i|)
    lr: float = 1e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    device_batch_size: int = 0        # sequences per forward pass in rollouts and log-prob passes (0 = all)
    # evaluation / logging
    eval_prompts: int = 256           # held-out prompts per task, scored before and after RL
    eval_samples: int = 4             # sampled completions per held-out prompt (one sample is too noisy)
    sample_every: int = 20            # print a decoded rollout every N RL steps (0 = never)
    # checkpoints and failures (checkpoint.py)
    checkpoint_every: int = 10        # RL steps between checkpoints in out_dir/checkpoints (0 = never)
    keep_last: int = 2                # complete checkpoints kept (0 = all)
    resume: bool = False              # continue from the latest complete checkpoint in out_dir
    max_bad_steps: int = 3            # stop after this many consecutive steps with non-finite loss/grad/reward
    dry_run: bool = False             # print parameters, memory per GPU and FLOPs per step; no weights, no run
    dry_run_gpus: int = 8             # world size assumed by --dry_run


# Shared by the 8B presets (method.md §7.1): LLaDA-8B shape, beta 0.01, eps 0.2, lr 3e-6, AdamW wd 0.1, grad
# clip 0.2, LoRA r 128 / alpha 64 / dropout 0.05, 8000 steps, a checkpoint every 100.
_8B = {"init_from": "", "d_model": 4096, "n_layers": 32, "n_heads": 32, "mlp_hidden_size": 12288, "beta": 0.01,
       "clip_eps": 0.2, "lr": 3e-6, "weight_decay": 0.1, "grad_clip": 0.2, "lora_rank": 128, "lora_alpha": 64.0,
       "lora_dropout": 0.05, "activation_checkpointing": True, "rl_steps": 8000, "eval_samples": 1,
       "sample_every": 50, "checkpoint_every": 100}

PRESETS: dict[str, dict] = {
    # 2-core laptop CPU: SFT from scratch, then RL on both toy tasks; held-out reward rises (README).
    "toy": {},
    # seconds-long smoke run of the whole pipeline (tests, CI).
    "smoke": {"sft_steps": 30, "gen_length": 12, "block_length": 12, "steps": 12, "image_steps": 4, "rl_steps": 2, "prompts_per_step": 2, "group_size": 4, "eval_prompts": 8, "eval_samples": 1,
              "d_model": 32, "n_layers": 2, "mlp_hidden_size": 64, "num_iterations": 2, "sample_every": 1,
              "checkpoint_every": 0},
    # LLaDA-8B-Instruct text RL, the paper's settings (method.md §7.1-7.2): G 6, 16 prompts per step, mu 12,
    # gamma 0.6, 256 tokens in blocks of 32 with 128 steps at temperature 0.9; shared 8B settings below.
    # Give --init_from=DIR (weights, config.json, tokenizer.json) and --train_data=gsm8k=FILE.
    "llada8b": {**_8B, "tasks": "gsm8k", "vocab_size": 126464, "gen_length": 256, "block_length": 32, "steps": 128,
                "temperature": 0.9, "group_size": 6, "prompts_per_step": 16, "num_iterations": 12, "gamma_text": 0.6,
                "device_batch_size": 6, "eval_prompts": 256},
    # MMaDA-8B text-to-image RL (method.md §7.3): emerge rollouts, 12 steps, CFG 3.0, G 9, mu 6, gamma 0.8,
    # 1024 image tokens (32 x 32) after a 257-token text part; rewards from a remote scorer. 8 prompts per
    # step (the official 6 GPUs ran 2 x 3 completions each; 8 divides over 8 or 16 GPUs).
    "mmada8b": {**_8B, "tasks": "geneval", "vocab_size": 134656, "image_width": 32, "image_text_len": 257,
                "image_steps": 12, "cfg_scale": 3.0, "group_size": 9, "prompts_per_step": 8, "num_iterations": 6,
                "gamma_image": 0.8, "device_batch_size": 3, "eval_prompts": 64},
}

def _parse_bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes"):
        return True
    if s.lower() in ("0", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {s!r}")


def parse_args(argv=None) -> Config:
    """Dataclass defaults, then PRESETS[--preset], then explicit --field=value flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="toy", help=f"one of {sorted(PRESETS)}")
    types = {"int": int, "float": float, "str": str, "bool": _parse_bool}
    for f in fields(Config):
        p.add_argument(f"--{f.name}", type=types[f.type], default=None, help=f"default {f.default!r}")
    args = p.parse_args(argv)
    if args.preset not in PRESETS:
        raise ValueError(f"unknown preset {args.preset!r}; choose one of {sorted(PRESETS)}")
    given = {k: v for k, v in vars(args).items() if v is not None and k != "preset"}
    cfg = Config(**{**PRESETS[args.preset], **given})
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Refuse impossible settings before any heavy work, naming the value and a fix."""
    def need(ok, msg):
        if not ok:
            raise ValueError(msg)
    need(cfg.gen_length % cfg.block_length == 0,
         f"gen_length ({cfg.gen_length}) must be divisible by block_length ({cfg.block_length})")
    blocks = cfg.gen_length // cfg.block_length
    need(cfg.steps % blocks == 0 and cfg.steps >= blocks,
         f"steps ({cfg.steps}) must be a positive multiple of the number of blocks ({blocks}); "
         f"try --steps={blocks * max(1, cfg.steps // blocks)}")
    need(cfg.group_size >= 2, f"group_size ({cfg.group_size}) must be >= 2: GRPO compares completions of a group")
    need(cfg.num_iterations >= 1, f"num_iterations ({cfg.num_iterations}) must be >= 1")
    for g in ("gamma_text", "gamma_image"):
        need(0 <= getattr(cfg, g) < 1, f"{g} ({getattr(cfg, g)}) must be in [0, 1)")
    need(cfg.clip_eps > 0, f"clip_eps ({cfg.clip_eps}) must be > 0 (paper: 0.2)")
    need(cfg.beta >= 0, f"beta ({cfg.beta}) must be >= 0")
    need(cfg.estimator in importance.ESTIMATORS, f"estimator ({cfg.estimator!r}) must be one of {importance.ESTIMATORS}")
    need(cfg.text_reversing in importance.MODES, f"text_reversing ({cfg.text_reversing!r}) must be one of {importance.MODES}")
    need(cfg.loss_norm in grpo.NORMS, f"loss_norm ({cfg.loss_norm!r}) must be one of {grpo.NORMS}")
    need(cfg.image_sampler in ("emerge", "maskgit"), f"image_sampler ({cfg.image_sampler!r}) must be emerge or maskgit")
    known = TOY_TASKS + data.TASKS
    bad = [t for t in task_list(cfg) if t not in known]
    need(not bad and cfg.tasks, f"tasks ({cfg.tasks!r}) must be a comma-separated subset of {','.join(known)}")
    real = [t for t in task_list(cfg) if t not in TOY_TASKS]
    need(not real or cfg.dry_run or cfg.init_from not in ("", "scratch"),
         f"tasks {real} need a pretrained model: pass --init_from=DIR (a LLaDA/MMaDA checkpoint directory)")
    need(cfg.init_from != "" or cfg.dry_run, "init_from is empty: pass --init_from=DIR, the local checkpoint")
    train_files = data_paths(cfg.train_data, "train_data")
    for t in real:
        need(t in train_files or cfg.dry_run, f"task {t!r} needs its training file: --train_data={t}=PATH")
    for field_name, paths in (("train_data", train_files), ("eval_data", data_paths(cfg.eval_data, "eval_data"))):
        extra = [t for t in paths if t not in real]
        need(not extra, f"{field_name} names {extra}, which are not among the RL tasks {task_list(cfg)}")
    need("geneval" not in real or cfg.image_scorer_url or cfg.dry_run,
         "task geneval needs a reward model: --image_scorer_url=http://HOST:PORT (scorer.RemoteScorer; "
         "`python -m infra.scorer --stub` serves a stand-in)")
    need(cfg.lora_rank >= 0, f"lora_rank ({cfg.lora_rank}) must be >= 0 (0 = full fine-tuning)")
    need(cfg.lora_rank == 0 or (cfg.lora_alpha > 0 and 0 <= cfg.lora_dropout < 1),
         f"lora_alpha ({cfg.lora_alpha}) must be > 0 and lora_dropout ({cfg.lora_dropout}) in [0, 1)")
    need(cfg.lora_rank == 0 or cfg.init_from != "scratch",
         "lora_rank > 0 with init_from=scratch: the toy model is trained from scratch by SFT, so there is no "
         "pretrained base to adapt; pass --init_from=DIR (for instance a toy run's out_dir/final)")
    world = int(os.environ.get("WORLD_SIZE", "1"))  # validated before the process group exists
    need(cfg.prompts_per_step % world == 0,
         f"prompts_per_step ({cfg.prompts_per_step}) must be divisible by the world size ({world}): groups are "
         f"never split across ranks; try --prompts_per_step={world * max(1, cfg.prompts_per_step // world)}")
    for k in ("eval_samples", "dry_run_gpus"):
        need(getattr(cfg, k) >= 1, f"{k} ({getattr(cfg, k)}) must be >= 1")
    for k in ("threads", "sample_every", "vocab_size", "weight_decay"):
        need(getattr(cfg, k) >= 0, f"{k} ({getattr(cfg, k)}) must be >= 0")
    need(cfg.lr > 0, f"lr ({cfg.lr}) must be > 0 (paper: 3e-6 at 8B; the toy uses 1e-4)")
    need(cfg.grad_clip > 0, f"grad_clip ({cfg.grad_clip}) must be > 0: 0 would zero every gradient (paper: 0.2)")
    need(cfg.cfg_scale >= 0, f"cfg_scale ({cfg.cfg_scale}) must be >= 0 (0 = no guidance; MaskGRPO uses 3.0)")
    need(0 <= cfg.p_mask_prompt <= 1, f"p_mask_prompt ({cfg.p_mask_prompt}) must be in [0, 1] (d1 uses 0.15)")
    images_only = all(t in IMAGE_TASKS for t in task_list(cfg))
    need(not (images_only and (cfg.kv_cache != "none" or cfg.threshold)),
         f"kv_cache / threshold apply to text rollouts, but tasks ({cfg.tasks!r}) has no text task; drop them")
    need(not cfg.image_scorer_url or "geneval" in task_list(cfg),
         f"image_scorer_url is set but no task uses it (tasks {cfg.tasks!r}); add geneval or drop the flag")
    for k in ("checkpoint_every", "keep_last"):
        need(getattr(cfg, k) >= 0, f"{k} ({getattr(cfg, k)}) must be >= 0 (0 = {'never' if k == 'checkpoint_every' else 'keep all'})")
    need(cfg.max_bad_steps >= 1, f"max_bad_steps ({cfg.max_bad_steps}) must be >= 1")
    need(cfg.max_prompt_len >= 8, f"max_prompt_len ({cfg.max_prompt_len}) must be >= 8")
    need(cfg.image_width >= 1 and cfg.image_text_len >= 0, "image_width must be >= 1 and image_text_len >= 0")
    need(cfg.temperature >= 0, f"temperature ({cfg.temperature}) must be >= 0")
    need(cfg.kv_cache in ("none", "prefix", "dual"), f"kv_cache ({cfg.kv_cache!r}) must be none, prefix or dual")
    need(0 <= cfg.threshold < 1, f"threshold ({cfg.threshold}) must be in [0, 1) (0 = off; Fast-dLLM uses 0.9)")
    need(cfg.dtype in ("auto", "float32", "bfloat16"),
         f"dtype ({cfg.dtype!r}) must be auto, float32 or bfloat16 (float16 needs a grad scaler, which this code omits)")
    for k in ("sft_steps", "rl_steps", "eval_prompts", "device_batch_size"):
        need(getattr(cfg, k) >= 0, f"{k} ({getattr(cfg, k)}) must be >= 0")
    for k in ("prompts_per_step", "sft_batch_size", "image_steps"):
        need(getattr(cfg, k) >= 1, f"{k} ({getattr(cfg, k)}) must be >= 1")


# -----------------------------------------------------------------------------------------------------
# setup


def setup(cfg: Config) -> tuple[torch.device, torch.dtype]:
    """Pick device and compute dtype once (joining torchrun's process group if there is one), and say why."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device ({cfg.device!r}) asks for CUDA, but torch sees no GPU; use --device=cpu")
    device = scale.init(cfg.device)
    if cfg.dtype == "auto":
        # bf16 on GPUs that support it (the released LLaDA weights are bf16); float32 on CPU, where bf16
        # matmuls are slow and the toy model is small.
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        dtype = torch.bfloat16 if bf16 else torch.float32
    else:
        dtype = getattr(torch, cfg.dtype)
    print0(f"device {device}, dtype {str(dtype).removeprefix('torch.')}, torch threads {torch.get_num_threads()}, "
           f"world size {scale.world()}")
    return device, dtype


# -----------------------------------------------------------------------------------------------------
# stage 1: masked-diffusion SFT


def diffusion_loss(model, b: Batch, sp, gen: torch.Generator, eps: float = 1e-3) -> torch.Tensor:
    """LLaDA/MDLM negative ELBO (method.md §1.4): t ~ U(eps, 1) per sequence, every window token masked
    with probability t, cross-entropy on the masked tokens weighted by 1/t, normalised by the window size
    (LLaDA's SFT loss; the prompt is never masked)."""
    B, L = b.x.shape
    t = torch.rand(B, 1, generator=gen) * (1 - eps) + eps                              # (B, 1)
    region = torch.zeros(B, L, dtype=torch.bool)
    region[:, b.window_slice] = True
    masked = (torch.rand(B, L, generator=gen) < t) & region                            # (B, L)
    masked, t = masked.to(b.x.device), t.to(b.x.device)
    logits = model(b.x.masked_fill(masked, sp.mask), b.attention_mask)                # (B, L, V)
    lo, hi = vocab_slice(b.task, sp) or (0, logits.shape[-1])
    ce = F.cross_entropy(logits[masked][:, lo:hi].float(), b.x[masked] - lo, reduction="none")  # (T,)
    return (ce / t.expand(B, L)[masked]).sum() / (B * b.window)


def sft(model, tok, sp, cfg: Config, device) -> float:
    """Train from scratch on noisy toy data (tasks.py); returns seconds spent."""
    t0 = time.time()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, betas=(0.9, 0.95), weight_decay=0.0)
    # Linear warm-up then cosine decay to 10%: fixed-lr runs plateau early at this size (toy-notes.md).
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.sft_warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, cfg.sft_steps))))))
    rng = random.Random(derive_seed(cfg.seed, "sft-data"))
    gen = generator("cpu", cfg.seed, "sft-mask")
    model.train()
    bar = tqdm(range(cfg.sft_steps), desc="sft", dynamic_ncols=True)
    for step in bar:
        loss_sum = 0.0
        for task in ("text", "image"):
            noise = cfg.text_noise if task == "text" else cfg.image_noise
            exs = [make_example(task, rng, cfg, "train", noise) for _ in range(cfg.sft_batch_size)]
            b = make_batch(task, exs, tok, sp, cfg, device, with_targets=True)
            if task == "image":
                # Caption dropout: the unconditional prompt teaches the model p(image) for CFG.
                drop = torch.rand(len(exs), generator=gen) < cfg.cond_dropout
                b.x[drop, : b.prompt_len] = b.uncond[drop, : b.prompt_len]
                b.attention_mask[drop] = b.uncond_mask[drop]
            loss = diffusion_loss(model, b, sp, gen)
            (loss * (cfg.image_loss_weight if task == "image" else 1.0)).backward()
            loss_sum += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss_sum:.3f}")
    model.eval()
    return time.time() - t0


# -----------------------------------------------------------------------------------------------------
# stage 2: MaskGRPO


class BadStep(Exception):
    """Rewards that are not finite numbers in [0, 1]: the RL step is skipped (rl_step's caller counts it)."""


class TrainingStopped(RuntimeError):
    """Too many consecutive bad steps: the run stops with a message naming the last good checkpoint."""


@dataclass
class Rollout:
    """One task's rollout batch (this rank's rows), ready for mu inner updates."""
    batch: Batch
    rewards: torch.Tensor       # (B_global,) every rank's rewards, for advantages and metrics
    adv: torch.Tensor           # (B,) this rank's rows
    inputs: list                # mu x (B, L) masked inputs, one per inner iteration
    loss_masks: torch.Tensor    # (mu, B, L) positions scored in iteration j (masked in that input)
    logp_old: list              # mu x (B, L) float32
    logp_ref: list | None       # mu x (B, L) float32, or None when beta = 0


@torch.no_grad()
def collect(model, ref, task: str, tok, sp, cfg: Config, device, step: int, datasets: dict, scorer=None) -> Rollout:
    """Steps 1-5 of the loop for one task: rollouts, rewards, advantages, masks, old/ref log-probs.
    ref: the reference model, or None for "this model with its LoRA adapters switched off"."""
    prompts = draw_prompts(task, cfg, step, datasets)
    exs = [ex for ex in prompts for _ in range(cfg.group_size)]        # each prompt G times, consecutively
    # Every rank builds the global batch (cheap: token ids) and keeps its own whole groups. The sequence
    # index (global prompt index * G + member) seeds the rollout noise and the masks, so each sequence's
    # randomness depends on (seed, task, step, index) only, not on the process or batch slot it lands in.
    rows = scale.shard_rows(len(exs))
    seq_index = list(range(len(exs)))[rows]
    model.eval()  # old log-probs without dropout (method.md §9 item 19)
    b = make_batch(task, exs, tok, sp, cfg, device, with_targets=False).rows(rows)
    gens = [generator(device, cfg.seed, "rollout", task, step, i) for i in seq_index]
    b = rollout(model, b, sp, cfg, gens, cfg.temperature, fast=True)
    # Rewards of all ranks, in global order: each group is normalised over its whole group (grpo.py).
    rewards = scale.all_gather_rows(score(b, tok, sp, scorer).to(device)).cpu()       # (B_global,)
    bad = (~torch.isfinite(rewards) | (rewards < 0) | (rewards > 1)).nonzero().flatten().tolist()
    if bad:  # a reward function's NaN or out-of-range value is reported, never averaged into the update
        i = bad[0]
        raise BadStep(f"{len(bad)} {task} reward(s) not a finite number in [0, 1], first {rewards[i].item()} "
                      f"at sequence {i} (prompt {i // cfg.group_size}); check the reward function or scorer")
    adv = grpo.group_advantages(rewards, group_size=cfg.group_size)[rows].to(device)   # (B,)

    B, L = b.x.shape
    image = task in IMAGE_TASKS
    in_masks, loss_masks = importance.build_masks(
        b.prompt_mask, torch.ones(B, b.window, dtype=torch.bool, device=device),
        seed=derive_seed(cfg.seed, "masks", task), step=step, seq_index=seq_index,
        num_iterations=cfg.num_iterations, gamma=cfg.gamma_image if image else cfg.gamma_text,
        estimator=cfg.estimator, mode="random" if image else cfg.text_reversing,
        p_mask_prompt=cfg.p_mask_prompt, suffix_len=L - b.prompt_len - b.window)      # (mu, B, L) each
    inputs = [importance.apply_mask(b.x, in_masks[j], sp.mask) for j in range(cfg.num_iterations)]
    # Log-probs use conditional logits only (no CFG), as the official code does at HEAD (method.md §4.5).
    kw = dict(attention_mask=b.attention_mask, vocab_slice=vocab_slice(task, sp),
              device_batch_size=cfg.device_batch_size or None)
    logp_old = [importance.token_logprobs(model, inputs[j], b.x, loss_masks[j], **kw) for j in range(len(inputs))]
    logp_ref = None
    if cfg.beta > 0:
        with lora.adapters_disabled(model) if ref is None else contextlib.nullcontext():
            logp_ref = [importance.token_logprobs(ref or model, inputs[j], b.x, loss_masks[j], **kw)
                        for j in range(len(inputs))]
    return Rollout(b, rewards, adv, inputs, loss_masks, logp_old, logp_ref)


def policy_backward(model, r: Rollout, j: int, cfg: Config, sp) -> dict:
    """Step 6 for one task and inner iteration j: re-score mask j with the current policy, backpropagate
    the GRPO loss. Rows go through in chunks of device_batch_size; each chunk's loss is weighted by its
    share of the normaliser over *all ranks' rows*, so the gradient equals that of one full-batch pass
    in a single process. Returns this rank's share-weighted statistics (rl_step sums them over ranks)."""
    b, mask = r.batch, r.loss_masks[j]                                                   # mask (B, L)
    B = b.x.shape[0]
    chunk = cfg.device_batch_size or B
    count = (lambda m: m.sum()) if cfg.loss_norm == "token" else (lambda m: m.any(-1).sum())
    total = scale.all_sum(count(mask).float()).clamp(min=1)
    # FSDP2 averages gradients over the ranks; scaling by the world size turns that mean into the sum
    # of the ranks' shares, i.e. the single-process gradient.
    world = scale.world()
    stats_sum: dict = {}
    for s in range(0, B, chunk):
        rows = slice(s, s + chunk)
        logp = importance.token_logprobs(model, r.inputs[j][rows], b.x[rows], mask[rows],
                                         attention_mask=b.attention_mask[rows], vocab_slice=vocab_slice(b.task, sp))
        loss, stats = grpo.policy_loss(logp, r.logp_old[j][rows], r.adv[rows], mask[rows], clip_eps=cfg.clip_eps,
                                       beta=cfg.beta, logp_ref=None if r.logp_ref is None else r.logp_ref[j][rows],
                                       norm=cfg.loss_norm)
        share = count(mask[rows]).float() / total
        (loss * share * world).backward()
        for k, v in stats.items():
            if k.endswith("_max"):
                stats_sum[k] = max(stats_sum.get(k, -math.inf), float(v))
            else:  # means weighted by their share of the normaliser; counts summed
                stats_sum[k] = stats_sum.get(k, 0.0) + float(v) * (1.0 if k == "num_tokens" else float(share))
        stats_sum["loss"] = stats_sum.get("loss", 0.0) + loss.item() * float(share)
    return stats_sum


def reduce_stats(stats: dict, device) -> dict:
    """Combine policy_backward's statistics over ranks (the same keys on every rank): maxima by max,
    share-weighted means and counts by sum."""
    keys = sorted(stats)
    t = torch.tensor([stats[k] for k in keys], dtype=torch.float64, device=device)
    is_max = torch.tensor([k.endswith("_max") for k in keys], device=device)
    maxed = scale.all_max(torch.where(is_max, t, -math.inf))
    summed = scale.all_sum(torch.where(is_max, 0.0, t))
    return dict(zip(keys, torch.where(is_max, maxed, summed).tolist()))


def rl_step(model, ref, opt, tok, sp, cfg: Config, device, step: int, datasets: dict, scorer=None
            ) -> tuple[dict, list]:
    t0 = time.time()
    rolls = [collect(model, ref, task, tok, sp, cfg, device, step, datasets, scorer) for task in task_list(cfg)]
    t_roll = time.time() - t0
    model.train()
    params = lora.trainable_parameters(model)
    agg: dict = {}
    skipped = 0
    for j in range(cfg.num_iterations):
        # LoRA dropout is the only draw from the global RNG (activation checkpointing replays it; lora.py):
        # seeded per (step, j, rank), so a resumed run draws the same masks. Dropout masks span a rank's
        # batch, so with --lora_dropout > 0 the result depends on the world size; nothing else does.
        torch.manual_seed(derive_seed(cfg.seed, "dropout", step, j, scale.rank()))
        opt.zero_grad(set_to_none=True)
        losses = []
        for r in rolls:
            stats = reduce_stats(policy_backward(model, r, j, cfg, sp), device)
            losses.append(stats["loss"])
            for k, v in stats.items():
                agg[f"{r.batch.task}/{k}"] = agg.get(f"{r.batch.task}/{k}", 0.0) + v / cfg.num_iterations
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        # Under FSDP2 the norm is a DTensor over the ranks' shards; full_tensor() is its value.
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        # Losses and the norm are reduced over ranks, so every rank takes the same decision.
        if not (math.isfinite(grad_norm) and all(map(math.isfinite, losses))):
            skipped += 1
            print0(f"warning: step {step + 1} update {j + 1}: non-finite loss {losses} or gradient norm "
                   f"{grad_norm}; update skipped")
            opt.zero_grad(set_to_none=True)
            continue
        opt.step()
    model.eval()
    log = {"step": step, "skipped_updates": skipped}
    for r in rolls:
        t = r.batch.task
        log[f"{t}/reward"] = r.rewards.mean().item()
        log[f"{t}/solved"] = (r.rewards >= 0.999).float().mean().item()
        # Groups whose completions all got the same reward carry no GRPO signal (zero advantage).
        flat = r.rewards.view(-1, cfg.group_size)
        log[f"{t}/zero_adv_groups"] = (flat.max(1).values == flat.min(1).values).float().mean().item()
        log.update({k: v for k, v in agg.items() if k.startswith(t + "/")})
    log["grad_norm"] = grad_norm
    log["rollout_s"] = t_roll
    log["seconds"] = time.time() - t0
    return log, rolls


def log_line(log: dict, total: int) -> str:
    parts = [f"step {log['step'] + 1}/{total}"]
    for t in sorted({k.split("/")[0] for k in log if k.endswith("/reward")}):
        if f"{t}/reward" in log:
            parts.append(f"{t} reward {log[f'{t}/reward']:.3f} loss {log[f'{t}/loss']:+.4f} "
                         f"clip {log[f'{t}/clipfrac']:.3f} kl {log[f'{t}/kl']:.4f}")
    parts.append(f"{log['seconds']:.1f}s")
    return " | ".join(parts)


# -----------------------------------------------------------------------------------------------------
# main


def scratch_config(cfg: Config, **vocab) -> ModelConfig:
    """The model shape given by the Config's d_model / n_layers / n_heads / mlp_hidden_size fields, with
    the vocabulary fields passed in (the toy tokenizer's, or --vocab_size for --dry_run)."""
    return ModelConfig(d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads, n_kv_heads=cfg.n_heads,
                       mlp_hidden_size=cfg.mlp_hidden_size, **vocab)


SFT_KEYS = ("seed", "d_model", "n_layers", "n_heads", "mlp_hidden_size", "text_noise", "image_noise", "image_width",
            "text_max_steps", "image_loss_weight",
            "sft_steps", "sft_batch_size", "sft_lr", "sft_warmup", "cond_dropout", "gen_length")


def load_or_train_sft(cfg: Config, tok, sp, device, dtype) -> tuple[Transformer, float]:
    """The toy SFT model, from out_dir/sft when it was trained with the same settings, else trained now
    (by rank 0 alone under torchrun; the other ranks wait, then read the same files)."""
    sft_dir = Path(cfg.sft_dir or Path(cfg.out_dir) / "sft")
    # tasks.py's source is part of the key: a change to the toy data invalidates the cached model.
    tasks_hash = hashlib.sha1(Path(tasks.__file__).read_bytes()).hexdigest()
    meta = {k: getattr(cfg, k) for k in SFT_KEYS} | {"tasks_sha1": tasks_hash}
    meta_file = sft_dir / "sft_meta.json"
    cached = lambda: meta_file.is_file() and json.loads(meta_file.read_text()) == meta
    if not cached() and scale.rank() == 0:
        meta_file.unlink(missing_ok=True)  # the old key must not vouch for half-overwritten weights
        mc = scratch_config(cfg, **tasks.model_config_overrides(tok))
        model = Transformer(mc).init_weights(generator("cpu", cfg.seed, "init")).to(device=device, dtype=dtype)
        print(f"SFT from scratch: {num_params(model) / 1e6:.2f}M parameters, {cfg.sft_steps} steps")
        seconds = sft(model, tok, sp, cfg, device)
        model.save_pretrained(sft_dir)
        tok.save(str(sft_dir / "tokenizer.json"))
        (sft_dir / "sft_seconds.json").write_text(json.dumps({"seconds": seconds}))
        meta_file.write_text(json.dumps(meta, indent=2))  # written last: its presence means "complete"
    scale.barrier()
    print0(f"loading the SFT model from {sft_dir} (delete it to retrain)")
    model = Transformer.from_pretrained(sft_dir, device=device, dtype=dtype)
    return model, json.loads((sft_dir / "sft_seconds.json").read_text())["seconds"]


def load_model(cfg: Config, device, dtype):
    """(model, tokenizer, special ids, SFT seconds): the toy SFT model, or a pretrained checkpoint."""
    toy = all(t in TOY_TASKS for t in task_list(cfg))
    if cfg.init_from == "scratch":
        tok = tasks.build_tokenizer()
        sp = tasks.specials(tok)
        model, seconds = load_or_train_sft(cfg, tok, sp, device, dtype)
        return model, tok, sp, seconds
    model = Transformer.from_pretrained(cfg.init_from, device=device, dtype=dtype)
    tok = load_tokenizer(cfg.init_from, model.config)
    # Toy tasks on a toy checkpoint (e.g. a LoRA run from a toy run's final/) read its ids by name.
    sp = tasks.specials(tok) if toy else model_specials(tok, model.config)
    return model, tok, sp, 0.0


def save_model(model, cfg: Config, path: Path, tok, dtype: torch.dtype) -> None:
    """The trained policy in the Hugging Face LLaDA layout (with tokenizer.json), weights in `dtype` (the
    compute dtype: bf16 for LLaDA, whatever the master weights were). With LoRA: the adapters
    (path/adapters.safetensors + adapters.json, the exact record) and the merged full checkpoint beside
    them. A collective under FSDP2: every rank calls it; rank 0 writes."""
    state = scale.full_state_dict(model)
    if scale.rank() != 0:
        return
    if cfg.lora_rank:
        # An unsharded copy on CPU to merge into (16 GB for LLaDA-8B in bf16, on rank 0 only).
        dtype = next(v for k, v in state.items() if k.endswith(".weight")).dtype
        with torch.device("meta"):
            plain = Transformer(model.config)
        plain = plain.to(dtype).to_empty(device="cpu")
        lora.add_lora(plain, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout)
        plain.load_state_dict(state)
        lora.save_adapters(plain, path)
        lora.merge_lora(plain).save_pretrained(path)
    else:
        model.save_pretrained(path, state_dict={k: v.to(dtype) for k, v in state.items()})
    tok.save(str(path / "tokenizer.json"))


def keep_steps_before(path: Path, start: int) -> Path:
    """Rewrite a jsonl log to its lines with step < start (all of it is dropped when start is 0), atomically
    (temporary file, then rename), skipping a line cut short by a crash; returns path for appending."""
    kept = []
    if start and path.is_file():
        for line in path.read_text().splitlines():
            try:
                if json.loads(line)["step"] < start:
                    kept.append(line)
            except (ValueError, KeyError, TypeError):
                continue
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(l + "\n" for l in kept))
    os.replace(tmp, path)
    return path


# Fields that may change between a run and its resumption; any other difference is refused.
# lr and grad_clip may change so that a run stopped by bad steps can continue more carefully.
RESUMABLE = ("resume", "rl_steps", "threads", "device", "sample_every", "checkpoint_every", "keep_last",
             "max_bad_steps", "device_batch_size", "out_dir", "lr", "grad_clip")


def reference_identity(cfg: Config) -> dict:
    """What the reference policy (and the starting point) is: the SFT cache key or the init_from
    checkpoint's config and index, so a resumed run cannot silently change its KL anchor."""
    if cfg.init_from == "scratch":
        meta = Path(cfg.sft_dir or Path(cfg.out_dir) / "sft") / "sft_meta.json"
        return {"sft_meta": json.loads(meta.read_text()) if meta.is_file() else None}
    root = Path(cfg.init_from)
    digest = hashlib.sha1()
    for name in ("config.json", "model.safetensors.index.json"):
        if (root / name).is_file():
            digest.update((root / name).read_bytes())
    # Hashing 16 GB of weights would take minutes; their names, sizes and modification times catch a
    # replaced checkpoint in practice.
    for f in sorted(root.glob("*.safetensors")):
        st = f.stat()
        digest.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return {"init_from": str(root.resolve()), "sha1": digest.hexdigest()}


def startup_checks(cfg: Config, out: Path) -> None:
    """Before any heavy work: out_dir writable with room for a checkpoint, sequence lengths that fit the
    model, and no stale checkpoints that a fresh run would silently mix with."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"out_dir {out} is not writable ({e.strerror}); pass --out_dir=a writable directory") from None
    mc = None
    if cfg.init_from != "scratch":
        cfg_file = Path(cfg.init_from) / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"{cfg_file} not found: --init_from must be a LLaDA/MMaDA checkpoint directory")
        mc = ModelConfig.from_hf(json.loads(cfg_file.read_text()))
        image = any(t in IMAGE_TASKS for t in task_list(cfg))
        need = (cfg.image_text_len or 64) + cfg.image_width ** 2 + 2 if image else cfg.max_prompt_len + cfg.gen_length
        if need > mc.max_sequence_length:
            raise ValueError(f"sequences of up to {need} tokens exceed the model's max_sequence_length "
                             f"({mc.max_sequence_length}); lower --max_prompt_len / --gen_length (or image sizes)")
    if cfg.checkpoint_every:
        budget.check_disk(cfg, out, mc or scratch_config(cfg, vocab_size=128))
    last = checkpoint.latest(out)
    if last is not None and not cfg.resume:
        raise ValueError(f"out_dir {out} already holds checkpoints (latest {last.name}): pass "
                         "--resume=true to continue that run, or choose another --out_dir")
    if last is not None:  # before anything is loaded or config.json is overwritten
        state = json.loads((last / "state.json").read_text())
        checkpoint.check_resumable(last, state, asdict(cfg), reference_identity(cfg), RESUMABLE)


def main(argv=None) -> dict:
    cfg = parse_args(argv)
    if cfg.dry_run:
        return budget.dry_run(cfg)
    device, dtype = setup(cfg)
    out = Path(cfg.out_dir)
    datasets = load_data(cfg)  # malformed data fails here, before any model is loaded
    # On every rank, and agreed: if one rank fails (a node-local disk, say), all stop here together.
    error = None
    try:
        startup_checks(cfg, out)
    except (ValueError, OSError) as e:
        error = e
    if scale.all_max(torch.tensor([int(error is not None)], device=device)).item():
        raise error or ValueError("another rank failed its start-up checks (its message is above)")
    if scale.rank() == 0:
        (out / "config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")
    scale.barrier()
    scorer = RemoteScorer(cfg.image_scorer_url) if cfg.image_scorer_url else None
    print0("\n".join(f"  {k} = {v}" for k, v in sorted(asdict(cfg).items())))

    # Full fine-tuning keeps float32 master weights: AdamW's steps at lr 3e-6 are far below bf16's spacing
    # near LLaDA's weights and would round away (lora.py says the same of adapters). Under torchrun FSDP2
    # computes in `dtype` from them; one process computes in float32 (use LoRA or torchrun for bf16).
    master = torch.float32 if cfg.lora_rank == 0 else dtype
    if master != dtype:
        print0(f"full fine-tuning: float32 master weights, {'bf16 compute (FSDP2)' if scale.world() > 1 else 'float32 compute'}")
    model, tok, sp, sft_seconds = load_model(cfg, device, master)
    ref = None
    if cfg.lora_rank:  # the reference policy is this model with its adapters switched off (collect)
        lora.add_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, generator=generator("cpu", cfg.seed, "lora"))
        print0("LoRA: {modules} modules, {lora_params:,} trainable of {total_params:,} parameters".format(
            **lora.lora_stats(model)))
    elif cfg.beta > 0:  # the reference policy is the starting model, frozen
        ref = scale.shard(copy.deepcopy(model).eval().requires_grad_(False), compute_dtype=dtype)
    model.set_activation_checkpointing(cfg.activation_checkpointing)
    model = scale.shard(model, compute_dtype=dtype)
    opt = torch.optim.AdamW(lora.trainable_parameters(model), lr=cfg.lr, betas=(0.9, 0.99),
                            weight_decay=cfg.weight_decay)
    print0(f"RL: {cfg.rl_steps} rollout steps x {cfg.prompts_per_step} prompts x G={cfg.group_size} per task "
           f"({', '.join(task_list(cfg))}), {cfg.num_iterations} optimizer steps per rollout batch, "
           f"{scale.world()} process(es)")

    identity = reference_identity(cfg)
    # What a resumed run must continue from (startup_checks has refused incompatible settings already).
    state = {"step": 0, "before": None, "bad_steps": 0, "bad_run": 0, "rl_seconds": 0.0, "last_good": None,
             "grid_before": None}
    last = checkpoint.latest(out) if cfg.resume else None
    if last is not None:
        state.update(checkpoint.load(last, model, opt, trainable_only=cfg.lora_rank > 0))
        for group in opt.param_groups:  # the saved optimizer carries the old lr; --lr may change on resume
            group["lr"] = cfg.lr
        print0(f"resumed from {last} at step {state['step']}")
    elif cfg.resume:
        print0(f"--resume: no complete checkpoint in {out / checkpoint.DIRNAME}; starting from step 0")
    start = state["step"]
    if state["before"] is None:
        state["before"] = evaluate_all(model, tok, sp, cfg, device, datasets, scorer)
        state["grid_before"] = image_snapshot(model, tok, sp, cfg, device)
    before = state["before"]
    print0("held-out mean reward before RL: " + ", ".join(f"{k} {v:.3f}" for k, v in before.items()))

    def save_checkpoint(step):
        saved = {**state, "step": step, "config": asdict(cfg), "reference": identity, "world_size": scale.world(),
                 "rl_seconds": state["rl_seconds"] + time.time() - t_rl}
        path = checkpoint.save(out, step, model, opt, saved, keep_last=cfg.keep_last, trainable_only=cfg.lora_rank > 0,
                               protect=state["last_good"])
        if state["bad_run"] == 0:  # written after a good step: where to go back to if things go wrong
            state["last_good"] = str(path)
        return path

    t_rl = time.time()
    logf = timef = None
    if scale.rank() == 0:
        # The logs keep the steps before `start` (a resumed run rewrites what came later). Wall times go
        # to times.jsonl, so that a repeated run gives an identical log.jsonl.
        logf, timef = (open(keep_steps_before(out / name, start), "a") for name in ("log.jsonl", "times.jsonl"))
    with checkpoint.graceful_stop() as stop:
        for step in range(start, cfg.rl_steps):
            try:
                log, rolls = rl_step(model, ref, opt, tok, sp, cfg, device, step, datasets, scorer)
                bad = log["skipped_updates"] > 0
                print0(log_line(log, cfg.rl_steps))
            except BadStep as e:
                log, rolls, bad = {"step": step, "bad_reward": str(e)}, [], True
                print0(f"warning: step {step + 1} skipped: {e}")
            state["bad_run"] = state["bad_run"] + 1 if bad else 0
            state["bad_steps"] += bad
            log["bad_steps"] = state["bad_steps"]
            times = {k: log.pop(k) for k in ("seconds", "rollout_s") if k in log}
            if logf:
                logf.write(json.dumps(log) + "\n")
                logf.flush()
                timef.write(json.dumps({"step": step, **times}) + "\n")
                timef.flush()
            if state["bad_run"] >= cfg.max_bad_steps:
                raise TrainingStopped(
                    f"{state['bad_run']} consecutive bad steps (non-finite loss, gradient or reward; see the "
                    f"warnings above), stopping at step {step + 1}. Last good checkpoint: "
                    f"{state['last_good'] or 'none (set --checkpoint_every)'}; fix the cause (a lower --lr or "
                    "--grad_clip, the reward function or scorer) and continue from it with --resume=true "
                    "(delete the newer checkpoints first)")
            if cfg.sample_every and (step + 1) % cfg.sample_every == 0:
                for r in rolls:
                    show(r.batch, r.rewards[scale.shard_rows(len(r.rewards))], tok, sp)
            # Every rank must stop at the same step: the flag is reduced over ranks.
            stopping = scale.all_max(torch.tensor([stop["signal"]], device=device)).item()
            if (cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0) or stopping:
                path = save_checkpoint(step + 1)
                print0(f"checkpoint {path}")
            if stopping:
                print0(f"stopped by {signal.Signals(int(stopping)).name} after step {step + 1}; continue with the "
                       "same command and --resume=true")
                raise SystemExit(128 + int(stopping))
    for f in (logf, timef):
        if f:
            f.close()
    rl_seconds = state["rl_seconds"] + time.time() - t_rl  # over every segment of a resumed run
    after = evaluate_all(model, tok, sp, cfg, device, datasets, scorer)
    print0("held-out mean reward after RL:  " + ", ".join(f"{k} {v:.3f}" for k, v in after.items()))
    grid = [("before RL", state["grid_before"]), ("after RL", image_snapshot(model, tok, sp, cfg, device))]

    save_model(model, cfg, out / "final", tok, dtype)
    summary = {k: {"before": before[k], "after": after[k]} for k in before}
    summary["seconds"] = {"sft": sft_seconds, "rl": rl_seconds}
    if scale.rank() == 0:
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        write_pictures(cfg, out, grid)
    print0(f"wrote {out / 'final'} and {out / 'summary.json'}")
    return summary


if __name__ == "__main__":
    try:
        main()
    except (ValueError, OSError, TrainingStopped) as e:  # user errors: one clear line, no traceback
        sys.exit(f"error: {e}")
    finally:
        scale.close()
