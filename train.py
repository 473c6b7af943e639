"""MaskGRPO training: masked-diffusion SFT, then RL with the MaskGRPO importance estimator.

    python train.py --preset toy                       # laptop CPU: SFT + RL on toy text and image tasks
    python train.py --preset toy --estimator=d1        # any Config field is a flag: --field=value
    torchrun --nproc_per_node=8 train.py --preset llada8b --init_from=DIR --train_data=gsm8k=train.jsonl
    python train.py --preset llada8b --dry_run         # parameters, memory per GPU, FLOPs, schedule

Stage 1 (`sft`) trains the toy model from scratch with the masked-diffusion loss (LLaDA arXiv:2502.09992,
MDLM arXiv:2406.07524); it is cached in out_dir/sft. Stage 2 (`rl_step`) is MaskGRPO (arXiv:2510.02880,
Alg. 5), one rollout batch at a time:

    1. rollouts      G completions per prompt: LLaDA block sampler (text), emerge sampler + CFG (images)
    2. rewards       verifiers in rewards.py / tasks.py, or a remote image scorer; finite, in [0, 1]
    3. advantages    grpo.group_advantages: (R - mean) / std within each group of G (d1: R - mean)
    4. masks         importance.build_masks: mu re-masked copies of every completion (AR-like reversing
                     for text, random for images, truncated ratio schedule, shared seeds)
    5. old/ref       importance.token_logprobs on exactly those masked inputs, without gradient
    6. mu updates    inner iteration j re-scores mask j with the current policy and takes one optimizer step
                     on grpo.policy_loss (clipped per-token ratio + beta * k3 KL to the reference)

docs/method.md derives each step; docs/differences.md lists where this code departs from the paper and
the official code. Everything a run writes goes to out_dir: log.jsonl, summary.json (held-out mean reward
before and after RL), final/ (Hugging Face LLaDA layout, tokenizer.json, generation.json), checkpoints/
(--resume continues), curves.png, images.png. The bookkeeping (logs, checkpoints, resume, signals,
start-up checks) is infra/run.py; torchrun and FSDP2 are infra/scale.py. Every random draw is seeded by
(seed, step, global sequence index), so the world size does not change the result (LoRA dropout
aside: its masks span a rank's rows).
"""
from __future__ import annotations

import contextlib
import math
import random
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

import grpo
import importance
from importance import derive_seed, generator
from infra import budget, cli, lora, scale
from infra.episodes import (IMAGE_TASKS, Batch, draw_prompts, evaluate_all, image_snapshot, load_data, make_batch,
                            make_example, rollout, score, task_list, vocab_slice)
