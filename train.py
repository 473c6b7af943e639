"""MaskGRPO training: masked-diffusion SFT, then RL with the MaskGRPO importance estimator.

    python train.py --preset toy                       # laptop CPU: SFT + RL on toy text and image tasks
    python train.py --preset toy --estimator=d1        # any Config field is a flag: --field=value
    torchrun --nproc_per_node=8 train.py --preset llada8b --init_from=DIR --train_data=gsm8k=train.jsonl
    python train.py --preset llada8b --dry_run         # parameters, memory per GPU, FLOPs, schedule

Stage 1 (`sft`) trains the toy model with the masked-diffusion loss (LLaDA arXiv:2502.09992), cached in
out_dir/sft. Stage 2 (`rl_step`) is MaskGRPO (arXiv:2510.02880, Alg. 5; docs/method.md §9). A run writes
log.jsonl, times.jsonl, summary.json, final/, checkpoints/ and pictures to out_dir.
"""
import contextlib
import math
import random
import signal
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import grpo
import importance
import tasks
from infra import budget, checkpoint, cli, outdir, scale, tracker
from infra.run import (Run, RunFailed, TrainingStopped, all_skipped, check_measured, dry_run, eval_batches,
                       failures_in_one_line, start)
from infra.data import evaluate_all, image_snapshot
from sample import chunks, derive_seed, generator, rollout
from tasks import IMAGE_TASKS, Batch, Ctx, make_batch, make_example, sft_tasks, step_prompts


# -----------------------------------------------------------------------------------------------------
# settings: one flag per field (`python train.py --help` prints each comment), and the presets

@dataclass
class StepConfig:
    """The settings one RL step reads (rl_step and everything it calls); Config adds the run's."""
    seed: int = 0                     # every random draw derives from (seed, purpose, step, index): sample.derive_seed
    # rollouts (text: LLaDA's low-confidence block sampler; images: sample.generate_image)
    temperature: float = 1.0          # rollout temperature (official default 0.9)
    block_length: int = 12            # semi-autoregressive block size; divides gen_length (official: 16)
    steps: int = 12                   # denoising steps per text rollout: a multiple of the blocks, <= gen_length
    image_sampler: str = "emerge"     # emerge (MaskGRPO) | maskgit (MMaDA default, baseline)
    image_steps: int = 12             # image denoising steps (paper Alg. 4: 12)
    cfg_scale: float = 0.0            # image guidance weight w: (1 + w) cond - w uncond
    # rewards and advantages
    reward_shaping: str = "none"      # benchmark rewards: none (correct 0/1) | official (format + correctness)
    text_reward: str = "answer"       # toy text verifier: answer (the last \\boxed{}) | solution (every step and the box)
    group_size: int = 8               # G completions per prompt
    adv_std: str = "auto"             # divide advantages by the group std: on | off | auto (off for d1, as d1)
    # importance estimator (importance.VIEWS)
    estimator: str = "maskgrpo"       # maskgrpo | d1 | unigrpo (baselines) | trajectory (exact decoding path)
    text_reversing: str = "arlike"    # maskgrpo's text masks: arlike (paper Alg. 1) | random | arlike_official
    gamma_text: float = 0.6           # maskgrpo: text mask ratios live in (gamma, 1) (paper: 0.6)
    gamma_image: float = 0.8          # maskgrpo: image mask ratios live in (gamma, 1) (paper: 0.8)
    mu: int = 4                       # mu: inner updates per rollout batch (paper: 12; the official num_iterations)
    p_mask_prompt: float = 0.15       # d1: prompt-token masking probability
    trajectory_states: int = 0        # trajectory: K decoding states per update, weighted T/K (0 = every state)
    # GRPO update
    clip_eps: float = 0.2             # PPO clip range epsilon of the ratio, > 0 (paper: 0.2)
    beta: float = 0.01                # k3 KL coefficient against the reference (0 skips the reference pass)
    loss_norm: str = "token"          # token (official code) | sequence (paper's 1/|o_i|)
    grad_clip: float = 1.0            # gradient-norm clip per optimizer step (official: 0.2)
    device_batch_size: int = 0        # sequences per forward pass in rollouts and log-prob passes (0 = all)
    @property
    def adv_scaled(self) -> bool:     # --adv_std=auto: divide by the std, but not for d1 (its trainer: A = R - mean)
        return self.adv_std == "on" or (self.adv_std == "auto" and self.estimator != "d1")


