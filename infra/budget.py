"""The dry-run budget: parameters, FLOPs per RL step and for the whole run, a wall-time and GPU-hour
estimate, and memory per GPU, without loading any weights (infra/dryrun.py prints them); the launcher's kill
delay and the start-up disk check.

    python train.py --preset llada8b --dry_run

Every figure here is an estimate from the model shape and the config, written so that it can be checked
by hand (tests/test_budget.py holds the hand derivation for LLaDA-8B).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from dataclasses import replace
from pathlib import Path

import torch

import tasks

from tasks import IMAGE_TASKS, task_list
from model import ModelConfig, Transformer, num_params
from sample import MIN_HEAD_ROWS
from infra import hf, toy
from infra.scale import print0

GB = 1024 ** 3
# The GPU the time estimate is stated for, its dense bf16 peak (NVIDIA's A100 datasheet: 312 TFLOP/s
# without sparsity), and the fraction of it assumed to be achieved. The MFU is an assumption, not a
# measurement: this code has not run on a GPU. Large-batch bf16 transformer training commonly reaches
# 35-50% on A100s; rollouts here are full-sequence forwards of 6-12 sequences per GPU, so the low end.
GPU_NAME = "A100-80GB SXM"
GPU_PEAK_FLOPS = 312e12
H100_PEAK_FLOPS = 989e12  # H100 SXM (and H200) dense bf16, NVIDIA's datasheet
# Dense bf16 peaks by the name torch.cuda.get_device_name gives (tests/first_gpu.py times a step against it).
GPU_PEAKS = {"A100": GPU_PEAK_FLOPS, "H100": H100_PEAK_FLOPS, "H200": H100_PEAK_FLOPS}
ASSUMED_MFU = 0.35
# The GPUs whose memory the dry run states the headroom for, in GiB (2^30 bytes, the unit of every memory
# figure here): the totals nvidia-smi lists for an H100 SXM "80 GB" (81,559 MiB) and an H200 "141 GB"
# (143,771 MiB), before the CUDA context. tests/first_gpu.py prints the card's own total.
GPU_MEMORY_GB = {"H100": 79.6, "H200": 140.4}


def gpu_kind(device_name: str) -> str | None:
    """"H100" for "NVIDIA H100 80GB HBM3" and so on: the GPU_PEAKS key a device name holds, or None."""
    return next((k for k in GPU_PEAKS if k in device_name.upper()), None)


# -----------------------------------------------------------------------------------------------------
# shape


def shape(mc: ModelConfig, lora_rank: int, lora_targets: str = "all") -> dict:
    """Parameter counts from a meta-device model (no memory): total, embedding, head, one block's matrices,
    and LoRA's adapters (rank r on every projection of lora.TARGET_SETS[lora_targets]: r * (in + out) each)."""
    from infra.lora import TARGET_SETS
    targets = TARGET_SETS[lora_targets]

    with torch.device("meta"):
        model = Transformer(mc)
    block = model.blocks[0]
    linears = [m for m in block.modules() if isinstance(m, torch.nn.Linear)]
    return {"params": num_params(model), "embedding": model.wte.weight.numel(), "head": model.ff_out.weight.numel(),
            "block_params": num_params(block), "block_matmul": sum(m.weight.numel() for m in linears),
            "lora_params": lora_rank * mc.n_layers * sum(m.in_features + m.out_features for name, m in
                                                         block.named_children() if name in targets)}


# -----------------------------------------------------------------------------------------------------
# FLOPs


