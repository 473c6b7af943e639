"""The first-GPU check: train.main end to end on an 8B-shaped checkpoint, measured, printed as ONE table, and
DECIDED (tests/first_gpu_checks.py): the exit status is 1, with one line per failed figure, when

  - update 0's first ratio (its largest and its mean, grpo.policy_loss's) is not 1 within RATIO_TOL: update 0
    re-scores pi_old's inputs with pi_old's weights (LoRA's B starts at zero, so dropout changes nothing);
  - a loss or a gradient norm of any update is not a finite number;
  - a phase's peak CUDA memory (allocated) is more than PEAK_SLACK (25%) above the dry run's figure for the
    same settings, world size and padded prompt length (infra/budget.memory);
  - the checkpoint does not resume to the same next step: a Run built with --resume on the trained model,
    after its adapters and optimizer state are zeroed, must start at the step after the one taken and give
    back every adapter and optimizer tensor as the run left them.

    python tests/first_gpu.py                          # one GPU: meant to take <= 10 minutes (80 GB)
    torchrun --nproc_per_node=2 tests/first_gpu.py     # two GPUs: NCCL, and FSDP2 sharding over two ranks
    python tests/first_gpu.py --with_test_cuda         # also runs tests/test_cuda*.py first (about 8 more minutes)
    python tests/first_gpu.py --device=cpu             # the CPU rehearsal at a small width (tests/test_first_gpu.py)

What it does, in order:
  1. versions: torch, CUDA, the GPU and its total memory, the torch floor of multi-GPU runs
     (infra/scale.check_torch, and the FSDPModule methods it stands for present) and whether torchrun reads
     TORCH_ELASTIC_SHUTDOWN_TIMEOUT (infra/budget.torchrun_reads_shutdown_timeout);
  2. optionally tests/test_cuda.py and test_cuda_torchrun.py (--with_test_cuda), its pass/fail line in the table;
  3. a random checkpoint written by infra/hf.save_pretrained (rank 0) with the toy tokenizer: on a GPU
     LLaDA-8B's shape (32 layers, d_model 4096, vocab 126,464), drawn directly in bf16 on the device
     (tests/cuda_helpers.random_weights); on the CPU the same 32 layers at d_model 64 with the same 126,464-row
     vocabulary. The toy tokenizer has 92 tokens, so nearly every sampled id lies outside it: decoding
     drops them and the toy verifier scores the empty answer 0 (checked in the table). So that the update
     has a gradient, the step trains on a stand-in reward computed from the sampled ids;
  4. train.main on it: the toy text task, LoRA r 128 on the official targets with dropout 0.05, activation
     checkpointing, --gen_length=256 --block_length=16 --steps=128 (CPU: 16/8/8), one RL step, a DCP
     checkpoint and final/;
  5. the resume check above;
  6. the table: per phase (rollout, reward, scoring = old/ref log-probs, update, checkpoint, final) the
     peak allocated and reserved CUDA memory (peak statistics reset when a phase starts; the largest over
     the ranks) against the dry run's rows, seconds per phase (out_dir/times.jsonl; checkpoint and final/
     timed here), generated tokens/s and seconds per RL step against the dry run's for the GPU it runs on
     (budget.GPU_PEAKS by device name, at the assumed MFU), sizes on disk, update 0's first ratio; then
     the decision.

Phases are told apart by the public functions train.rl_step calls, wrapped by module attribute for the run
(train.rollout / sample.rollout, tasks.score, importance.token_logprobs without / with gradients, grpo.policy_loss for the
ratio and the losses, train.clip_grad_norm for the gradient norms, Run.record and Run.finish); nothing inside
train.py is patched. On the GPU the run needs about 35 GB of disk in --out_dir (16 GB random checkpoint,
17 GB final/, 2 GB checkpoint) and 16 GB of host memory while the random checkpoint is written; delete the
folder afterwards. Not yet run on a GPU.

FIRST_GPU_FAULTS (tests only; comma separated) plants a fault so that tests/test_first_gpu.py can show each
decision fail: "ratio" adds 0.05 to pi_old's log-probs of view 0, "nan" makes one of the last view's NaN,
"peak" holds an extra buffer of twice the dry run's rollout figure through the rollout (on the CPU, which
has no allocator statistics, that buffer's size is the rollout's measured peak), "resume" rewrites the
checkpoint's state.json to step 0."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

# `python tests/first_gpu.py` puts tests/ first on the path; the repository root must come before any
# installed copy of the project.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "tests"))
import grpo  # noqa: E402
import importance  # noqa: E402
import tasks  # noqa: E402
import train  # noqa: E402
from cuda_helpers import random_weights  # noqa: E402
from first_gpu_checks import GB, RATIO_TOL, decide, du, fmt_gb, format_table, gpu_kind, planted_faults  # noqa: E402
from infra import budget, hf, run as run_mod, scale, toy  # noqa: E402
from model import ModelConfig  # noqa: E402

# Inner updates per rollout batch: None keeps the Config default. The flag's name is in one place here.
MU_FLAG, MU = "mu", None

LLADA_VOCAB = 126464
# (layers, d_model, heads, mlp hidden) of the random checkpoint; the vocabulary is LLaDA-8B's on both.
SHAPE = {"cuda": (32, 4096, 32, 12288), "cpu": (32, 64, 4, 128)}
# decoding settings and the step's rows: the llada8b preset's on a GPU (12 rows = its device_batch_size,
# one chunk); on the CPU short windows and rows split into two chunks
DECODE = {"cuda": dict(gen_length=256, block_length=16, steps=128, prompts_per_step=2, group_size=6,
                       device_batch_size=12),
          "cpu": dict(gen_length=16, block_length=8, steps=8, prompts_per_step=2, group_size=4,
                      device_batch_size=4)}
PHASES = ("rollout", "reward", "scoring", "update", "checkpoint", "final")
DRY_ROW = {"rollout": "lora_rollout", "scoring": "lora_scoring", "update": "lora_update"}


# -----------------------------------------------------------------------------------------------------
# phases: peak memory and seconds, keyed by the public function being entered


class PhaseMeter:
    """The current phase changes when a wrapped function of another phase is entered; each phase keeps the
    largest peak (allocated, reserved) seen while it was current and its seconds."""

    def __init__(self, cuda: bool):
        self.cuda, self.current, self.since = cuda, None, 0.0
        self.peak = {}      # phase -> (allocated, reserved) bytes
        self.seconds = {}   # phase -> wall seconds
        self.first_ratio = None  # update 0's first chunk: (ratio_max, ratio_mean)
        self.losses = []    # every update chunk's loss (grpo.policy_loss's sums)
        self.grad_norms = []  # every update's gradient norm (train.clip_grad_norm)
        self.rollout_rows = 0
        self.prompt_len = None
        self.window_ids = []  # every rollout's completion ids, to count those outside the tokenizer
        self.verifier_rewards = []  # the toy verifier's rewards of every rollout
        self.run = None     # train.main's Run, seen at Run.record (the resume check uses its model)
        self.ballast = {}   # phase -> bytes held through it (the "peak" fault)
        self._held = None

    def enter(self, phase):
        if phase == self.current:
            return
        self.close()
        self.current, self.since = phase, time.time()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        if phase in self.ballast and self.cuda:
            self._held = torch.empty(self.ballast[phase], dtype=torch.uint8, device="cuda")

    def close(self):
        if self.current is None:
            return
        if self.cuda:
            torch.cuda.synchronize()
            now = (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
        elif self.current in self.ballast:  # no allocator statistics on the CPU: the ballast stands for them
            now = (self.ballast[self.current],) * 2
        else:
            now = None
        if now is not None:
            old = self.peak.get(self.current, (0, 0))
            self.peak[self.current] = tuple(max(a, b) for a, b in zip(old, now))
        self._held = None
        self.seconds[self.current] = self.seconds.get(self.current, 0.0) + time.time() - self.since
        self.current = None


@contextlib.contextmanager
def wrapped(meter: PhaseMeter, faults=frozenset()):
    """Wrap, for the duration, the public functions one RL step calls, by module or class attribute."""
    saved = []

    def wrap(owner, name, phase_of, after=None):
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def inner(*a, **kw):
            if phase_of is not None:
                meter.enter(phase_of(a, kw))
            out = fn(*a, **kw)
            if after:
                after(a, kw, out)
            return out
        saved.append((owner, name, fn))
        setattr(owner, name, inner)

    def saw_rollout(a, kw, out):
        batch = out[0]
        meter.rollout_rows += batch.x.shape[0]
        meter.prompt_len = batch.prompt_len
        meter.window_ids.append(batch.x[:, batch.window_slice].cpu())

    def saw_loss(a, kw, out):
        if torch.is_grad_enabled():
            stats = {k: float(v) for k, v in out[1].items()}
            meter.losses.append(stats["loss"])
            if meter.first_ratio is None:  # sums: the mean is ratio / tokens
                meter.first_ratio = (stats["ratio_max"], stats["ratio"] / max(stats["tokens"], 1.0))

    # train.py imports rollout by name; sample.rollout is the same function under its module
    for owner in (train, tasks):
        if hasattr(owner, "rollout"):
            wrap(owner, "rollout", lambda a, kw: "rollout", saw_rollout)
    # The toy verifier scores every random completion 0, so the advantages and the update's gradient would
    # be 0. Its rewards are kept for the table; the step trains on a stand-in from the sampled ids.
    score = tasks.score

    @functools.wraps(score)
    def stand_in(b, *a, **kw):
        meter.enter("reward")
        meter.verifier_rewards.append(score(b, *a, **kw))
        return (b.x[:, b.window_slice].sum(1) % 3).float().cpu() / 2
    saved.append((tasks, "score", score))
    tasks.score = stand_in
    if faults & {"ratio", "nan"}:
        frozen, calls = train.frozen_logprobs, []

        @functools.wraps(frozen)
        def planted(model, b, views, ctx):
            out = frozen(model, b, views, ctx)
            calls.append(1)
            if len(calls) == 1:  # pi_old's pass of the first task (pi_ref's comes second)
                if "ratio" in faults:  # update 0 scores view 0: its ratios become exp(-0.05)
                    out[0] = out[0] + 0.05 * views.loss_masks[0].float()
                if "nan" in faults:  # the last update's view: one scored token's log-prob is NaN
                    first = views.loss_masks[-1].flatten().nonzero()[0]
                    out[-1] = out[-1].flatten().index_fill(0, first, float("nan")).view_as(out[-1])
            return out
        saved.append((train, "frozen_logprobs", frozen))
        train.frozen_logprobs = planted
    wrap(importance, "token_logprobs", lambda a, kw: "update" if torch.is_grad_enabled() else "scoring")
    wrap(grpo, "policy_loss", lambda a, kw: "update" if torch.is_grad_enabled() else "scoring", saw_loss)
    wrap(train, "clip_grad_norm", None, lambda a, kw, out: meter.grad_norms.append(out))
    wrap(run_mod.Run, "record", lambda a, kw: "checkpoint", lambda a, kw, out: setattr(meter, "run", a[0]))
    wrap(run_mod.Run, "finish", lambda a, kw: "final")
    try:
        yield meter
    finally:
        meter.close()
        for owner, name, fn in reversed(saved):
            setattr(owner, name, fn)


# -----------------------------------------------------------------------------------------------------
# the steps


def versions(dev: torch.device) -> list:
    from torch.distributed.fsdp import FSDPModule
    try:
        scale.check_torch()
        floor = f"ok (>= {'.'.join(map(str, scale.MIN_TORCH))})"
    except ValueError:
        floor = f"too old (< {'.'.join(map(str, scale.MIN_TORCH))})"
    missing = [m for m in scale.FSDP_METHODS if not hasattr(FSDPModule, m)]
    reads = budget.torchrun_reads_shutdown_timeout()
    total = torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else None
    return [("torch", torch.__version__, ""),
            ("CUDA", torch.version.cuda or "none", ""),
            ("device", torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU", ""),
            ("device memory", "n/a (CPU)" if total is None else f"{total / GB:.1f} GiB", ""),
            ("ranks", f"{scale.world()} ({torch.distributed.get_backend() if scale.world() > 1 else 'one process'})",
             ""),
            ("torch floor (scale.check_torch)", floor, "ok"),
            ("FSDPModule methods of torch 2.8", "present" if not missing else f"missing {', '.join(missing)}",
             "present"),
            ("TORCH_ELASTIC_SHUTDOWN_TIMEOUT read by torchrun", "yes" if reads else "no (kills 30 s after SIGTERM)",
             f"yes from torch {budget.SHUTDOWN_TIMEOUT_TORCH}")]


def run_test_cuda() -> tuple:
    t0 = time.time()
    files = [str(ROOT / "tests" / f) for f in ("test_cuda.py", "test_cuda_torchrun.py")]
    p = subprocess.run([sys.executable, "-m", "pytest", *files, "-q", "-s", "-p", "no:xdist", "-p", "no:cacheprovider"],
                       cwd=ROOT, capture_output=True, text=True)
    lines = [ln for ln in p.stdout.splitlines() if ln.strip()]
    last = lines[-1].strip("= ") if lines else f"exit {p.returncode}"
    return ("tests/test_cuda*.py", f"{last} ({time.time() - t0:.0f} s)", "all passed")


def checkpoint_config(dev: torch.device) -> ModelConfig:
    """The random checkpoint's config: the device's SHAPE with LLaDA-8B's vocabulary and the toy tokenizer's ids."""
    layers, d, heads, hidden = SHAPE[dev.type]
    vocab = {**tasks.model_config_overrides(toy.build_tokenizer()), "vocab_size": LLADA_VOCAB}
    return ModelConfig(d_model=d, n_layers=layers, n_heads=heads, n_kv_heads=heads, mlp_hidden_size=hidden,
                       max_sequence_length=4096, **vocab)


def write_checkpoint(path: Path, dev: torch.device) -> ModelConfig:
    """Random weights of checkpoint_config, drawn on the device in bf16 (float32 on the CPU, as a run there
    computes), written by infra/hf."""
    mc = checkpoint_config(dev)
    model = random_weights(mc, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32)
    hf.save_pretrained(model, path)
    toy.build_tokenizer().save(str(path / "tokenizer.json"))
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return mc


def train_flags(init: Path, out: Path, dev: torch.device) -> list:
    d = DECODE[dev.type]
    flags = [f"--init_from={init}", f"--out_dir={out}", f"--device={dev.type if scale.world() > 1 else dev}",
             "--tasks=text", "--eval_prompts=0",
             "--lora_rank=128", "--lora_targets=official", "--lora_dropout=0.05", "--activation_checkpointing=true",
             "--rl_steps=1", "--checkpoint_every=1", "--sample_every=0", "--seed=0",
             *(f"--{k}={v}" for k, v in d.items())]
    if MU is not None:
        flags.append(f"--{MU_FLAG}={MU}")
    if dev.type == "cpu":
        flags.append("--threads=1")
    return flags


def dry_run(flags: list, prompt_len: int | None = None) -> dict:
    """infra/budget's dry run of the same settings at this world size and the prompt length the step padded to."""
    pad = [] if prompt_len is None else [f"--max_prompt_len={prompt_len}"]
    cfg = train.parse_args([*flags, "--dry_run=true", f"--dry_run_gpus={scale.world()}", *pad])
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
        return budget.report(cfg)