@dataclass
class Config(StepConfig):
    """Every flag: the step's settings (StepConfig) and the run's: io, model, data, SFT, RL schedule, evaluation."""
    # io / system
    out_dir: str = "out/toy"          # everything this run writes goes here
    device: str = "auto"              # auto | cpu | cuda | cuda:N
    dtype: str = "auto"               # auto (float32 on CPU, bfloat16 on CUDA) | float32 | bfloat16
    threads: int = 0                  # torch CPU threads (0: one on CPU, fastest for the toy on busy cores; torch's default with a GPU)
    # Fast-dLLM (arXiv:2505.22618) text rollouts in RL steps (tasks.Ctx.text_sampler; evaluation stays exact)
    kv_cache: str = "none"            # none (exact) | prefix | dual: block KV cache
    threshold: float = 0.0            # > 0: also commit every masked token more confident than this
    # model
    init_from: str = "scratch"        # "scratch" (toy model below, trained by SFT) or a checkpoint directory
    sft_dir: str = ""                 # SFT model cache ("" = out_dir/sft); runs with the same SFT settings may share it
    retrain_sft: bool = False         # replace an SFT model in sft_dir trained with other settings (else refused)
    d_model: int = 128                # scratch model width (and --dry_run's, when init_from has no config.json)
    n_layers: int = 4                 # transformer blocks (LLaDA-8B: 32)
    n_heads: int = 4                  # attention heads; d_model must divide by it (LLaDA-8B: 32)
    mlp_hidden_size: int = 384        # SwiGLU hidden width (LLaDA-8B: 12288)
    vocab_size: int = 0               # --dry_run only: embedding rows (0 = the toy tokenizer's)
    lora_rank: int = 0                # > 0: train LoRA adapters only; the reference is the adapters-off policy
    lora_alpha: float = 64.0          # LoRA scale alpha / rank on the adapter output (official: 64)
    lora_dropout: float = 0.0         # dropout on the LoRA input, in [0, 1) (official: 0.05)
    lora_targets: str = "all"         # LoRA'd block projections: all (the seven) | official (q/k/v/up)
    attend_padding: str = "auto"      # attention over [iPAD]/EOS padding: on | off | auto (on for geneval only)
    activation_checkpointing: bool = False  # recompute each block in backward (needed at 8B)
    # tasks and data
    tasks: str = "text,image"         # RL tasks, comma separated: text, image (toy); gsm8k, math, mbpp, countdown, sudoku, geneval
    train_data: str = ""              # task=path[,task=path]: local files in their public format (infra/data.py)
    eval_data: str = ""               # task=path[,...]: held-out sets scored before and after RL
    max_prompt_len: int = 256         # real text prompts keep their last max_prompt_len tokens
    prompt_prefill: str = ""          # text that opens the assistant turn of benchmark prompts (e.g. "<reasoning>")
    system_prompt: str = ""           # a system turn before benchmark prompts' user turn ("" = none)
    image_text_len: int = 0           # t2i text part, left-padded with [iPAD] (0 = longest toy caption; MMaDA 257)
    image_scorer_url: str = ""        # geneval rewards: POST to this scorer (infra/sandbox.py)
    image_scorer_timeout: float = 30.0  # seconds a scorer request may take before a retry (every rank posts at once)
    text_max_steps: int = 1           # arithmetic steps per toy word problem (1 to 4)
    text_noise: float = 0.4           # fraction of SFT text targets boxing the amount before the last step
    image_noise: float = 0.4          # fraction of SFT images with one colour drawn as its look-alike
    image_width: int = 4              # images are image_width x image_width tokens (MMaDA 512 px: 32)
    # stage 1: masked-diffusion SFT
    sft_steps: int = 600              # optimizer steps of the toy SFT stage (0 with --init_from)
    sft_batch_size: int = 64          # sequences per SFT step and task
    sft_lr: float = 2e-3              # SFT peak learning rate (AdamW), after warm-up, cosine-decayed to 10%
    sft_warmup: int = 50              # SFT linear warm-up steps
    image_loss_weight: float = 3.0    # weight of the image SFT loss beside text's 1
    cond_dropout: float = 0.1         # fraction of SFT captions dropped, for CFG (MMaDA: 0.1)
    # RL schedule
    gen_length: int = 12              # completion tokens N per text rollout (official: 256)
    rl_steps: int = 80                # rollout batches; each gives mu optimizer steps
    prompts_per_step: int = 8         # prompts per rollout batch and task
    lr: float = 1e-4                  # RL learning rate (AdamW, constant; official: 3e-6)
    weight_decay: float = 0.0         # AdamW weight decay in RL (official: 0.1)
    # evaluation / logging
    eval_prompts: int = 256           # held-out prompts per task, scored before and after RL
    eval_samples: int = 4             # sampled completions per held-out prompt
    sample_every: int = 20            # print a decoded rollout every N RL steps (0 = never)
    tracker: str = "none"             # none | tensorboard | wandb | trackio: live curves beside log.jsonl (infra/tracker.py)
    tracker_project: str = "maskgrpo" # the tracker's project this run is filed under
    tracker_run: str = ""             # the tracked run's name ("" = out_dir's folder name)
    # checkpoints and failures (infra/checkpoint.py)
    checkpoint_every: int = 10        # rollout batches between checkpoints in out_dir/checkpoints (0 = never)
    keep_last: int = 2                # complete checkpoints kept (0 = all)
    resume: bool = False              # continue from the latest complete checkpoint in out_dir
    extend: bool = False              # with --resume and a larger --rl_steps: train a finished run further
    change_on_resume: str = ""        # with --resume: lr and/or grad_clip (comma separated) may change from here on; log.jsonl records it
    max_bad_steps: int = 3            # stop after this many consecutive steps with non-finite loss/grad/reward
    dry_run: bool = False             # print parameters, memory per GPU and FLOPs per step; no weights, no run
    dry_run_gpus: int = 8             # world size assumed by --dry_run


