"""The dry run (`python train.py --preset llada8b --dry_run`): parameters, FLOPs, time and memory per GPU by phase,
loading no weights (tests/test_budget.py derives them by hand); start-up checks on them: kill delay, memory, disk."""
import dataclasses
import math
import os
import shutil
from pathlib import Path

import torch

import tasks
from tasks import IMAGE_TASKS, task_list
from model import ModelConfig, Transformer, num_params
from sample import MIN_HEAD_ROWS
from infra import data, hf, toy
from infra.scale import print0

GB = 1024 ** 3
# Dense bf16 peaks (NVIDIA's datasheets, without sparsity). ASSUMED_MFU: large-batch bf16 training reaches 35-50% on
# A100s, and rollouts here are full-sequence forwards of 6-12 sequences per GPU, so the low end.
GPU_PEAKS = {"A100": 312e12, "H100": 989e12, "H200": 989e12}
GPU_NAME, GPU_PEAK_FLOPS = "A100-80GB SXM", GPU_PEAKS["A100"]
ASSUMED_MFU = 0.35
GPU_MEMORY_GB = {"H100": 79.6, "H200": 140.4}  # GiB of an H100 SXM and an H200 by nvidia-smi, before the CUDA context
DEFAULT_KILL_DELAY = 30  # s from SIGTERM to SIGKILL: torchrun's TORCH_ELASTIC_SHUTDOWN_TIMEOUT and Slurm's KillWait
CHECKPOINT_WRITE_SPEED = 0.5 * GB  # bytes/s, assumed: torch.distributed.checkpoint to a network file system
SHUTDOWN_TIMEOUT_TORCH = "2.12"  # the first torch whose torchrun reads TORCH_ELASTIC_SHUTDOWN_TIMEOUT


def shape(mc: ModelConfig, lora_rank: int, lora_targets: str = "all") -> dict:
    """Parameter counts of a meta-device model; LoRA: r * (in + out) per projection of hf.TARGET_SETS[lora_targets]."""
    with torch.device("meta"):
        model = Transformer(mc)
    block = model.blocks[0]
    linears = [m for m in block.modules() if isinstance(m, torch.nn.Linear)]
    adapted = [m for name, m in block.named_children() if name in hf.TARGET_SETS[lora_targets]]
    return {"params": num_params(model), "embedding": model.wte.weight.numel(), "head": model.ff_out.weight.numel(),
            "block_params": num_params(block), "block_matmul": sum(m.weight.numel() for m in linears),
            "lora_params": lora_rank * mc.n_layers * sum(m.in_features + m.out_features for m in adapted)}


def task_shapes(cfg) -> list[dict]:
    """Per task, what one RL step processes; window: the completion or the image slots."""
    out = []
    for task in task_list(cfg):
        image = task in IMAGE_TASKS
        prompt_len = (cfg.image_text_len or 32) + 2 if image else cfg.max_prompt_len
        window = cfg.image_width ** 2 if image else cfg.gen_length
        out.append(dict(task=task, image=image, prompt_len=prompt_len, seq_len=prompt_len + window,
                        rollout="image" if image else "exact" if cfg.kv_cache == "none" else cfg.kv_cache,
                        steps=cfg.image_steps if image else cfg.steps, seqs=cfg.prompts_per_step * cfg.group_size,
                        window=window))
    return out


