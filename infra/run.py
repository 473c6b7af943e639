"""Everything a training run does besides the algorithm: settings checked at the boundary, device and
dtype, the toy SFT cache and model loading, start-up checks, logs, checkpoints and resume, signals,
non-finite guards and the final save. train.py calls it through a few names (validate, setup, load_policy,
startup_checks, Run, and the step's Clock and StepStats) so that its own text is the method.

A Run keeps the state a resumed run must continue from (step, the held-out rewards before RL, bad-step
counters, RL seconds, the last good checkpoint), writes log.jsonl (one line per RL step; wall times go to
times.jsonl so that a repeated run gives an identical log.jsonl), stops after max_bad_steps consecutive bad
steps, and on SIGTERM/SIGINT writes a checkpoint and exits 128 + signal (checkpoint.py). Every rank makes
the same decisions: flags are reduced over ranks before they are acted on.
"""
from __future__ import annotations

import atexit
import hashlib
import itertools
import json
import math
import os
import shutil
import signal
import time
from dataclasses import asdict
from pathlib import Path

import torch

import grpo
import importance
import tasks
from importance import generator
from infra import budget, checkpoint, data, hf, lora, phases, scale
from infra.budget import scratch_config
from infra.data import data_paths
from infra.hf import load_tokenizer, read_checkpoint
from infra.scale import print0
from model import Transformer, chat_prompt, num_params
from tasks import IMAGE_TASKS, TOY_TASKS, task_list

# -----------------------------------------------------------------------------------------------------
# settings, device


def _need(ok, msg):
    if not ok:
        raise ValueError(msg)


def validate_generation(o) -> None:
    """The sampler settings train.py's Config and sample.py's options share (same names, same rules):
    checked here, once, for both, so that the samplers only assert their preconditions."""
    need = _need
    for k, v in vars(o).items():  # inf or nan would pass the range checks below (inf > 0) and fail mid-run
        need(not isinstance(v, float) or math.isfinite(v), f"{k} ({v}) must be a finite number")
    for k in ("gen_length", "block_length", "steps", "image_steps", "image_width"):
        need(getattr(o, k) >= 1, f"{k} ({getattr(o, k)}) must be >= 1")
    need(o.gen_length % o.block_length == 0,
         f"gen_length ({o.gen_length}) must be divisible by block_length ({o.block_length}); "
         f"try --block_length={o.gen_length}")
    blocks = o.gen_length // o.block_length
    need(o.steps % blocks == 0 and o.steps >= blocks,
         f"steps ({o.steps}) must be a positive multiple of the number of blocks ({blocks}); "
         f"try --steps={blocks * max(1, o.steps // blocks)}")
    need(o.temperature >= 0, f"temperature ({o.temperature}) must be >= 0")
    need(o.kv_cache in ("none", "prefix", "dual"), f"kv_cache ({o.kv_cache!r}) must be none, prefix or dual")
    need(0 <= o.threshold < 1, f"threshold ({o.threshold}) must be in [0, 1) (0 = off; Fast-dLLM uses 0.9)")
    need(o.image_sampler in ("emerge", "maskgit"), f"image_sampler ({o.image_sampler!r}) must be emerge or maskgit")
    need(o.cfg_scale >= 0, f"cfg_scale ({o.cfg_scale}) must be >= 0 (0 = no guidance; MaskGRPO uses 3.0)")
    need(o.image_text_len >= 0, f"image_text_len ({o.image_text_len}) must be >= 0 (0 = the longest toy caption)")