# Presets: the settings each one changes from the defaults above; where each value comes from: docs/differences.md.
_8B = {"init_from": "", "d_model": 4096, "n_layers": 32, "n_heads": 32, "mlp_hidden_size": 12288, "beta": 0.01,
       "clip_eps": 0.2, "lr": 3e-6, "weight_decay": 0.1, "grad_clip": 0.2, "lora_rank": 128, "lora_alpha": 64.0,
       "lora_dropout": 0.05, "lora_targets": "official", "activation_checkpointing": True, "eval_samples": 1,
       "sample_every": 50, "reward_shaping": "official"}
_LLADA = {**_8B, "tasks": "gsm8k", "vocab_size": 126464, "gen_length": 256, "steps": 128, "temperature": 0.9,
          "group_size": 6, "prompts_per_step": 16, "mu": 12, "device_batch_size": 6, "eval_prompts": 256,
          "rl_steps": 667, "checkpoint_every": 42}
_MMADA = {**_8B, "tasks": "geneval", "vocab_size": 134656, "image_width": 32, "image_text_len": 257,
          "image_steps": 12, "group_size": 9, "device_batch_size": 9, "eval_prompts": 64}

PRESETS: dict[str, dict] = {
    "toy": {},  # 2-core laptop CPU: SFT from scratch, then RL on both toy tasks
    "toy_long": {"tasks": "text", "text_max_steps": 4, "text_noise": 0.2, "text_reward": "solution",
                 "gen_length": 32, "block_length": 8, "steps": 32, "sft_steps": 4800, "rl_steps": 40,
                 "prompts_per_step": 16, "lr": 3e-5, "eval_prompts": 512},
    "smoke": {"sft_steps": 30, "gen_length": 12, "block_length": 12, "steps": 12, "image_steps": 4, "rl_steps": 2,
              "prompts_per_step": 2, "group_size": 4, "eval_prompts": 8, "eval_samples": 1, "d_model": 32,
              "n_layers": 2, "mlp_hidden_size": 64, "mu": 2, "sample_every": 1, "checkpoint_every": 0},
    "llada8b": {**_LLADA, "block_length": 16, "gamma_text": 0.6, "device_batch_size": 12},
    "mmada8b": {**_MMADA, "cfg_scale": 3.0, "prompts_per_step": 4, "mu": 6, "gamma_image": 0.6,
                "clip_eps": 0.2, "rl_steps": 1334, "checkpoint_every": 84, "dry_run_gpus": 4},
    "mmada8b_server": {**_MMADA, "cfg_scale": 3.5, "prompts_per_step": 8, "mu": 12,
                       "gamma_image": 0.8, "clip_eps": 0.001, "rl_steps": 667, "checkpoint_every": 42},
    "d1_official": {**_LLADA, "block_length": 32, "estimator": "d1", "beta": 0.04, "clip_eps": 0.5,
                    "max_prompt_len": 200},
}


