"""The dry run's report: `python train.py --preset llada8b --dry_run` prints parameters, FLOPs per RL step and
per run, the held-out evaluations' cost, a wall-time and GPU-hour estimate, memory per GPU by phase, and the
kill delay a launcher needs, without loading any weights. The figures are infra/budget.py's (an estimate from
the model shape and the config, derived by hand in tests/test_budget.py); this file only prints them.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import replace

import torch

import tasks
from infra.budget import (ASSUMED_MFU, DEFAULT_KILL_DELAY, GPU_MEMORY_GB, GPU_NAME, GPU_PEAK_FLOPS, H100_PEAK_FLOPS,
                          MEMORY_ROWS, SHUTDOWN_TIMEOUT_TORCH, checkpoint_seconds, eval_flops, memory, model_config,
                          padded_prompt_len, shape, step_flops, step_shape, torchrun_reads_shutdown_timeout)


def report(cfg) -> dict:
    """--dry_run: print and return the schedule, FLOPs (per RL step, per run), the time estimate on
    GPU_NAME at ASSUMED_MFU, and the memory table, from the model shape alone (no weights)."""
    mc = model_config(cfg)
    p = step_shape(cfg)
    names, image, seq_len, rollout, steps, seqs = (p[k] for k in ("names", "image", "seq_len", "rollout", "steps",
                                                                   "seqs"))
    lora = cfg.lora_rank > 0
    s = shape(mc, cfg.lora_rank, cfg.lora_targets)
    f = step_flops(cfg, mc, s)
    maskgrpo = step_flops(dataclasses.replace(cfg, estimator="maskgrpo"), mc, s)["step"]  # the same step with
    # MaskGRPO's mu masks, for comparison
    one_eval, eval_seqs = eval_flops(cfg, mc, s)
    evaluation = 2 * one_eval  # before and after RL
    run = f["step"] * cfg.rl_steps + evaluation
    gpus = cfg.dry_run_gpus
    step_s = f["step"] / (gpus * GPU_PEAK_FLOPS * ASSUMED_MFU)
    eval_min = one_eval / (gpus * GPU_PEAK_FLOPS * ASSUMED_MFU) / 60
    run_h = run / (gpus * GPU_PEAK_FLOPS * ASSUMED_MFU) / 3600
    opt_steps = cfg.rl_steps * cfg.mu
    # world sizes each task's batch splits evenly over (train.py requires it)
    per_task = cfg.prompts_per_step * cfg.group_size
    cols = [w for w in sorted({1, 8, 16, gpus}) if per_task % w == 0]
    chunk = {w: min(cfg.device_batch_size or per_task // w, per_task // w) for w in cols}
    # Each task's memory; the table shows the largest of each row over the tasks. window: the positions
    # scored, where the head runs (importance.token_logprobs): an upper bound, as a mask scores a share of them.
    mem = {w: {} for w in cols}
    for t in p["tasks"]:
        for w in cols:
            m = memory(mc, s, world_size=w, chunk=chunk[w], seq_len=t["seq_len"],
                       sampled=t["window"] if t["image"] else cfg.block_length, image=t["image"],
                       cfg_scale=cfg.cfg_scale, beta=cfg.beta, activation_checkpointing=cfg.activation_checkpointing,
                       head_len=t["window"])
            mem[w].update({k: max(v, mem[w].get(k, v)) for k, v in m.items()})

    print(f"model: {s['params']:,} parameters ({mc.n_layers} layers, d_model {mc.d_model}, vocab {mc.vocab_size}); "
          + (f"LoRA r={cfg.lora_rank} on the {cfg.lora_targets!r} targets: {s['lora_params']:,} adapter parameters"
             if lora else "full fine-tuning (--lora_rank=0): every parameter trained"))
    print(f"RL step: {seqs} sequences ({cfg.prompts_per_step} prompts x G={cfg.group_size} x {len(names)} task(s)) "
          f"of {seq_len} tokens, {steps} denoising steps ({rollout}), mu={cfg.mu}, "
          f"{'LoRA' if lora else 'full fine-tuning'}, activation checkpointing "
          f"{'on' if cfg.activation_checkpointing else 'off'}, device_batch_size {cfg.device_batch_size or 'all'}")
    ckpt = (f"a checkpoint every {cfg.checkpoint_every} rollout batches = "
            f"{cfg.checkpoint_every * cfg.mu:,} optimizer steps" if cfg.checkpoint_every else "no checkpoints")
    print(f"schedule: {cfg.rl_steps:,} rollout batches x mu {cfg.mu} = {opt_steps:,} optimizer steps; {ckpt}")
    # The settings an official script fixes, in its own terms, to compare line by line (tests/test_presets.py).
    gamma = cfg.gamma_image if image else cfg.gamma_text
    print(f"settings: G {cfg.group_size}, {cfg.prompts_per_step} prompts per optimizer step, mu {cfg.mu}, "
          f"gamma {gamma}, CFG {cfg.cfg_scale}, eps {cfg.clip_eps}, beta {cfg.beta}, lr {cfg.lr}, estimator "
          f"{cfg.estimator}{'' if image else f' ({cfg.text_reversing})'}, "
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
    print(f"held-out evaluation: {eval_seqs:,} sequences ({cfg.eval_prompts} prompts x {cfg.eval_samples} sampled "
          f"per task{', + 1 greedy per text prompt' if not all(t['image'] for t in p['tasks']) else ''}; exact "
          f"sampler), {one_eval:.2e} FLOPs each, run before and after RL")
    print(f"global FLOPs per run: {run:.2e} ({cfg.rl_steps:,} RL steps, and 2 x {one_eval:.2e} for the held-out "
          f"evaluations)")
    print(f"time on {gpus} x {GPU_NAME} (bf16 dense peak {GPU_PEAK_FLOPS / 1e12:.0f} TFLOP/s, assumed MFU "
          f"{ASSUMED_MFU:.0%}): {step_s:.0f} s per RL step, {eval_min:.0f} min per held-out evaluation, "
          f"{run_h:.1f} h per run = {run_h * gpus:,.0f} GPU-hours")
    print("| GiB per GPU (estimate) | " + " | ".join(f"{w} GPU{'s' * (w > 1)}" for w in cols) + " |")
    print("|---|" + "---|" * len(cols))
    other = "full" if lora else "lora"  # the rows of the mode this run does not train in are left out
    for key, label in MEMORY_ROWS:
        if not key.startswith(other + "_"):
            print(f"| {label} | " + " | ".join(f"{mem[w][key]:.1f}" for w in cols) + " |")
    print(f"(update chunk: {', '.join(f'{chunk[w]} seq' for w in cols)}; rollouts chunk the same way; "
          "FSDP2 gathers only with more than one GPU)")
    if gpus in mem:
        kind = "lora" if lora else "full"
        peak = mem[gpus][f"{kind}_peak"]
        phase = max(("update", "rollout", "scoring"), key=lambda ph: mem[gpus][f"{kind}_{ph}"])
        room = ", ".join(f"{gb - peak:.0f} GiB of {gb} on an {name}" if gb >= peak else
                         f"does not fit on an {name} ({gb} GiB, {peak - gb:.0f} GiB short)"
                         for name, gb in GPU_MEMORY_GB.items())
        print(f"device_batch_size {chunk[gpus]} of {per_task // gpus} sequences per task and GPU on {gpus} GPUs: "
              f"{'LoRA' if lora else 'full fine-tuning'} peak {peak:.1f} GiB ({phase}), headroom {room} (before the "
              "CUDA context and allocator slack)")
        if peak > max(GPU_MEMORY_GB.values()):
            print(f"this run does not fit on {gpus} GPU(s) of any size listed: use more GPUs (--dry_run_gpus), "
                  f"{'a lower --device_batch_size' if lora else 'LoRA (--lora_rank)'} or a smaller model")
    rate = {}
    if not image:  # generated tokens/s per GPU of the rollout phase at the padded prompt length
        padded, source = padded_prompt_len(cfg)
        roll = step_flops(replace(cfg, max_prompt_len=padded), mc, s)["rollout"]
        for name, peak_flops in (("A100", GPU_PEAK_FLOPS), ("H100", H100_PEAK_FLOPS)):
            rate[name] = seqs * cfg.gen_length / (roll / (peak_flops * ASSUMED_MFU))  # = per GPU on any count
        print(f"rollouts at a padded prompt length of {padded} tokens ({source}): about {rate['A100']:.0f} "
              f"generated tokens/s per A100 and {rate['H100']:.0f} per H100 at {ASSUMED_MFU:.0%} MFU")
    need = step_s + checkpoint_seconds(cfg, mc)
    wait = 2 * math.ceil(need)  # twice the estimate; below torchrun's default of 30 s the default is the advice
    print(f"SIGTERM: one RL step plus a checkpoint takes about {need:.0f} s here; under torchrun "
          + (f"the default TORCH_ELASTIC_SHUTDOWN_TIMEOUT of {DEFAULT_KILL_DELAY} s leaves room for it (do not set "
             "it lower)" if wait <= DEFAULT_KILL_DELAY else f"export TORCH_ELASTIC_SHUTDOWN_TIMEOUT={wait} (default "
             f"{DEFAULT_KILL_DELAY}" + ("" if torchrun_reads_shutdown_timeout() else f"; read by torch >= "
                                       f"{SHUTDOWN_TIMEOUT_TORCH} only, and this torch {torch.__version__} ignores it")
             + ")") + f", under Slurm sbatch --signal=TERM@{wait} and check KillWait")
    return {"params": s["params"], "lora_params": s["lora_params"], "shape": s, "seqs_per_step": seqs,
            "seq_len": seq_len, "flops": {**f, "evaluation": evaluation, "eval_once": one_eval, "run": run},
            "eval_sequences": eval_seqs, "eval_minutes": eval_min, "chunk": chunk,
            "rollout_batches": cfg.rl_steps, "optimizer_steps": opt_steps,
            "checkpoint_every_optimizer_steps": cfg.checkpoint_every * cfg.mu,
            "gpu": GPU_NAME, "gpus": gpus, "mfu": ASSUMED_MFU, "seconds_per_step": step_s, "run_hours": run_h,
            "gpu_hours": run_h * gpus, "budget": mem, "tokens_per_s_per_gpu": rate}
