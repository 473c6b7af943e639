"""MaskGRPO training: masked-diffusion SFT, then RL with the MaskGRPO importance estimator.

    python train.py --preset toy                       # laptop CPU: SFT + RL on toy text and image tasks
    python train.py --preset toy --estimator=d1        # any Config field can be overridden: --field=value

Stage 1 (SFT) trains the toy model from scratch with the masked-diffusion loss (LLaDA / MDLM: mask each
completion token with probability t ~ U(0, 1), cross-entropy on the masked tokens weighted by 1/t). It is
cached in out_dir/sft, so a second run goes straight to RL. Stage 2 (RL) is MaskGRPO (arXiv:2510.02880):

    1. rollouts        G completions per prompt: LLaDA block sampler (text), emerge sampler + CFG (image)
    2. rewards         rewards.py / tasks.py verifiers, one float in [0, 1] per completion
    3. advantages      grpo.group_advantages: (R - mean) / (std + eps) within each group
    4. masks           importance.build_masks: mu masked versions of every completion (AR-like reversing
                       for text, random for images, truncated ratio schedule, seeds from (seed, step, index))
    5. old/ref logp    importance.token_logprobs under no_grad, on those same masked inputs
    6. mu updates      inner iteration j re-scores mask j with the current policy and takes one optimizer step
                       on grpo.policy_loss (clipped surrogate + beta * k3 KL to the SFT reference)

Everything is written to out_dir: log.jsonl (one line per RL step), summary.json (held-out mean reward
before/after RL per task), final/ (the RL model in the Hugging Face LLaDA layout, with tokenizer.json).
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

import grpo
import importance
import sample
import tasks
from model import ModelConfig, Transformer, load_tokenizer

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
    d_model: int = 128                # scratch model dims
    n_layers: int = 4
    n_heads: int = 4
    mlp_hidden_size: int = 384
    # toy tasks
    tasks: str = "text,image"         # RL tasks, comma separated: text, image
    text_max_steps: int = 1           # arithmetic steps per word problem (1 or 2)
    text_noise: float = 0.4           # fraction of SFT text targets with the box off by one (tasks.py)
    image_noise: float = 0.4          # fraction of SFT images with one colour drawn as its look-alike
    image_width: int = 4              # toy images are image_width x image_width grids of palette codes
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
    device_batch_size: int = 0        # sequences per forward pass in log-prob passes (0 = all at once)
    # evaluation / logging
    eval_prompts: int = 256           # held-out prompts per task, scored before and after RL
    eval_samples: int = 4             # sampled completions per held-out prompt (one sample is too noisy)
    sample_every: int = 20            # print a decoded rollout every N RL steps (0 = never)


PRESETS: dict[str, dict] = {
    # 2-core laptop CPU: SFT from scratch, then RL on both toy tasks; held-out reward rises (README).
    "toy": {},
    # seconds-long smoke run of the whole pipeline (tests, CI).
    "smoke": {"sft_steps": 30, "gen_length": 12, "block_length": 12, "steps": 12, "image_steps": 4, "rl_steps": 2, "prompts_per_step": 2, "group_size": 4, "eval_prompts": 8, "eval_samples": 1,
              "d_model": 32, "n_layers": 2, "mlp_hidden_size": 64, "num_iterations": 2, "sample_every": 1},
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
    bad = [t for t in cfg.tasks.split(",") if t not in ("text", "image")]
    need(not bad and cfg.tasks, f"tasks ({cfg.tasks!r}) must be a comma-separated subset of text,image")
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
    """Pick device and compute dtype once, and say why."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(cfg.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device ({cfg.device!r}) asks for CUDA, but torch sees no GPU; use --device=cpu")
    if cfg.dtype == "auto":
        # bf16 on GPUs that support it (the released LLaDA weights are bf16); float32 on CPU, where bf16
        # matmuls are slow and the toy model is small.
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        dtype = torch.bfloat16 if bf16 else torch.float32
    else:
        dtype = getattr(torch, cfg.dtype)
    print(f"device {device}, dtype {str(dtype).removeprefix('torch.')}, torch threads {torch.get_num_threads()}")
    return device, dtype