def validate(cfg) -> None:
    """Refuse impossible settings before any heavy work, naming the value and a fix."""
    need = _need
    validate_generation(cfg)
    if cfg.init_from == "scratch" or cfg.dry_run:  # the sizes of the model built here (else: its config.json)
        for k in ("d_model", "n_layers", "n_heads", "mlp_hidden_size"):
            need(getattr(cfg, k) >= 1, f"{k} ({getattr(cfg, k)}) must be >= 1: a model needs at least one of each")
        need(cfg.d_model % cfg.n_heads == 0 and (cfg.d_model // cfg.n_heads) % 2 == 0,
             f"d_model ({cfg.d_model}) must be n_heads ({cfg.n_heads}) times an even head size (rotary embeddings)")
    need(cfg.group_size >= 2, f"group_size ({cfg.group_size}) must be >= 2: GRPO compares completions of a group")
    need(cfg.num_iterations >= 1, f"num_iterations ({cfg.num_iterations}) must be >= 1")
    for g in ("gamma_text", "gamma_image"):
        need(0 <= getattr(cfg, g) < 1, f"{g} ({getattr(cfg, g)}) must be in [0, 1)")
    need(cfg.clip_eps > 0, f"clip_eps ({cfg.clip_eps}) must be > 0 (paper: 0.2)")
    need(cfg.beta >= 0, f"beta ({cfg.beta}) must be >= 0")
    need(cfg.estimator in importance.ESTIMATORS, f"estimator ({cfg.estimator!r}) must be one of {importance.ESTIMATORS}")
    need(cfg.text_reversing in importance.MODES, f"text_reversing ({cfg.text_reversing!r}) must be one of {importance.MODES}")
    need(cfg.loss_norm in grpo.NORMS, f"loss_norm ({cfg.loss_norm!r}) must be one of {grpo.NORMS}")
    need(cfg.estimator != "trajectory" or cfg.loss_norm == "token", "estimator 'trajectory' scores each token at "
         "its own decoding step, which only the token mean adds up across steps: use --loss_norm=token")
    need(cfg.trajectory_states >= 0, f"trajectory_states ({cfg.trajectory_states}) must be >= 0 (0 = every "
         "decoding state; K > 0 scores K of them per update)")
    need(cfg.estimator == "trajectory" or not cfg.trajectory_states, f"trajectory_states ({cfg.trajectory_states}) "
         f"draws decoding states of --estimator=trajectory, not of {cfg.estimator!r}: add --estimator=trajectory "
         "or drop it")
    need(cfg.adv_std in ("auto", "on", "off"), f"adv_std ({cfg.adv_std!r}) must be auto, on or off")
    need(cfg.text_reward in tasks.TEXT_REWARDS, f"text_reward ({cfg.text_reward!r}) must be one of {tuple(tasks.TEXT_REWARDS)}")
    need(cfg.reward_shaping in ("none", "official"), f"reward_shaping ({cfg.reward_shaping!r}) must be none or official")
    need(cfg.attend_padding in ("auto", "on", "off"), f"attend_padding ({cfg.attend_padding!r}) must be auto, on or off")
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
    need(cfg.lora_targets in lora.TARGET_SETS, f"lora_targets ({cfg.lora_targets!r}) must be one of {tuple(lora.TARGET_SETS)}")
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
    need(cfg.dtype in ("auto", "float32", "bfloat16"),
         f"dtype ({cfg.dtype!r}) must be auto, float32 or bfloat16 (float16 needs a grad scaler, which this code omits)")
    for k in ("sft_steps", "rl_steps", "eval_prompts", "device_batch_size"):
        need(getattr(cfg, k) >= 0, f"{k} ({getattr(cfg, k)}) must be >= 0")
    for k in ("prompts_per_step", "sft_batch_size"):
        need(getattr(cfg, k) >= 1, f"{k} ({getattr(cfg, k)}) must be >= 1")



def setup(cfg) -> tuple[torch.device, torch.dtype]:
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



def paired_se(d: list) -> float:
    """Standard error of the mean of per-prompt differences d (after - before on the same prompts):
    sd(d) / sqrt(n), so that the prompt-to-prompt spread both scores share cancels."""
    n = len(d)
    assert n > 1, "a standard error needs two or more prompts"
    m = sum(d) / n
    return math.sqrt(sum((x - m) ** 2 for x in d) / (n - 1) / n)


class BadStep(Exception):
    """Rewards that are not finite numbers in [0, 1]: the RL step is skipped (rl_step's caller counts it)."""


class TrainingStopped(RuntimeError):
    """Too many consecutive bad steps: the run stops with a message naming the last good checkpoint."""



class Clock:
    """Wall and process CPU time of the phases of one RL step: lap("rollout_s") adds the wall seconds since
    the last lap to rollout_s and the CPU seconds (time.process_time: every thread of this process) to
    rollout_cpu_s. CPU seconds compare compute between runs on a shared machine, where wall time counts the
    other jobs' share of the cores too."""

    def __init__(self):
        self.t0 = self.last = time.time()
        self.cpu0 = self.cpu_last = time.process_time()
        self.times: dict = {}

    def lap(self, name: str) -> None:
        now, cpu = time.time(), time.process_time()
        cpu_name = name.removesuffix("_s") + "_cpu_s"
        self.times[name] = self.times.get(name, 0.0) + now - self.last
        self.times[cpu_name] = self.times.get(cpu_name, 0.0) + cpu - self.cpu_last
        self.last, self.cpu_last = now, cpu

    def laps(self) -> dict:
        return {**self.times, "seconds": time.time() - self.t0, "cpu_s": time.process_time() - self.cpu0}


class StepStats:
    """grpo.policy_loss statistics of one RL step, per task: within an update, each row chunk's are merged
    (maxima by max, means weighted by the chunk's share of the loss normaliser, counts summed); end_update
    reduces them over ranks; mean(task) averages them over the mu updates."""

    def __init__(self, num_iterations: int):
        self.mu, self.update, self.total = num_iterations, {}, {}

    def add(self, task: str, stats: dict, share: float, loss: float) -> None:
        acc = self.update.setdefault(task, {})
        for k, v in stats.items():
            if k == "adv_abs_mean":  # a mean over rows, not tokens: rl_step logs it from all rows instead
                continue
            if k.endswith("_max"):
                acc[k] = max(acc.get(k, -math.inf), float(v))
            else:
                acc[k] = acc.get(k, 0.0) + float(v) * (1.0 if k == "num_tokens" else share)
        acc["loss"] = acc.get("loss", 0.0) + loss * share

    def end_update(self, device) -> list[float]:
        """Reduce this update's statistics over ranks, add them to the step's; returns each task's loss."""
        losses = []
        for task, acc in self.update.items():
            keys = sorted(acc)
            t = torch.tensor([acc[k] for k in keys], dtype=torch.float64, device=device)
            is_max = torch.tensor([k.endswith("_max") for k in keys], device=device)
            maxed = scale.all_max(torch.where(is_max, t, -math.inf))
            summed = scale.all_sum(torch.where(is_max, 0.0, t))
            reduced = dict(zip(keys, torch.where(is_max, maxed, summed).tolist()))
            for k, v in reduced.items():
                self.total[f"{task}/{k}"] = self.total.get(f"{task}/{k}", 0.0) + v / self.mu
            losses.append(reduced["loss"])
        self.update = {}
        return losses

    def mean(self, task: str) -> dict:
        return {k: v for k, v in self.total.items() if k.startswith(task + "/")}


def log_line(log: dict, total: int) -> str:
    # 0-based, as log.jsonl and the plots count: the last step of a 50-step run is "step 49/50".
    parts = [f"step {log['step']}/{total}"]
    for t in sorted({k.split("/")[0] for k in log if k.endswith("/reward")}):
        if f"{t}/reward" in log:
            parts.append(f"{t} reward {log[f'{t}/reward']:.3f} loss {log[f'{t}/loss']:+.4f} "
                         f"clip {log[f'{t}/clipfrac']:.3f} kl {log[f'{t}/kl']:.4f}")
    parts.append(f"{log['seconds']:.1f}s")
    return " | ".join(parts)



SFT_KEYS = ("seed", "d_model", "n_layers", "n_heads", "mlp_hidden_size", "text_noise", "image_noise", "image_width",
            "text_max_steps", "image_loss_weight",
            "sft_steps", "sft_batch_size", "sft_lr", "sft_warmup", "cond_dropout", "gen_length")


def sft_key(cfg) -> dict:
    """What the toy SFT model depends on: the SFT_KEYS settings, the toy tasks it trains and tasks.py's source
    (its toy data)."""
    tasks_hash = hashlib.sha1(Path(tasks.__file__).read_bytes()).hexdigest()
    return {k: getattr(cfg, k) for k in SFT_KEYS} | {"sft_tasks": list(tasks.sft_tasks(cfg)), "tasks_sha1": tasks_hash}


def sft_dir_of(cfg) -> Path:
    return Path(cfg.sft_dir or Path(cfg.out_dir) / "sft")


def check_sft_cache(cfg) -> bool:
    """True when sft_dir holds an SFT model trained with cfg's settings (reuse it), False when it is new
    (train it); a model trained with other settings is refused, naming them, unless --retrain_sft=true.
    Never silently replaced: several runs may share one --sft_dir, and SFT can take an hour."""
    sft_dir = sft_dir_of(cfg)
    meta_file = sft_dir / "sft_meta.json"
    if meta_file.is_file():
        saved, meta = hf.read_json(meta_file, "pass --retrain_sft=true to train the SFT model again"), sft_key(cfg)
        # A model trained on more toy tasks serves a run on fewer (a text-only ablation from the toy's SFT
        # model); models saved before sft_tasks was recorded were trained on both.
        trained, wanted = saved.pop("sft_tasks", list(TOY_TASKS)), meta.pop("sft_tasks")
        covered = set(wanted) <= set(trained)
        if saved == meta and covered:
            return True
        diff = [f"{k} {saved.get(k)!r} -> {meta[k]!r}" for k in meta if k != "tasks_sha1" and saved.get(k) != meta[k]]
        if not covered:
            diff.append(f"toy tasks {trained} -> {wanted}")
        if saved.get("tasks_sha1") != meta["tasks_sha1"]:
            diff.append("tasks.py (the toy data) changed")
        problem = f"holds an SFT model trained with other settings: {', '.join(diff)}"
    elif sft_dir.is_dir() and any(sft_dir.iterdir()):
        problem = "holds files but no sft_meta.json, so not an SFT model this code wrote"
    else:
        return False
    if not cfg.retrain_sft:
        raise ValueError(f"sft_dir {sft_dir} {problem}; pass --retrain_sft=true to replace it, or give this "
                         "run its own --sft_dir")
    return False


def load_or_train_sft(cfg, tok, ids, device, dtype, sft) -> tuple[Path, float]:
    """(directory, SFT seconds) of the toy SFT model: sft_dir when it was trained with the same settings,
    else trained now by `sft(model, tok, ids, cfg, device) -> seconds` (by rank 0 alone under torchrun; the
    other ranks wait, then every rank reads the same files).

    Written atomically: into a temporary directory beside sft_dir, which replaces it by rename once complete
    (sft_meta.json last), so a crash or Ctrl-C at any moment leaves the old model, or none, never a mix."""
    sft_dir = sft_dir_of(cfg)
    cached = check_sft_cache(cfg)
    if not cached and scale.rank() == 0:
        mc = scratch_config(cfg, **tasks.model_config_overrides(tok))
        model = Transformer(mc).init_weights(generator("cpu", cfg.seed, "init")).to(device=device, dtype=dtype)
        print(f"SFT from scratch: {num_params(model) / 1e6:.2f}M parameters, {cfg.sft_steps} steps")
        seconds = sft(model, tok, ids, cfg, device)
        sft_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp, old = (sft_dir.with_name(f".{sft_dir.name}.{kind}-{os.getpid()}") for kind in ("tmp", "old"))
        try:
            hf.save_pretrained(model, tmp)
            tok.save(str(tmp / "tokenizer.json"))
            (tmp / "sft_seconds.json").write_text(json.dumps({"seconds": seconds}))
            (tmp / "sft_meta.json").write_text(json.dumps(sft_key(cfg), indent=2))
            checkpoint.fsync_tree(tmp)
            if sft_dir.exists():  # the model being replaced (--retrain_sft) stays whole until the new one is in
                os.rename(sft_dir, old)
            try:
                os.rename(tmp, sft_dir)
            except OSError:
                if old.exists():
                    os.rename(old, sft_dir)
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
        print(f"saved the SFT model to {sft_dir} (later runs with the same settings reuse it)")
    scale.barrier()
    if cached:
        print0(f"loading the SFT model from {sft_dir} (trained with these settings; --retrain_sft=true retrains it)")
    seconds = hf.read_json(sft_dir / "sft_seconds.json", "pass --retrain_sft=true to train it again")["seconds"]
    return sft_dir, seconds


def report_truncation(cfg, tok, datasets: dict) -> dict:
    """Say how many benchmark prompts --max_prompt_len cuts (tasks.make_batch keeps their last max_prompt_len
    tokens, as the official code): {(task, split): (cut, total, longest)}, printed when anything is cut."""
    cut = {}
    for task, splits in datasets.items():
        if task in IMAGE_TASKS:
            continue
        for split, exs in splits.items():
            if not exs:
                continue
            texts = [chat_prompt([{"role": "user", "content": ex["prompt"]}]) + cfg.prompt_prefill for ex in exs]
            lengths = [len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False)]
            n = sum(length > cfg.max_prompt_len for length in lengths)
            if n:
                cut[(task, split)] = (n, len(lengths), max(lengths))
                print0(f"note: {n} of {len(lengths)} {task} {split} prompts are longer than --max_prompt_len="
                       f"{cfg.max_prompt_len} tokens (the longest {max(lengths)}) and keep only their last "
                       f"{cfg.max_prompt_len}; raise --max_prompt_len to keep them whole")
    return cut


