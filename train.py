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
before and after RL, the gain's standard error paired by prompt), final/ (Hugging Face LLaDA layout,
tokenizer.json, generation.json), checkpoints/ (--resume continues), curves.png, images.png. The
bookkeeping (logs, checkpoints, resume, signals, start-up checks) is infra/run.py; torchrun and FSDP2 are
infra/scale.py. Every random draw is seeded by (seed, step, global sequence index), so the world size does
not change the result (LoRA dropout aside: its masks span a rank's rows).
"""
from __future__ import annotations

import contextlib
import math
import random
import signal
import time
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

import grpo
import importance
import rewards
import sample
from importance import derive_seed, generator
from infra import budget, checkpoint, claims, cli, fast_sample, lora, phases, scale
from infra.data import load_data
from infra.run import (BadStep, Clock, Run, StepStats, TrainingStopped, load_policy, report_truncation, setup,
                       startup_checks, validate)
from infra.scale import print0
from infra.scorer import RemoteScorer
from model import TokenIds
from tasks import (GRID_PROMPTS, IMAGE_TASKS, Batch, decode_window, draw_prompts, eval_examples, make_batch, make_example,
                   sft_tasks, task_list, vocab_slice)

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
    sft_dir: str = ""                 # where the SFT model is cached ("" = out_dir/sft); runs with the same SFT
                                      # settings may share it: one trains it, held (SFT_DIR.run.pid) till saved
    retrain_sft: bool = False         # replace an SFT model in sft_dir trained with other settings (otherwise
                                      # refused: runs sharing one sft_dir would overwrite each other's)
    d_model: int = 128                # scratch model dims (and --dry_run's, when init_from has no config.json)
    n_layers: int = 4                 # transformer blocks (LLaDA-8B: 32)
    n_heads: int = 4                  # attention heads; d_model must divide by it (LLaDA-8B: 32)
    mlp_hidden_size: int = 384        # SwiGLU hidden width (LLaDA-8B: 12288)
    vocab_size: int = 0               # --dry_run only: embedding rows (0 = the toy tokenizer's)
    lora_rank: int = 0                # > 0: train LoRA adapters only (lora.py); the reference is adapters-off
    lora_alpha: float = 64.0          # LoRA scale alpha / rank on the adapter output (official: 64)
    lora_dropout: float = 0.0         # dropout on the LoRA input, in [0, 1) (official: 0.05)
    lora_targets: str = "all"         # LoRA'd block projections: all (the seven) | official (q/k/v/up, what the
                                      # official run's Llama-named list matched; infra/lora.TARGET_SETS)
    attend_padding: str = "auto"      # on: attention sees the [iPAD]/EOS padding, as the official MMaDA/LLaDA
                                      # modelling does (it drops the attention bias) | off: pad keys are masked |
                                      # auto: on for geneval (MMaDA checkpoints), off for text and toy images
    activation_checkpointing: bool = False  # recompute each block in backward (needed at 8B)
    # tasks and data
    tasks: str = "text,image"         # RL tasks, comma separated: toy text, image; or gsm8k, math, mbpp,
                                      # countdown, sudoku (text) and geneval (image) with --train_data
    train_data: str = ""              # task=path[,task=path]: local files in their public format (data.py)
    eval_data: str = ""               # task=path[,...]: held-out sets scored before and after RL
    max_prompt_len: int = 256         # real text prompts keep their last max_prompt_len tokens
    prompt_prefill: str = ""          # text that opens the assistant turn of benchmark prompts (official
                                      # GSM8K/MATH evaluation: "<reasoning>")
    system_prompt: str = ""           # a system turn before benchmark prompts' user turn ("" = none);
                                      # docs/differences.md describes the official runs' instruction
    image_text_len: int = 0           # t2i text part, left-padded with [iPAD] (0 = longest toy caption; MMaDA 257)
    image_scorer_url: str = ""        # geneval rewards: POST to this scorer (scorer.RemoteScorer)
    reward_shaping: str = "none"      # none (correctness, 0/1) | official: GSM8K/MATH format + correctness terms
                                      # of the official runs, divided by their maximum (rewards.SHAPED)
    text_max_steps: int = 1           # arithmetic steps per word problem (1 or 2)
    text_reward: str = "answer"       # toy text verifier: answer (the last \boxed{}) | solution (the whole
                                      # written-out solution: every step and the box; tasks.solution_reward)
    text_noise: float = 0.4           # fraction of SFT text targets boxing the amount before the last step (tasks.py)
    image_noise: float = 0.4          # fraction of SFT images with one colour drawn as its look-alike
    image_width: int = 4              # images are image_width x image_width tokens (MMaDA 512 px: 32)
    # stage 1: masked-diffusion SFT
    sft_steps: int = 600              # optimizer steps of the toy SFT stage (0 with --init_from)
    sft_batch_size: int = 64          # sequences per SFT step and task
    sft_lr: float = 2e-3              # SFT peak learning rate (AdamW), after warm-up, cosine-decayed to 10%
    sft_warmup: int = 50              # SFT linear warm-up steps
    image_loss_weight: float = 3.0    # images stall beside text at weight 1 (measured, tasks.py calibration)
    cond_dropout: float = 0.1         # caption dropped for CFG (MMaDA trains with 0.1)
    # text rollouts (LLaDA low-confidence block sampler)
    gen_length: int = 12              # completion tokens N per text rollout (official: 256)
    block_length: int = 12            # semi-autoregressive block size; divides gen_length (official: 16)
    steps: int = 12                   # denoising steps per text rollout, a multiple of the number of blocks
                                      # and at most gen_length (official: 128)
    temperature: float = 1.0          # rollout temperature (official default 0.9)
    kv_cache: str = "none"            # none (exact) | prefix | dual: Fast-dLLM block KV cache for text rollouts
    threshold: float = 0.0            # > 0: also commit every masked token more confident than this (Fast-dLLM)
    # image rollouts
    image_sampler: str = "emerge"     # emerge (MaskGRPO) | maskgit (MMaDA default, baseline)
    image_steps: int = 12             # MaskGRPO rollouts use 12 emerge steps (paper Alg. 4)
    cfg_scale: float = 0.0            # guidance weight w; (1 + w) cond - w uncond
    # importance estimator
    estimator: str = "maskgrpo"       # maskgrpo | d1 | unigrpo (baselines for ablation) | trajectory (the exact
                                      # decoding-path log-ratio the others approximate: one forward per step)
    text_reversing: str = "arlike"    # arlike (paper Alg. 1) | random | arlike_official (the released runs' masks:
                                      # the ramp also spans the prompt, docs/differences.md)
    gamma_text: float = 0.6           # truncation: mask ratios live in (gamma, 1) (paper: 0.6 text)
    gamma_image: float = 0.8          # (paper: 0.8 image)
    num_iterations: int = 4           # mu: inner updates per rollout batch, one mask ratio each (paper: 12)
    p_mask_prompt: float = 0.15       # d1 only: prompt-token masking probability
    trajectory_states: int = 0        # trajectory only: K decoding states per update, drawn per sequence and
                                      # weighted T/K (unbiased, importance.draw_states); 0 = every state
    # GRPO
    rl_steps: int = 80                # rollout batches; each gives num_iterations optimizer steps, so a run
                                      # takes rl_steps * num_iterations optimizer steps (--dry_run prints both).
                                      # Toy: 80, because at 50 the text training reward was still rising over
                                      # its last 10 steps on seeds 0-2 (image flattens after ~20) and held-out
                                      # text gains sat at +0.10 to +0.13, too close to the toy's +0.10 bar
    prompts_per_step: int = 8         # per task
    group_size: int = 8               # G completions per prompt
    clip_eps: float = 0.2             # PPO clip range epsilon of the ratio, > 0 (paper: 0.2)
    beta: float = 0.01                # k3 KL coefficient against the SFT reference (0 skips the ref pass)
    loss_norm: str = "token"          # token (official code) | sequence (paper's 1/|o_i|)
    adv_std: str = "auto"             # divide advantages by the group std: on | off | auto (off for d1, as
                                      # d1's trainer: A = r - mean; on otherwise, as MaskGRPO's)
    lr: float = 1e-4                  # RL learning rate (AdamW, constant; official: 3e-6)
    weight_decay: float = 0.0         # AdamW weight decay in RL (official: 0.1)
    grad_clip: float = 1.0            # gradient-norm clip per optimizer step (official: 0.2)
    device_batch_size: int = 0        # sequences per forward pass in rollouts and log-prob passes (0 = all)
    # evaluation / logging
    eval_prompts: int = 256           # held-out prompts per task, scored before and after RL
    eval_samples: int = 4             # sampled completions per held-out prompt (one sample is too noisy)
    sample_every: int = 20            # print a decoded rollout every N RL steps (0 = never)
    # checkpoints and failures (checkpoint.py)
    checkpoint_every: int = 10        # rollout batches between checkpoints in out_dir/checkpoints (0 = never)
    keep_last: int = 2                # complete checkpoints kept (0 = all)
    resume: bool = False              # continue from the latest complete checkpoint in out_dir
    extend: bool = False              # with --resume and a larger --rl_steps: train a finished run further,
                                      # replacing its final/ and summary.json (otherwise refused)
    max_bad_steps: int = 3            # stop after this many consecutive steps with non-finite loss/grad/reward
    dry_run: bool = False             # print parameters, memory per GPU and FLOPs per step; no weights, no run
    dry_run_gpus: int = 8             # world size assumed by --dry_run


# Shared by the 8B presets: the official MaskGRPO configuration (the paper's Appendix settings, and its
# released configs/rl.yaml): LLaDA-8B shape, beta 0.01, eps 0.2, lr 3e-6, AdamW weight decay 0.1, grad clip
# 0.2, LoRA r 128 / alpha 64 / dropout 0.05. LoRA on the "official" targets (q/k/v/up), the layers the released
# runs trained, since these presets reproduce them; --lora_targets=all adapts all seven. The official
# max_steps 8000 and save_steps 500 count optimizer steps; here a rollout batch gives num_iterations of them,
# so the presets below divide by mu. tests/test_presets.py pins every value to its source.
_8B = {"init_from": "", "d_model": 4096, "n_layers": 32, "n_heads": 32, "mlp_hidden_size": 12288, "beta": 0.01,
       "clip_eps": 0.2, "lr": 3e-6, "weight_decay": 0.1, "grad_clip": 0.2, "lora_rank": 128, "lora_alpha": 64.0,
       "lora_dropout": 0.05, "lora_targets": "official", "activation_checkpointing": True, "eval_samples": 1,
       "sample_every": 50, "reward_shaping": "official"}
# MMaDA-8B text-to-image: emerge rollouts of 12 steps (the trainer's default), 1024 image tokens (32 x 32)
# after a 257-token text part, rewards from a remote scorer, attention over the [iPAD] padding (auto).
_MMADA = {**_8B, "tasks": "geneval", "vocab_size": 134656, "image_width": 32, "image_text_len": 257,
          "image_steps": 12, "group_size": 9, "device_batch_size": 9, "eval_prompts": 64}

PRESETS: dict[str, dict] = {
    # 2-core laptop CPU: SFT from scratch, then RL on both toy tasks; held-out reward rises (README).
    "toy": {},
    # Text only, with long completions: 3-4 written-out steps (21 or 27 tokens) decoded as 32 tokens in 4
    # blocks of 8, one token per step, so that decode order and the reversing operators have room to matter.
    # Measured (docs/results.md): 2,400 SFT steps left some seeds unable to do the working; the box-only
    # reward pays wrong working (15% of one SFT model's greedy answers); lr 1e-4 damaged a competent model
    # (greedy 0.98 -> 0.85); 8 prompts per step moved one by +0.043, 16 by +0.073. Hence 4,800 SFT steps, the
    # whole-solution reward, lr 3e-5, 16 prompts x G = 8 per step for 40 steps, and 512 held-out prompts (4
    # samples each). Seeds 0-2: SFT 0.80 held-out, RL +0.078 to +0.098, each over 10 paired standard errors.
    "toy_long": {"tasks": "text", "text_max_steps": 4, "text_noise": 0.2, "text_reward": "solution",
                 "gen_length": 32, "block_length": 8, "steps": 32, "sft_steps": 4800, "rl_steps": 40,
                 "prompts_per_step": 16, "lr": 3e-5, "eval_prompts": 512},
    # seconds-long smoke run of the whole pipeline (tests, CI).
    "smoke": {"sft_steps": 30, "gen_length": 12, "block_length": 12, "steps": 12, "image_steps": 4, "rl_steps": 2,
              "prompts_per_step": 2, "group_size": 4, "eval_prompts": 8, "eval_samples": 1, "d_model": 32,
              "n_layers": 2, "mlp_hidden_size": 64, "num_iterations": 2, "sample_every": 1, "checkpoint_every": 0},
    # LLaDA-8B-Instruct text RL (official t2t script): G 6, 16 prompts per step, mu 12, gamma 0.6, 256 tokens
    # in blocks of 16 with 128 steps at temperature 0.9; 667 x 12 = 8,004 optimizer steps (official 8,000),
    # a checkpoint every 42 x 12 = 504 (official 500). Give --init_from=DIR and --train_data=gsm8k=FILE.
    # Reversing is the paper's AR-like operator; --text_reversing=arlike_official gives the released run's masks.
    "llada8b": {**_8B, "tasks": "gsm8k", "vocab_size": 126464, "gen_length": 256, "block_length": 16, "steps": 128,
                "temperature": 0.9, "group_size": 6, "prompts_per_step": 16, "num_iterations": 12, "gamma_text": 0.6,
                "device_batch_size": 12, "eval_prompts": 256, "rl_steps": 667, "checkpoint_every": 42},
    # MMaDA-8B text-to-image RL, exactly scripts/train/t2i_grpo_train.sh (with configs/rl.yaml): G 9, mu 6,
    # gamma 0.6, CFG 3.0, eps 0.2. Its 6 GPUs x 3 completions x gradient accumulation 2 = 36 completions, i.e.
    # 4 prompts of 9, per optimizer step; here 4 prompts run on 1, 2 or 4 GPUs (a group stays on one rank).
    # 1334 x 6 = 8,004 optimizer steps, a checkpoint every 84 x 6 = 504.
    "mmada8b": {**_MMADA, "cfg_scale": 3.0, "prompts_per_step": 4, "num_iterations": 6, "gamma_image": 0.6,
                "clip_eps": 0.2, "rl_steps": 1334, "checkpoint_every": 84, "dry_run_gpus": 4},
    # The other image script, scripts/train/t2i_grpo_train_w_server.sh: G 9, gamma 0.8 (the paper's image
    # value), CFG 3.5, eps 0.001; 6 GPUs x 3 x accumulation 4 = 72 completions = 8 prompts per optimizer step.
    # It leaves NUM_ITER unset, so `--num_iterations` receives no value and the parser stops; with the flag
    # dropped, configs/rl.yaml's num_iterations 12 applies (MaskGRPOConfig's own default, 1, would crash the
    # MaskGRPO path), so mu 12 here. 667 x 12 = 8,004 optimizer steps, a checkpoint every 42 x 12 = 504.
    "mmada8b_server": {**_MMADA, "cfg_scale": 3.5, "prompts_per_step": 8, "num_iterations": 12,
                       "gamma_image": 0.8, "clip_eps": 0.001, "rl_steps": 667, "checkpoint_every": 42},
    # d1's own diffu-GRPO run (dllm-reasoning/d1, diffu-grpo/slurm_scripts/train.yaml and gsm_base.sbatch) on
    # the llada8b settings it shares: beta 0.04, eps 0.5, blocks of 32, prompts cut to 200 tokens, G 6, 16
    # prompts, mu 12. `--preset llada8b --estimator=d1` is the estimator ablation (MaskGRPO's beta, eps, blocks).
    "d1_official": {**_8B, "tasks": "gsm8k", "vocab_size": 126464, "gen_length": 256, "block_length": 32,
                    "steps": 128, "temperature": 0.9, "group_size": 6, "prompts_per_step": 16, "num_iterations": 12,
                    "device_batch_size": 6, "eval_prompts": 256, "rl_steps": 667, "checkpoint_every": 42,
                    "estimator": "d1", "beta": 0.04, "clip_eps": 0.5, "max_prompt_len": 200},
}


def parse_args(argv=None) -> Config:
    """Dataclass defaults, then PRESETS[--preset], then the flags; checked once, here (infra/run.validate)."""
    cfg = cli.parse(Config, argv, description=__doc__.split("\n")[0], presets=PRESETS)
    validate(cfg)
    return cfg


# -----------------------------------------------------------------------------------------------------
# stage 1: masked-diffusion SFT


def diffusion_loss(model, b: Batch, ids, gen: torch.Generator, eps: float = 1e-3) -> torch.Tensor:
    """The masked-diffusion negative ELBO (MDLM, LLaDA; docs/method.md §1): t ~ U(eps, 1) per sequence,
    each completion token masked with probability t, cross-entropy on the masked tokens weighted by 1/t,
    normalised by the completion length (LLaDA's SFT loss: the prompt is never masked)."""
    B, L = b.x.shape
    t = torch.rand(B, 1, generator=gen) * (1 - eps) + eps                              # (B, 1)
    region = torch.zeros(B, L, dtype=torch.bool)
    region[:, b.window_slice] = True
    masked = (torch.rand(B, L, generator=gen) < t) & region                            # (B, L)
    masked, t = masked.to(b.x.device), t.to(b.x.device)
    logits = model(b.x.masked_fill(masked, ids.mask), b.attention_mask)                # (B, L, V)
    # Image positions predict image codes only, so the softmax runs over the codebook columns.
    lo, hi = vocab_slice(b.task, ids) or (0, logits.shape[-1])
    ce = F.cross_entropy(logits[masked][:, lo:hi].float(), b.x[masked] - lo, reduction="none")  # (T,)
    return (ce / t.expand(B, L)[masked]).sum() / (B * b.window)


def sft(model, tok, ids, cfg: Config, device) -> float:
    """Train the toy model from scratch on noisy toy data (tasks.py) of the run's toy tasks; returns the
    seconds spent. SIGINT or SIGTERM finishes the current step and exits with 128 + signal: SFT keeps no
    checkpoint (it takes minutes on a laptop, not hours), so the next run restarts it, and sft_dir is left
    as it was (infra/phases.py: every phase's stop)."""
    t0 = time.time()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, betas=(0.9, 0.95), weight_decay=0.0)
    # Linear warm-up, then cosine decay to 10%: a fixed learning rate plateaus early at this size.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.sft_warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, cfg.sft_steps))))))
    rng = random.Random(derive_seed(cfg.seed, "sft-data"))
    gen = generator("cpu", cfg.seed, "sft-mask")
    model.train()
    loss_sum = 0.0
    with checkpoint.graceful_stop("finishing this SFT step, then stopping (SFT keeps no checkpoint)") as stop:
        bar = cli.progress_bar(range(cfg.sft_steps), desc="sft", dynamic_ncols=True)
        for step in bar:
            if stop["signal"]:
                print0(f"SFT stopped by {signal.Signals(stop['signal']).name} after {step} of {cfg.sft_steps} "
                       "steps; SFT keeps no checkpoint, so the next run restarts SFT from step 0 (nothing was "
                       f"written to the sft_dir); start it again with: {phases.resume_command()}")
                raise SystemExit(128 + stop["signal"])
            loss_sum = 0.0
            for task in sft_tasks(cfg):
                noise = cfg.text_noise if task == "text" else cfg.image_noise
                exs = [make_example(task, rng, cfg, "train", noise) for _ in range(cfg.sft_batch_size)]
                b = make_batch(task, exs, tok, ids, cfg, device, with_targets=True)
                if task == "image":
                    # Caption dropout: the unconditional prompt teaches the model p(image), which CFG needs.
                    drop = torch.rand(len(exs), generator=gen) < cfg.cond_dropout
                    b.x[drop, : b.prompt_len] = b.uncond[drop, : b.prompt_len]
                    b.attention_mask[drop] = b.uncond_mask[drop]
                loss = diffusion_loss(model, b, ids, gen)
                (loss * (cfg.image_loss_weight if task == "image" else 1.0)).backward()
                loss_sum += loss.item()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            bar.set_postfix(loss=f"{loss_sum:.3f}")
            if bar.disable and (step + 1) % max(1, cfg.sft_steps // 10) == 0 and step + 1 < cfg.sft_steps:
                print0(f"sft step {step + 1}/{cfg.sft_steps}: loss {loss_sum:.3f}, {time.time() - t0:.0f}s")
    # The bar is silent in a log file: a line every tenth of the steps above, and one for the end.
    print0(f"SFT: {cfg.sft_steps} steps in {time.time() - t0:.0f}s, last loss {loss_sum:.3f}")
    model.eval()
    return time.time() - t0


# -----------------------------------------------------------------------------------------------------
# stage 2: MaskGRPO


@dataclass
class Ctx:
    """What every function of the loop needs besides the model: the settings, the tokenizer and its
    special ids, the device, the benchmark data and the optional remote image scorer."""
    cfg: Config
    tok: object                       # tokenizers.Tokenizer
    ids: TokenIds
    device: torch.device
    datasets: dict                    # {task: {"train": rows, "test": rows}} (infra/data.load_data)
    scorer: object = None             # infra/scorer.RemoteScorer for geneval rewards


@torch.no_grad()
def rollout(model, b: Batch, ctx: Ctx, gens: list, temperature: float, fast: bool = False,
            return_order: bool = False, stats: dict | None = None):
    """Fill the window of every row of b with the policy's sample: a new Batch (prompts unchanged), and the
    decoding order (B, L) when return_order. gens: one generator per row, so a row's sample depends on its
    own seed only. fast: RL rollouts may use cfg.kv_cache / cfg.threshold (infra/fast_sample.py);
    evaluation always uses the exact sampler. stats: fast text rollouts count what they commit into it."""
    cfg, ids = ctx.cfg, ctx.ids
    text_sampler = fast_sample.generate if fast and (cfg.kv_cache != "none" or cfg.threshold) else sample.generate
    xs, orders = [], []
    with scale.full_weights(model):
        for rows in scale.chunks(len(gens), cfg.device_batch_size):   # device_batch_size rows at a time
            c, g = b.rows(rows), gens[rows]
            if c.task not in IMAGE_TASKS:
                kw = dict(kv_cache=cfg.kv_cache, threshold=cfg.threshold, stats=stats) \
                    if text_sampler is not sample.generate else {}
                x = text_sampler(model, c.x[:, : c.prompt_len], gen_length=c.window, block_length=cfg.block_length,
                                 steps=cfg.steps, temperature=temperature, mask_id=ids.mask, generator=g,
                                 attention_mask=c.attention_mask[:, : c.prompt_len], return_order=return_order, **kw)
            else:
                x = sample.generate_image(model, c.x, image_start=c.prompt_len, num_tokens=c.window,
                                          steps=cfg.image_steps, sampler=cfg.image_sampler, cfg_scale=cfg.cfg_scale,
                                          uncond_input_ids=c.uncond, generator=g, attention_mask=c.attention_mask,
                                          uncond_attention_mask=c.uncond_mask, code_offset=ids.image_token_offset,
                                          codebook_size=ids.codebook_size, mask_id=ids.mask, return_order=return_order)
            x, order = x if return_order else (x, None)
            xs.append(x)
            orders.append(order)
    out = replace(b, x=torch.cat(xs))
    return (out, torch.cat(orders)) if return_order else out


def advantages(rewards: torch.Tensor, cfg: Config) -> torch.Tensor:
    """Group-relative advantages (GRPO, arXiv:2402.03300 §4.1.2) of the global rewards, divided by the
    group std or not (d1's trainer: A = r - mean)."""
    std = cfg.adv_std == "on" or (cfg.adv_std == "auto" and cfg.estimator != "d1")
    return grpo.group_advantages(rewards, group_size=cfg.group_size, scale_by_std=std)


@dataclass
class Rollout:
    """One task's rollout batch (this rank's rows), ready for the mu inner updates."""
    batch: Batch
    rewards: torch.Tensor       # (B_global,) every rank's rewards, for advantages and metrics
    adv: torch.Tensor           # (B,) this rank's rows
    inputs: list                # mu x (B, L) masked inputs, one per inner iteration (trajectory: T decoding states)
    loss_masks: torch.Tensor    # (mu or T, B, L) positions scored with each input (the ones masked in it;
                                # trajectory: the ones revealed at that step)
    logp_old: list              # mu or T x (B, L) float32
    logp_ref: list | None       # mu or T x (B, L) float32, or None when beta = 0
    draw: importance.StateDraw | None = None  # --trajectory_states: the views of each update, the normaliser


def rl_step(model, ref, opt, ctx: Ctx, step: int) -> tuple[dict, list]:
    """One MaskGRPO step (paper Alg. 5): steps 1-5 build every task's rollout batch, step 6 takes mu
    optimizer steps on it. ref: the reference model, or None for "this model with its LoRA adapters off".
    Returns the step's log and its rollouts."""
    cfg, device = ctx.cfg, ctx.device
    clock, rolls, fast_log = Clock(), [], {}
    for task in task_list(cfg):
        # Every rank builds the global batch (token ids: cheap) and keeps its own whole groups. A sequence's
        # global index seeds its rollout noise and its masks, so its randomness is the same on any process.
        prompts = draw_prompts(task, cfg, step, ctx.datasets)
        exs = [ex for ex in prompts for _ in range(cfg.group_size)]     # each prompt G times, consecutively
        rows = scale.shard_rows(len(exs))
        seq_index = list(range(len(exs)))[rows]
        model.eval()  # no dropout when sampling and scoring pi_old: the first ratio of an update is then 1
        b = make_batch(task, exs, ctx.tok, ctx.ids, cfg, device, with_targets=False).rows(rows)

        # 1. rollouts: G completions per prompt, one generator per sequence (with the decoding order for the
        # trajectory estimator)
        gens = [generator(device, cfg.seed, "rollout", task, step, i) for i in seq_index]
        trajectory = cfg.estimator == "trajectory"
        fast = {} if (cfg.kv_cache != "none" or cfg.threshold) and task not in IMAGE_TASKS else None
        b, order = rollout(model, b, ctx, gens, cfg.temperature, True, True, fast) if trajectory \
            else (rollout(model, b, ctx, gens, cfg.temperature, True, stats=fast), None)
        fast_log.update(fast_sample.step_summary(task, fast, device))
        clock.lap("rollout_s")

        # 2. rewards, gathered in global order: a group is normalised over all of its members
        shaped = cfg.reward_shaping == "official"
        r = rewards.score(b, ctx.tok, ctx.ids, ctx.scorer, shaped, cfg.text_reward)
        r = scale.all_gather_rows(r.to(device)).cpu()                                      # (B_global,)
        bad = (~torch.isfinite(r) | (r < 0) | (r > 1)).nonzero().flatten().tolist()
        if bad:  # a NaN or out-of-range reward is reported and the step skipped, never averaged in
            raise BadStep(f"{len(bad)} {task} reward(s) not a finite number in [0, 1], first {r[bad[0]].item()} at "
                          f"sequence {bad[0]} (prompt {bad[0] // cfg.group_size}); check the reward function or scorer")
        clock.lap("reward_s")

        # 3. advantages, within each group of G
        adv = advantages(r, cfg)[rows].to(device)                                          # (B,)

        # 4. reversing masks: mask j of every sequence at ratio t_j of the truncated schedule (paper Alg. 5),
        # AR-like reversing for text, random for images (Alg. 1, 2), from seeds shared by the old, reference
        # and current passes; the masked log-likelihoods give the ratios of Eqs. 9-10. The trajectory estimator
        # instead takes the sampler's own states, one per decoding step, each scoring the tokens it revealed.
        B, L = b.x.shape
        image = task in IMAGE_TASKS
        if trajectory:
            in_masks, loss_masks = importance.trajectory_masks(order, cfg.image_steps if image else cfg.steps)
            # Steps in which no rank revealed anything (threshold decoding ends blocks early) are dropped,
            # the same ones on every rank.
            keep = scale.all_max(loss_masks.flatten(1).any(1).to(device, torch.float32)).bool().cpu()
            in_masks, loss_masks = in_masks[keep], loss_masks[keep]                  # (T, B, L) each
            if cfg.trajectory_states:  # K of the T states per update (U = min(mu K, T) views)
                in_masks, loss_masks, draw = importance.subsample_states(
                    in_masks, loss_masks, cfg.trajectory_states, cfg.num_iterations, step=step, seq_index=seq_index,
                    seed=derive_seed(cfg.seed, "trajectory-states", task))          # (U, B, L) each
        else:
            scored = torch.ones(B, b.window, dtype=torch.bool, device=device)
            if cfg.estimator == "d1" and not image:  # d1 scores the completion up to and including its first EOS
                scored = importance.completion_mask_until_eos(b.x[:, b.window_slice], ctx.ids.eos)
            in_masks, loss_masks = importance.build_masks(
                b.prompt_mask, scored,
                seed=derive_seed(cfg.seed, "masks", task), step=step, seq_index=seq_index,
                num_iterations=cfg.num_iterations, gamma=cfg.gamma_image if image else cfg.gamma_text,
                estimator=cfg.estimator, mode="random" if image else cfg.text_reversing,
                p_mask_prompt=cfg.p_mask_prompt, suffix_len=L - b.prompt_len - b.window)  # (mu, B, L) each
        inputs = [importance.apply_mask(b.x, m, ctx.ids.mask) for m in in_masks]

        # 5. old and reference log-probs on the same masked inputs; conditional logits only (no CFG). Under
        # FSDP2 the weights are gathered once for all of these forwards, not once per forward.
        kw = dict(attention_mask=b.attention_mask, vocab_slice=vocab_slice(task, ctx.ids),
                  device_batch_size=cfg.device_batch_size or None)
        with torch.no_grad(), scale.full_weights(model):
            logp_old = [importance.token_logprobs(model, x_j, b.x, m_j, **kw) for x_j, m_j in zip(inputs, loss_masks)]
        logp_ref = None
        if cfg.beta > 0:
            reference = model if ref is None else ref
            with torch.no_grad(), scale.full_weights(reference), \
                    lora.adapters_disabled(model) if ref is None else contextlib.nullcontext():
                logp_ref = [importance.token_logprobs(reference, x_j, b.x, m_j, **kw)
                            for x_j, m_j in zip(inputs, loss_masks)]
        clock.lap("logprob_s")
        rolls.append(Rollout(b, r, adv, inputs, loss_masks, logp_old, logp_ref,
                             draw if trajectory and cfg.trajectory_states else None))

    # 6. mu inner updates: iteration j re-scores mask j with the current policy and takes one optimizer step
    # on the clipped GRPO objective with the k3 KL to the reference (paper Eq. 11, clipped per token)
    model.train()
    stats, skipped = StepStats(cfg.num_iterations), 0
    for j in range(cfg.num_iterations):
        # LoRA dropout is the only draw from the global RNG (activation checkpointing replays it), seeded
        # per (step, j, rank) so that a resumed run draws the same masks.
        torch.manual_seed(derive_seed(cfg.seed, "dropout", step, j, scale.rank()))
        opt.zero_grad(set_to_none=True)
        for ro in rolls:
            # The input and loss masks this update scores: mask j, or for the trajectory estimator every
            # decoding step's state (--trajectory_states: K of them, weighted T/K through the normaliser).
            # Each chunk's loss is weighted by its share of the normaliser over all ranks' rows and views,
            # so the gradient is that of one full-batch pass in one process.
            b = ro.batch
            views = ro.draw.updates[j] if ro.draw else range(len(ro.inputs)) if cfg.estimator == "trajectory" else [j]
            count = (lambda m: m.sum()) if cfg.loss_norm == "token" else (lambda m: m.any(-1).sum())
            total = scale.all_sum(ro.draw.norm if ro.draw else sum(count(ro.loss_masks[v]) for v in views).float())
            total = total.clamp(min=1)
            for v in views:
                mask = ro.loss_masks[v]                                                    # (B, L)
                for rows in scale.chunks(b.x.shape[0], cfg.device_batch_size):
                    logp = importance.token_logprobs(model, ro.inputs[v][rows], b.x[rows], mask[rows],
                                                     attention_mask=b.attention_mask[rows],
                                                     vocab_slice=vocab_slice(b.task, ctx.ids))
                    loss, s = grpo.policy_loss(logp, ro.logp_old[v][rows], ro.adv[rows], mask[rows],
                                               clip_eps=cfg.clip_eps, beta=cfg.beta, norm=cfg.loss_norm,
                                               logp_ref=None if ro.logp_ref is None else ro.logp_ref[v][rows])
                    share = count(mask[rows]).float() / total
                    scale.backward_sum(loss * share)
                    stats.add(b.task, s, float(share), loss.item())
        losses = stats.end_update(device)
        # The optimizer's own parameters: under FSDP2 the module may expose gathered copies between passes.
        grad_norm = scale.clip_grad_norm([p for g in opt.param_groups for p in g["params"]], cfg.grad_clip)
        # Losses and the norm are the same on every rank, so every rank takes the same decision.
        if not (math.isfinite(grad_norm) and all(map(math.isfinite, losses))):
            print0(f"warning: step {step} update {j}: non-finite loss {losses} or gradient norm {grad_norm}; "
                   "update skipped")
            opt.zero_grad(set_to_none=True)
            skipped += 1
            continue
        opt.step()
    model.eval()
    clock.lap("update_s")

    log = {"step": step, "skipped_updates": skipped}
    for ro in rolls:
        t, flat = ro.batch.task, ro.rewards.view(-1, cfg.group_size)
        log[f"{t}/reward"] = ro.rewards.mean().item()
        log[f"{t}/solved"] = (ro.rewards >= 0.999).float().mean().item()
        # Groups whose completions all got the same reward carry no GRPO signal (zero advantage).
        log[f"{t}/zero_adv_groups"] = (flat.max(1).values == flat.min(1).values).float().mean().item()
        log.update(stats.mean(t))
        log[f"{t}/adv_abs_mean"] = advantages(ro.rewards, cfg).abs().mean().item()
    log["grad_norm"] = grad_norm
    log.update(fast_log)  # committed tokens per step and their confidence, with --threshold / --kv_cache only
    log.update(clock.laps())  # phase times; Run.record moves them to times.jsonl
    return log, rolls


# -----------------------------------------------------------------------------------------------------
# held-out evaluation (before and after RL; evaluate.py)


def evaluate(model, ctx: Ctx, task: str, temperature: float, records: list | None = None, progress=None,
             prompt_means: list | None = None, stop=None) -> float | None:
    """Held-out mean reward: eval_samples completions per held-out prompt (one at temperature 0), each
    from a generator seeded by its index, so that runs are paired and the world size changes nothing.
    Ranks take interleaved rows of every 64-example batch. records: if given, one dict per scored row of
    this rank is appended (index, prompt, output, reward); prompt_means: if given, receives each held-out
    prompt's mean reward, gathered over ranks (for the paired standard error of a gain); progress(n) is
    called after each batch of n rows (evaluate.py's bar); stop() before each batch, on every rank (it
    raises to end a run on a signal: infra/phases.py). None when the task has no held-out set."""
    cfg, device = ctx.cfg, ctx.device
    exs = eval_examples(task, cfg, ctx.datasets)
    if not exs:
        return None
    k = cfg.eval_samples if temperature > 0 else 1
    per_prompt = torch.zeros(len(exs), dtype=torch.float64, device=device)  # summed reward of each prompt
    exs = [ex for ex in exs for _ in range(k)]
    total = torch.zeros(2, dtype=torch.float64, device=device)  # (sum of rewards, count)
    # Entered by every rank, also one without rows in some batch (rollout's own is then a no-op).
    with scale.full_weights(model):
        for i in range(0, len(exs), 64):
            if stop is not None:
                stop()
            mine = slice(scale.rank(), None, scale.world())
            b = make_batch(task, exs[i:i + 64], ctx.tok, ctx.ids, cfg, device, with_targets=False).rows(mine)
            idx = list(range(i, min(i + 64, len(exs))))[mine]
            if not idx:
                continue
            gens = [generator(device, cfg.seed, "eval-sampling", task, temperature, j) for j in idx]
            b = rollout(model, b, ctx, gens, temperature)
            r = rewards.score(b, ctx.tok, ctx.ids, ctx.scorer, text_reward=cfg.text_reward)
            total += torch.tensor([r.sum().item(), len(r)], dtype=torch.float64, device=device)
            per_prompt.index_add_(0, torch.tensor([j // k for j in idx], device=device), r.to(device, torch.float64))
            if progress is not None:
                progress(len(idx))
            if records is not None:
                outs = decode_window(b, ctx.tok, ctx.ids)
                records.extend({"index": j, "prompt": ex["prompt"], "output": o, "reward": float(v)}
                               for j, ex, o, v in zip(idx, b.examples, outs, r.tolist()))
    total = scale.all_sum(total)
    if prompt_means is not None:
        prompt_means.extend((scale.all_sum(per_prompt) / k).tolist())
    return (total[0] / total[1]).item()


def evaluate_all(model, ctx: Ctx, prompt_means: dict | None = None, stop=None) -> dict:
    """Held-out mean reward per task (sampled), and greedy for text tasks; tasks without held-out data
    are left out. prompt_means: if given, receives the per-prompt means of each, under the same keys;
    stop: as evaluate's."""
    res = {}
    for task in task_list(ctx.cfg):
        for key, temperature in ((task, ctx.cfg.temperature), (f"{task}_greedy", 0.0)):
            if key != task and task in IMAGE_TASKS:  # images have no greedy decoding
                continue
            means = []
            r = evaluate(model, ctx, task, temperature, prompt_means=means, stop=stop)
            if r is None:
                break
            res[key] = r
            if prompt_means is not None:
                prompt_means[key] = means
    return res


def image_snapshot(model, ctx: Ctx) -> list | None:
    """Toy images for the first GRID_PROMPTS held-out prompts, each from its own fixed generator, so the
    before and after pictures differ only by the policy. None without the toy image task."""
    if "image" not in task_list(ctx.cfg):
        return None
    exs = eval_examples("image", ctx.cfg, {})[:GRID_PROMPTS]
    if not exs:
        return None
    b = make_batch("image", exs, ctx.tok, ctx.ids, ctx.cfg, ctx.device, with_targets=False)
    gens = [generator(ctx.device, ctx.cfg.seed, "grid", i) for i in range(len(exs))]
    return decode_window(rollout(model, b, ctx, gens, ctx.cfg.temperature), ctx.tok, ctx.ids)


# -----------------------------------------------------------------------------------------------------
# main


def main(argv=None) -> dict:
    cfg = parse_args(argv)
    if cfg.dry_run:  # one report under torchrun, after checking the model folder and data files exist
        return claims.dry_run(cfg, budget.dry_run)
    phases.remember_command(argv)   # for the messages that name the command continuing this run
    finished = claims.check_resume(cfg)  # --resume: a run to continue, or a finished one (nothing to do)
    if finished is not None:
        return finished
    device, dtype = setup(cfg)
    datasets = load_data(cfg)       # malformed data fails here, before any model is loaded
    with claims.sft_dir_claimed(cfg):  # a folder, writable, and this run's alone until its SFT model is saved
        startup_checks(cfg, device)     # out_dir, disk room, sequence lengths, resume compatibility
        scorer = RemoteScorer(cfg.image_scorer_url) if cfg.image_scorer_url else None
        model, ref, tok, ids, sft_seconds = load_policy(cfg, device, dtype, sft)
    ctx = Ctx(cfg, tok, ids, device, datasets, scorer)
    report_truncation(cfg, tok, datasets)  # --max_prompt_len cuts long prompts from the left: say how many
    opt = torch.optim.AdamW(lora.trainable_parameters(model), lr=cfg.lr, betas=(0.9, 0.99),
                            weight_decay=cfg.weight_decay)
    print0(f"RL: {cfg.rl_steps} rollout batches x {cfg.num_iterations} optimizer steps, {cfg.prompts_per_step} "
           f"prompts x G={cfg.group_size} per task ({', '.join(task_list(cfg))}), {scale.world()} process(es); "
           f"steps count from 0, as in log.jsonl")
    with Run(cfg, model, opt, device) as run:
        if run.state["before"] is None:
            with phases.before_rl(run):  # a signal stops it after the current batch
                stop = phases.Stop(run.signal, device)
                run.state["before_by_prompt"] = {}
                run.state["before"] = evaluate_all(model, ctx, run.state["before_by_prompt"], stop)
                run.state["grid_before"] = image_snapshot(model, ctx)
        if run.state["before"]:
            print0("held-out mean reward before RL: " + ", ".join(f"{k} {v:.3f}" for k, v in run.state["before"].items()))
        else:
            print0("no held-out set, so no mean reward before and after RL: pass --eval_data=TASK=PATH "
                   "(and --eval_prompts > 0)")
        for step in range(run.start, cfg.rl_steps):
            try:
                log, rolls = rl_step(model, ref, opt, ctx, step)
            except BadStep as e:
                log, rolls = {"step": step, "bad_reward": str(e)}, []
            run.record(step, log, rolls, tok, ids)
    after_by_prompt = {}
    with phases.final(run) as stop:  # the last step is checkpointed first; a signal stops after a batch
        after = evaluate_all(model, ctx, after_by_prompt, stop)
        grid_after = image_snapshot(model, ctx)
        stop.saving()
        summary = run.finish(after, after_by_prompt, grid_after, tok, dtype, sft_seconds)
    if after:
        print0("held-out mean reward after RL:  " + ", ".join(
            f"{k} {v:.3f}" + (f" ({v - summary[k]['before']:+.3f} ± {summary[k]['gain_se']:.3f})"
                              if "gain_se" in summary[k] else "") for k, v in after.items()))
    return summary


if __name__ == "__main__":
    # User errors: one line naming the value, the file and the fix, exit status 2 (infra/cli.py). A run that
    # stopped on bad steps is not the user's typo: one line too, exit status 1.
    with scale.process_exit(), cli.user_errors():  # process_exit leaves the process group on every path
        try:
            main()
        except TrainingStopped as e:
            raise SystemExit(f"error: {e}") from None