from infra.run import BadStep, Run, TrainingStopped, load_policy, reduce_stats, setup, startup_checks, validate
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
    prompt_prefill: str = ""          # text that opens the assistant turn of benchmark prompts (official
                                      # GSM8K/MATH evaluation: "<reasoning>")
    image_text_len: int = 0           # t2i text part, left-padded with [iPAD] (0 = longest toy caption; MMaDA 257)
    image_scorer_url: str = ""        # geneval rewards: POST to this scorer (scorer.RemoteScorer)
    reward_shaping: str = "none"      # none (correctness, 0/1) | official: GSM8K/MATH format + correctness terms
                                      # of the official runs, divided by their maximum (rewards.SHAPED)
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
    image_steps: int = 12             # MaskGRPO rollouts use 12 emerge steps (paper Alg. 4)
    cfg_scale: float = 0.0            # guidance weight w; (1 + w) cond - w uncond
    # importance estimator
    estimator: str = "maskgrpo"       # maskgrpo | d1 | unigrpo (baselines for ablation)
    text_reversing: str = "arlike"    # arlike (paper, text) | random
    gamma_text: float = 0.6           # truncation: mask ratios live in (gamma, 1) (paper: 0.6 text)
    gamma_image: float = 0.8          # (paper: 0.8 image)
    num_iterations: int = 4           # mu: inner updates per rollout batch, one mask ratio each (paper: 12)
    p_mask_prompt: float = 0.15       # d1 only: prompt-token masking probability
    # GRPO
    rl_steps: int = 50                # rollout batches; each gives num_iterations optimizer steps, so a run
                                      # takes rl_steps * num_iterations optimizer steps (--dry_run prints both)
    prompts_per_step: int = 8         # per task
    group_size: int = 8               # G completions per prompt
    clip_eps: float = 0.2
    beta: float = 0.01                # k3 KL coefficient against the SFT reference (0 skips the ref pass)
    loss_norm: str = "token"          # token (official code) | sequence (paper's 1/|o_i|)
    adv_std: str = "auto"             # divide advantages by the group std: on | off | auto (off for d1, as
                                      # d1's trainer: A = r - mean; on otherwise, as MaskGRPO's)
    lr: float = 1e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    device_batch_size: int = 0        # sequences per forward pass in rollouts and log-prob passes (0 = all)
    # evaluation / logging
    eval_prompts: int = 256           # held-out prompts per task, scored before and after RL
    eval_samples: int = 4             # sampled completions per held-out prompt (one sample is too noisy)
    sample_every: int = 20            # print a decoded rollout every N RL steps (0 = never)
    # checkpoints and failures (checkpoint.py)
    checkpoint_every: int = 10        # rollout batches between checkpoints in out_dir/checkpoints (0 = never)
    keep_last: int = 2                # complete checkpoints kept (0 = all)
    resume: bool = False              # continue from the latest complete checkpoint in out_dir
    max_bad_steps: int = 3            # stop after this many consecutive steps with non-finite loss/grad/reward
    dry_run: bool = False             # print parameters, memory per GPU and FLOPs per step; no weights, no run
    dry_run_gpus: int = 8             # world size assumed by --dry_run


# Shared by the 8B presets: the official MaskGRPO configuration (the paper's Appendix settings, and its
# released configs/rl.yaml): LLaDA-8B shape, beta 0.01, eps 0.2, lr 3e-6, AdamW weight decay 0.1, grad clip
# 0.2, LoRA r 128 / alpha 64 / dropout 0.05. The official max_steps 8000 and save_steps 500 count optimizer
# steps; here a rollout batch gives num_iterations of them, so the presets below divide by mu.
# tests/test_presets.py pins every value to its source.
_8B = {"init_from": "", "d_model": 4096, "n_layers": 32, "n_heads": 32, "mlp_hidden_size": 12288, "beta": 0.01,
       "clip_eps": 0.2, "lr": 3e-6, "weight_decay": 0.1, "grad_clip": 0.2, "lora_rank": 128, "lora_alpha": 64.0,
       "lora_dropout": 0.05, "activation_checkpointing": True, "eval_samples": 1, "sample_every": 50,
       "reward_shaping": "official"}