def find_model(cfg, device, dtype, sft) -> tuple[Path, object, dict, float]:
    """(checkpoint directory, tokenizer, special ids, SFT seconds) to start from: init_from, or for the toy
    out_dir/sft (trained first when missing or stale)."""
    if cfg.init_from == "scratch":
        tok = tasks.build_tokenizer()
        ids = tasks.token_ids(tok)
        path, seconds = load_or_train_sft(cfg, tok, ids, device, dtype, sft)
        return path, tok, ids, seconds
    config, _ = read_checkpoint(cfg.init_from)  # checks the directory; reads no weights
    tok = load_tokenizer(cfg.init_from, config)
    # Toy tasks on a toy checkpoint (e.g. a LoRA run from a toy run's final/) read its ids by name.
    toy = all(t in TOY_TASKS for t in task_list(cfg))
    ids = tasks.token_ids(tok) if toy else hf.token_ids(tok, config)
    return Path(cfg.init_from), tok, ids, 0.0


def load_model(cfg, device, dtype, sft):
    """(model, tokenizer, special ids, SFT seconds): the toy SFT model, or a pretrained checkpoint, whole."""
    path, tok, ids, seconds = find_model(cfg, device, dtype, sft)
    return hf.from_pretrained(path, device=device, dtype=dtype), tok, ids, seconds