def parse_args(argv=None) -> Config:
    """Dataclass defaults, then PRESETS[--preset], then the flags; checked once, here (infra/cli.validate)."""
    if any(a.split("=")[0] == "--num_iterations" for a in (sys.argv[1:] if argv is None else argv)):
        raise ValueError("unknown flag --num_iterations: the inner updates per rollout batch are --mu (the paper's mu)")
    cfg = cli.parse(Config, argv, description=__doc__.split("\n")[0], presets=PRESETS)
    cli.validate(cfg)
    for task in tasks.task_list(cfg):  # a verifier the settings name that a task lacks: refused here, not at step 0
        tasks.verifier(task, cfg.text_reward, cfg.reward_shaping)
    return cfg


def diffusion_loss(model, b: Batch, ids, gen: torch.Generator, eps: float = 1e-3) -> torch.Tensor:
    """The masked-diffusion negative ELBO (LLaDA's SFT loss; docs/method.md §1): t ~ U(eps, 1) per sequence, each
    completion token masked with prob t, cross-entropy on them weighted by 1/t, over the completion length."""
    B, L = b.x.shape
    t = torch.rand(B, 1, generator=gen) * (1 - eps) + eps                              # (B, 1)
    masked = torch.zeros(B, L, dtype=torch.bool)                                       # (B, L)
    masked[:, b.window_slice] = (torch.rand(B, L, generator=gen) < t)[:, b.window_slice]
    masked, t = masked.to(b.x.device), t.to(b.x.device)
    logits = model(b.x.masked_fill(masked, ids.mask), b.attention_mask)                # (B, L, V)
    # Image positions predict image codes only, so the softmax runs over the codebook columns.
    lo, hi = b.vocab_slice or (0, logits.shape[-1])
    ce = F.cross_entropy(logits[masked][:, lo:hi].float(), b.x[masked] - lo, reduction="none")  # (T,)
    return (ce / t.expand(B, L)[masked]).sum() / (B * b.window)


