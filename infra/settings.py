"""Settings checked at the boundary, and the device: every train.py, evaluate.py and sample.py setting is
validated here once, naming the value and a fix, so that the method files only assert their preconditions.
A checkpoint carries the generation settings it was trained with (generation.json), read back here.
"""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import torch

import grpo
import importance
import sample
import tasks
from infra import fast_sample, hf, lora, scale, tracker
from infra.data import data_paths
from infra.scale import print0
from tasks import IMAGE_TASKS, TOY_TASKS, task_list


def _need(ok, msg):
    if not ok:
        raise ValueError(msg)


def _one_of(names) -> str:
    return ", ".join(names[:-1]) + " or " + names[-1]


def validate_generation(o) -> None:
    """The sampler settings train.Config and sample.py's options share (same names, same rules):
    checked here, once, for both, so that the samplers only assert their preconditions."""
    need = _need
    for k, v in vars(o).items():  # inf or nan would pass the range checks below (inf > 0) and fail mid-run
        need(not isinstance(v, float) or math.isfinite(v), f"{k} ({v}) must be a finite number")
    for k in ("gen_length", "block_length", "steps", "image_steps", "image_width"):
        need(getattr(o, k) >= 1, f"{k} ({getattr(o, k)}) must be >= 1")
    need(o.steps <= o.gen_length, f"steps ({o.steps}) must be <= gen_length ({o.gen_length}): each step commits at "
         f"least one token, so steps beyond gen_length do nothing; try --steps={o.gen_length}")
    need(o.gen_length % o.block_length == 0,
         f"gen_length ({o.gen_length}) must be divisible by block_length ({o.block_length}); "
         f"try --block_length={o.gen_length}")
    blocks = o.gen_length // o.block_length
    need(o.steps % blocks == 0 and o.steps >= blocks,
         f"steps ({o.steps}) must be a positive multiple of the number of blocks ({blocks}); "
         f"try --steps={blocks * max(1, o.steps // blocks)}")
    need(o.temperature >= 0, f"temperature ({o.temperature}) must be >= 0")
    need(o.kv_cache in fast_sample.KV_CACHES, f"kv_cache ({o.kv_cache!r}) must be {_one_of(fast_sample.KV_CACHES)}")
    need(0 <= o.threshold < 1, f"threshold ({o.threshold}) must be in [0, 1) (0 = off; Fast-dLLM uses 0.9)")
    need(o.image_sampler in sample.IMAGE_SAMPLERS,
         f"image_sampler ({o.image_sampler!r}) must be {_one_of(sample.IMAGE_SAMPLERS)}")
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
    need(cfg.mu >= 1, f"mu ({cfg.mu}) must be >= 1")
    for g in ("gamma_text", "gamma_image"):
        need(0 <= getattr(cfg, g) < 1, f"{g} ({getattr(cfg, g)}) must be in [0, 1)")
    need(cfg.clip_eps > 0, f"clip_eps ({cfg.clip_eps}) must be > 0 (paper: 0.2)")
    need(cfg.beta >= 0, f"beta ({cfg.beta}) must be >= 0")
    need(cfg.estimator in importance.ESTIMATORS, f"estimator ({cfg.estimator!r}) must be one of {importance.ESTIMATORS}")
    need(cfg.text_reversing in importance.MODES, f"text_reversing ({cfg.text_reversing!r}) must be one of {importance.MODES}")
    need(cfg.loss_norm in grpo.NORMS, f"loss_norm ({cfg.loss_norm!r}) must be one of {grpo.NORMS}")
    ignored = importance.ignored_settings(cfg, type(cfg)())
    if ignored:  # a setting the chosen estimator never reads would otherwise be silently without effect
        print0(f"warning: --estimator={cfg.estimator} does not read {', '.join(f'--{k}' for k in ignored)}; "
               "drop the flag, or choose an estimator that uses it (importance.READ_BY)")
    need(cfg.estimator != "trajectory" or cfg.loss_norm == "token", "estimator 'trajectory' scores each token at "
         "its own decoding step, which only the token mean adds up across steps: use --loss_norm=token")
    need(cfg.trajectory_states >= 0, f"trajectory_states ({cfg.trajectory_states}) must be >= 0 (0 = every "
         "decoding state; K > 0 scores K of them per update)")
    need(cfg.estimator == "trajectory" or not cfg.trajectory_states, f"trajectory_states ({cfg.trajectory_states}) "
         f"draws decoding states of --estimator=trajectory, not of {cfg.estimator!r}: add --estimator=trajectory or drop it")
    need(cfg.adv_std in ("auto", "on", "off"), f"adv_std ({cfg.adv_std!r}) must be auto, on or off")
    need(cfg.text_reward in tasks.TEXT_REWARDS, f"text_reward ({cfg.text_reward!r}) must be one of {tuple(tasks.TEXT_REWARDS)}")
    need(cfg.reward_shaping in ("none", "official"), f"reward_shaping ({cfg.reward_shaping!r}) must be none or official")
    need(cfg.attend_padding in ("auto", "on", "off"), f"attend_padding ({cfg.attend_padding!r}) must be auto, on or off")
    known = tuple(tasks.TASKS)
    bad = [t for t in task_list(cfg) if t not in known]
    need(not bad and cfg.tasks, f"tasks ({cfg.tasks!r}) must be a comma-separated subset of {','.join(known)}")
    twice = sorted({t for t in task_list(cfg) if task_list(cfg).count(t) > 1})
    need(not twice, f"tasks ({cfg.tasks!r}) names {', '.join(twice)} twice, which would roll out and update it twice "
         f"per step; give each task once (--tasks={','.join(dict.fromkeys(task_list(cfg)))})")
    real = [t for t in task_list(cfg) if t not in TOY_TASKS]
    need(not real or cfg.dry_run or cfg.init_from not in ("", "scratch"),
         f"tasks {real} need a pretrained model: pass --init_from=DIR (a LLaDA/MMaDA checkpoint directory)")
    need(cfg.init_from != "" or cfg.dry_run, "init_from is empty: pass --init_from=DIR, the local checkpoint")
    given = getattr(cfg, "_given", frozenset())  # the flags typed (infra/cli.parse); empty when built in code
    if cfg.init_from != "scratch" and not cfg.dry_run:
        # Settings of the toy model built and SFT-trained here: a pretrained model has its own shape and no SFT.
        idle = sorted(given & set(SCRATCH_SHAPE))
        need(not idle, f"{', '.join('--' + k for k in idle)} {'sets' if len(idle) == 1 else 'set'} the shape of the "
             f"toy model trained from scratch, but --init_from={cfg.init_from} is given (its config.json sets the "
             "shape): drop " + ("it" if len(idle) == 1 else "them"))
        idle = sorted(given & set(SCRATCH_SFT))
        if idle:  # harmless, so a warning: a command line reused from a toy run keeps working
            print0(f"warning: {', '.join('--' + k for k in idle)} only act on the SFT stage of a model trained from "
                   f"scratch; with --init_from={cfg.init_from} there is none, so they do nothing")
    idle = [f"--{k} (it acts on {what})" for k, what in idle_flags(cfg) if k in given]
    if idle:  # recorded in config.json, so a silent no-op would read as a setting of the run
        one = len(idle) == 1
        print0(f"warning: with --tasks={cfg.tasks}, {'; '.join(idle)} {'does' if one else 'do'} nothing: drop "
               f"{'it' if one else 'them'}, or add a task {'it acts' if one else 'they act'} on")
    if "eval_data" in given:
        need(cfg.eval_prompts > 0, f"--eval_data is given but --eval_prompts=0 scores none of it: drop one of them")
    train_files = data_paths(cfg.train_data, "train_data")
    for t in real:
        need(t in train_files or cfg.dry_run, f"task {t!r} needs its training file: --train_data={t}=PATH")
    for field_name, paths in (("train_data", train_files), ("eval_data", data_paths(cfg.eval_data, "eval_data"))):
        extra = [t for t in paths if t not in real]
        need(not extra, f"{field_name} names {extra}, which are not among the RL tasks {task_list(cfg)}")
    need("geneval" not in real or cfg.image_scorer_url or cfg.dry_run,
         "task geneval needs a reward model: --image_scorer_url=http://HOST:PORT (scorer.RemoteScorer; "
         "`python -m infra.scorer --stub` serves a stand-in)")
    need(cfg.image_scorer_timeout > 0, f"image_scorer_timeout ({cfg.image_scorer_timeout}) must be > 0 seconds "
         "(default 30; a scorer serving every rank at once may need more)")
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
    if not cfg.dry_run:  # a dry run plans for GPUs it need not see
        check_device(cfg.device)
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
    tracker.check(cfg)  # an unknown tracker, or its package missing: one line with the install command
    need(cfg.max_prompt_len >= 8, f"max_prompt_len ({cfg.max_prompt_len}) must be >= 8")
    need(cfg.dtype in ("auto", "float32", "bfloat16"),
         f"dtype ({cfg.dtype!r}) must be auto, float32 or bfloat16 (float16 needs a grad scaler, which this code omits)")
    for k in ("sft_steps", "rl_steps", "eval_prompts", "device_batch_size"):
        need(getattr(cfg, k) >= 0, f"{k} ({getattr(cfg, k)}) must be >= 0")
    for k in ("prompts_per_step", "sft_batch_size"):
        need(getattr(cfg, k) >= 1, f"{k} ({getattr(cfg, k)}) must be >= 1")
    other = [k for k in resume_changes(cfg) if k not in CHANGEABLE]
    need(not other, f"change_on_resume ({cfg.change_on_resume!r}) names {', '.join(other)}: only "
         f"{_one_of(CHANGEABLE)} may change when a run resumes (any other change makes another run: start it "
         "with another --out_dir)")
    need(cfg.resume or not cfg.change_on_resume, "--change_on_resume changes settings of a run being continued: "
         "pass --resume=true with it, or drop it")