def load_policy(cfg, device, dtype, sft):
    """(policy, reference, tokenizer, special ids, SFT seconds), sharded under torchrun and ready to train.

    Full fine-tuning keeps float32 master weights: AdamW's steps at lr 3e-6 are far below bf16's spacing
    near LLaDA's weights and would round away (lora.py says the same of adapters). Under torchrun FSDP2
    computes in `dtype` from them; one process computes in float32 (use LoRA or torchrun for bf16).
    The reference policy is the starting model: with LoRA, the policy with its adapters switched off
    (reference None); otherwise a frozen second copy read from the same checkpoint, built only when the
    KL term needs it (beta > 0)."""
    master = torch.float32 if cfg.lora_rank == 0 else dtype
    if master != dtype:
        print0(f"full fine-tuning: float32 master weights, {'bf16 compute (FSDP2)' if scale.world() > 1 else 'float32 compute'}")
    path, tok, ids, sft_seconds = find_model(cfg, device, master, sft)
    adapt = None
    if cfg.lora_rank:
        adapt = lambda m: lora.add_lora(m, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout,
                                        lora.TARGET_SETS[cfg.lora_targets], generator=generator("cpu", cfg.seed, "lora"))
    model = load_sharded(path, device, master, dtype, adapt)
    if cfg.lora_rank:
        print0("LoRA: {modules} modules, {lora_params:,} trainable of {total_params:,} parameters".format(
            **lora.lora_stats(model)))
    ref = None
    if not cfg.lora_rank and cfg.beta > 0:
        ref = load_sharded(path, device, master, dtype, lambda m: m.requires_grad_(False))
    model.set_activation_checkpointing(cfg.activation_checkpointing)
    return model, ref, tok, ids, sft_seconds