def derive_seed(*parts) -> int:
    """A stable 63-bit seed from (run seed, purpose, step, ...): same on every device and world size."""
    h = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & (2**63 - 1)


def generator(device, *parts) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(derive_seed(*parts))


# -----------------------------------------------------------------------------------------------------
# data: toy examples -> token tensors


@dataclass
class Batch:
    """A batch of sequences laid out as [prompt (P) | window (N) | suffix (S)]. The window is what the
    model generates: the text completion, or the image slots between <|soi|> and <|eoi|>."""
    task: str
    x: torch.Tensor                 # (B, L) token ids; the window holds targets (SFT) or rollouts (RL)
    attention_mask: torch.Tensor    # (B, L) 1 = real token, 0 = left padding
    prompt_len: int                 # P
    window: int                     # N
    uncond: torch.Tensor | None = None       # (B, L) unconditional prompt for CFG (image)
    uncond_mask: torch.Tensor | None = None  # (B, L)
    examples: list | None = None

    @property
    def prompt_mask(self):          # (B, P) real prompt tokens (never masked by the MaskGRPO estimator)
        return self.attention_mask[:, : self.prompt_len].bool()

    @property
    def window_slice(self):
        return slice(self.prompt_len, self.prompt_len + self.window)


def make_batch(task: str, examples: list, tok, sp, cfg: Config, device, with_targets: bool) -> Batch:
    """Token tensors for `examples`; the window holds the target (SFT) or mask ids (rollout prompts)."""
    if task == "text":
        pairs = [tasks.encode_text(tok, ex, cfg.gen_length) for ex in examples]
        P = max(len(p) for p, _ in pairs)
        rows, att = [], []
        for p, c in pairs:
            pad = P - len(p)
            window = c if with_targets else [sp.mask] * cfg.gen_length
            rows.append([sp.pad] * pad + p + window)  # LLaDA left-pads prompts with EOS
            att.append([0] * pad + [1] * (len(p) + cfg.gen_length))
        x = torch.tensor(rows, device=device)
        return Batch(task, x, torch.tensor(att, device=device), P, cfg.gen_length, examples=examples)
    n = cfg.image_width ** 2
    enc = [tasks.encode_image_prompt(tok, ex["prompt"], image_text_len(tok), n) for ex in examples]
    unc = tasks.encode_image_prompt(tok, "", image_text_len(tok), n)
    x = torch.tensor([e[0] for e in enc], device=device)
    att = torch.tensor([e[2] for e in enc], device=device)
    start = enc[0][1]
    if with_targets:
        x[:, start:start + n] = torch.tensor([ex["image"] for ex in examples], device=device) + sp.image_token_offset
    B = len(examples)
    uncond = torch.tensor(unc[0], device=device).expand(B, -1).clone()
    uncond_mask = torch.tensor(unc[2], device=device).expand(B, -1).clone()
    return Batch(task, x, att, start, n, uncond, uncond_mask, examples)


def make_example(task: str, rng: random.Random, cfg: Config, split: str, noise: float = 0.0) -> dict:
    if task == "text":
        return tasks.make_text_example(rng, split=split, noise=noise, max_steps=cfg.text_max_steps)
    return tasks.make_image_example(rng, split=split, noise=noise, width=cfg.image_width)


_TEXT_LEN: dict = {}


def image_text_len(tok) -> int:
    """Caption part of every t2i prompt, padded to the longest toy caption (computed once)."""
    if "n" not in _TEXT_LEN:
        _TEXT_LEN["n"] = tasks.image_text_len(tok)
    return _TEXT_LEN["n"]


