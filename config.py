"""The settings of a run: Config, one flag per field (`python train.py --help` prints each field's comment),
and the presets, each the values it changes from the defaults. train.py parses them (train.parse_args);
evaluate.py and the diagnosis read the same names. Where each preset's values come from: docs/differences.md.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Config:
    # io / system
    out_dir: str = "out/toy"          # everything this run writes goes here
    seed: int = 0                     # every random draw derives from (seed, purpose, step, index): infra/rng.py
    device: str = "auto"              # auto | cpu | cuda | cuda:N
    dtype: str = "auto"               # auto (float32 on CPU, bfloat16 on CUDA) | float32 | bfloat16
    threads: int = 0                  # torch CPU threads (0 = torch's default)
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
    image_scorer_url: str = ""        # geneval rewards: POST to this scorer (infra/scorer.py)
    reward_shaping: str = "none"      # benchmark rewards: none (correct 0/1) | official (format + correctness)
    text_max_steps: int = 1           # arithmetic steps per toy word problem (1 to 4)
    text_reward: str = "answer"       # toy text verifier: answer (the last \\boxed{}) | solution (every step and the box)
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
    # text rollouts (LLaDA low-confidence block sampler)
    gen_length: int = 12              # completion tokens N per text rollout (official: 256)
    block_length: int = 12            # semi-autoregressive block size; divides gen_length (official: 16)
    steps: int = 12                   # denoising steps per text rollout: a multiple of the blocks, <= gen_length
    temperature: float = 1.0          # rollout temperature (official default 0.9)
    kv_cache: str = "none"            # none (exact) | prefix | dual: Fast-dLLM block KV cache for text rollouts
    threshold: float = 0.0            # > 0: also commit every masked token more confident than this (Fast-dLLM)
    # image rollouts
    image_sampler: str = "emerge"     # emerge (MaskGRPO) | maskgit (MMaDA default, baseline)
    image_steps: int = 12             # image denoising steps (paper Alg. 4: 12)
    cfg_scale: float = 0.0            # image guidance weight w: (1 + w) cond - w uncond
    # importance estimator (importance.views)
    estimator: str = "maskgrpo"       # maskgrpo | d1 | unigrpo (baselines) | trajectory (exact decoding path)
    text_reversing: str = "arlike"    # maskgrpo's text masks: arlike (paper Alg. 1) | random | arlike_official
    gamma_text: float = 0.6           # maskgrpo: text mask ratios live in (gamma, 1) (paper: 0.6)
    gamma_image: float = 0.8          # maskgrpo: image mask ratios live in (gamma, 1) (paper: 0.8)
    num_iterations: int = 4           # mu: inner updates per rollout batch (paper: 12)
    p_mask_prompt: float = 0.15       # d1: prompt-token masking probability
    trajectory_states: int = 0        # trajectory: K decoding states per update, weighted T/K (0 = every state)
    # GRPO
    rl_steps: int = 80                # rollout batches; each gives num_iterations optimizer steps
    prompts_per_step: int = 8         # prompts per rollout batch and task
    group_size: int = 8               # G completions per prompt
    clip_eps: float = 0.2             # PPO clip range epsilon of the ratio, > 0 (paper: 0.2)
    beta: float = 0.01                # k3 KL coefficient against the reference (0 skips the reference pass)
    loss_norm: str = "token"          # token (official code) | sequence (paper's 1/|o_i|)
    adv_std: str = "auto"             # divide advantages by the group std: on | off | auto (off for d1, as d1)
    lr: float = 1e-4                  # RL learning rate (AdamW, constant; official: 3e-6)
    weight_decay: float = 0.0         # AdamW weight decay in RL (official: 0.1)
    grad_clip: float = 1.0            # gradient-norm clip per optimizer step (official: 0.2)
    device_batch_size: int = 0        # sequences per forward pass in rollouts and log-prob passes (0 = all)
    # evaluation / logging
    eval_prompts: int = 256           # held-out prompts per task, scored before and after RL
    eval_samples: int = 4             # sampled completions per held-out prompt
    sample_every: int = 20            # print a decoded rollout every N RL steps (0 = never)
    # checkpoints and failures (infra/checkpoint.py)
    checkpoint_every: int = 10        # rollout batches between checkpoints in out_dir/checkpoints (0 = never)
    keep_last: int = 2                # complete checkpoints kept (0 = all)
    resume: bool = False              # continue from the latest complete checkpoint in out_dir
    extend: bool = False              # with --resume and a larger --rl_steps: train a finished run further
    max_bad_steps: int = 3            # stop after this many consecutive steps with non-finite loss/grad/reward
    dry_run: bool = False             # print parameters, memory per GPU and FLOPs per step; no weights, no run
    dry_run_gpus: int = 8             # world size assumed by --dry_run


# Presets: the settings each one changes from the defaults above. Where each value comes from (the official
# scripts, the measurements behind the toy ones) is docs/differences.md "Presets"; tests/test_presets.py pins them.
_8B = {"init_from": "", "d_model": 4096, "n_layers": 32, "n_heads": 32, "mlp_hidden_size": 12288, "beta": 0.01,
       "clip_eps": 0.2, "lr": 3e-6, "weight_decay": 0.1, "grad_clip": 0.2, "lora_rank": 128, "lora_alpha": 64.0,
       "lora_dropout": 0.05, "lora_targets": "official", "activation_checkpointing": True, "eval_samples": 1,
       "sample_every": 50, "reward_shaping": "official"}
_LLADA = {**_8B, "tasks": "gsm8k", "vocab_size": 126464, "gen_length": 256, "steps": 128, "temperature": 0.9,
          "group_size": 6, "prompts_per_step": 16, "num_iterations": 12, "device_batch_size": 6, "eval_prompts": 256,
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
              "n_layers": 2, "mlp_hidden_size": 64, "num_iterations": 2, "sample_every": 1, "checkpoint_every": 0},
    "llada8b": {**_LLADA, "block_length": 16, "gamma_text": 0.6, "device_batch_size": 12},
    "mmada8b": {**_MMADA, "cfg_scale": 3.0, "prompts_per_step": 4, "num_iterations": 6, "gamma_image": 0.6,
                "clip_eps": 0.2, "rl_steps": 1334, "checkpoint_every": 84, "dry_run_gpus": 4},
    "mmada8b_server": {**_MMADA, "cfg_scale": 3.5, "prompts_per_step": 8, "num_iterations": 12,
                       "gamma_image": 0.8, "clip_eps": 0.001, "rl_steps": 667, "checkpoint_every": 42},
    "d1_official": {**_LLADA, "block_length": 32, "estimator": "d1", "beta": 0.04, "clip_eps": 0.5,
                    "max_prompt_len": 200},
}