def load_sharded(path, device, dtype, compute_dtype, adapt=None) -> Transformer:
    """hf.from_pretrained(path) in `dtype`, then adapt(model) (add_lora, freezing), then
    scale.shard(model, compute_dtype); in one process that is exactly what happens.

    Under torchrun no rank ever holds the whole model: loading it whole first would put every rank's
    device at the full float32 size (32 GB for LLaDA-8B, twice that with the reference) before sharding.
    So the model is built, adapted and sharded on the meta device (no memory), each rank allocates only
    its shards on `device`, and every checkpoint tensor is read on the CPU, one at a time, for each rank
    to copy in its own rows (scale.fill_shard): about one shard plus one tensor in transit per rank."""
    if scale.world() == 1:
        model = hf.from_pretrained(path, device=device, dtype=dtype)
        return adapt(model) if adapt else model
    config, tensors = read_checkpoint(path)  # on the CPU
    with torch.device("meta"):
        model = Transformer(config).to(dtype).eval()  # eval(): as from_pretrained returns it
    added = _adapt_on_meta(model, adapt) if adapt else {}
    model = scale.shard(model, compute_dtype=compute_dtype)
    model.to_empty(device=device)
    targets = dict(model.named_parameters()) | dict(model.named_buffers())
    with torch.no_grad():
        for name, full in itertools.chain(tensors, added.items()):
            scale.fill_shard(targets.pop(name), full)
    if targets:  # a tensor to_empty left uninitialised would silently train from garbage
        raise RuntimeError(f"{path}: no values for {sorted(targets)[:8]}")
    return model


def _adapt_on_meta(model: Transformer, adapt) -> dict[str, torch.Tensor]:
    """Run adapt(model) on a meta-device model and return the parameters it added, on the CPU with the
    values it gave them (LoRA's lora_A and lora_B), leaving meta placeholders in the model.

    LoRALinear draws lora_A from the seeded generator on the CPU, then moves it to its base weight's
    device: on meta the values would be lost. So while adapt runs, every weight is an empty CPU
    stand-in (the adapters land on the CPU, drawn in the same order as in one process), and the meta
    weights go back afterwards, frozen or not as adapt left the stand-ins."""
    def put(name, p):
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, p)

    before = dict(model.named_parameters())
    for name, p in before.items():
        put(name, torch.nn.Parameter(torch.empty(0), p.requires_grad))
    adapt(model)
    added = {}
    for name, p in list(model.named_parameters()):
        if name in before:
            put(name, before[name].requires_grad_(p.requires_grad))
        else:
            added[name] = p.detach()
            put(name, torch.nn.Parameter(p.detach().to("meta"), p.requires_grad))
    return added


def save_model(model, cfg, path: Path, tok, dtype: torch.dtype) -> None:
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
        lora.add_lora(plain, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, lora.TARGET_SETS[cfg.lora_targets])
        plain.load_state_dict(state)
        lora.save_adapters(plain, path)
        hf.save_pretrained(lora.merge_lora(plain), path)
    else:
        hf.save_pretrained(model, path, state_dict={k: v.to(dtype) for k, v in state.items()})
    tok.save(str(path / "tokenizer.json"))
    (path / GENERATION_FILE).write_text(json.dumps(generation_settings(cfg), indent=2) + "\n")


# A checkpoint carries the settings it was trained to generate with, so that sample.py and evaluate.py
# decode it as it was trained (each flag still overrides them).
GENERATION_FILE = "generation.json"
GENERATION_KEYS = ("tasks", "gen_length", "block_length", "steps", "temperature", "image_steps", "image_sampler",
                   "cfg_scale", "image_width", "image_text_len", "max_prompt_len", "prompt_prefill")


def generation_settings(cfg) -> dict:
    return {k: getattr(cfg, k) for k in GENERATION_KEYS}


