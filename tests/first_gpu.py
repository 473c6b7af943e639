"""The first-GPU run: train.main end to end on an 8B-shaped checkpoint, measured and printed as ONE table.

    python tests/first_gpu.py                        # on one GPU: meant to take <= 10 minutes (80 GB)
    python tests/first_gpu.py --with_test_cuda       # also runs tests/test_cuda.py first (about 8 more minutes)
    python tests/first_gpu.py --device=cpu           # the CPU rehearsal at a small width (tests/test_first_gpu.py)

What it does, in order:
  1. versions: torch, CUDA, the GPU, the torch floor of multi-GPU runs (infra/scale.check_torch, and
     FSDPModule.set_reshard_after_forward present) and whether torchrun reads TORCH_ELASTIC_SHUTDOWN_TIMEOUT
     (infra/budget.torchrun_reads_shutdown_timeout);
  2. optionally tests/test_cuda.py (--with_test_cuda), its pass/fail line in the table;
  3. a random checkpoint written by infra/hf.save_pretrained with the toy tokenizer: on a GPU LLaDA-8B's
     shape (32 layers, d_model 4096, vocab 126,464), drawn directly in bf16 on the device
     (tests/cuda_helpers.random_weights); on the CPU the same 32 layers at d_model 64 with the same 126,464-row
     vocabulary. The toy tokenizer has 92 tokens, so nearly every sampled id lies outside it: decoding
     drops them and the toy verifier scores the empty answer 0 (checked in the table). So that the update
     has a gradient, the step trains on a stand-in reward computed from the sampled ids;
  4. train.main on it: the toy text task, LoRA r 128 on the official targets with dropout 0.05, activation
     checkpointing, --gen_length=256 --block_length=16 --steps=128 (CPU: 16/8/8), one RL step, a DCP
     checkpoint and final/;
  5. the table: per phase (rollout, reward, scoring = old/ref log-probs, update, checkpoint, final) the
     peak allocated and reserved CUDA memory (peak statistics reset when a phase starts) against the dry
     run's rows at world size 1 (infra/budget, at the prompt length the step padded to), seconds per phase
     (out_dir/times.jsonl; checkpoint and final/ timed here), generated tokens/s against the dry run's
     assumption, sizes on disk, and update 0's first ratio (LoRA's B starts at zero and update 0 re-scores
     pi_old's inputs with pi_old's weights, so it is 1).

Phases are told apart by the public functions train.rl_step calls, wrapped by module attribute for the run
(train.rollout / tasks.rollout, tasks.score, importance.token_logprobs without / with gradients, grpo.policy_loss for the
ratio, Run.record and Run.finish); nothing inside train.py is patched. On the GPU the run needs about 35 GB
of disk in --out_dir (16 GB random checkpoint, 17 GB final/, 2 GB checkpoint) and 16 GB of host memory
while the random checkpoint is written; delete the folder afterwards. Not yet run on a GPU."""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
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
from infra import budget, dryrun, hf, run as run_mod, scale, toy  # noqa: E402
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
GB = 2 ** 30


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
        self.rollout_rows = 0
        self.prompt_len = None
        self.window_ids = []  # every rollout's completion ids, to count those outside the tokenizer
        self.verifier_rewards = []  # the toy verifier's rewards of every rollout

    def enter(self, phase):
        if phase == self.current:
            return
        self.close()
        self.current, self.since = phase, time.time()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def close(self):
        if self.current is None:
            return
        if self.cuda:
            torch.cuda.synchronize()
            now = (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
            old = self.peak.get(self.current, (0, 0))
            self.peak[self.current] = tuple(max(a, b) for a, b in zip(old, now))
        self.seconds[self.current] = self.seconds.get(self.current, 0.0) + time.time() - self.since
        self.current = None


@contextlib.contextmanager
def wrapped(meter: PhaseMeter):
    """Wrap, for the duration, the public functions one RL step calls, by module or class attribute."""
    saved = []

    def wrap(owner, name, phase_of, after=None):
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def inner(*a, **kw):
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
        if meter.first_ratio is None and torch.is_grad_enabled():
            stats = out[1]
            meter.first_ratio = (stats["ratio_max"], stats["ratio"] / max(stats["tokens"], 1.0))  # sums: the mean is ratio / tokens

    # train.py imports rollout by name; tasks.rollout is the same function under its module
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
    wrap(importance, "token_logprobs", lambda a, kw: "update" if torch.is_grad_enabled() else "scoring")
    wrap(grpo, "policy_loss", lambda a, kw: "update" if torch.is_grad_enabled() else "scoring", saw_loss)
    wrap(run_mod.Run, "record", lambda a, kw: "checkpoint")
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
    has = hasattr(FSDPModule, "set_reshard_after_forward")
    reads = budget.torchrun_reads_shutdown_timeout()
    return [("torch", torch.__version__, ""),
            ("CUDA", torch.version.cuda or "none", ""),
            ("device", torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU", ""),
            ("torch floor (scale.check_torch)", floor, "ok"),
            ("FSDPModule.set_reshard_after_forward", "present" if has else "missing", "present"),
            ("TORCH_ELASTIC_SHUTDOWN_TIMEOUT read by torchrun", "yes" if reads else "no (kills 30 s after SIGTERM)",
             f"yes from torch {budget.SHUTDOWN_TIMEOUT_TORCH}")]


def run_test_cuda() -> tuple:
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "pytest", str(ROOT / "tests" / "test_cuda.py"), "-q", "-s",
                        "-p", "no:xdist", "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True)
    lines = [ln for ln in p.stdout.splitlines() if ln.strip()]
    last = lines[-1].strip("= ") if lines else f"exit {p.returncode}"
    return ("tests/test_cuda.py", f"{last} ({time.time() - t0:.0f} s)", "all passed")


def write_checkpoint(path: Path, dev: torch.device) -> ModelConfig:
    """Random weights of the device's SHAPE with LLaDA-8B's vocabulary and the toy tokenizer's special ids,
    drawn on the device in bf16 (float32 on the CPU, as a run there computes), written by infra/hf."""
    layers, d, heads, hidden = SHAPE[dev.type]
    tok = toy.build_tokenizer()
    vocab = {**tasks.model_config_overrides(tok), "vocab_size": LLADA_VOCAB}
    mc = ModelConfig(d_model=d, n_layers=layers, n_heads=heads, n_kv_heads=heads, mlp_hidden_size=hidden,
                     max_sequence_length=4096, **vocab)
    model = random_weights(mc, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32)
    hf.save_pretrained(model, path)
    tok.save(str(path / "tokenizer.json"))
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return mc


def train_flags(init: Path, out: Path, dev: torch.device) -> list:
    d = DECODE[dev.type]
    flags = [f"--init_from={init}", f"--out_dir={out}", f"--device={dev}", "--tasks=text", "--eval_prompts=0",
             "--lora_rank=128", "--lora_targets=official", "--lora_dropout=0.05", "--activation_checkpointing=true",
             "--rl_steps=1", "--checkpoint_every=1", "--sample_every=0", "--seed=0",
             *(f"--{k}={v}" for k, v in d.items())]
    if MU is not None:
        flags.append(f"--{MU_FLAG}={MU}")
    if dev.type == "cpu":
        flags.append("--threads=1")
    return flags


def dry_run(flags: list, prompt_len: int) -> dict:
    """infra/budget's dry run of the same settings on one GPU at the prompt length the step padded to."""
    cfg = train.parse_args([*flags, "--dry_run=true", "--dry_run_gpus=1", f"--max_prompt_len={prompt_len}"])
    with contextlib.redirect_stdout(open("/dev/null", "w")):
        return dryrun.report(cfg)


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def fmt_gb(b: float) -> str:
    return f"{b / GB:.2f} GB" if b >= GB / 10 else f"{b / 2 ** 20:.2f} MB"


def format_table(rows) -> str:
    head = ("check", "measured", "dry run / expected")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(3)]
    line = lambda r: " | ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
    return "\n".join([line(head), "-+-".join("-" * w for w in widths), *map(line, rows)])


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out_dir", default="out/first_gpu", help="a new or empty directory for everything written")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    ap.add_argument("--with_test_cuda", action="store_true", help="also run tests/test_cuda.py first")
    args = ap.parse_args(argv)
    out = Path(args.out_dir)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"error: --out_dir {out} is not empty; choose a new directory or delete it")
    if args.device == "auto":
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"error: --device={args.device} but torch sees no CUDA device; pass --device=cpu")
    cuda = dev.type == "cuda"
    if cuda and dev.index is not None:
        torch.cuda.set_device(dev)
    start = time.time()
    rows = versions(dev)
    if args.with_test_cuda:
        rows.append(run_test_cuda())

    t0 = time.time()
    init, run_dir = out / "init", out / "run"
    mc = write_checkpoint(init, dev)
    rows.append(("random checkpoint (infra/hf)", f"{mc.n_layers} layers, d_model {mc.d_model}, vocab {mc.vocab_size}"
                 f", {fmt_gb(du(init))}, {time.time() - t0:.0f} s", "LLaDA-8B shape" if cuda else
                 "CPU: 32 layers at a small width, LLaDA-8B vocab"))

    flags = train_flags(init, run_dir, dev)
    meter = PhaseMeter(cuda)
    t0 = time.time()
    output = out / "train_output.txt"
    try:
        with open(output, "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log), \
                wrapped(meter):
            train.main(flags)
    except BaseException:
        print(f"train.main {' '.join(flags)} failed; its output is in {output}", file=sys.stderr)
        raise
    run_seconds = time.time() - t0
    rows.append(("train.main, one RL step", f"{run_seconds:.0f} s wall (output: {output})",
                 ""))

    dry = dry_run(flags, meter.prompt_len)
    mem = dry["budget"][1]
    times = [json.loads(ln) for ln in (run_dir / "times.jsonl").read_text().splitlines() if ln.strip()][0]
    cpu_note = "" if cuda else " (CPU)"
    for ph in PHASES:
        if ph not in meter.seconds:  # a wrapped function was renamed or is no longer called
            measured, bound = "phase not seen (no wrapped call)", ""
        elif cuda:
            a, r = meter.peak.get(ph, (0, 0))
            measured = f"{fmt_gb(a)} allocated, {fmt_gb(r)} reserved"
            bound = f"{mem[DRY_ROW[ph]]:.2f} GB" if ph in DRY_ROW else ""
        else:
            measured, bound = "n/a (CPU)", f"{mem[DRY_ROW[ph]]:.3f} GB" if ph in DRY_ROW else ""
        rows.append((f"{ph}: peak memory", measured, bound))
    # seconds per phase: times.jsonl's where it has the phase (key <phase>_s, scoring as logprob_s)
    for ph in PHASES:
        key = next((k for k in (f"{ph}_s", "logprob_s" if ph == "scoring" else "") if k in times), None)
        secs, src = (times[key], "times.jsonl") if key else (meter.seconds.get(ph, 0.0), "timed here")
        rows.append((f"{ph}: seconds", f"{secs:.2f} s{cpu_note} ({src})", ""))
    rollout_s = times.get("rollout_s", meter.seconds.get("rollout", 0.0))
    gen = meter.rollout_rows * DECODE[dev.type]["gen_length"]
    rate = dry["tokens_per_s_per_gpu"]
    rows.append(("generated tokens/s", f"{gen / rollout_s:.1f}{cpu_note} ({gen} tokens, prompts padded to "
                 f"{meter.prompt_len})", f"A100 {rate['A100']:.3g}, H100 {rate['H100']:.3g} (at {dry['mfu']:.0%} MFU)"))
    rows.append(("seconds per RL step", f"{times.get('seconds', run_seconds):.1f} s{cpu_note}",
                 f"{dry['seconds_per_step']:.3g} s on 1 {dry['gpu']}"))
    ids = torch.cat(meter.window_ids)
    toy_vocab = toy.build_tokenizer().get_vocab_size(with_added_tokens=True)
    logged = json.loads((run_dir / "log.jsonl").read_text().splitlines()[0])
    verifier = torch.cat(meter.verifier_rewards)
    rows.append(("sampled ids outside the toy tokenizer", f"{(ids >= toy_vocab).float().mean().item():.1%}",
                 f"about {1 - toy_vocab / LLADA_VOCAB:.1%} (random weights)"))
    rows.append(("toy verifier's reward on them", f"max {verifier.max().item():.3f} over {len(verifier)}",
                 "0 (decoded as nothing)"))
    rows.append(("stand-in reward trained on", f"mean {logged['text/reward']:.3f}, largest grad norm {logged['grad_norm_max']:.3g}",
                 "finite, > 0"))
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
                 f"{ratio[0]:.9g}, {ratio[1]:.9g}", "1, 1"))
    if "text/ratio_mean" in logged:
        rows.append(("ratio mean over the step's updates (log.jsonl)", f"{logged['text/ratio_mean']:.6g}",
                     "moves from 1 after update 0"))
    rows.append(("tests/first_gpu.py in all", f"{time.time() - start:.0f} s" + ("" if cuda else " (CPU)"),
                 "<= 600 s on one 80 GB GPU" if cuda else ""))
    print(f"first-GPU run on {rows[2][1]}\n" + format_table(rows))
    return rows


if __name__ == "__main__":
    main()