def sft(model, tok, ids, cfg: Config, device) -> float:
    """Train the toy model from scratch on noisy data of the run's toy tasks; returns the seconds spent."""
    t0 = time.time()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, betas=(0.9, 0.95), weight_decay=0.0)
    # Linear warm-up, then cosine decay to 10%: a fixed learning rate plateaus early at this size.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.sft_warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, cfg.sft_steps))))))
    rng = random.Random(derive_seed(cfg.seed, "sft-data"))
    gen = generator("cpu", cfg.seed, "sft-mask")
    model.train()
    loss_sum = 0.0
    with checkpoint.graceful_stop("finishing this SFT step, then stopping (SFT keeps no checkpoint)",
                                  abort=lambda: "nothing more is lost, SFT restarts from step 0 either way") as stop:
        bar = cli.progress_bar(range(cfg.sft_steps), desc="sft", dynamic_ncols=True)
        for step in bar:
            if stop["signal"]:
                scale.print0(f"SFT stopped by {signal.Signals(stop['signal']).name} after {step} of {cfg.sft_steps} "
                             "steps; SFT keeps no checkpoint, so the next run restarts SFT from step 0 (nothing was "
                             f"written to the sft_dir); start it again with: {outdir.resume_command()}")
                raise SystemExit(128 + stop["signal"])
            loss_sum = 0.0
            for task in sft_tasks(cfg):
                noise = cfg.image_noise if task in IMAGE_TASKS else cfg.text_noise
                exs = [make_example(task, rng, cfg, "train", noise) for _ in range(cfg.sft_batch_size)]
                b = make_batch(task, exs, tok, ids, cfg, device, with_targets=True)
                if task in IMAGE_TASKS:
                    # Caption dropout: the unconditional prompt teaches the model p(image), which CFG needs.
                    drop = torch.rand(len(exs), generator=gen) < cfg.cond_dropout
                    b.x[drop, : b.prompt_len] = b.uncond[drop, : b.prompt_len]
                    b.attention_mask[drop] = b.uncond_mask[drop]
                loss = diffusion_loss(model, b, ids, gen)
                (loss * (cfg.image_loss_weight if task in IMAGE_TASKS else 1.0)).backward()
                loss_sum += loss.item()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            bar.set_postfix(loss=f"{loss_sum:.3f}")
            if bar.disable and (step + 1) % max(1, cfg.sft_steps // 10) == 0 and step + 1 < cfg.sft_steps:
                scale.print0(f"sft step {step + 1}/{cfg.sft_steps}: loss {loss_sum:.3f}, {time.time() - t0:.0f}s")
    # The bar is silent in a log file: a line every tenth of the steps above, and one for the end.
    scale.print0(f"SFT: {cfg.sft_steps} steps in {time.time() - t0:.0f}s, last loss {loss_sum:.3f}")
    model.eval()
    return time.time() - t0


@dataclass
class Experience:
    """One task's scored rollouts (this rank's rows) with the estimator's K views and their old/ref log-probs."""
    batch: Batch                # the rollouts, in the window of batch.x (B, L)
    rewards: torch.Tensor       # (B_global,) every rank's rewards, for advantages and metrics
    adv: torch.Tensor           # (B_global,) advantages of every rank's rows (this rank's: batch.index)
    views: importance.Views     # K masked inputs, the positions each scores, which views update j scores
    logp_old: list              # K x (B, L) float32
    logp_ref: list | None       # K x (B, L) float32, or None when beta = 0


class BadStep(Exception):
    """Rewards that are not finite numbers in [0, 1]: the RL step is skipped (main counts it)."""


_SECONDS: dict[str, float] = {}  # each phase's wall and CPU seconds in this step (times.jsonl only)


@contextlib.contextmanager
def timed(phase: str):
    """Add the block's wall and CPU seconds (comparable on a shared machine) to the phase's, also when it raises."""
    wall, cpu = time.time(), time.process_time()
    try:
        yield
    finally:
        _SECONDS[f"{phase}_s"] = _SECONDS.get(f"{phase}_s", 0.0) + time.time() - wall
        _SECONDS[f"{phase}_cpu_s"] = _SECONDS.get(f"{phase}_cpu_s", 0.0) + time.process_time() - cpu


def rl_step(model, ref, opt, ctx: Ctx, step: int, prompts: list[Batch]) -> tuple[dict, list]:
    """One MaskGRPO step (Alg. 5; docs/method.md §9): (its log line, experiences). ref: None when beta = 0."""
    cfg, device, exps = ctx.cfg, ctx.device, []
    model.eval()  # no dropout when sampling and scoring pi_old: the first ratio of an update is then 1
    for p in prompts:
        # 1. rollouts: G completions per prompt, one generator per sequence, with their decoding order
        gens = [generator(device, cfg.seed, "rollout", p.task, step, i) for i in p.index]
        with timed("rollout"):
            batch, order = rollout(model, p, ctx, gens, cfg.temperature, ctx.text_sampler)
        # 2. rewards from the task's verifier (geneval: a remote scorer), of every rank's rows
        verify = tasks.verifier(p.task, cfg.text_reward, cfg.reward_shaping)
        with timed("reward"):
            r = tasks.score(batch, verify, ctx.tok, ctx.ids, ctx.scorer).to(device)
        r = scale.all_gather_rows(r).cpu()                                                 # (B_global,)
        check_rewards(r, p.task, cfg.group_size)
        # 3. advantages within each group of G (GRPO, arXiv:2402.03300 §4.1.2)
        adv = grpo.group_advantages(r, cfg.group_size, scale_by_std=cfg.adv_scaled)        # (B_global,)
        # 4. the estimator's views (importance.maskgrpo_views): K masked inputs, the positions each scores
        views = importance.VIEWS[cfg.estimator](batch, order, cfg, image=p.task in IMAGE_TASKS, step=step,
                                                seq_index=p.index, eos_id=ctx.ids.eos, mask_id=ctx.ids.mask,
                                                all_max=scale.all_max)
        # 5. old and reference log-probs on the same inputs (LoRA: one all-gather serves both)
        shared = getattr(ref, "policy", None) is model
        with scale.full_weights(model) if shared else contextlib.nullcontext(), timed("logprob"):
            logp_old = frozen_logprobs(model, batch, views, ctx)
            logp_ref = frozen_logprobs(ref, batch, views, ctx) if ref is not None else None
        exps.append(Experience(batch, r, adv, views, logp_old, logp_ref))
    # 6. mu inner updates on the clipped GRPO objective with the k3 KL to the reference (paper Eq. 11)
    model.train()
    with timed("update"):
        updates = [update(model, opt, exps, ctx, step, j) for j in range(cfg.mu)]
    model.eval()
    return step_log(step, exps, updates, cfg), exps


def check_rewards(r: torch.Tensor, task: str, group_size: int) -> None:
    """A NaN or out-of-range reward is reported and the step skipped (BadStep), never averaged in."""
    bad = (~torch.isfinite(r) | (r < 0) | (r > 1)).nonzero().flatten().tolist()
    if bad:
        raise BadStep(f"{len(bad)} {task} reward(s) not a finite number in [0, 1], first {r[bad[0]].item()} at "
                      f"sequence {bad[0]} (prompt {bad[0] // group_size}); check the reward function or scorer")


@torch.no_grad()
def frozen_logprobs(model, b: Batch, views: importance.Views, ctx: Ctx) -> list:
    """K x (B, L) float32: the log-probs of every view under a frozen policy (pi_old or pi_ref)."""
    with scale.full_weights(model):  # FSDP2 gathers the weights once for all K passes
        return [importance.token_logprobs(model, x_k, b.x, m_k, attention_mask=b.attention_mask,
                                          vocab_slice=b.vocab_slice, device_batch_size=ctx.cfg.device_batch_size)
                for x_k, m_k in zip(views.inputs, views.loss_masks)]


def update(model, opt, exps: list, ctx: Ctx, step: int, j: int) -> dict:
    """Inner update j: every task's loss backward, clip, step, unless a loss or the norm (over ranks) is not finite."""
    # LoRA dropout draws from the global RNG (activation checkpointing replays it): seeded per (step, j, rank)
    torch.manual_seed(derive_seed(ctx.cfg.seed, "dropout", step, j, scale.rank()))
    opt.zero_grad(set_to_none=True)
    sums = {e.batch.task: reduce_sums(backward_loss(model, e, j, ctx), ctx.device) for e in exps}
    norm = clip_grad_norm([p for g in opt.param_groups for p in g["params"]], ctx.cfg.grad_clip)  # all shards
    skipped = not all(map(math.isfinite, [norm] + [s["loss"] for s in sums.values()]))
    if not skipped:  # else the next zero_grad drops the gradients (Run.record warns)
        opt.step()
    return {**sums, "grad_norm": norm, "skipped": skipped}


def clip_grad_norm(params, max_norm: float) -> float:
    """Clip the global gradient norm; return it as a float, the same on every rank (FSDP2: a DTensor's full value)."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def backward_loss(model, e: Experience, j: int, ctx: Ctx) -> dict:
    """Backpropagate update j's loss on one task, device_batch_size rows at a time; returns this rank's sums. The
    loss is ONE mean over the global batch: n counts the terms of every view, chunk and rank (or Views.norm)."""
    cfg, b, v = ctx.cfg, e.batch, e.views
    adv = e.adv[b.index].to(b.x.device)                                                    # (B,)
    # the terms: scored tokens, or sequences with one (--loss_norm), unless the views count them
    terms = [m.sum() if cfg.loss_norm == "token" else m.any(-1).sum() for m in (v.loss_masks[k] for k in v.updates[j])]
    n = scale.all_sum(torch.as_tensor(sum(terms) if v.norm is None else v.norm).float()).clamp(min=1)
    sums = {}
    for k in v.updates[j]:
        mask = v.loss_masks[k]                                                             # (B, L)
        for rows in chunks(b.x.shape[0], cfg.device_batch_size):
            logp = importance.token_logprobs(model, v.inputs[k][rows], b.x[rows], mask[rows],
                                             attention_mask=b.attention_mask[rows], vocab_slice=b.vocab_slice)
            loss, s = grpo.policy_loss(logp, e.logp_old[k][rows], adv[rows], mask[rows], clip_eps=cfg.clip_eps,
                                       beta=cfg.beta, norm=cfg.loss_norm, total=n,
                                       logp_ref=None if e.logp_ref is None else e.logp_ref[k][rows])
            loss.backward()  # FSDP2 sums the ranks' gradients (scale.shard), as the loss is a sum over ranks
            sums = add_sums(sums, s)
    return sums


def add_sums(a: dict, b: dict) -> dict:
    """Two chunks' (or ranks') sums of grpo.policy_loss as one: ratio_max by max, the rest added."""
    return {k: torch.maximum(a[k], b[k]) if k == "ratio_max" else a[k] + b[k] for k in b} if a else dict(b)


def reduce_sums(s: dict, device) -> dict:
    """grpo.policy_loss's sums (0-d tensors) over ranks as floats, ratio_max by max: the update's only host reads."""
    keys, f64 = [k for k in s if k != "ratio_max"], dict(dtype=torch.float64, device=device)
    out = dict(zip(keys, scale.all_sum(torch.stack([s[k] for k in keys]).to(**f64)).tolist()))
    return {**out, "ratio_max": scale.all_max(s["ratio_max"].to(**f64)).item()}


def step_log(step: int, exps: list, updates: list, cfg) -> dict:
    """log.jsonl's line of one RL step (docs/method.md "What a step logs" says what each key is)."""
    log = {"step": step, "skipped_updates": sum(u["skipped"] for u in updates)}
    for e in exps:
        t = e.batch.task
        log[f"{t}/reward"] = e.rewards.mean().item()
        log[f"{t}/solved"] = (e.rewards >= 0.999).float().mean().item()
        # groups of equal rewards: no GRPO signal (grpo.group_advantages makes their advantages exactly 0)
        log[f"{t}/zero_adv_groups"] = (e.adv.view(-1, cfg.group_size) == 0).all(1).float().mean().item()
        log.update({f"{t}/{k}": v for k, v in step_stats([u[t] for u in updates]).items()})
        log[f"{t}/adv_abs_mean"] = e.adv.abs().mean().item()
    norms = [u["grad_norm"] for u in updates]
    log.update(grad_norm_mean=sum(x / len(norms) for x in norms), grad_norm_max=max(norms))
    return log