def flops(mc: ModelConfig, s: dict, *, seqs: int, seq_len: int, prompt_len: int, rollout: str, steps: int,
          block_length: int, cfg_scale: float, mu: int, beta: float, lora: bool,
          activation_checkpointing: bool, window: int, trajectory: bool = False, trajectory_states: int = 0) -> dict:
    """Global FLOPs of one RL step (one rollout batch: every task's prompts_per_step * group_size
    sequences, all ranks together), by phase. A multiply-add is 2 FLOPs.

    Per token of a forward pass: 2 per weight of every block matrix (and adapter), plus attention,
    4 * keys * d_model per layer (QK^T and the weighted sum of V); the embedding is a lookup. The head
    (2 per weight) runs only at the positions the code computes it at, not at every token:
    - rollouts: `steps` denoising passes over the whole sequence, the head over the current block of
      block_length positions ("exact", LLaDA's sampler without a KV cache: an upper bound, the first
      masked position of the block on) or over the `window` image slots ("image", MMaDA's sampler); with
      CFG (images only: text rollouts take no guidance) each pass runs the unconditional rows too.
      "prefix"/"dual" (Fast-dLLM caches): one full pass per block, then only the tokens from the block on
      (prefix) or the block itself (dual), attending to all keys, the head over the block. Threshold
      decoding can end a block early: these are upper bounds then.
    - scoring: the old policy's log-probabilities for each of the mu masks, and the reference's when
      beta > 0 (LoRA: the same model with adapters off), one forward each, the head over the `window`
      (importance.token_logprobs: the columns holding a scored position, the completion or the image).
    - updates: mu optimizer steps over all sequences: a forward, the backward (full fine-tuning: input
      and weight gradients, 2x the forward; LoRA: input gradients of the frozen matrices, 1x, plus the
      adapters' both), the head's over the window, and with activation checkpointing the blocks' forward
      once more.
    - trajectory: the exact-path estimator scores the state of every decoding step instead of mu masks,
      so scoring takes `steps` forwards per sequence, and each of the mu updates `steps` forward-backwards;
      with trajectory_states = K > 0 each update takes K (at most `steps`) and scoring min(mu K, steps).
    per_rollout_seq: the FLOPs of one rollout sequence (its CFG rows included)."""
    d, nl = mc.d_model, mc.n_layers
    body, head = nl * s["block_matmul"], s["head"]
    adapters = s["lora_params"] if lora else 0
    image = rollout == "image"

    def fwd(tokens, keys, head_tokens):  # FLOPs of a forward over `tokens` query positions
        return tokens * (2 * (body + adapters) + 4 * keys * d * nl) + head_tokens * 2 * head

    cfg_rows = 2 if image and cfg_scale > 0 else 1
    if rollout in ("exact", "image"):
        per_seq = steps * fwd(seq_len, seq_len, window if image else block_length)
    else:  # Fast-dLLM block caches
        blocks = (seq_len - prompt_len) // block_length
        spb = steps // blocks
        per_seq = 0
        for b in range(blocks):
            start = prompt_len + b * block_length
            q = seq_len - start if rollout == "prefix" else block_length
            per_seq += fwd(seq_len, seq_len, block_length) + (spb - 1) * fwd(q, seq_len, block_length)
    roll = seqs * cfg_rows * per_seq
    per_update = min(trajectory_states or steps, steps) if trajectory else 1  # inputs of one update
    views = min(mu * per_update, steps) if trajectory else mu  # scored, old and ref
    # Head positions of a scored input: the window. A trajectory state of a text rollout scores only the
    # tokens one step revealed, within its block, so the head runs over fewer columns: an upper bound there.
    scored = window
    score = seqs * views * (1 + (beta > 0)) * fwd(seq_len, seq_len, scored)
    attn = 4 * seq_len * d * nl
    if lora:  # input gradients through frozen matrices (2 per weight), adapters' input and weight gradients
        bwd = seq_len * (2 * body + 4 * adapters + 2 * attn) + scored * 2 * head
    else:
        bwd = seq_len * (4 * body + 2 * attn) + scored * 4 * head
    recompute = seq_len * (2 * (body + adapters) + attn) if activation_checkpointing else 0
    update = seqs * mu * per_update * (fwd(seq_len, seq_len, scored) + bwd + recompute)
    return {"rollout": roll, "scoring": score, "update": update, "step": roll + score + update,
            "per_rollout_seq": cfg_rows * per_seq}


# -----------------------------------------------------------------------------------------------------
# memory