def read_generation_settings(path) -> dict:
    """The generation settings saved beside a checkpoint ({} for one written elsewhere, e.g. LLaDA's own)."""
    f = Path(path) / GENERATION_FILE
    return hf.read_json(f, "delete it to use the defaults and flags only") if f.is_file() else {}


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
RESUMABLE = ("resume", "extend", "retrain_sft", "rl_steps", "threads", "device", "sample_every", "checkpoint_every", "keep_last",
             "max_bad_steps", "device_batch_size", "out_dir", "lr", "grad_clip")


def reference_identity(cfg) -> dict:
    """What the reference policy (and the starting point) is: the SFT cache key or the init_from
    checkpoint's config and index, so a resumed run cannot silently change its KL anchor."""
    if cfg.init_from == "scratch":
        meta = sft_dir_of(cfg) / "sft_meta.json"
        return {"sft_meta": hf.read_json(meta) if meta.is_file() else None}
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


def startup_checks(cfg, device) -> None:
    """On every rank, and agreed: if one rank fails (a node-local disk, say), all stop here together.
    Then rank 0 writes out_dir/config.json."""
    out = Path(cfg.out_dir)
    error = None
    try:
        _check_out_dir(cfg, out)
    except (ValueError, OSError) as e:
        error = e
    if scale.all_max(torch.tensor([int(error is not None)], device=device)).item():
        raise error or ValueError("another rank failed its start-up checks (its message is above)")
    if scale.rank() == 0:
        (out / "config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")
    scale.barrier()
    print0("\n".join(f"  {k} = {v}" for k, v in sorted(asdict(cfg).items())))
    budget.warn_kill_delay(cfg, scale.world())  # SIGTERM's checkpoint must fit in the launcher's kill delay


FINISHED = ("final", "log.jsonl", "summary.json")  # what a run leaves besides checkpoints (config.json is
                                                  # written at start-up, so a run that failed early has one)