def step_stats(updates: list[dict]) -> dict[str, float]:
    """One task's statistics from each update's batch sums, divided once (per scored token), over the updates."""
    mean = lambda f: sum(f(u) / len(updates) for u in updates)  # over the updates, in order
    per_token = lambda k, empty=0.0: mean(lambda u: u[k] / u["tokens"] if u["tokens"] else empty)
    return {"loss": mean(lambda u: u["loss"]), "clipfrac": per_token("clipped"), "kl": per_token("kl"),
            "ratio_mean": per_token("ratio", 1.0), "ratio_max": max(u["ratio_max"] for u in updates),
            "num_tokens": sum(u["tokens"] for u in updates)}


def main(argv=None) -> dict:
    cfg = parse_args(argv)
    if cfg.dry_run:  # one report under torchrun, after checking the model folder and data files exist
        return dry_run(cfg, budget.report)
    with failures_in_one_line(cfg):  # out of memory, a full disk, a dead rank: one line naming what is kept
        return _run(cfg, argv)


def _run(cfg: Config, argv) -> dict:
    t_start = time.time()
    started = start(cfg, argv, sft)  # infra/run.py: data, the policy (SFT first for a toy run), its reference
    if isinstance(started, dict):    # --resume of a run that had finished: its summary, nothing to do
        return started
    model, ref, opt, ctx, dtype, sft_seconds = started
    track = tracker.Tracker(cfg)  # --tracker: the run's settings as the tracked run's config (off by default)
    with Run(cfg, model, opt, ctx.device) as run:
        held_out_before(run, model, ctx, track)  # once per run (a resumed run has it in its checkpoint)
        for step in range(run.start, cfg.rl_steps):
            t0, cpu0 = time.time(), time.process_time()
            try:
                log, rolls = rl_step(model, ref, opt, ctx, step, step_prompts(ctx, step))
            except BadStep as e:
                log, rolls = {"step": step, "bad_reward": str(e)}, []
            if ctx.text_sampler is not None:  # --kv_cache/--threshold: Fast-dLLM rollouts' statistics, all ranks
                log.update(ctx.text_sampler.take_log(ctx.device))
            times = {"seconds": time.time() - t0, "cpu_s": time.process_time() - cpu0, **_SECONDS}
            _SECONDS.clear()  # the next step's phases count from zero
            run.record(step, log, times, rolls, ctx.tok, ctx.ids, track)  # log.jsonl, times.jsonl, the tracker
        if nothing_trained := all_skipped(run):  # every step skipped (a scorer down): no model, no "after"
            raise TrainingStopped(nothing_trained)
    summary, after = held_out_after_and_save(run, model, ctx, track, dtype, sft_seconds)
    outdir.closing_summary(run, time.time() - t_start)
    check_measured(run, after)  # a number the run should report is missing: the exit status says so
    return summary