def memory(mc: ModelConfig, s: dict, *, world_size: int, chunk: int, seq_len: int, sampled: int, image: bool,
           cfg_scale: float, beta: float, activation_checkpointing: bool, compute_bytes: int = 2,
           codebook: int = 8192, head_len: int | None = None) -> dict:
    """Memory per GPU in GB (2^30 bytes), by component, for one world size. Estimates: the CUDA context,
    allocator fragmentation and NCCL buffers (a few GB) are left out.

    Sharded state (FSDP2 splits it over the ranks): full fine-tuning keeps float32 master weights,
    gradients and AdamW's two moments (16 B/param) and, with beta > 0, a float32 reference copy (4 B);
    LoRA keeps the frozen base in the compute dtype (2 B) and float32 adapters with gradients and moments
    (16 B). One process holds all of it and computes from it directly, so it gathers nothing.
    Gathered (world_size > 1, compute dtype): the root (embedding, final norm, head) stays gathered from
    an update chunk's forward to its backward; blocks are gathered one at a time, two with the next
    one's prefetch; a rollout holds the whole model (scale.full_weights). Each all-gather first fills a
    flat buffer of the whole group, then copies it into the unsharded parameters: for a moment the group
    is there twice, so the largest group (the root at LLaDA's shape) adds one more copy to every phase.
    An update chunk of `chunk` sequences keeps its activations (checkpointing: each block's input,
    d_model values per token and layer, plus one block's full activations while it is recomputed, about
    16 d_model + 3 mlp_hidden values per token; without it every block's) and the head: it runs in float32 at
    the `head_len` positions per sequence (default: all; the scored window), over the vocabulary (text) or
    the codebook's columns (images), so float32 logits and their log-softmax, 8 B per entry, plus a float32
    copy of the head's weight rows it uses (none when the compute dtype is float32) and, in full
    fine-tuning, that copy's gradient during the backward (importance.token_logprobs, model.Transformer.head).
    A rollout forward of `chunk` sequences (twice the rows with CFG) makes bf16 logits over the current
    block (text; at least MIN_HEAD_ROWS rows) or the image slots, the codebook's columns only (images),
    in the compute dtype; the text sampler then draws
    float64 Gumbel noise over the block's columns (the uniforms, the float64 logits and the noisy sum:
    24 B, and a bf16 softmax: 2 B), the image sampler a float64 softmax over the codebook at every image
    position.
    Scoring (the old and reference log-probs, train.rl_step step 5) runs without gradients inside
    scale.full_weights: the whole model gathered, as in a rollout, with a chunk's logits as in an update
    and one block's activations at a time (no_grad_block: nothing is kept for a backward)."""
    c, w = mc, world_size
    n = s["params"]
    per_tok_block = 16 * c.d_model + 3 * c.mlp_hidden_size
    rows = {}
    rows["full_state"] = n * (16 + 4 * (beta > 0)) / w
    rows["lora_state"] = n * compute_bytes / w + s["lora_params"] * 16 / w
    gathered = w > 1
    root = s["embedding"] + s["head"] + c.d_model
    rows["root_gathered"] = root * compute_bytes * gathered
    block = s["block_params"] + s["lora_params"] / c.n_layers
    rows["blocks_gathered"] = 2 * block * compute_bytes * gathered
    rows["allgather_buffer"] = max(root, block) * compute_bytes * gathered
    rows["model_gathered"] = (n + s["lora_params"]) * compute_bytes * gathered
    tokens = chunk * seq_len
    if activation_checkpointing:
        acts = tokens * c.n_layers * c.d_model * compute_bytes + tokens * per_tok_block * compute_bytes
    else:
        acts = tokens * c.n_layers * per_tok_block * compute_bytes
    rows["activations"] = acts
    head_len = seq_len if head_len is None else head_len
    cols = codebook if image else c.vocab_size  # images score the codebook's columns only (vocab_slice)
    head_f32 = cols * c.d_model * 4 * (compute_bytes != 4)  # the float32 copy of the head's rows
    rows["logits"] = chunk * head_len * cols * 8 + head_f32
    cfg_rows = 2 if cfg_scale > 0 else 1
    # The text sampler computes the head only over the current block (sample.py, at least MIN_HEAD_ROWS
    # rows per chunk); the image samplers over the image slots and the codebook's columns only.
    head_rows = chunk * (sampled if image else max(sampled, -(-MIN_HEAD_ROWS // chunk)))
    model_logits = cfg_rows * head_rows * cols * compute_bytes
    if image:
        sampler = chunk * sampled * codebook * 8 * 2  # float64 probabilities and their cumulative sum
    else:
        sampler = chunk * sampled * c.vocab_size * (24 + 2)
    rows["sampling"] = model_logits + sampler
    rows["no_grad_block"] = tokens * per_tok_block * compute_bytes
    update_common = rows["root_gathered"] + rows["blocks_gathered"] + rows["allgather_buffer"] + acts + rows["logits"]
    rollout_common = rows["model_gathered"] + rows["allgather_buffer"] + rows["sampling"]
    scoring_common = rows["model_gathered"] + rows["allgather_buffer"] + rows["no_grad_block"] + rows["logits"]
    for kind in ("full", "lora"):
        # full fine-tuning: the float32 head copy's gradient, before it is cast into the weight's gradient
        rows[f"{kind}_update"] = rows[f"{kind}_state"] + update_common + head_f32 * (kind == "full")
        rows[f"{kind}_rollout"] = rows[f"{kind}_state"] + rollout_common
        rows[f"{kind}_scoring"] = rows[f"{kind}_state"] + scoring_common
        rows[f"{kind}_peak"] = max(rows[f"{kind}_update"], rows[f"{kind}_rollout"], rows[f"{kind}_scoring"])
    out = {k: v / GB for k, v in rows.items()}
    # the short names that the README and tests read
    out.update(weights_gb=n * compute_bytes / w / GB, full_ft_gb=out["full_peak"], lora_gb=out["lora_peak"],
               full_ft_rollout_gb=out["full_rollout"], lora_rollout_gb=out["lora_rollout"],
               activations_gb=out["activations"], logits_gb=out["logits"])
    return out


MEMORY_ROWS = (("full_state", "full fine-tuning state, sharded"), ("lora_state", "LoRA state, sharded"),
               ("root_gathered", "gathered embedding + head (update)"), ("blocks_gathered", "gathered blocks (2)"),
               ("allgather_buffer", "all-gather buffer (largest group)"),
               ("model_gathered", "gathered model (rollout)"), ("activations", "activations per update chunk"),
               ("logits", "logits per update or scoring chunk"), ("sampling", "sampling transients per rollout chunk"),
               ("no_grad_block", "one block's activations per scoring chunk"),
               ("full_update", "full fine-tuning, update peak"), ("full_rollout", "full fine-tuning, rollout peak"),
               ("full_scoring", "full fine-tuning, scoring peak"), ("full_peak", "full fine-tuning, peak"),
               ("lora_update", "LoRA, update peak"), ("lora_rollout", "LoRA, rollout peak"),
               ("lora_scoring", "LoRA, scoring peak"), ("lora_peak", "LoRA, peak"))


# -----------------------------------------------------------------------------------------------------
# the dry run


def scratch_config(cfg, **vocab) -> ModelConfig:
    """The model shape given by the Config's d_model / n_layers / n_heads / mlp_hidden_size fields, with
    the vocabulary fields passed in (the toy tokenizer's, or --vocab_size for --dry_run)."""
    return ModelConfig(d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads, n_kv_heads=cfg.n_heads,
                       mlp_hidden_size=cfg.mlp_hidden_size, **vocab)


def model_config(cfg) -> ModelConfig:
    """The model shape of a train.Config: --init_from's config.json, else the scratch shape."""
    cfg_file = Path(cfg.init_from) / "config.json" if cfg.init_from not in ("", "scratch") else None
    if cfg_file is not None and cfg_file.is_file():
        return hf.config_from_hf(json.loads(cfg_file.read_text()))
    vocab = cfg.vocab_size or tasks.model_config_overrides(toy.build_tokenizer())["vocab_size"]
    return scratch_config(cfg, vocab_size=vocab, mask_token_id=vocab - 1)


def task_shape(cfg, task: str) -> dict:
    """What one RL step processes for one task: whether it is images, the prompt and sequence lengths, the
    rollout kind, the denoising steps, the global number of sequences and the window (completion or image
    slots: the positions scored, and the head's columns in scoring and updates)."""
    if task in IMAGE_TASKS:
        prompt_len = (cfg.image_text_len or 32) + 2
        seq_len, rollout, steps, window = prompt_len + cfg.image_width ** 2, "image", cfg.image_steps, cfg.image_width ** 2
    else:
        prompt_len, steps, window = cfg.max_prompt_len, cfg.steps, cfg.gen_length
        seq_len, rollout = prompt_len + window, "exact" if cfg.kv_cache == "none" else cfg.kv_cache
    return dict(task=task, image=task in IMAGE_TASKS, prompt_len=prompt_len, seq_len=seq_len, rollout=rollout,
                steps=steps, seqs=cfg.prompts_per_step * cfg.group_size, window=window)


def step_shape(cfg) -> dict:
    """The step's tasks (task_shape of each) and what the dry run prints of them: the global number of
    sequences, the longest sequence, the denoising steps and rollout kind of the first task."""
    shapes = [task_shape(cfg, t) for t in task_list(cfg)]
    return dict(names=[p["task"] for p in shapes], tasks=shapes, image=any(p["image"] for p in shapes),
                seq_len=max(p["seq_len"] for p in shapes), rollout="/".join(dict.fromkeys(p["rollout"] for p in shapes)),
                steps="/".join(str(p["steps"]) for p in shapes), seqs=sum(p["seqs"] for p in shapes))


def step_flops(cfg, mc: ModelConfig, s: dict | None = None) -> dict:
    """flops() of one RL step of the Config `cfg` on the model shape mc, summed over its tasks;
    per_rollout_seq by task."""
    s = shape(mc, cfg.lora_rank, cfg.lora_targets) if s is None else s
    total = {"rollout": 0, "scoring": 0, "update": 0, "step": 0, "per_rollout_seq": {}}
    for p in step_shape(cfg)["tasks"]:
        f = flops(mc, s, seqs=p["seqs"], seq_len=p["seq_len"], prompt_len=p["prompt_len"], rollout=p["rollout"],
                  steps=p["steps"], block_length=cfg.block_length, cfg_scale=cfg.cfg_scale, window=p["window"],
                  mu=cfg.mu, beta=cfg.beta, lora=cfg.lora_rank > 0,
                  activation_checkpointing=cfg.activation_checkpointing, trajectory=cfg.estimator == "trajectory",
                  trajectory_states=cfg.trajectory_states)
        total["per_rollout_seq"][p["task"]] = f.pop("per_rollout_seq")
        total.update({k: total[k] + v for k, v in f.items()})
    return total


def eval_flops(cfg, mc: ModelConfig, s: dict) -> tuple[float, int]:
    """(FLOPs, sequences) of ONE held-out evaluation (the run makes two, before and after RL) at
    --eval_prompts per task: heldout.evaluate_all samples eval_samples completions per prompt and, for text,
    one more greedily, always with the exact sampler (no KV cache, no threshold; images with CFG)."""
    exact = step_flops(replace(cfg, kv_cache="none", threshold=0.0), mc, s)["per_rollout_seq"]
    seqs = {t: cfg.eval_prompts * (cfg.eval_samples + (t not in IMAGE_TASKS)) for t in exact}
    return sum(seqs[t] * exact[t] for t in exact), sum(seqs.values())


def padded_prompt_len(cfg) -> tuple[int, str]:
    """The prompt length a text rollout batch is padded to (tasks.make_batch pads to the longest prompt of
    the batch), and where the figure comes from. With --init_from's tokenizer and --train_data at hand:
    measured, the mean over the data's consecutive groups of prompts_per_step prompts of the longest one;
    otherwise --max_prompt_len, the upper bound."""
    from infra import data

    paths = data.data_paths(cfg.train_data, "train_data")
    text = [t for t in task_list(cfg) if t not in IMAGE_TASKS and t in paths]
    folder = Path(cfg.init_from) if cfg.init_from not in ("", "scratch") else None
    if not text or folder is None or not (folder / "tokenizer.json").is_file():
        return cfg.max_prompt_len, "--max_prompt_len, an upper bound; --init_from with --train_data measures it"
    mc = hf.read_config(folder)
    tok = hf.load_tokenizer(folder, mc)
    ids, k, longest = hf.token_ids(tok, mc), cfg.prompts_per_step, []
    for task in text:
        rows = data.load_dataset(task, paths[task])
        longest += [tasks.make_batch(task, rows[i:i + k], tok, ids, cfg, "cpu", with_targets=False).prompt_len
                    for i in range(0, len(rows) - k + 1, k)]
    return round(sum(longest) / len(longest)), f"measured over {len(longest)} batches of {k} {'/'.join(text)} prompts"


# -----------------------------------------------------------------------------------------------------
# the launcher's kill delay

# Seconds a launcher waits between forwarding SIGTERM and SIGKILL when nothing says otherwise: torchrun's
# TORCH_ELASTIC_SHUTDOWN_TIMEOUT default (torch.distributed.launcher) and Slurm's KillWait default.
DEFAULT_KILL_DELAY = 30
# Assumed checkpoint write speed (bytes/s): torch.distributed.checkpoint to a network file system.
CHECKPOINT_WRITE_SPEED = 0.5 * GB


def checkpoint_seconds(cfg, mc: ModelConfig) -> float:
    """Estimated seconds to write one checkpoint of cfg's run (checkpoint_bytes at CHECKPOINT_WRITE_SPEED)."""
    return checkpoint_bytes(cfg, mc) / CHECKPOINT_WRITE_SPEED


# The first torch release whose torchrun reads TORCH_ELASTIC_SHUTDOWN_TIMEOUT (and --shutdown_timeout);
# earlier ones send SIGKILL 30 s after SIGTERM whatever the variable says.
SHUTDOWN_TIMEOUT_TORCH = "2.12"


def torchrun_reads_shutdown_timeout() -> bool:
    """Whether the installed torchrun honours TORCH_ELASTIC_SHUTDOWN_TIMEOUT: its launch configuration
    (torch.distributed.launcher.api.LaunchConfig) has the shutdown_timeout field that reads the variable.
    Read from the installed torch itself, not from its version number; tests/test_cuda.py check 9
    measures it with a worker that ignores SIGTERM."""
    try:
        from torch.distributed.launcher.api import LaunchConfig
    except ImportError:
        return False
    return "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)}


def kill_delay_warning(env: dict, step_seconds: float, checkpoint_seconds: float,
                       reads_variable: bool | None = None) -> str | None:
    """The start-up warning when a SIGTERM would not end in a checkpoint, else None. On SIGTERM the run
    finishes its step and writes a checkpoint (infra/checkpoint.graceful_stop), so it needs step_seconds +
    checkpoint_seconds before the launcher's SIGKILL. env: the process environment. Under torchrun
    (TORCHELASTIC_RUN_ID set) the delay is TORCH_ELASTIC_SHUTDOWN_TIMEOUT, default 30 s, if the installed
    torchrun reads it (reads_variable; default: torchrun_reads_shutdown_timeout()), else 30 s whatever it
    says; under Slurm (SLURM_JOB_ID) the cluster's KillWait, which a process cannot read, so its default,
    30 s, is assumed; both apply to a torchrun inside Slurm. Without a launcher the user's own kill
    decides: None."""
    torchrun, slurm = "TORCHELASTIC_RUN_ID" in env, "SLURM_JOB_ID" in env
    if not (torchrun or slurm):
        return None
    if reads_variable is None:
        reads_variable = torchrun_reads_shutdown_timeout() if torchrun else True
    ignored = torchrun and not reads_variable
    delay = float(env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", DEFAULT_KILL_DELAY)) if torchrun and not ignored \
        else DEFAULT_KILL_DELAY
    if slurm:
        delay = min(delay, DEFAULT_KILL_DELAY)
    need = step_seconds + checkpoint_seconds
    if delay >= need:
        return None
    fix = [] if not torchrun else [
        f"upgrade torch to {SHUTDOWN_TIMEOUT_TORCH} or later (this torchrun, torch {torch.__version__}, ignores "
        f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT), then export TORCH_ELASTIC_SHUTDOWN_TIMEOUT={2 * math.ceil(need)}"
        if ignored else f"export TORCH_ELASTIC_SHUTDOWN_TIMEOUT={2 * math.ceil(need)}"]
    if slurm:
        fix.append(f"ask Slurm for the signal early (sbatch --signal=TERM@{2 * math.ceil(need)}) and check "
                   "KillWait (scontrol show config)")
    who = " and ".join(([f"torchrun's fixed {DEFAULT_KILL_DELAY} s" if ignored else
                         "torchrun's TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] if torchrun else [])
                       + (["Slurm's KillWait (default assumed)"] if slurm else []))
    return (f"warning: a SIGTERM gets SIGKILL {delay:.0f} s later ({who}), but one RL step plus a checkpoint "
            f"takes about {need:.0f} s here (dry-run estimate), so a pre-emption would lose the step and write "
            f"no checkpoint; {'; '.join(fix)} (README: resuming)")


def warn_kill_delay(cfg, world: int, env=None) -> None:
    """Print kill_delay_warning's warning (rank 0) for cfg's run on `world` GPUs at the dry run's speed.
    Returns at once without a launcher, so a plain run computes nothing here."""
    env = os.environ if env is None else env
    if "TORCHELASTIC_RUN_ID" not in env and "SLURM_JOB_ID" not in env:
        return
    mc = model_config(cfg)
    step_s = step_flops(cfg, mc)["step"] / (world * GPU_PEAK_FLOPS * ASSUMED_MFU)
    text = kill_delay_warning(env, step_s, checkpoint_seconds(cfg, mc))
    if text:
        print0(text)


def state_over_memory(cfg, world: int, device_bytes: int) -> str | None:
    """The out-of-memory advice when the sharded training state alone (memory's full_state or lora_state rows:
    weights, gradients, AdamW moments, a float32 reference) exceeds the GPU's memory: then no
    --device_batch_size helps. None when it fits (fewer sequences per forward pass may then help)."""
    mc = model_config(cfg)
    s = shape(mc, cfg.lora_rank, cfg.lora_targets)
    compute = 2 if cfg.dtype != "float32" else 4
    state = (s["params"] * compute + s["lora_params"] * 16 if cfg.lora_rank > 0 else
             s["params"] * (16 + 4 * (cfg.beta > 0))) / world
    if state < device_bytes:
        return None
    mode, lora_too = ("LoRA", "") if cfg.lora_rank > 0 else ("full fine-tuning", " or LoRA (--lora_rank)")
    return (f"the training state alone is {state / GB:.1f} GiB per GPU ({mode} on {world} GPU(s)), over this GPU's "
            f"{device_bytes / GB:.1f} GiB, so fewer sequences per forward pass cannot help: use more GPUs (torchrun "
            f"--nproc_per_node){lora_too}; python train.py --dry_run --dry_run_gpus=N prints the memory per GPU")


# -----------------------------------------------------------------------------------------------------
# disk


def checkpoint_bytes(cfg, mc: ModelConfig) -> int:
    """Bytes of one checkpoint as checkpoint.save writes it: with LoRA the adapters (float32) and their
    AdamW moments (two float32 tensors each); with full fine-tuning every parameter in float32 (the master
    weights train.py keeps) and its two moments. 1 MB more for state.json, step counters and DCP metadata."""
    s = shape(mc, cfg.lora_rank, cfg.lora_targets)
    trained = s["lora_params"] if cfg.lora_rank > 0 else s["params"]
    return trained * 4 * 3 + 2 ** 20


def final_bytes(cfg, mc: ModelConfig) -> int:
    """Bytes of final/ (infra/run.Run.finish): every parameter in the run's dtype (bf16 on a GPU with --dtype=auto,
    float32 on the CPU) and, with LoRA, the float32 adapters beside the merged model."""
    s = shape(mc, cfg.lora_rank, cfg.lora_targets)
    bf16 = cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and torch.cuda.is_available())
    return s["params"] * (2 if bf16 else 4) + (s["lora_params"] * 4 if cfg.lora_rank > 0 else 0)


def checkpoints_on_disk(cfg, present: int = 0) -> int:
    """New checkpoints on disk at once: keep_last complete ones plus the one being written before the oldest
    is deleted, but never more than the run writes (rl_steps // checkpoint_every, and one of the last step or
    on a stop signal; keep_last 0 keeps every one), less the `present` ones a resumed run already has."""
    writes = cfg.rl_steps // max(cfg.checkpoint_every, 1) + 1 if cfg.rl_steps else 0
    at_once = min(cfg.keep_last + 1, writes) if cfg.keep_last else writes
    return max(0, at_once - present)


def _bytes(n: float) -> str:
    """A size in the largest unit that leaves it at least 1 (1.5 MB, not 0.0 GB)."""
    for unit, size in (("GB", GB), ("MB", 2 ** 20), ("KB", 2 ** 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} bytes"


def check_disk(cfg, out: Path, mc, present: int = 0) -> None:
    """Refuse to start when out_dir cannot hold the checkpoints the run will keep during rotation (beside the
    `present` ones of a resumed run, already on that disk) and final/ (written while the last checkpoint is still
    there)."""
    one = checkpoint_bytes(cfg, mc)
    k = checkpoints_on_disk(cfg, present)
    final = final_bytes(cfg, mc)
    size = one * k + final
    free = shutil.disk_usage(out).free
    if free < size:
        what = "LoRA adapters and their AdamW moments" if cfg.lora_rank > 0 else \
            "float32 weights and AdamW moments (full fine-tuning)"
        raise ValueError(f"out_dir {out} has {_bytes(free)} free, but a checkpoint needs about {_bytes(one)} "
                         f"({what}), rotation keeps {k} at once (--keep_last={cfg.keep_last}) and final/ needs "
                         f"{_bytes(final)}: {_bytes(size)}; free space, pick another --out_dir, lower --keep_last, "
                         "use LoRA (--lora_rank) or set --checkpoint_every=0")