PRESETS: dict[str, dict] = {
    # 2-core laptop CPU: SFT from scratch, then RL on both toy tasks; held-out reward rises (README).
    "toy": {},
    # Text only, with long completions: 5-6 written-out steps (33 or 39 tokens) decoded in 5 blocks of 8, one
    # token per step, so that decode order and the reversing operators have room to matter. With 20 RL
    # steps and 64 held-out prompts, RL took 5-13 min on one shared core, after a 12-16 min SFT (README).
    "toy_long": {"tasks": "text", "text_max_steps": 6, "gen_length": 40, "block_length": 8, "steps": 40,
                 "rl_steps": 20, "eval_prompts": 64},
    # seconds-long smoke run of the whole pipeline (tests, CI).
    "smoke": {"sft_steps": 30, "gen_length": 12, "block_length": 12, "steps": 12, "image_steps": 4, "rl_steps": 2,
              "prompts_per_step": 2, "group_size": 4, "eval_prompts": 8, "eval_samples": 1, "d_model": 32,
              "n_layers": 2, "mlp_hidden_size": 64, "num_iterations": 2, "sample_every": 1, "checkpoint_every": 0},
    # LLaDA-8B-Instruct text RL (official t2t script): G 6, 16 prompts per step, mu 12, gamma 0.6, 256 tokens
    # in blocks of 16 with 128 steps at temperature 0.9; 667 x 12 = 8,004 optimizer steps (official 8,000),
    # a checkpoint every 42 x 12 = 504 (official 500). Give --init_from=DIR and --train_data=gsm8k=FILE.
    "llada8b": {**_8B, "tasks": "gsm8k", "vocab_size": 126464, "gen_length": 256, "block_length": 16, "steps": 128,
                "temperature": 0.9, "group_size": 6, "prompts_per_step": 16, "num_iterations": 12, "gamma_text": 0.6,
                "device_batch_size": 6, "eval_prompts": 256, "rl_steps": 667, "checkpoint_every": 42},
    # MMaDA-8B text-to-image RL (official t2i scripts): emerge rollouts, 12 steps, CFG 3.0, G 9, mu 6, gamma
    # 0.8, 1024 image tokens (32 x 32) after a 257-token text part; rewards from a remote scorer. 8 prompts
    # per step (the official 6 GPUs ran 2 x 3 completions each; 8 divides over 8 or 16 GPUs).
    # 1334 x 6 = 8,004 optimizer steps, a checkpoint every 84 x 6 = 504.
    "mmada8b": {**_8B, "tasks": "geneval", "vocab_size": 134656, "image_width": 32, "image_text_len": 257,
                "image_steps": 12, "cfg_scale": 3.0, "group_size": 9, "prompts_per_step": 8, "num_iterations": 6,
                "gamma_image": 0.8, "device_batch_size": 3, "eval_prompts": 64, "rl_steps": 1334,
                "checkpoint_every": 84},
}


def parse_args(argv=None) -> Config:
    """Dataclass defaults, then PRESETS[--preset], then the flags; checked once, here (infra/run.validate)."""
    cfg = cli.parse(Config, argv, description=__doc__.split("\n")[0], presets=PRESETS)
    validate(cfg)
    return cfg


# -----------------------------------------------------------------------------------------------------
# stage 1: masked-diffusion SFT


def diffusion_loss(model, b: Batch, sp, gen: torch.Generator, eps: float = 1e-3) -> torch.Tensor:
    """The masked-diffusion negative ELBO (MDLM, LLaDA; docs/method.md §1): t ~ U(eps, 1) per sequence,
    each completion token masked with probability t, cross-entropy on the masked tokens weighted by 1/t,
    normalised by the completion length (LLaDA's SFT loss: the prompt is never masked)."""
    B, L = b.x.shape
    t = torch.rand(B, 1, generator=gen) * (1 - eps) + eps                              # (B, 1)
    region = torch.zeros(B, L, dtype=torch.bool)
    region[:, b.window_slice] = True
    masked = (torch.rand(B, L, generator=gen) < t) & region                            # (B, L)
    masked, t = masked.to(b.x.device), t.to(b.x.device)
    logits = model(b.x.masked_fill(masked, sp.mask), b.attention_mask)                # (B, L, V)
    # Image positions predict image codes only, so the softmax runs over the codebook columns.
    lo, hi = vocab_slice(b.task, sp) or (0, logits.shape[-1])
    ce = F.cross_entropy(logits[masked][:, lo:hi].float(), b.x[masked] - lo, reduction="none")  # (T,)
    return (ce / t.expand(B, L)[masked]).sum() / (B * b.window)


def sft(model, tok, sp, cfg: Config, device) -> float:
    """Train the toy model from scratch on noisy toy data (tasks.py); returns the seconds spent."""
    t0 = time.time()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, betas=(0.9, 0.95), weight_decay=0.0)
    # Linear warm-up, then cosine decay to 10%: a fixed learning rate plateaus early at this size.
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
                # Caption dropout: the unconditional prompt teaches the model p(image), which CFG needs.
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


@dataclass
class Rollout:
    """One task's rollout batch (this rank's rows), ready for the mu inner updates."""
    batch: Batch
    rewards: torch.Tensor       # (B_global,) every rank's rewards, for advantages and metrics
    adv: torch.Tensor           # (B,) this rank's rows
    inputs: list                # mu x (B, L) masked inputs, one per inner iteration
    loss_masks: torch.Tensor    # (mu, B, L) positions scored in iteration j (the ones masked in its input)
    logp_old: list              # mu x (B, L) float32
    logp_ref: list | None       # mu x (B, L) float32, or None when beta = 0
    seconds: dict               # wall time of each phase (times.jsonl)
    order: torch.Tensor | None = None  # (B, L) sampler step at which each position was revealed (diagnosis)