def vocab_slice(task: str, sp):
    """Image positions are scored over the image-code columns only (MMaDA / method.md §2.6)."""
    return (sp.image_token_offset, sp.image_token_offset + sp.codebook_size) if task == "image" else None


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
# rollouts, rewards, evaluation


@torch.no_grad()
def rollout(model, b: Batch, sp, cfg: Config, gen: torch.Generator, temperature: float, fast: bool = False) -> Batch:
    """Fill the window of every row with the policy's sample (a new Batch; prompts unchanged). fast: use
    cfg.kv_cache / cfg.threshold for text (RL rollouts only; evaluation always uses the exact sampler)."""
    if b.task == "text":
        x = sample.generate(model, b.x[:, : b.prompt_len], gen_length=b.window, block_length=cfg.block_length,
                            steps=cfg.steps, temperature=temperature, mask_id=sp.mask, generator=gen,
                            attention_mask=b.attention_mask[:, : b.prompt_len],
                            kv_cache=None if not fast or cfg.kv_cache == "none" else cfg.kv_cache,
                            threshold=(cfg.threshold or None) if fast else None)
    else:
        x = sample.generate_image(model, b.x, image_start=b.prompt_len, num_tokens=b.window,
                                  steps=cfg.image_steps, sampler=cfg.image_sampler, cfg_scale=cfg.cfg_scale,
                                  uncond_input_ids=b.uncond, generator=gen, attention_mask=b.attention_mask,
                                  uncond_attention_mask=b.uncond_mask, code_offset=sp.image_token_offset,
                                  codebook_size=sp.codebook_size, mask_id=sp.mask)
    return Batch(b.task, x, b.attention_mask, b.prompt_len, b.window, b.uncond, b.uncond_mask, b.examples)


def decode_window(b: Batch, tok, sp) -> list:
    """Completion text (text task) or image codes (image task) per row."""
    w = b.x[:, b.window_slice].tolist()
    if b.task == "text":
        return [tok.decode(row, skip_special_tokens=True) for row in w]
    return [[c - sp.image_token_offset for c in row] for row in w]


def score(b: Batch, tok, sp) -> torch.Tensor:
    """Reward in [0, 1] per row."""
    outs = decode_window(b, tok, sp)
    fn = tasks.text_reward if b.task == "text" else tasks.image_reward
    key = None if b.task == "text" else "spec"
    return torch.tensor([fn(o, ex if key is None else ex[key]) for o, ex in zip(outs, b.examples)])


def evaluate(model, tok, sp, cfg: Config, device, task: str, temperature: float) -> float:
    """Held-out mean reward: eval_samples completions per held-out prompt (one at temperature 0), with
    fixed seeds so that runs are paired."""
    rng = random.Random(derive_seed(cfg.seed, "eval", task))
    exs = [make_example(task, rng, cfg, "test") for _ in range(cfg.eval_prompts)]
    exs = [ex for ex in exs for _ in range(cfg.eval_samples if temperature > 0 else 1)]
    rewards = []
    for i in range(0, len(exs), 64):
        b = make_batch(task, exs[i:i + 64], tok, sp, cfg, device, with_targets=False)
        gen = generator(device, cfg.seed, "eval-sampling", task, i)
        rewards.append(score(rollout(model, b, sp, cfg, gen, temperature), tok, sp))
    return torch.cat(rewards).mean().item()


def show(b: Batch, rewards, tok, sp, n: int = 1) -> None:
    outs = decode_window(b, tok, sp)
    for i in range(n):
        prompt = b.examples[i]["prompt"]
        if b.task == "text":
            print(f"  [text] {prompt!r} -> {outs[i]!r}  reward {rewards[i]:.2f}")
        else:
            print(f"  [image] {prompt!r}  reward {rewards[i]:.2f}")
            print(tasks.render_image(outs[i], int(math.isqrt(len(outs[i])))))


# -----------------------------------------------------------------------------------------------------
# stage 2: MaskGRPO