def _check_out_dir(cfg, out: Path) -> None:
    """Before any heavy work: out_dir writable with room for a checkpoint, sequence lengths that fit the
    model, no finished run or stale checkpoints that a fresh run would silently overwrite or mix with,
    and an SFT cache that is this run's or none."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"out_dir {out} is not writable ({e.strerror}); pass --out_dir=a writable directory") from None
    mc = None
    if cfg.init_from != "scratch":
        if not (Path(cfg.init_from) / "config.json").is_file():
            raise FileNotFoundError(f"{Path(cfg.init_from) / 'config.json'} not found: --init_from must be a "
                                    "LLaDA/MMaDA checkpoint directory")
        mc = hf.read_config(cfg.init_from)
        image = any(t in IMAGE_TASKS for t in task_list(cfg))
        need = (cfg.image_text_len or 64) + cfg.image_width ** 2 + 2 if image else cfg.max_prompt_len + cfg.gen_length
        if need > mc.max_sequence_length:
            raise ValueError(f"sequences of up to {need} tokens exceed the model's max_sequence_length "
                             f"({mc.max_sequence_length}); lower --max_prompt_len / --gen_length (or image sizes)")
    else:
        check_sft_cache(cfg)
    if cfg.checkpoint_every:
        budget.check_disk(cfg, out, mc or scratch_config(cfg, vocab_size=128))
    any_checkpoint = checkpoint.latest(out)
    if any_checkpoint is not None and not cfg.resume:
        raise ValueError(f"out_dir {out} already holds checkpoints (latest {any_checkpoint.name}): pass "
                         "--resume=true to continue that run, or choose another --out_dir")
    finished = [f"{n}/" if (out / n).is_dir() else n for n in FINISHED if (out / n).exists()]
    if finished and any_checkpoint is None:
        # Without checkpoints (checkpoint_every=0, or fewer steps than it) there is nothing to resume from:
        # this run would start again and replace the files.
        raise ValueError(f"out_dir {out} holds a run ({', '.join(finished)}) and no checkpoint to "
                         f"resume from{'' if cfg.resume else ' (--resume=true continues from checkpoints only)'}"
                         "; choose another --out_dir, or delete that run")
    if any_checkpoint is not None:  # before anything is loaded or config.json is overwritten
        last = resume_point(out)
        state = hf.read_json(last / "state.json", "remove that checkpoint directory")
        checkpoint.check_resumable(last, state, asdict(cfg), reference_identity(cfg), RESUMABLE)
    if scale.rank() == 0:
        _claim_out_dir(out)


PID_FILE = "run.pid"
_HELD: set[Path] = set()


def _claim_out_dir(out: Path) -> None:
    """Two runs started at once in one out_dir would both pass the checks above and then overwrite each
    other's logs and model. The first to create out/run.pid (atomically) holds the directory until it
    exits; a pid file whose process is gone (a killed run) is taken over."""
    pid_file = out / PID_FILE
    for _ in range(3):
        try:
            fd = os.open(pid_file, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                holder = int(pid_file.read_text().strip() or 0)
            except (OSError, ValueError):
                holder = 0
            if holder and holder != os.getpid() and _alive(holder):
                raise ValueError(f"out_dir {out} is in use by the running process {holder} ({pid_file}); wait "
                                 "for it to end, choose another --out_dir, or delete that file if no run holds it")
            pid_file.unlink(missing_ok=True)  # our own (an earlier main() in this process) or a dead run's
            continue
        with os.fdopen(fd, "w") as f:
            f.write(f"{os.getpid()}\n")
        if out not in _HELD:  # one exit hook per directory, however often main() runs in this process
            _HELD.add(out)
            atexit.register(release_out_dir, out)
        return
    raise ValueError(f"out_dir {out}: could not create {pid_file}; choose another --out_dir")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def release_out_dir(out: Path) -> None:
    """Remove out/run.pid if this process holds it."""
    pid_file = Path(out) / PID_FILE
    try:
        if int(pid_file.read_text().strip()) == os.getpid():
            pid_file.unlink()
    except (OSError, ValueError):
        pass


def resume_point(out: Path, quiet: bool = True) -> Path:
    """The newest intact checkpoint of out (checkpoint.latest_intact); newer damaged ones are named, with
    the fix, unless quiet. None intact: a ValueError listing every problem."""
    last, skipped = checkpoint.latest_intact(out)
    if last is None:
        raise ValueError(f"--resume: no intact checkpoint in {out / checkpoint.DIRNAME}: " + "; ".join(skipped)
                         + "; remove the damaged directories, or choose another --out_dir")
    if not quiet:
        for line in skipped:
            print0(f"warning: {line}; resuming from the newest intact checkpoint, {last.name} (remove the "
                   "damaged one to silence this)")
    return last




# -----------------------------------------------------------------------------------------------------
# the run: logs, checkpoints, resume, signals, bad steps


class Run:
    """The bookkeeping around train.py's loop, used as `with Run(cfg, model, opt, device) as run:`.
    Construction resumes from the latest complete checkpoint when --resume is set (run.start is the first
    step to take, run.state["before"] the held-out rewards measured before RL); inside the block SIGTERM and
    SIGINT only set a flag; `record` is called once per RL step with that step's log; `finish` writes the
    model, summary.json and the pictures."""

    def __init__(self, cfg, model, opt, device):
        self.cfg, self.model, self.opt, self.device = cfg, model, opt, device
        self.out = Path(cfg.out_dir)
        self.identity = reference_identity(cfg)
        # What a resumed run must continue from (startup_checks has refused incompatible settings already).
        self.state = {"step": 0, "before": None, "before_by_prompt": None, "bad_steps": 0, "bad_run": 0,
                      "rl_seconds": 0.0, "last_good": None, "grid_before": None}
        last = resume_point(self.out, quiet=False) if cfg.resume and checkpoint.latest(self.out) else None
        if last is not None:
            self.state.update(checkpoint.load(last, model, opt, trainable_only=cfg.lora_rank > 0))
            for group in opt.param_groups:  # the saved optimizer carries the old lr; --lr may change on resume
                group["lr"] = cfg.lr
            print0(f"resumed from {last} at step {self.state['step']}")
        elif cfg.resume:
            print0(f"--resume: no complete checkpoint in {self.out / checkpoint.DIRNAME}; starting from step 0")
        self.start = self.state["step"]
        self.t0 = time.time()
        self.logf = self.timef = None
        if scale.rank() == 0:
            # The logs keep the steps before `start` (a resumed run rewrites what came later).
            self.logf, self.timef = (open(keep_steps_before(self.out / name, self.start), "a")
                                     for name in ("log.jsonl", "times.jsonl"))
        self._stop = checkpoint.graceful_stop()

    def __enter__(self):
        self.signal = self._stop.__enter__()
        return self

    def __exit__(self, *exc):
        self.rl_end = self.rl_seconds()
        self._stop.__exit__(*exc)
        for f in (self.logf, self.timef):
            if f:
                f.close()

    def rl_seconds(self) -> float:
        return self.state["rl_seconds"] + time.time() - self.t0  # over every segment of a resumed run

    def record(self, step: int, log: dict, rolls: list, tok, ids) -> None:
        """Count bad steps, write the logs, show samples, checkpoint on cadence or on a signal."""
        cfg, state = self.cfg, self.state
        bad = "bad_reward" in log or log.get("skipped_updates", 0) > 0
        if "bad_reward" in log:
            print0(f"warning: step {step} skipped: {log['bad_reward']}")
        else:
            print0(log_line(log, cfg.rl_steps))
        state["bad_run"] = state["bad_run"] + 1 if bad else 0
        state["bad_steps"] += bad
        log["bad_steps"] = state["bad_steps"]
        times = {k: log.pop(k) for k in list(log) if k == "seconds" or k.endswith("_s")}
        if self.logf:
            self.logf.write(json.dumps(log) + "\n")
            self.logf.flush()
            self.timef.write(json.dumps({"step": step, **times}) + "\n")
            self.timef.flush()
        if state["bad_run"] >= cfg.max_bad_steps:
            raise TrainingStopped(
                f"{state['bad_run']} consecutive bad steps (non-finite loss, gradient or reward; see the "
                f"warnings above), stopping at step {step}. Last good checkpoint: "
                f"{state['last_good'] or 'none (set --checkpoint_every)'}; fix the cause (a lower --lr or "
                "--grad_clip, the reward function or scorer) and continue from it with --resume=true "
                "(delete the newer checkpoints first)")
        if cfg.sample_every and (step + 1) % cfg.sample_every == 0:
            for r in rolls:
                show(r.batch, r.rewards[scale.shard_rows(len(r.rewards))], tok, ids)
        # Every rank must stop at the same step: the flag is reduced over ranks.
        stopping = scale.all_max(torch.tensor([self.signal["signal"]], device=self.device)).item()
        if (cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0) or stopping:
            print0(f"checkpoint {self._save_checkpoint(step + 1)}")
        if stopping:
            print0(f"stopped by {signal.Signals(int(stopping)).name} after step {step}; continue with: "
                   f"{phases.resume_command()}")
            raise SystemExit(128 + int(stopping))

    def _save_checkpoint(self, step: int) -> Path:
        saved = {**self.state, "step": step, "config": asdict(self.cfg), "reference": self.identity,
                 "world_size": scale.world(), "rl_seconds": self.rl_seconds()}
        # After a good step the checkpoint being written is itself the last good one (the newest, which
        # rotation keeps): the previous one needs no protection, or --keep_last=1 would keep two.
        protect = self.state["last_good"] if self.state["bad_run"] else None
        path = checkpoint.save(self.out, step, self.model, self.opt, saved, keep_last=self.cfg.keep_last,
                               trainable_only=self.cfg.lora_rank > 0, protect=protect)
        if self.state["bad_run"] == 0:  # written after a good step: where to go back to if things go wrong
            self.state["last_good"] = str(path)
        return path

    def finish(self, after: dict, after_by_prompt: dict, grid_after, tok, dtype, sft_seconds: float) -> dict:
        """Write out_dir/final (the policy, with tokenizer.json and generation.json), summary.json (held-out
        mean reward before/after RL per task, the gain's standard error paired by prompt, and seconds) and
        the pictures; returns the summary."""
        before, before_by_prompt = self.state["before"], self.state.get("before_by_prompt") or {}
        save_model(self.model, self.cfg, self.out / "final", tok, dtype)
        summary = {k: {"before": before[k], "after": after[k]} for k in before}
        for k in summary:
            if len(before_by_prompt.get(k, ())) == len(after_by_prompt.get(k, ())) > 1:
                summary[k]["gain_se"] = paired_se([a - b for a, b in zip(after_by_prompt[k], before_by_prompt[k])])
        summary["seconds"] = {"sft": sft_seconds, "rl": self.rl_end}
        if scale.rank() == 0:
            (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            write_pictures(self.cfg, self.out, [("before RL", self.state["grid_before"]), ("after RL", grid_after)])
        print0(f"wrote {self.out / 'final'} and {self.out / 'summary.json'}")
        if scale.rank() == 0:
            release_out_dir(self.out)
        return summary


def show(b, rewards, tok, ids, n: int = 1) -> None:
    """Print n decoded rollouts with their rewards."""
    outs = tasks.decode_window(b, tok, ids)
    for i in range(n):
        prompt = b.examples[i]["prompt"]
        if b.task not in IMAGE_TASKS:
            print0(f"  [{b.task}] {prompt[-200:]!r} -> {outs[i]!r}  reward {rewards[i]:.2f}")
        else:
            print0(f"  [{b.task}] {prompt!r}  reward {rewards[i]:.2f}")
            if b.task == "image":  # toy palette codes; real VQ codes need the image decoder
                from infra import plots  # (ANSI colours on a terminal only, letters in a log file)

                print0(plots.text_image(outs[i], int(math.isqrt(len(outs[i])))))


def write_pictures(cfg, out: Path, grid: list) -> None:
    """out_dir/curves.png (reward, KL, clip fraction per step) and out_dir/images.png (toy images before
    and after RL, prompt under each), when Pillow is installed (plots.py says how to get it otherwise)."""
    from infra import plots

    if (out / "log.jsonl").is_file() and (out / "log.jsonl").stat().st_size:
        plots.plot_curves(out / "log.jsonl", out / "curves.png")
    if grid[0][1] is not None and grid[1][1] is not None:
        summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").is_file() else None
        plots.toy_image_panel(grid, tasks.eval_examples("image", cfg, {})[:tasks.GRID_PROMPTS], cfg.image_width,
                              out / "images.png", summary)