def resume_check(meter: PhaseMeter, log) -> tuple[int, int, int]:
    """(the step a --resume Run starts at, the step the run would take next, tensors not given back): the
    trained adapters and AdamW state are zeroed, then a Run with --resume loads the newest checkpoint."""
    run = meter.run
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # FSDP2: this rank's shard
    params = [p for p in run.model.parameters() if p.requires_grad]
    states = [v for st in run.opt.state.values() for v in st.values() if torch.is_tensor(v)]
    kept = [local(t.detach()).clone() for t in params + states]
    with torch.no_grad():
        for t in params + states:
            t.zero_()
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        again = run_mod.Run(dataclasses.replace(run.cfg, resume=True), run.model, run.opt, run.device)
    for f in (again.logf, again.timef):
        if f:
            f.close()
    states = [v for st in run.opt.state.values() for v in st.values() if torch.is_tensor(v)]
    differ = sum(not torch.equal(local(t.detach()), k) for t, k in zip(params + states, kept))
    differ += abs(len(params + states) - len(kept))
    return again.start, run.done, differ


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out_dir", default="out/first_gpu", help="a new or empty directory for everything written")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    ap.add_argument("--with_test_cuda", action="store_true", help="also run tests/test_cuda*.py first")
    args = ap.parse_args(argv)
    faults = planted_faults()
    out = Path(args.out_dir)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"error: --out_dir {out} is not empty; choose a new directory or delete it")
    if args.device == "auto":
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"error: --device={args.device} but torch sees no CUDA device; pass --device=cpu")
    dev = scale.init(str(dev))  # under torchrun: the process group (NCCL on CUDA, gloo on the CPU), cuda:LOCAL_RANK
    cuda, rank0, world = dev.type == "cuda", scale.rank() == 0, scale.world()
    if cuda and dev.index is not None:
        torch.cuda.set_device(dev)
    start = time.time()
    rows = versions(dev)
    if args.with_test_cuda and rank0:
        rows.append(run_test_cuda())

    t0 = time.time()
    init, run_dir = out / "init", out / "run"
    scale.barrier()  # every rank has seen out_dir empty before rank 0 writes into it
    mc = write_checkpoint(init, dev) if rank0 else checkpoint_config(dev)
    scale.barrier()
    rows.append(("random checkpoint (infra/hf)", f"{mc.n_layers} layers, d_model {mc.d_model}, vocab {mc.vocab_size}"
                 f", {fmt_gb(du(init))}, {time.time() - t0:.0f} s", "LLaDA-8B shape" if cuda else
                 "CPU: 32 layers at a small width, LLaDA-8B vocab"))

    flags = train_flags(init, run_dir, dev)
    meter = PhaseMeter(cuda)
    if "peak" in faults:  # twice the dry run's rollout figure at the longest prompt: over it, whatever the padding
        meter.ballast["rollout"] = int(2 * dry_run(flags)["budget"][world]["lora_rollout"] * GB)
    t0 = time.time()
    output = out / ("train_output.txt" if rank0 else f"train_output.rank{scale.rank()}.txt")
    stopped = None
    with open(output, "a") as log:
        try:
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log), wrapped(meter, faults):
                train.main(flags)
        except Exception as e:  # the run stopped itself (every step skipped, ...): a failed figure, decided below
            stopped = f"train.main stopped: {e} (its output: {output})"
        except BaseException:
            print(f"train.main {' '.join(flags)} failed; its output is in {output}", file=sys.stderr)
            raise
        run_seconds = time.time() - t0
        # read before the resume check: a Run resuming at step s keeps the logs' lines before s only
        times = [json.loads(ln) for ln in (run_dir / "times.jsonl").read_text().splitlines() if ln.strip()][0]
        logged = json.loads((run_dir / "log.jsonl").read_text().splitlines()[0])
        latest = run_mod.checkpoint.latest(run_dir)
        if "resume" in faults and rank0 and latest:  # a checkpoint whose bookkeeping lost the step
            (latest / "state.json").write_text(json.dumps({**json.loads((latest / "state.json").read_text()), "step": 0}))
        scale.barrier()
        resumed = resume_check(meter, log) if meter.run is not None and latest else None
    rows.append(("train.main, one RL step", f"{run_seconds:.0f} s wall (output: {output})", ""))

    dry = dry_run(flags, meter.prompt_len)
    mem = dry["budget"][world]
    # every rank's peaks; the table shows the largest, each rank's are decided
    peaks = {ph: meter.peak[ph] for ph in PHASES if ph in meter.peak}
    all_peaks = [peaks]
    if world > 1:
        all_peaks = [None] * world
        torch.distributed.all_gather_object(all_peaks, peaks)
    cpu_note = "" if cuda else " (CPU)"
    for ph in PHASES:
        seen = [p[ph] for p in all_peaks if ph in p]
        bound = f"{mem[DRY_ROW[ph]]:.3f} GiB" if ph in DRY_ROW else ""
        if ph not in meter.seconds:  # a wrapped function was renamed or is no longer called
            measured, bound = "phase not seen (no wrapped call)", ""
        elif seen:
            a, r = max(x[0] for x in seen), max(x[1] for x in seen)
            measured = f"{fmt_gb(a)} allocated, {fmt_gb(r)} reserved" + ("" if cuda else " (planted)")
        else:
            measured = "n/a (CPU)"
        rows.append((f"{ph}: peak memory", measured, bound))
    # seconds per phase: times.jsonl's where it has the phase (key <phase>_s, scoring as logprob_s)
    for ph in PHASES:
        key = next((k for k in (f"{ph}_s", "logprob_s" if ph == "scoring" else "") if k in times), None)
        secs, src = (times[key], "times.jsonl") if key else (meter.seconds.get(ph, 0.0), "timed here")
        rows.append((f"{ph}: seconds", f"{secs:.2f} s{cpu_note} ({src})", ""))
    # time against the dry run for this GPU: its FLOPs at the GPU's dense bf16 peak and the assumed MFU
    kind = gpu_kind(torch.cuda.get_device_name(dev)) if cuda else None
    rate = dry["tokens_per_s_per_gpu"]
    scale_to = None if kind is None else budget.GPU_PEAKS[kind] / budget.GPU_PEAK_FLOPS  # the dry run's A100 ->
    no_figure = "no dry-run figure for " + (torch.cuda.get_device_name(dev) if cuda else "a CPU")
    rollout_s = times.get("rollout_s", meter.seconds.get("rollout", 0.0))
    gen = meter.rollout_rows * DECODE[dev.type]["gen_length"]
    rows.append(("generated tokens/s per rank", f"{gen / rollout_s:.1f}{cpu_note} ({gen} tokens, prompts padded to "
                 f"{meter.prompt_len})", no_figure if kind is None else
                 f"{rate['A100'] * scale_to:.3g} on an {kind} (at {dry['mfu']:.0%} MFU)"))
    rows.append(("seconds per RL step", f"{times.get('seconds', run_seconds):.1f} s{cpu_note}",
                 no_figure if kind is None else f"{dry['seconds_per_step'] / scale_to:.3g} s on {world} {kind}"
                 f"{'s' * (world > 1)} (at {dry['mfu']:.0%} MFU)"))
    ids = torch.cat(meter.window_ids)
    toy_vocab = toy.build_tokenizer().get_vocab_size(with_added_tokens=True)
    verifier = torch.cat(meter.verifier_rewards)
    rows.append(("sampled ids outside the toy tokenizer", f"{(ids >= toy_vocab).float().mean().item():.1%}",
                 f"about {1 - toy_vocab / LLADA_VOCAB:.1%} (random weights)"))
    rows.append(("toy verifier's reward on them", f"max {verifier.max().item():.3f} over {len(verifier)}",
                 "0 (decoded as nothing)"))
    rows.append(("stand-in reward trained on", f"mean {logged['text/reward']:.3f}, largest grad norm "
                 f"{max(meter.grad_norms, default=float('nan')):.3g}", "finite, > 0"))
    ckpts = run_dir / "checkpoints"
    cfg = train.parse_args(flags)
    rows.append(("checkpoints/ on disk", f"{fmt_gb(du(ckpts))} ({', '.join(sorted(p.name for p in ckpts.iterdir()))})"
                 if ckpts.is_dir() else "missing",
                 f"{fmt_gb(budget.checkpoint_bytes(cfg, mc))} (adapters + AdamW moments, float32)"))
    final = run_dir / "final"
    model_bytes = 2 if cuda else 4  # the run's dtype: bf16 on CUDA, float32 on the CPU
    rows.append(("final/ on disk", fmt_gb(du(final)) if final.is_dir() else "missing",
                 f"{fmt_gb(dry['params'] * model_bytes + dry['lora_params'] * 4)} (merged model in "
                 f"{'bf16' if cuda else 'float32'} + float32 adapters)"))
    ratio = meter.first_ratio
    rows.append(("update 0: first ratio (max, mean)", "not seen" if ratio is None else
                 f"{ratio[0]:.9g}, {ratio[1]:.9g}", f"1, 1 (within {RATIO_TOL:g})"))
    if "text/ratio_mean" in logged:
        rows.append(("ratio mean over the step's updates (log.jsonl)", f"{logged['text/ratio_mean']:.6g}",
                     "moves from 1 after update 0"))
    rows.append(("losses, gradient norms", f"{sum(map(math.isfinite, meter.losses))} of {len(meter.losses)} finite, "
                 f"{sum(map(math.isfinite, meter.grad_norms))} of {len(meter.grad_norms)} finite", "all finite"))
    rows.append(("resume: next step, tensors differing", "no checkpoint" if resumed is None else
                 f"{resumed[0]}, {resumed[2]}", "the step after the last, 0"))
    rows.append(("tests/first_gpu.py in all", f"{time.time() - start:.0f} s" + ("" if cuda else " (CPU)"),
                 "<= 600 s on one 80 GB GPU" if cuda else ""))

    dry_peaks = {ph: (peaks[ph][0], mem[DRY_ROW[ph]]) for ph in DRY_ROW if ph in peaks}
    fails = decide(meter.first_ratio, meter.losses, meter.grad_norms, dry_peaks, resumed, stopped)
    if world > 1:  # each rank decides its own figures; every rank exits with the verdict of all
        every = [None] * world
        torch.distributed.all_gather_object(every, fails)
        fails = [f"rank {r}: {f}" for r, fs in enumerate(every) for f in fs]
    if rank0:
        print(f"first-GPU run on {rows[2][1]}\n" + format_table(rows))
        print("first-GPU check: " + ("passed" if not fails else f"FAILED, {len(fails)} figure(s)"), flush=True)
    if fails:  # every rank exits 1 together (an agreed exit: no rank tells the others it failed alone)
        if rank0:
            print("\n".join(f"error: {f}" for f in fails), file=sys.stderr, flush=True)
        raise SystemExit(1)
    return rows


if __name__ == "__main__":
    with scale.process_exit():  # under torchrun: leave the process group, end the rank with main's status
        main()