@dataclass
class Rollout:
    """One task's rollout batch, ready for mu inner updates."""
    batch: Batch
    rewards: torch.Tensor       # (B,)
    adv: torch.Tensor           # (B,)
    inputs: list                # mu x (B, L) masked inputs, one per inner iteration
    loss_masks: torch.Tensor    # (mu, B, L) positions scored in iteration j (masked in that input)
    logp_old: list              # mu x (B, L) float32
    logp_ref: list | None       # mu x (B, L) float32, or None when beta = 0


@torch.no_grad()
def collect(model, ref, task: str, tok, sp, cfg: Config, device, step: int) -> Rollout:
    """Steps 1-5 of the loop for one task: rollouts, rewards, advantages, masks, old/ref log-probs."""
    rng = random.Random(derive_seed(cfg.seed, "rl-prompts", task, step))
    prompts = [make_example(task, rng, cfg, "train") for _ in range(cfg.prompts_per_step)]
    exs = [ex for ex in prompts for _ in range(cfg.group_size)]        # each prompt G times, consecutively
    model.eval()  # old log-probs without dropout (method.md §9 item 19); our model has none anyway
    b = make_batch(task, exs, tok, sp, cfg, device, with_targets=False)
    b = rollout(model, b, sp, cfg, generator(device, cfg.seed, "rollout", task, step), cfg.temperature,
                fast=True)
    rewards = score(b, tok, sp)                                                        # (B,)
    adv = grpo.group_advantages(rewards, group_size=cfg.group_size).to(device)         # (B,)

    B, L = b.x.shape
    # Sequence index (prompt index * G + member) feeds the mask seeds: each sequence's masks depend on
    # (seed, task, step, index) only, not on which process or batch slot scores it.
    seq_index = list(range(B))
    in_masks, loss_masks = importance.build_masks(
        b.prompt_mask, torch.ones(B, b.window, dtype=torch.bool, device=device),
        seed=derive_seed(cfg.seed, "masks", task), step=step, seq_index=seq_index,
        num_iterations=cfg.num_iterations, gamma=cfg.gamma_text if task == "text" else cfg.gamma_image,
        estimator=cfg.estimator, mode=cfg.text_reversing if task == "text" else "random",
        p_mask_prompt=cfg.p_mask_prompt, suffix_len=L - b.prompt_len - b.window)      # (mu, B, L) each
    inputs = [importance.apply_mask(b.x, in_masks[j], sp.mask) for j in range(cfg.num_iterations)]
    # Log-probs use conditional logits only (no CFG), as the official code does at HEAD (method.md §4.5).
    kw = dict(attention_mask=b.attention_mask, vocab_slice=vocab_slice(task, sp),
              device_batch_size=cfg.device_batch_size or None)
    logp_old = [importance.token_logprobs(model, inputs[j], b.x, loss_masks[j], **kw) for j in range(len(inputs))]
    logp_ref = None
    if cfg.beta > 0:
        logp_ref = [importance.token_logprobs(ref, inputs[j], b.x, loss_masks[j], **kw) for j in range(len(inputs))]
    return Rollout(b, rewards, adv, inputs, loss_masks, logp_old, logp_ref)