def check_device(name: str, flag: str = "device") -> None:
    """--device: auto, cpu, cuda or cuda:N (this code's maths runs on CPU and CUDA only), and CUDA only when
    torch sees a GPU (cuda:N only when it sees N + 1 of them)."""
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", name):
        hint = " (Apple GPUs are not supported: use --device=cpu)" if name == "mps" else \
            " (for a GPU: --device=cuda)" if name.lower() in ("gpu", "cuda0", "nvidia") else ""
        raise ValueError(f"{flag} ({name!r}) must be auto, cpu, cuda or cuda:N{hint}")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"{flag} ({name!r}) asks for CUDA, but torch sees no GPU; use --{flag}=cpu")
    if name.startswith("cuda:") and int(name[5:]) >= torch.cuda.device_count():
        raise ValueError(f"{flag} ({name!r}): torch sees {torch.cuda.device_count()} GPU(s), numbered from 0")


def check_threads(n: int, flag: str = "threads") -> None:
    if n < 0:
        raise ValueError(f"{flag} ({n}) must be >= 0 (0 = torch's default; on a shared machine pass 1)")


def idle_flags(cfg) -> list:
    """[(setting, what it acts on)] for the settings that cfg's tasks never read."""
    chosen = task_list(cfg)
    benchmark_text = [t for t in chosen if t not in TOY_TASKS and t not in IMAGE_TASKS]
    idle = []
    if not benchmark_text:
        idle += [(k, "benchmark prompts: gsm8k, math, mbpp, countdown, sudoku") for k in
                 ("system_prompt", "prompt_prefill", "reward_shaping")]
    if "text" not in chosen:
        idle += [(k, "the toy text task") for k in ("text_reward", "text_max_steps")]
    if not cfg.image_scorer_url:
        idle.append(("image_scorer_timeout", "the image scorer of --image_scorer_url, for geneval"))
    return idle