def held_out_before(run, model, ctx, track) -> None:
    """The held-out rewards before RL (and the toy image grid), unless a resumed run measured them already."""
    if run.state["before"] is None:
        with outdir.before_rl(run):  # a signal stops it after the current batch
            stop = outdir.Stop(run.signal, ctx.device, eval_batches(ctx), "held-out evaluation before RL")
            run.state["before_by_prompt"] = {}
            run.state["before"] = evaluate_all(model, ctx, run.state["before_by_prompt"], stop)
            run.state["grid_before"] = image_snapshot(model, ctx)
    outdir.print_held_out("before RL", run.state["before"])
    track.held_out("before", run.state["before"])


def held_out_after_and_save(run, model, ctx, track, dtype, sft_seconds: float) -> tuple[dict, dict]:
    """The held-out rewards after RL, then final/, summary.json and the pictures: (summary, rewards after RL)."""
    after_by_prompt = {}
    with outdir.final(run) as stop:  # the last step is checkpointed first; a signal stops after a batch
        stop.counting(eval_batches(ctx), "held-out evaluation after RL")
        after = evaluate_all(model, ctx, after_by_prompt, stop)
        grid_after = image_snapshot(model, ctx)
        stop.saving()
        summary = run.finish(after, after_by_prompt, grid_after, ctx.tok, dtype, sft_seconds)
    outdir.print_held_out("after RL", after, summary)
    track.held_out("after", after)
    track.finish(run.out)  # the pictures, then the tracked run is closed
    return summary, after


if __name__ == "__main__":
    with scale.process_exit(), cli.user_errors(failures=(TrainingStopped, RunFailed)):
        main()