def policy_backward(model, r: Rollout, j: int, cfg: Config, sp) -> dict:
    """Step 6 for one task and inner iteration j: re-score mask j with the current policy, backpropagate
    the GRPO loss. Rows go through in chunks of device_batch_size; each chunk's loss is weighted by its
    share of the normaliser, so the gradient equals that of one full-batch pass."""
    b, mask = r.batch, r.loss_masks[j]                                                   # mask (B, L)
    B = b.x.shape[0]
    chunk = cfg.device_batch_size or B
    if cfg.loss_norm == "token":
        total = mask.sum().clamp(min=1)
    else:
        total = mask.any(-1).sum().clamp(min=1)
    stats_sum: dict = {}
    for s in range(0, B, chunk):
        rows = slice(s, s + chunk)
        logp = importance.token_logprobs(model, r.inputs[j][rows], b.x[rows], mask[rows],
                                         attention_mask=b.attention_mask[rows], vocab_slice=vocab_slice(b.task, sp))
        loss, stats = grpo.policy_loss(logp, r.logp_old[j][rows], r.adv[rows], mask[rows], clip_eps=cfg.clip_eps,
                                       beta=cfg.beta, logp_ref=None if r.logp_ref is None else r.logp_ref[j][rows],
                                       norm=cfg.loss_norm)
        share = (mask[rows].sum() if cfg.loss_norm == "token" else mask[rows].any(-1).sum()) / total
        (loss * share).backward()
        for k, v in stats.items():
            stats_sum[k] = stats_sum.get(k, 0.0) + float(v) * float(share)
        stats_sum["loss"] = stats_sum.get("loss", 0.0) + loss.item() * float(share)
    return stats_sum


def rl_step(model, ref, opt, tok, sp, cfg: Config, device, step: int) -> tuple[dict, list]:
    t0 = time.time()
    rolls = [collect(model, ref, task, tok, sp, cfg, device, step) for task in cfg.tasks.split(",")]
    t_roll = time.time() - t0
    model.train()
    agg: dict = {}
    for j in range(cfg.num_iterations):
        opt.zero_grad(set_to_none=True)
        for r in rolls:
            for k, v in policy_backward(model, r, j, cfg, sp).items():
                agg[f"{r.batch.task}/{k}"] = agg.get(f"{r.batch.task}/{k}", 0.0) + v / cfg.num_iterations
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
    model.eval()
    log = {"step": step}
    for r in rolls:
        t = r.batch.task
        log[f"{t}/reward"] = r.rewards.mean().item()
        log[f"{t}/solved"] = (r.rewards >= 0.999).float().mean().item()
        # Groups whose completions all got the same reward carry no GRPO signal (zero advantage).
        flat = r.rewards.view(-1, cfg.group_size)
        log[f"{t}/zero_adv_groups"] = (flat.max(1).values == flat.min(1).values).float().mean().item()
        log.update({k: v for k, v in agg.items() if k.startswith(t + "/")})
    log["grad_norm"] = float(grad_norm)
    log["rollout_s"] = t_roll
    log["seconds"] = time.time() - t0
    return log, rolls


def log_line(log: dict, total: int) -> str:
    parts = [f"step {log['step'] + 1}/{total}"]
    for t in ("text", "image"):
        if f"{t}/reward" in log:
            parts.append(f"{t} reward {log[f'{t}/reward']:.3f} loss {log[f'{t}/loss']:+.4f} "
                         f"clip {log[f'{t}/clipfrac']:.3f} kl {log[f'{t}/kl']:.4f}")
    parts.append(f"{log['seconds']:.1f}s")
    return " | ".join(parts)


# -----------------------------------------------------------------------------------------------------
# main


SFT_KEYS = ("seed", "d_model", "n_layers", "n_heads", "mlp_hidden_size", "text_noise", "image_noise", "image_width",
            "text_max_steps", "image_loss_weight",
            "sft_steps", "sft_batch_size", "sft_lr", "sft_warmup", "cond_dropout", "gen_length")


