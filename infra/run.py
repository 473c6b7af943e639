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

import hashlib
import itertools
import json
import math
import os
import signal
import time
from dataclasses import asdict
from pathlib import Path

import torch

import grpo
import importance
import tasks
from importance import generator
from infra import budget, checkpoint, data, hf, lora, scale
from infra.budget import scratch_config
from infra.data import data_paths
from infra.hf import load_tokenizer, read_checkpoint
from infra.scale import print0
from model import ModelConfig, Transformer, num_params
from tasks import IMAGE_TASKS, TOY_TASKS, task_list

# -----------------------------------------------------------------------------------------------------
# settings, device


def validate(cfg) -> None:
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
    need(cfg.adv_std in ("auto", "on", "off"), f"adv_std ({cfg.adv_std!r}) must be auto, on or off")
    need(cfg.reward_shaping in ("none", "official"), f"reward_shaping ({cfg.reward_shaping!r}) must be none or official")
    need(cfg.attend_padding in ("auto", "on", "off"), f"attend_padding ({cfg.attend_padding!r}) must be auto, on or off")
    need(cfg.image_sampler in ("emerge", "maskgit"), f"image_sampler ({cfg.image_sampler!r}) must be emerge or maskgit")
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
    need(cfg.cfg_scale >= 0, f"cfg_scale ({cfg.cfg_scale}) must be >= 0 (0 = no guidance; MaskGRPO uses 3.0)")
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
    need(cfg.image_width >= 1 and cfg.image_text_len >= 0, "image_width must be >= 1 and image_text_len >= 0")
    need(cfg.temperature >= 0, f"temperature ({cfg.temperature}) must be >= 0")
    need(cfg.kv_cache in ("none", "prefix", "dual"), f"kv_cache ({cfg.kv_cache!r}) must be none, prefix or dual")
    need(0 <= cfg.threshold < 1, f"threshold ({cfg.threshold}) must be in [0, 1) (0 = off; Fast-dLLM uses 0.9)")
    need(cfg.dtype in ("auto", "float32", "bfloat16"),
         f"dtype ({cfg.dtype!r}) must be auto, float32 or bfloat16 (float16 needs a grad scaler, which this code omits)")
    for k in ("sft_steps", "rl_steps", "eval_prompts", "device_batch_size"):
        need(getattr(cfg, k) >= 0, f"{k} ({getattr(cfg, k)}) must be >= 0")
    for k in ("prompts_per_step", "sft_batch_size", "image_steps"):
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



class BadStep(Exception):
    """Rewards that are not finite numbers in [0, 1]: the RL step is skipped (rl_step's caller counts it)."""


class TrainingStopped(RuntimeError):
    """Too many consecutive bad steps: the run stops with a message naming the last good checkpoint."""



class Clock:
    """Wall time of the phases of one RL step: lap(name) adds the time since the last lap to that name."""

    def __init__(self):
        self.t0 = self.last = time.time()
        self.times: dict = {}

    def lap(self, name: str) -> None:
        now = time.time()
        self.times[name] = self.times.get(name, 0.0) + now - self.last
        self.last = now

    def laps(self) -> dict:
        return {**self.times, "seconds": time.time() - self.t0}


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
    parts = [f"step {log['step'] + 1}/{total}"]
    for t in sorted({k.split("/")[0] for k in log if k.endswith("/reward")}):
        if f"{t}/reward" in log:
            parts.append(f"{t} reward {log[f'{t}/reward']:.3f} loss {log[f'{t}/loss']:+.4f} "
                         f"clip {log[f'{t}/clipfrac']:.3f} kl {log[f'{t}/kl']:.4f}")
    parts.append(f"{log['seconds']:.1f}s")
    return " | ".join(parts)



SFT_KEYS = ("seed", "d_model", "n_layers", "n_heads", "mlp_hidden_size", "text_noise", "image_noise", "image_width",
            "text_max_steps", "image_loss_weight",
            "sft_steps", "sft_batch_size", "sft_lr", "sft_warmup", "cond_dropout", "gen_length")


def load_or_train_sft(cfg, tok, ids, device, dtype, sft) -> tuple[Path, float]:
    """(directory, SFT seconds) of the toy SFT model: out_dir/sft when it was trained with the same
    settings, else trained now by `sft(model, tok, ids, cfg, device) -> seconds` (by rank 0 alone under
    torchrun; the other ranks wait, then every rank reads the same files)."""
    sft_dir = Path(cfg.sft_dir or Path(cfg.out_dir) / "sft")
    # tasks.py's source is part of the key: a change to the toy data invalidates the cached model.
    tasks_hash = hashlib.sha1(Path(tasks.__file__).read_bytes()).hexdigest()
    meta = {k: getattr(cfg, k) for k in SFT_KEYS} | {"tasks_sha1": tasks_hash}
    meta_file = sft_dir / "sft_meta.json"
    cached = lambda: meta_file.is_file() and json.loads(meta_file.read_text()) == meta
    if not cached() and scale.rank() == 0:
        meta_file.unlink(missing_ok=True)  # the old key must not vouch for half-overwritten weights
        mc = scratch_config(cfg, **tasks.model_config_overrides(tok))
        model = Transformer(mc).init_weights(generator("cpu", cfg.seed, "init")).to(device=device, dtype=dtype)
        print(f"SFT from scratch: {num_params(model) / 1e6:.2f}M parameters, {cfg.sft_steps} steps")
        seconds = sft(model, tok, ids, cfg, device)
        hf.save_pretrained(model, sft_dir)
        tok.save(str(sft_dir / "tokenizer.json"))
        (sft_dir / "sft_seconds.json").write_text(json.dumps({"seconds": seconds}))
        meta_file.write_text(json.dumps(meta, indent=2))  # written last: its presence means "complete"
    scale.barrier()
    print0(f"loading the SFT model from {sft_dir} (delete it to retrain)")
    return sft_dir, json.loads((sft_dir / "sft_seconds.json").read_text())["seconds"]


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
    return json.loads(f.read_text()) if f.is_file() else {}


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
RESUMABLE = ("resume", "rl_steps", "threads", "device", "sample_every", "checkpoint_every", "keep_last",
             "max_bad_steps", "device_batch_size", "out_dir", "lr", "grad_clip")