@torch.no_grad()
def collect(model, ref, task: str, tok, sp, cfg: Config, device, step: int, datasets: dict, scorer=None,
            with_order: bool = False) -> Rollout:
    """Steps 1-5 for one task. ref: the reference model, or None for "this model with its LoRA adapters
    switched off". with_order: also keep the sampler's decoding order (infra/diagnose.py)."""
    prompts = draw_prompts(task, cfg, step, datasets)
    exs = [ex for ex in prompts for _ in range(cfg.group_size)]        # each prompt G times, consecutively
    # Every rank builds the global batch (token ids: cheap) and keeps its own whole groups. A sequence's
    # global index seeds its rollout noise and its masks, so its randomness is the same on any process.
    rows = scale.shard_rows(len(exs))
    seq_index = list(range(len(exs)))[rows]
    model.eval()  # no dropout when sampling and scoring pi_old: the first ratio of an update is then 1
    b = make_batch(task, exs, tok, sp, cfg, device, with_targets=False).rows(rows)

    # 1. rollouts: one generator per sequence
    t0 = time.time()
    gens = [generator(device, cfg.seed, "rollout", task, step, i) for i in seq_index]
    b, order = rollout(model, b, sp, cfg, gens, cfg.temperature, fast=True, return_order=with_order)
    t1 = time.time()

    # 2. rewards, gathered in global order: a group is normalised over all of its members
    shaped = cfg.reward_shaping == "official"
    rewards = scale.all_gather_rows(score(b, tok, sp, scorer, shaped).to(device)).cpu()  # (B_global,)
    bad = (~torch.isfinite(rewards) | (rewards < 0) | (rewards > 1)).nonzero().flatten().tolist()
    if bad:  # a NaN or out-of-range reward is reported and the step skipped, never averaged in
        i = bad[0]
        raise BadStep(f"{len(bad)} {task} reward(s) not a finite number in [0, 1], first {rewards[i].item()} "
                      f"at sequence {i} (prompt {i // cfg.group_size}); check the reward function or scorer")

    t2 = time.time()

    # 3. advantages (GRPO, arXiv:2402.03300 §4.1.2)
    adv = advantages(rewards, cfg)[rows].to(device)                                    # (B,)

    # 4. reversing masks: mask j of every sequence, with ratio t_j of the truncated schedule (docs/method.md §3)
    B, L = b.x.shape
    image = task in IMAGE_TASKS
    scored = torch.ones(B, b.window, dtype=torch.bool, device=device)
    if cfg.estimator == "d1" and not image:  # d1 scores the completion up to and including its first EOS
        scored = importance.completion_mask_until_eos(b.x[:, b.window_slice], sp.eos)
    in_masks, loss_masks = importance.build_masks(
        b.prompt_mask, scored,
        seed=derive_seed(cfg.seed, "masks", task), step=step, seq_index=seq_index,
        num_iterations=cfg.num_iterations, gamma=cfg.gamma_image if image else cfg.gamma_text,
        estimator=cfg.estimator, mode="random" if image else cfg.text_reversing,
        p_mask_prompt=cfg.p_mask_prompt, suffix_len=L - b.prompt_len - b.window)      # (mu, B, L) each
    inputs = [importance.apply_mask(b.x, in_masks[j], sp.mask) for j in range(cfg.num_iterations)]

    # 5. old and reference log-probs on the same masked inputs; conditional logits only (no CFG). Under
    # FSDP2 the weights are gathered once for all of these forwards, not once per forward.
    kw = dict(attention_mask=b.attention_mask, vocab_slice=vocab_slice(task, sp),
              device_batch_size=cfg.device_batch_size or None)
    with scale.full_weights(model):
        logp_old = [importance.token_logprobs(model, inputs[j], b.x, loss_masks[j], **kw) for j in range(len(inputs))]
    logp_ref = None
    if cfg.beta > 0:
        reference = model if ref is None else ref
        with scale.full_weights(reference), lora.adapters_disabled(model) if ref is None else contextlib.nullcontext():
            logp_ref = [importance.token_logprobs(reference, inputs[j], b.x, loss_masks[j], **kw)
                        for j in range(len(inputs))]
    seconds = {"rollout_s": t1 - t0, "reward_s": t2 - t1, "logprob_s": time.time() - t2}
    return Rollout(b, rewards, adv, inputs, loss_masks, logp_old, logp_ref, seconds, order)