def load_or_train_sft(cfg: Config, tok, sp, device, dtype) -> tuple[Transformer, float]:
    """The SFT model, from out_dir/sft when it was trained with the same settings, else trained now."""
    if cfg.init_from != "scratch":
        model = Transformer.from_pretrained(cfg.init_from, device=device, dtype=dtype)
        load_tokenizer(cfg.init_from, model.config)
        return model, 0.0
    sft_dir = Path(cfg.sft_dir or Path(cfg.out_dir) / "sft")
    # tasks.py's source is part of the key: a change to the toy data invalidates the cached model.
    tasks_hash = hashlib.sha1(Path(tasks.__file__).read_bytes()).hexdigest()
    meta = {k: getattr(cfg, k) for k in SFT_KEYS} | {"tasks_sha1": tasks_hash}
    meta_file = sft_dir / "sft_meta.json"
    if meta_file.is_file() and json.loads(meta_file.read_text()) == meta:
        print(f"loading cached SFT model from {sft_dir} (delete it to retrain)")
        model = Transformer.from_pretrained(sft_dir, device=device, dtype=dtype)
        return model, json.loads((sft_dir / "sft_seconds.json").read_text())["seconds"]
    mc = ModelConfig(d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads, n_kv_heads=cfg.n_heads,
                     mlp_hidden_size=cfg.mlp_hidden_size, **tasks.model_config_overrides(tok))
    model = Transformer(mc).init_weights(generator("cpu", cfg.seed, "init")).to(device=device, dtype=dtype)
    print(f"SFT from scratch: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
          f"{cfg.sft_steps} steps")
    seconds = sft(model, tok, sp, cfg, device)
    model.save_pretrained(sft_dir)
    tok.save(str(sft_dir / "tokenizer.json"))
    (sft_dir / "sft_seconds.json").write_text(json.dumps({"seconds": seconds}))
    meta_file.write_text(json.dumps(meta, indent=2))  # written last: its presence means "complete"
    return model, seconds


def evaluate_all(model, tok, sp, cfg: Config, device) -> dict:
    res = {}
    for task in cfg.tasks.split(","):
        res[task] = evaluate(model, tok, sp, cfg, device, task, cfg.temperature)
        if task == "text":
            res["text_greedy"] = evaluate(model, tok, sp, cfg, device, task, 0.0)
    return res


def main(argv=None) -> dict:
    cfg = parse_args(argv)
    device, dtype = setup(cfg)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")
    print("\n".join(f"  {k} = {v}" for k, v in sorted(asdict(cfg).items())))

    tok = tasks.build_tokenizer()
    sp = tasks.specials(tok)
    model, sft_seconds = load_or_train_sft(cfg, tok, sp, device, dtype)
    ref = None
    if cfg.beta > 0:  # the reference policy is the SFT model, frozen
        ref = copy.deepcopy(model).eval().requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=cfg.weight_decay)
    n_tasks = len(cfg.tasks.split(","))
    print(f"RL: {cfg.rl_steps} rollout steps x {cfg.prompts_per_step} prompts x G={cfg.group_size} per task "
          f"({n_tasks} task(s)), {cfg.num_iterations} optimizer steps per rollout batch")

    before = evaluate_all(model, tok, sp, cfg, device)
    print("held-out mean reward before RL: " + ", ".join(f"{k} {v:.3f}" for k, v in before.items()))
    t_rl = time.time()
    with open(out / "log.jsonl", "w") as logf:
        for step in range(cfg.rl_steps):
            log, rolls = rl_step(model, ref, opt, tok, sp, cfg, device, step)
            print(log_line(log, cfg.rl_steps))
            logf.write(json.dumps(log) + "\n")
            logf.flush()
            if cfg.sample_every and (step + 1) % cfg.sample_every == 0:
                for r in rolls:
                    show(r.batch, r.rewards, tok, sp)
    rl_seconds = time.time() - t_rl
    after = evaluate_all(model, tok, sp, cfg, device)
    print("held-out mean reward after RL:  " + ", ".join(f"{k} {v:.3f}" for k, v in after.items()))

    model.save_pretrained(out / "final")
    tok.save(str(out / "final" / "tokenizer.json"))
    summary = {k: {"before": before[k], "after": after[k]} for k in before}
    summary["seconds"] = {"sft": sft_seconds, "rl": rl_seconds}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {out / 'final'} and {out / 'summary.json'}")
    return summary


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError) as e:  # user errors: one clear line, no traceback
        sys.exit(f"error: {e}")