def reference_identity(cfg) -> dict:
    """What the reference policy (and the starting point) is: the SFT cache key or the init_from
    checkpoint's config and index, so a resumed run cannot silently change its KL anchor."""
    if cfg.init_from == "scratch":
        meta = Path(cfg.sft_dir or Path(cfg.out_dir) / "sft") / "sft_meta.json"
        return {"sft_meta": json.loads(meta.read_text()) if meta.is_file() else None}
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


def _check_out_dir(cfg, out: Path) -> None:
    """Before any heavy work: out_dir writable with room for a checkpoint, sequence lengths that fit the
    model, and no stale checkpoints that a fresh run would silently mix with."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"out_dir {out} is not writable ({e.strerror}); pass --out_dir=a writable directory") from None
    mc = None
    if cfg.init_from != "scratch":
        cfg_file = Path(cfg.init_from) / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"{cfg_file} not found: --init_from must be a LLaDA/MMaDA checkpoint directory")
        mc = hf.config_from_hf(json.loads(cfg_file.read_text()))
        image = any(t in IMAGE_TASKS for t in task_list(cfg))
        need = (cfg.image_text_len or 64) + cfg.image_width ** 2 + 2 if image else cfg.max_prompt_len + cfg.gen_length
        if need > mc.max_sequence_length:
            raise ValueError(f"sequences of up to {need} tokens exceed the model's max_sequence_length "
                             f"({mc.max_sequence_length}); lower --max_prompt_len / --gen_length (or image sizes)")
    if cfg.checkpoint_every:
        budget.check_disk(cfg, out, mc or scratch_config(cfg, vocab_size=128))
    last = checkpoint.latest(out)
    if last is not None and not cfg.resume:
        raise ValueError(f"out_dir {out} already holds checkpoints (latest {last.name}): pass "
                         "--resume=true to continue that run, or choose another --out_dir")
    if last is not None:  # before anything is loaded or config.json is overwritten
        state = json.loads((last / "state.json").read_text())
        checkpoint.check_resumable(last, state, asdict(cfg), reference_identity(cfg), RESUMABLE)




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
        self.state = {"step": 0, "before": None, "bad_steps": 0, "bad_run": 0, "rl_seconds": 0.0,
                      "last_good": None, "grid_before": None}
        last = checkpoint.latest(self.out) if cfg.resume else None
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
            print0(f"warning: step {step + 1} skipped: {log['bad_reward']}")
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
                f"warnings above), stopping at step {step + 1}. Last good checkpoint: "
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
            print0(f"stopped by {signal.Signals(int(stopping)).name} after step {step + 1}; continue with the "
                   "same command and --resume=true")
            raise SystemExit(128 + int(stopping))

    def _save_checkpoint(self, step: int) -> Path:
        saved = {**self.state, "step": step, "config": asdict(self.cfg), "reference": self.identity,
                 "world_size": scale.world(), "rl_seconds": self.rl_seconds()}
        path = checkpoint.save(self.out, step, self.model, self.opt, saved, keep_last=self.cfg.keep_last,
                               trainable_only=self.cfg.lora_rank > 0, protect=self.state["last_good"])
        if self.state["bad_run"] == 0:  # written after a good step: where to go back to if things go wrong
            self.state["last_good"] = str(path)
        return path

    def finish(self, after: dict, grid_after, tok, dtype, sft_seconds: float) -> dict:
        """Write out_dir/final (the policy, with tokenizer.json and generation.json), summary.json (held-out
        mean reward before/after RL per task, and seconds) and the pictures; returns the summary."""
        before = self.state["before"]
        save_model(self.model, self.cfg, self.out / "final", tok, dtype)
        summary = {k: {"before": before[k], "after": after[k]} for k in before}
        summary["seconds"] = {"sft": sft_seconds, "rl": self.rl_end}
        if scale.rank() == 0:
            (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            write_pictures(self.cfg, self.out, [("before RL", self.state["grid_before"]), ("after RL", grid_after)])
        print0(f"wrote {self.out / 'final'} and {self.out / 'summary.json'}")
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
                print0(tasks.render_image(outs[i], int(math.isqrt(len(outs[i])))))


def write_pictures(cfg, out: Path, grid: list) -> None:
    """out_dir/curves.png (reward, KL, clip fraction per step) and out_dir/images.png (toy images before
    and after RL, prompt under each), when Pillow is installed (plots.py says how to get it otherwise)."""
    from infra import plots

    if (out / "log.jsonl").is_file() and (out / "log.jsonl").stat().st_size:
        plots.plot_curves(out / "log.jsonl", out / "curves.png")
    if grid[0][1] is not None and grid[1][1] is not None:
        prompts = [ex["prompt"] for ex in tasks.eval_examples("image", cfg, {})[:tasks.GRID_PROMPTS]]
        plots.image_grid(grid, prompts, cfg.image_width, out / "images.png")