def advantages(rewards: torch.Tensor, cfg: Config) -> torch.Tensor:
    """Group-relative advantages of the global rewards, with or without the division by the group std."""
    std = cfg.adv_std == "on" or (cfg.adv_std == "auto" and cfg.estimator != "d1")
    return grpo.group_advantages(rewards, group_size=cfg.group_size, scale_by_std=std)


def policy_backward(model, r: Rollout, j: int, cfg: Config, sp) -> dict:
    """Step 6 for one task and inner iteration j: re-score mask j with the current policy and backpropagate
    the GRPO loss, device_batch_size rows at a time. Each chunk's loss is weighted by its share of the
    normaliser over all ranks' rows, so the gradient is that of one full-batch pass in one process."""
    b, mask = r.batch, r.loss_masks[j]                                                   # mask (B, L)
    count = (lambda m: m.sum()) if cfg.loss_norm == "token" else (lambda m: m.any(-1).sum())
    total = scale.all_sum(count(mask).float()).clamp(min=1)
    stats_sum: dict = {}
    for rows in scale.chunks(b.x.shape[0], cfg.device_batch_size):
        logp = importance.token_logprobs(model, r.inputs[j][rows], b.x[rows], mask[rows],
                                         attention_mask=b.attention_mask[rows], vocab_slice=vocab_slice(b.task, sp))
        loss, stats = grpo.policy_loss(logp, r.logp_old[j][rows], r.adv[rows], mask[rows], clip_eps=cfg.clip_eps,
                                       beta=cfg.beta, logp_ref=None if r.logp_ref is None else r.logp_ref[j][rows],
                                       norm=cfg.loss_norm)
        share = count(mask[rows]).float() / total
        scale.backward_sum(loss * share)
        merge_stats(stats_sum, stats, float(share), loss.item())
    return stats_sum


def merge_stats(acc: dict, stats: dict, share: float, loss: float) -> None:
    """Accumulate one chunk's statistics: maxima by max, means weighted by the chunk's share, counts summed."""
    for k, v in stats.items():
        if k == "adv_abs_mean":  # a mean over rows, not tokens: rl_step logs it from all rows instead
            continue
        if k.endswith("_max"):
            acc[k] = max(acc.get(k, -math.inf), float(v))
        else:
            acc[k] = acc.get(k, 0.0) + float(v) * (1.0 if k == "num_tokens" else share)
    acc["loss"] = acc.get("loss", 0.0) + loss * share


def update(model, opt, rolls: list, j: int, cfg: Config, sp, device, step: int) -> tuple[dict, float, bool]:
    """Inner iteration j of step 6: one optimizer step on every task's loss for mask j. Returns the
    statistics ("task/name"), the gradient norm, and whether the step was taken (not when a loss or the
    gradient is not finite)."""
    # LoRA dropout is the only draw from the global RNG (activation checkpointing replays it), seeded
    # per (step, j, rank) so that a resumed run draws the same masks.
    torch.manual_seed(derive_seed(cfg.seed, "dropout", step, j, scale.rank()))
    opt.zero_grad(set_to_none=True)
    stats, losses = {}, []
    for r in rolls:
        s = reduce_stats(policy_backward(model, r, j, cfg, sp), device)
        losses.append(s["loss"])
        stats.update({f"{r.batch.task}/{k}": v for k, v in s.items()})
    # The optimizer's own parameters: under FSDP2 the module may expose gathered copies between passes.
    grad_norm = scale.clip_grad_norm([p for g in opt.param_groups for p in g["params"]], cfg.grad_clip)
    # Losses and the norm are the same on every rank, so every rank takes the same decision.
    if not (math.isfinite(grad_norm) and all(map(math.isfinite, losses))):
        print0(f"warning: step {step + 1} update {j + 1}: non-finite loss {losses} or gradient norm "
               f"{grad_norm}; update skipped")
        opt.zero_grad(set_to_none=True)
        return stats, grad_norm, False
    opt.step()
    return stats, grad_norm, True