def flops(cfg, mc: ModelConfig, s: dict) -> dict:
    """Global FLOPs of one RL step by phase, and of one rollout sequence by task (per_rollout_seq). A forward costs
    per token 2 per weight of the block matrices and adapters, 4 * keys * d_model per layer of attention, 2 per
    weight of the head where the code runs it."""
    d, nl, block_length = mc.d_model, mc.n_layers, cfg.block_length
    body, head = nl * s["block_matmul"], s["head"]
    adapters = s["lora_params"] if cfg.lora_rank > 0 else 0
    trajectory = cfg.estimator == "trajectory"

    def fwd(tokens, keys, head_tokens):  # FLOPs of a forward over `tokens` query positions
        return tokens * (2 * (body + adapters) + 4 * keys * d * nl) + head_tokens * 2 * head

    total = {"rollout": 0, "scoring": 0, "update": 0, "step": 0, "per_rollout_seq": {}}
    for p in task_shapes(cfg):
        seq_len, steps, window = p["seq_len"], p["steps"], p["window"]
        cfg_rows = 2 if p["image"] and cfg.cfg_scale > 0 else 1
        if p["rollout"] in ("exact", "image"):
            per_seq = steps * fwd(seq_len, seq_len, window if p["image"] else block_length)
        else:  # Fast-dLLM: a full pass per block, then the tokens from the block on (prefix) or the block (dual);
            # upper bounds, as threshold decoding can end a block early
            blocks = (seq_len - p["prompt_len"]) // block_length
            queries = [seq_len - p["prompt_len"] - b * block_length if p["rollout"] == "prefix" else block_length
                       for b in range(blocks)]
            per_seq = sum(fwd(seq_len, seq_len, block_length) + (steps // blocks - 1) * fwd(q, seq_len, block_length)
                          for q in queries)
        roll = p["seqs"] * cfg_rows * per_seq
        per_update = min(cfg.trajectory_states or steps, steps) if trajectory else 1  # inputs of one update
        views = min(cfg.mu * per_update, steps) if trajectory else cfg.mu  # scored, old and ref
        # the head over the window; a text trajectory state scores only its step's tokens: an upper bound there
        score = p["seqs"] * views * (1 + (cfg.beta > 0)) * fwd(seq_len, seq_len, window)
        attn = 4 * seq_len * d * nl
        if adapters:  # LoRA: input gradients through frozen matrices (2 per weight), adapters' input + weight ones
            bwd = seq_len * (2 * body + 4 * adapters + 2 * attn) + window * 2 * head
        else:  # full fine-tuning: input and weight gradients, twice the forward
            bwd = seq_len * (4 * body + 2 * attn) + window * 4 * head
        recompute = seq_len * (2 * (body + adapters) + attn) if cfg.activation_checkpointing else 0
        update = p["seqs"] * cfg.mu * per_update * (fwd(seq_len, seq_len, window) + bwd + recompute)
        total["per_rollout_seq"][p["task"]] = cfg_rows * per_seq
        for k, v in (("rollout", roll), ("scoring", score), ("update", update), ("step", roll + score + update)):
            total[k] += v
    return total


def memory(mc: ModelConfig, s: dict, *, world_size: int, chunk: int, seq_len: int, sampled: int, image: bool,
           head_len: int, cfg_scale: float, beta: float, activation_checkpointing: bool, compute_bytes: int = 2,
           codebook: int = 8192) -> dict:
    """GiB per GPU by component and phase, without the CUDA context, fragmentation and NCCL buffers: the sharded
    state, FSDP2's gathered groups, and per chunk activations, float32 logits and sampler transients."""
    c, w, n = mc, world_size, s["params"]
    per_tok_block = 16 * c.d_model + 3 * c.mlp_hidden_size
    gathered = w > 1
    root = s["embedding"] + s["head"] + c.d_model
    block = s["block_params"] + s["lora_params"] / c.n_layers
    tokens = chunk * seq_len
    acts = tokens * c.n_layers * (c.d_model if activation_checkpointing else per_tok_block) * compute_bytes
    acts += tokens * per_tok_block * compute_bytes * activation_checkpointing  # the block being recomputed
    cols = codebook if image else c.vocab_size  # images score the codebook's columns only (vocab_slice)
    head_f32 = cols * c.d_model * 4 * (compute_bytes != 4)  # the float32 copy of the head's rows
    # the sampler's head: text over the current block (at least MIN_HEAD_ROWS rows per chunk), images their slots
    head_rows = chunk * (sampled if image else max(sampled, -(-MIN_HEAD_ROWS // chunk)))
    # images: float64 probabilities and their cumulative sum; text: float64 Gumbel noise (24 B) and a softmax
    sampler = chunk * sampled * codebook * 8 * 2 if image else chunk * sampled * c.vocab_size * (24 + 2)
    # full fine-tuning: float32 weights, gradients, AdamW moments (+ the reference); LoRA: the base in the compute
    # dtype. Gathered: the root and two blocks in an update, the whole model in a rollout or scoring.
    rows = {"full_state": n * (16 + 4 * (beta > 0)) / w,
            "lora_state": n * compute_bytes / w + s["lora_params"] * 16 / w,
            "root_gathered": root * compute_bytes * gathered, "blocks_gathered": 2 * block * compute_bytes * gathered,
            "allgather_buffer": max(root, block) * compute_bytes * gathered,
            "model_gathered": (n + s["lora_params"]) * compute_bytes * gathered, "activations": acts,
            "logits": chunk * head_len * cols * 8 + head_f32,
            "sampling": (1 + (cfg_scale > 0)) * head_rows * cols * compute_bytes + sampler,  # CFG: two rows
            "no_grad_block": tokens * per_tok_block * compute_bytes}
    phases = {"update": ("root_gathered", "blocks_gathered", "allgather_buffer", "activations", "logits"),
              "rollout": ("model_gathered", "allgather_buffer", "sampling"),
              "scoring": ("model_gathered", "allgather_buffer", "no_grad_block", "logits")}  # held beside the state
    for kind in ("full", "lora"):
        for ph, held in phases.items():  # full fine-tuning's update: also the float32 head copy's gradient
            grad = head_f32 * (kind == "full" and ph == "update")
            rows[f"{kind}_{ph}"] = rows[f"{kind}_state"] + sum(rows[k] for k in held) + grad
        rows[f"{kind}_peak"] = max(rows[f"{kind}_{ph}"] for ph in phases)
    return {**{k: v / GB for k, v in rows.items()}, "weights_gb": n * compute_bytes / w / GB}


MEMORY_ROWS = (("full_state", "full fine-tuning state, sharded"), ("lora_state", "LoRA state, sharded"),
               ("root_gathered", "gathered embedding + head (update)"), ("blocks_gathered", "gathered blocks (2)"),
               ("allgather_buffer", "all-gather buffer (largest group)"),
               ("model_gathered", "gathered model (rollout)"), ("activations", "activations per update chunk"),
               ("logits", "logits per update or scoring chunk"), ("sampling", "sampling transients per rollout chunk"),
               ("no_grad_block", "one block's activations per scoring chunk"),
               *((f"{kind}_{ph}", f"{mode}, {'' if ph == 'peak' else ph + ' '}peak") for kind, mode in
                 (("full", "full fine-tuning"), ("lora", "LoRA")) for ph in ("update", "rollout", "scoring", "peak")))


def scratch_config(cfg, **vocab) -> ModelConfig:
    """The model shape of the Config's sizes, with the vocabulary given."""
    return ModelConfig(d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads, n_kv_heads=cfg.n_heads,
                       mlp_hidden_size=cfg.mlp_hidden_size, **vocab)


def model_config(cfg) -> ModelConfig:
    """The model shape of a train.Config: --init_from's config.json, else the scratch shape."""
    if cfg.init_from not in ("", "scratch") and (Path(cfg.init_from) / "config.json").is_file():
        return hf.read_config(cfg.init_from, "--init_from")
    vocab = cfg.vocab_size or tasks.model_config_overrides(toy.build_tokenizer())["vocab_size"]
    return scratch_config(cfg, vocab_size=vocab, mask_token_id=vocab - 1)


def padded_prompt_len(cfg) -> tuple[int, str]:
    """A text rollout batch's padded prompt length and its source: measured over --train_data, else --max_prompt_len."""
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


def report(cfg) -> dict:
    """--dry_run: print and return the schedule, FLOPs, time on GPU_NAME at ASSUMED_MFU and memory (no weights)."""
    mc, shapes, lora, gpus = model_config(cfg), task_shapes(cfg), cfg.lora_rank > 0, cfg.dry_run_gpus
    names, image = [p["task"] for p in shapes], any(p["image"] for p in shapes)
    seq_len, seqs = max(p["seq_len"] for p in shapes), sum(p["seqs"] for p in shapes)
    s = shape(mc, cfg.lora_rank, cfg.lora_targets)
    f = flops(cfg, mc, s)
    maskgrpo = flops(dataclasses.replace(cfg, estimator="maskgrpo"), mc, s)["step"]  # to compare with
    # one held-out evaluation (data.evaluate_all): eval_samples per prompt, 1 greedy per text prompt, exact sampler
    exact = flops(dataclasses.replace(cfg, kv_cache="none", threshold=0.0), mc, s)["per_rollout_seq"]
    eval_n = {t: cfg.eval_prompts * (cfg.eval_samples + (t not in IMAGE_TASKS)) for t in exact}
    one_eval, eval_seqs = sum(eval_n[t] * exact[t] for t in exact), sum(eval_n.values())
    run = f["step"] * cfg.rl_steps + 2 * one_eval
    achieved = gpus * GPU_PEAK_FLOPS * ASSUMED_MFU
    step_s, eval_min, run_h = f["step"] / achieved, one_eval / achieved / 60, run / achieved / 3600
    opt_steps = cfg.rl_steps * cfg.mu
    per_task = cfg.prompts_per_step * cfg.group_size
    cols = [w for w in sorted({1, 8, 16, gpus}) if per_task % w == 0]  # each task's batch splits evenly (train.py)
    chunk = {w: min(cfg.device_batch_size or per_task // w, per_task // w) for w in cols}
    # The largest of each row over the tasks; the head runs over the scored window (an upper bound per mask).
    mem = {w: [memory(mc, s, world_size=w, chunk=chunk[w], seq_len=t["seq_len"], image=t["image"],
                      sampled=t["window"] if t["image"] else cfg.block_length, head_len=t["window"],
                      cfg_scale=cfg.cfg_scale, beta=cfg.beta, activation_checkpointing=cfg.activation_checkpointing)
                   for t in shapes] for w in cols}
    mem = {w: {k: max(m[k] for m in per_task) for k in per_task[0]} for w, per_task in mem.items()}
    mode = "LoRA" if lora else "full fine-tuning"
    print(f"model: {s['params']:,} parameters ({mc.n_layers} layers, d_model {mc.d_model}, vocab {mc.vocab_size}); "
          + (f"LoRA r={cfg.lora_rank} on the {cfg.lora_targets!r} targets: {s['lora_params']:,} adapter parameters"
             if lora else "full fine-tuning (--lora_rank=0): every parameter trained"))
    print(f"RL step: {seqs} sequences ({cfg.prompts_per_step} prompts x G={cfg.group_size} x {len(names)} task(s)) "
          f"of {seq_len} tokens, {'/'.join(str(p['steps']) for p in shapes)} denoising steps "
          f"({'/'.join(dict.fromkeys(p['rollout'] for p in shapes))}), mu={cfg.mu}, {mode}, activation checkpointing "
          f"{'on' if cfg.activation_checkpointing else 'off'}, device_batch_size {cfg.device_batch_size or 'all'}")
    ckpt = (f"a checkpoint every {cfg.checkpoint_every} rollout batches = "
            f"{cfg.checkpoint_every * cfg.mu:,} optimizer steps" if cfg.checkpoint_every else "no checkpoints")
    print(f"schedule: {cfg.rl_steps:,} rollout batches x mu {cfg.mu} = {opt_steps:,} optimizer steps; {ckpt}")
    # The settings an official script fixes, in its own terms, to compare line by line (tests/test_presets.py).
    print(f"settings: G {cfg.group_size}, {cfg.prompts_per_step} prompts per optimizer step, mu {cfg.mu}, "
          f"gamma {cfg.gamma_image if image else cfg.gamma_text}, CFG {cfg.cfg_scale}, eps {cfg.clip_eps}, beta "
          f"{cfg.beta}, lr {cfg.lr}, estimator {cfg.estimator}{'' if image else f' ({cfg.text_reversing})'}, "
          + (f"LoRA r {cfg.lora_rank} alpha {cfg.lora_alpha:g} dropout {cfg.lora_dropout} on {cfg.lora_targets}"
             if lora else "no LoRA") + ", attention over padding "
          f"{'on' if any(tasks.attends_padding(cfg, t) for t in names) else 'off'}")
    print(f"global FLOPs per RL step: {f['step']:.2e} (rollouts {f['rollout']:.2e}, old/ref scoring "
          f"{f['scoring']:.2e}, updates {f['update']:.2e})")
    if cfg.estimator == "trajectory":
        states = (f"{cfg.trajectory_states} decoding state(s) per update" if cfg.trajectory_states
                  else "every decoding state")
        print(f"trajectory estimator, {states}: {f['step']:.2e} FLOPs per RL step against {maskgrpo:.2e} for "
              f"MaskGRPO's mu = {cfg.mu} masks, {f['step'] / maskgrpo:.2f} x")
    print(f"global FLOPs per run: {run:.2e} ({cfg.rl_steps:,} RL steps, and 2 x {one_eval:.2e} for the held-out "
          f"evaluation before and after RL: {eval_seqs:,} sequences of {cfg.eval_prompts} prompts x "
          f"{cfg.eval_samples} sampled per task{', + 1 greedy per text prompt' * (not all(p['image'] for p in shapes))}"
          ", exact sampler)")
    print(f"time on {gpus} x {GPU_NAME} (bf16 dense peak {GPU_PEAK_FLOPS / 1e12:.0f} TFLOP/s, assumed MFU "
          f"{ASSUMED_MFU:.0%}): {step_s:.0f} s per RL step, {eval_min:.0f} min per held-out evaluation, "
          f"{run_h:.1f} h per run = {run_h * gpus:,.0f} GPU-hours")
    print("| GiB per GPU (estimate) | " + " | ".join(f"{w} GPU{'s' * (w > 1)}" for w in cols) + " |")
    print("|---|" + "---|" * len(cols))
    kind = "lora" if lora else "full"  # the rows of the mode this run does not train in are left out
    for key, label in MEMORY_ROWS:
        if not key.startswith(("full" if lora else "lora") + "_"):
            print(f"| {label} | " + " | ".join(f"{mem[w][key]:.1f}" for w in cols) + " |")
    print(f"(update chunk: {', '.join(f'{chunk[w]} seq' for w in cols)}; rollouts chunk the same way; "
          "FSDP2 gathers only with more than one GPU)")
    if gpus in mem:
        peak = mem[gpus][f"{kind}_peak"]
        phase = max(("update", "rollout", "scoring"), key=lambda ph: mem[gpus][f"{kind}_{ph}"])
        room = ", ".join(f"{gb - peak:.0f} GiB of {gb} on an {name}" if gb >= peak else
                         f"does not fit on an {name} ({gb} GiB, {peak - gb:.0f} GiB short)"
                         for name, gb in GPU_MEMORY_GB.items())
        print(f"device_batch_size {chunk[gpus]} of {per_task // gpus} sequences per task and GPU on {gpus} GPUs: "
              f"{mode} peak {peak:.1f} GiB ({phase}), headroom {room} (before the CUDA context and allocator slack)")
        if peak > max(GPU_MEMORY_GB.values()):
            print(f"this run does not fit on {gpus} GPU(s) of any size listed: use more GPUs (--dry_run_gpus), "
                  f"{'a lower --device_batch_size' if lora else 'LoRA (--lora_rank)'} or a smaller model")
    rate = {}
    if not image:  # generated tokens/s per GPU of the rollout phase at the padded prompt length
        padded, source = padded_prompt_len(cfg)
        roll = flops(dataclasses.replace(cfg, max_prompt_len=padded), mc, s)["rollout"]
        rate = {k: seqs * cfg.gen_length / (roll / (GPU_PEAKS[k] * ASSUMED_MFU)) for k in ("A100", "H100")}
        print(f"rollouts at a padded prompt length of {padded} tokens ({source}): about {rate['A100']:.0f} "
              f"generated tokens/s per A100 and {rate['H100']:.0f} per H100 at {ASSUMED_MFU:.0%} MFU")
    need = step_s + checkpoint_bytes(cfg, mc) / CHECKPOINT_WRITE_SPEED
    wait = 2 * math.ceil(need)  # twice the estimate; below torchrun's default of 30 s the default is the advice
    print(f"SIGTERM: one RL step plus a checkpoint takes about {need:.0f} s here; under torchrun "
          + (f"the default TORCH_ELASTIC_SHUTDOWN_TIMEOUT of {DEFAULT_KILL_DELAY} s leaves room for it (do not set "
             "it lower)" if wait <= DEFAULT_KILL_DELAY else f"export TORCH_ELASTIC_SHUTDOWN_TIMEOUT={wait} (default "
             f"{DEFAULT_KILL_DELAY}" + ("" if torchrun_reads_shutdown_timeout() else f"; read by torch >= "
                                       f"{SHUTDOWN_TIMEOUT_TORCH} only, and this torch {torch.__version__} ignores it")
             + ")") + f", under Slurm sbatch --signal=TERM@{wait} and check KillWait")
    return {"params": s["params"], "lora_params": s["lora_params"], "shape": s, "seqs_per_step": seqs, "chunk": chunk,
            "seq_len": seq_len, "flops": {**f, "evaluation": 2 * one_eval, "eval_once": one_eval, "run": run},
            "optimizer_steps": opt_steps, "checkpoint_every_optimizer_steps": cfg.checkpoint_every * cfg.mu,
            "gpus": gpus, "mfu": ASSUMED_MFU, "seconds_per_step": step_s, "run_hours": run_h, "gpu_hours": run_h * gpus,
            "budget": mem, "tokens_per_s_per_gpu": rate}


def torchrun_reads_shutdown_timeout() -> bool:
    """Whether the installed torchrun honours TORCH_ELASTIC_SHUTDOWN_TIMEOUT (measured: tests/test_cuda_torchrun.py)."""
    try:
        from torch.distributed.launcher.api import LaunchConfig
    except ImportError:
        return False
    return "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)}


def kill_delay_warning(env: dict, step_seconds: float, checkpoint_seconds: float) -> str | None:
    """The warning when torchrun's or Slurm's SIGKILL would cut off a SIGTERM's step and checkpoint; else None."""
    torchrun, slurm = "TORCHELASTIC_RUN_ID" in env, "SLURM_JOB_ID" in env
    ignored = torchrun and not torchrun_reads_shutdown_timeout()
    delay = float(env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", DEFAULT_KILL_DELAY)) if torchrun and not ignored \
        else DEFAULT_KILL_DELAY
    delay = min(delay, DEFAULT_KILL_DELAY) if slurm else delay
    need = step_seconds + checkpoint_seconds
    if not (torchrun or slurm) or delay >= need:
        return None
    wait, fix, who = 2 * math.ceil(need), [], []
    if torchrun:
        upgrade = f"upgrade torch to {SHUTDOWN_TIMEOUT_TORCH} or later (torch {torch.__version__} ignores it), then "
        fix.append(f"{upgrade * ignored}export TORCH_ELASTIC_SHUTDOWN_TIMEOUT={wait}")
        who.append(f"torchrun's fixed {DEFAULT_KILL_DELAY} s" if ignored else "torchrun's shutdown timeout")
    if slurm:
        fix.append(f"sbatch --signal=TERM@{wait} to be signalled early, and check KillWait (scontrol show config)")
        who.append("Slurm's KillWait (default assumed)")
    return (f"warning: a SIGTERM gets SIGKILL {delay:.0f} s later ({' and '.join(who)}), but one RL step plus a "
            f"checkpoint takes about {need:.0f} s (dry-run estimate): a pre-emption would lose the step and write no "
            f"checkpoint; {'; '.join(fix)} (README: resuming)")


def warn_kill_delay(cfg, world: int, env=os.environ) -> None:
    """Print kill_delay_warning's warning (rank 0) for cfg's run on `world` GPUs."""
    if "TORCHELASTIC_RUN_ID" not in env and "SLURM_JOB_ID" not in env:
        return
    mc = model_config(cfg)
    step_s = flops(cfg, mc, shape(mc, cfg.lora_rank, cfg.lora_targets))["step"] / (world * GPU_PEAK_FLOPS * ASSUMED_MFU)
    if text := kill_delay_warning(env, step_s, checkpoint_bytes(cfg, mc) / CHECKPOINT_WRITE_SPEED):
        print0(text)


def state_over_memory(cfg, world: int, device_bytes: int) -> str | None:
    """The advice when the sharded training state alone is over the GPU's memory (no --device_batch_size helps)."""
    s = shape(model_config(cfg), cfg.lora_rank, cfg.lora_targets)
    state = (s["params"] * (4 if cfg.dtype == "float32" else 2) + s["lora_params"] * 16 if cfg.lora_rank > 0 else
             s["params"] * (16 + 4 * (cfg.beta > 0))) / world
    if state < device_bytes:
        return None
    mode, lora_too = ("LoRA", "") if cfg.lora_rank > 0 else ("full fine-tuning", " or LoRA (--lora_rank)")
    return (f"the training state alone is {state / GB:.1f} GiB per GPU ({mode} on {world} GPU(s)), over this GPU's "
            f"{device_bytes / GB:.1f} GiB: use more GPUs (torchrun --nproc_per_node){lora_too}; python train.py "
            "--dry_run --dry_run_gpus=N prints the memory per GPU")


def checkpoint_bytes(cfg, mc: ModelConfig) -> int:
    """Bytes of one checkpoint: the trained parameters in float32, their two AdamW moments, 1 MB of metadata."""
    s = shape(mc, cfg.lora_rank, cfg.lora_targets)
    return (s["lora_params"] if cfg.lora_rank > 0 else s["params"]) * 4 * 3 + 2 ** 20


def _bytes(n: float) -> str:
    for unit, size in (("GB", GB), ("MB", 2 ** 20), ("KB", 2 ** 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} bytes"


def check_disk(cfg, out: Path, mc, present: int = 0) -> None:
    """Refuse to start when out_dir cannot hold the checkpoints kept during rotation (beside a resumed run's
    `present` ones) and final/, written while the last checkpoint is still there."""
    s, one = shape(mc, cfg.lora_rank, cfg.lora_targets), checkpoint_bytes(cfg, mc)
    # at once: keep_last and the one being written (0: every one), at most what the run writes (and its last step)
    writes = cfg.rl_steps // max(cfg.checkpoint_every, 1) + 1 if cfg.rl_steps else 0
    k = max(0, (min(cfg.keep_last + 1, writes) if cfg.keep_last else writes) - present)
    # final/: every parameter in the run's dtype (bf16 on a GPU with --dtype=auto), and LoRA's float32 adapters
    bf16 = cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and torch.cuda.is_available())
    final = s["params"] * (2 if bf16 else 4) + (s["lora_params"] * 4 if cfg.lora_rank > 0 else 0)
    size, free = one * k + final, shutil.disk_usage(out).free
    if free < size:
        what = "LoRA adapters and their AdamW moments" if cfg.lora_rank > 0 else \
            "float32 weights and AdamW moments (full fine-tuning)"
        raise ValueError(f"out_dir {out} has {_bytes(free)} free, but a checkpoint needs about {_bytes(one)} "
                         f"({what}), rotation keeps {k} at once (--keep_last={cfg.keep_last}) and final/ needs "
                         f"{_bytes(final)}: {_bytes(size)}; free space, pick another --out_dir, lower --keep_last, "
                         "use LoRA (--lora_rank) or set --checkpoint_every=0")