# The settings a resumed run may change, named in --change_on_resume (a run stopped by bad steps continues more
# carefully); any other difference from the checkpoint's settings is refused (infra/outdir.RESUMABLE).
CHANGEABLE = ("lr", "grad_clip")


def resume_changes(cfg) -> tuple:
    """The settings --change_on_resume names (checked by validate)."""
    return tuple(k.strip() for k in cfg.change_on_resume.split(",") if k.strip())


# Flags that only shape and train the toy model built here (init_from=scratch): with --init_from they act on
# nothing, so the shape is refused when typed and the SFT settings are warned about (a preset may set them).
SCRATCH_SHAPE = ("d_model", "n_layers", "n_heads", "mlp_hidden_size")
SCRATCH_SFT = ("sft_dir", "retrain_sft", "sft_steps", "sft_batch_size", "sft_lr", "sft_warmup", "cond_dropout",
               "text_noise", "image_noise", "image_loss_weight")


def setup(cfg) -> tuple[torch.device, torch.dtype]:
    """Pick device and compute dtype once (joining torchrun's process group if there is one), and say why."""
    check_threads(cfg.threads)
    check_device(cfg.device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = scale.init(cfg.device)
    if not cfg.threads and device.type == "cpu":
        # One thread: the toy's matrices are too small to gain much from more, and on cores other jobs keep busy
        # OpenMP's threads wait on each other (40 toy SFT steps at load 3 on 2 cores: 16 s with one, 147 s with two).
        torch.set_num_threads(1)
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


# A checkpoint carries the settings it was trained to generate with, so that sample.py and evaluate.py
# decode it as it was trained (each flag still overrides them), and those its held-out evaluation scored
# with (the toy problems' length, the text verifier, the attention over padding, the system turn).
GENERATION_FILE = "generation.json"


GENERATION_KEYS = ("tasks", "gen_length", "block_length", "steps", "temperature", "image_steps", "image_sampler",
                   "cfg_scale", "image_width", "image_text_len", "max_prompt_len", "prompt_prefill", "system_prompt",
                   "attend_padding", "text_max_steps", "text_reward")


def generation_settings(cfg) -> dict:
    return {k: getattr(cfg, k) for k in GENERATION_KEYS}


# The type of each GENERATION_KEYS value (train.Config's); a float field takes an integer too.
GENERATION_TYPES = {"tasks": str, "gen_length": int, "block_length": int, "steps": int, "temperature": float,
                    "image_steps": int, "image_sampler": str, "cfg_scale": float, "image_width": int,
                    "image_text_len": int, "max_prompt_len": int, "prompt_prefill": str, "system_prompt": str,
                    "attend_padding": str, "text_max_steps": int, "text_reward": str}


def read_generation_settings(path) -> dict:
    """The generation settings saved beside a checkpoint ({} for one written elsewhere, e.g. LLaDA's own),
    each of its type: a hand-edited value of another type ("twelve", null, 12.5 for a length) is one line
    naming the file, the key and the fix."""
    f = Path(path) / GENERATION_FILE
    if not f.is_file():
        return {}
    fix = "delete it to use the defaults and flags only"
    saved = hf.read_json(f, fix)
    if not isinstance(saved, dict):
        raise ValueError(f"{f} holds {type(saved).__name__}, not an object of settings; {fix}")
    for k, v in saved.items():
        kind = GENERATION_TYPES.get(k)
        number = isinstance(v, (int, float)) and not isinstance(v, bool)  # JSON true is no number
        ok = kind is None or (isinstance(v, str) if kind is str else number and (kind is float or isinstance(v, int)))
        if not ok:
            what, like = {int: ("a whole number", 12), float: ("a number", 1.0), str: ("a string", "text")}[kind]
            raise ValueError(f"{f}: {k} is {json.dumps(v)}, not {what}; correct it (e.g. \"{k}\": "
                             f"{json.dumps(like)}), or {fix}")
    return saved