def rl_step(model, ref, opt, tok, sp, cfg: Config, device, step: int, datasets: dict, scorer=None
            ) -> tuple[dict, list]:
    """One rollout batch and its mu optimizer steps; returns the step's log and its rollouts."""
    t0 = time.time()
    rolls = [collect(model, ref, task, tok, sp, cfg, device, step, datasets, scorer) for task in task_list(cfg)]
    t_update = time.time()
    model.train()
    agg: dict = {}
    skipped = 0
    for j in range(cfg.num_iterations):
        stats, grad_norm, ok = update(model, opt, rolls, j, cfg, sp, device, step)
        skipped += not ok
        for k, v in stats.items():
            agg[k] = agg.get(k, 0.0) + v / cfg.num_iterations
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
        log[f"{t}/adv_abs_mean"] = advantages(r.rewards, cfg).abs().mean().item()
    log["grad_norm"] = grad_norm
    for k in rolls[0].seconds:  # phase times, summed over tasks; Run.record moves them to times.jsonl
        log[k] = sum(r.seconds[k] for r in rolls)
    log["update_s"] = time.time() - t_update
    log["seconds"] = time.time() - t0
    return log, rolls


# -----------------------------------------------------------------------------------------------------
# main


def main(argv=None) -> dict:
    cfg = parse_args(argv)
    if cfg.dry_run:
        return budget.dry_run(cfg)
    device, dtype = setup(cfg)
    datasets = load_data(cfg)       # malformed data fails here, before any model is loaded
    startup_checks(cfg, device)     # out_dir, disk room, sequence lengths, resume compatibility
    scorer = RemoteScorer(cfg.image_scorer_url) if cfg.image_scorer_url else None
    model, ref, tok, sp, sft_seconds = load_policy(cfg, device, dtype, sft)
    opt = torch.optim.AdamW(lora.trainable_parameters(model), lr=cfg.lr, betas=(0.9, 0.99),
                            weight_decay=cfg.weight_decay)
    print0(f"RL: {cfg.rl_steps} rollout batches x {cfg.num_iterations} optimizer steps, {cfg.prompts_per_step} "
           f"prompts x G={cfg.group_size} per task ({', '.join(task_list(cfg))}), {scale.world()} process(es)")
    with Run(cfg, model, opt, device) as run:
        if run.state["before"] is None:
            run.state["before"] = evaluate_all(model, tok, sp, cfg, device, datasets, scorer)
            run.state["grid_before"] = image_snapshot(model, tok, sp, cfg, device)
        print0("held-out mean reward before RL: " + ", ".join(f"{k} {v:.3f}" for k, v in run.state["before"].items()))
        for step in range(run.start, cfg.rl_steps):
            try:
                log, rolls = rl_step(model, ref, opt, tok, sp, cfg, device, step, datasets, scorer)
            except BadStep as e:
                log, rolls = {"step": step, "bad_reward": str(e)}, []
            run.record(step, log, rolls, tok, sp)
    after = evaluate_all(model, tok, sp, cfg, device, datasets, scorer)
    print0("held-out mean reward after RL:  " + ", ".join(f"{k} {v:.3f}" for k, v in after.items()))
    return run.finish(after, image_snapshot(model, tok, sp, cfg, device), tok, dtype, sft_seconds)


if __name__ == "__main__":
    with scale.process_exit():  # leaves the process group on every path (infra/scale.py)
        try:
            main()
        except (ValueError, OSError, TrainingStopped) as e:  # user errors: one clear line, no traceback
            raise SystemExit(f"error: {e}")
