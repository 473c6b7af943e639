"""Flags and settings: each field of an entry point's dataclass is a flag (`--field=value`, `--field value`, a
bare boolean; exact, never a prefix; the last of two wins) valued from the flag, else `--preset`, else the default.
Every setting is checked here once, naming the value and a fix; a user error is one line."""
import argparse
import difflib
import functools
import inspect
import json
import math
import os
import re
import sys
import tokenize
from contextlib import contextmanager, suppress
from dataclasses import MISSING, fields
from pathlib import Path
from types import MappingProxyType

import torch
from tqdm import tqdm

import grpo
import importance
import sample
import tasks
from infra import checkpoint, hf, scale, tracker
from infra.scale import print0

USER_ERROR = 2  # exit status of a user error, as argparse's own
EPILOGS = {"Config": (  # what --help prints after the flags, per dataclass name (train.py's: infra/outdir.py)
    "Stopping and continuing: Ctrl-C, SIGTERM or SIGHUP (a closed terminal) lets the current SFT step, RL step or "
    "evaluation batch finish (in RL, then a checkpoint), and prints what was kept and the command that continues "
    "(--resume=true); the exit status is 128 + the signal. A second signal, 5 s or more later, stops at once. Out "
    "of memory, a full disk or a dead torchrun rank also ends with one such line. `python -m infra.load "
    "OUT_DIR/checkpoints/step-N DEST` turns a checkpoint into a model folder for sample.py and evaluate.py.")}
# Flags whose value is a path, or a list of them: a shell expands `~` only at the start of a word, so here.
PATH_FLAGS = {"out_dir", "init_from", "sft_dir", "ckpt", "data", "out", "run", "png"}
PATH_LIST_FLAGS = {"train_data", "eval_data", "compare"}
# Bounds and choices of settings (of any entry point that has them): "NAME (VALUE) must be OP BOUND" + its HINTS.
BOUNDS = {(">=", 1): ("mu", "eval_samples", "dry_run_gpus", "max_bad_steps", "prompts_per_step", "sft_batch_size",
                      "gen_length", "block_length", "steps", "image_steps", "image_width"),
          (">=", 0): ("beta", "threads", "sample_every", "vocab_size", "weight_decay", "sft_steps", "rl_steps",
                      "eval_prompts", "device_batch_size", "temperature", "cfg_scale", "image_text_len", "lora_rank",
                      "trajectory_states", "checkpoint_every", "keep_last"),
          (">", 0): ("clip_eps", "lr", "grad_clip", "image_scorer_timeout"), (">=", 2): ("group_size",),
          (">=", 8): ("max_prompt_len",)}
CHOICES = {"kv_cache": sample.KV_CACHES, "image_sampler": sample.IMAGE_SAMPLERS, "estimator": importance.ESTIMATORS,
           "text_reversing": importance.MODES, "loss_norm": grpo.NORMS, "text_reward": tuple(tasks.TEXT_REWARDS),
           "lora_targets": tuple(hf.TARGET_SETS), "adv_std": ("auto", "on", "off"), "attend_padding": ("auto", "on",
           "off"), "reward_shaping": ("none", "official"), "dtype": ("auto", "float32", "bfloat16")}
HINTS = {"group_size": ": GRPO compares completions of a group", "clip_eps": " (paper: 0.2)",
         "lr": " (paper: 3e-6 at 8B; the toy uses 1e-4)", "grad_clip": ": 0 would zero every gradient (paper: 0.2)",
         "image_scorer_timeout": " seconds (default 30; a scorer serving every rank at once may need more)",
         "trajectory_states": " (0 = every decoding state; K > 0 scores K of them per update)",
         "lora_rank": " (0 = full fine-tuning)", "checkpoint_every": " (0 = never)", "keep_last": " (0 = keep all)",
         "cfg_scale": " (0 = no guidance; MaskGRPO uses 3.0)", "image_text_len": " (0 = the longest toy caption)",
         "dtype": " (float16 needs a grad scaler)", "threshold": " (0 = off; Fast-dLLM uses 0.9)"}
# What --change_on_resume may name (a run stopped by bad steps continues more carefully; see outdir.RESUMABLE).
CHANGEABLE = ("lr", "grad_clip")
# The toy model's shape and SFT flags (init_from=scratch): with --init_from the shape is refused, SFT warned of.
SCRATCH_SHAPE = ("d_model", "n_layers", "n_heads", "mlp_hidden_size")
SCRATCH_SFT = ("sft_dir", "retrain_sft", "sft_steps", "sft_batch_size", "sft_lr", "sft_warmup", "cond_dropout",
               "text_noise", "image_noise", "image_loss_weight")
# Saved beside a checkpoint (with their types) so that sample.py and evaluate.py decode it as trained; flags override.
GENERATION_FILE = "generation.json"
GENERATION_TYPES = {"tasks": str, "gen_length": int, "block_length": int, "steps": int, "temperature": float,
                    "image_steps": int, "image_sampler": str, "cfg_scale": float, "image_width": int,
                    "image_text_len": int, "max_prompt_len": int, "prompt_prefill": str, "system_prompt": str,
                    "attend_padding": str, "text_max_steps": int, "text_reward": str}


def expand_home(flag: str, value: str) -> str:
    """value with a leading ~ or ~user expanded (each item of a PATH_LIST_FLAGS list); an unknown user is refused."""
    items = value.split(",") if flag in PATH_LIST_FLAGS else [value] if flag in PATH_FLAGS else []
    for i, item in enumerate(items):
        task, eq, where = item.rpartition("=") if flag in ("train_data", "eval_data") else ("", "", item)
        full = os.path.expanduser(where)
        need(not full.startswith("~"), f"--{flag}={value}: {where.split('/')[0]} is no user's home; write it in full")
        items[i] = task + eq + full
    return ",".join(items) if items else value


def parse_bool(s: str) -> bool:
    if s.lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {s!r}")
    return s.lower() in ("1", "true", "yes", "on")


@functools.cache  # parsing the module's source costs ~20 ms, and every parse() asks (a test suite, often)
def field_comments(cls):
    """{field: its comment} from the source of cls and its bases (comment-only lines below it continue it)."""
    out: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if "__dataclass_fields__" in vars(k)]):
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):  # defined where no source is kept (an interactive session)
            continue
        current = None
        for tok in tokenize.generate_tokens(iter(source.splitlines(True)).__next__):
            if tok.type == tokenize.NAME and tok.start[1] == 4:  # a field, or a method (whose comment is its own)
                current = tok.string if tok.string in klass.__dataclass_fields__ else None
            elif tok.type == tokenize.COMMENT and current:
                text, alone = tok.string.lstrip("#").strip(), tok.line.strip().startswith("#")
                if alone and tok.start[1] <= 4:  # a section heading ("    # model"), not a continuation
                    current = None
                else:
                    out[current] = f"{out[current]} {text}" if current in out and alone else text
    return MappingProxyType(out)


def flag_fields(cls, inherited: set | None = None) -> list:
    """The fields of cls that are flags: its own first, then its bases' (only those in `inherited`, when given)."""
    own = set(getattr(cls, "__annotations__", {}))
    chosen = [f for f in fields(cls) if f.name in own or inherited is None or f.name in inherited]
    return sorted(chosen, key=lambda f: f.name not in own)  # stable: each part keeps the dataclass order


def parser(cls, description: str, presets: dict | None = None, argv=(), defaults: dict | None = None,
           inherited: set | None = None, prog: str | None = None) -> argparse.ArgumentParser:
    """One flag per field (and --preset), None unless typed; --help shows the values under argv's preset."""
    usage = "%(prog)s" + (" [--preset NAME]" if presets else "") + " [--FIELD=VALUE ...]  (every FIELD below; a " \
        "flag given twice takes its last value)"
    p = argparse.ArgumentParser(description=description, usage=usage, exit_on_error=False, allow_abbrev=False,
                                epilog=EPILOGS.get(cls.__name__), prog=prog)  # no prefix silently sets a flag
    base, name, preset = dict(defaults or {}), None, {}
    if presets is not None:
        first = next(iter(presets))
        p.add_argument("--preset", default=first, help=f"one of {', '.join(presets)}; {first} when none is given")
        named = argparse.ArgumentParser(add_help=False, exit_on_error=False, allow_abbrev=False)
        named.add_argument("--preset", default=first)
        name = named.parse_known_args(list(argv))[0].preset
        base.update(preset := presets.get(name, {}))
    types = {"int": int, "float": float, "str": str, "bool": parse_bool}
    comments = field_comments(cls)
    own = set(getattr(cls, "__annotations__", {}))
    group = p
    for f in flag_fields(cls, inherited):
        if f.name not in own and own and group is p:  # an entry point's own flags first, then train.py's
            group = p.add_argument_group("settings shared with train.py")
        kind = f.type if isinstance(f.type, str) else f.type.__name__  # with or without postponed annotations
        default = f"{base[f.name]!r}" + (f" under --preset {name}" if f.name in preset else "") if f.name in base \
            else "required" if f.default is MISSING else f"default {f.default!r}"
        text = (f"{comments[f.name]} ({default})" if f.name in comments else default).replace("%", "%%")
        bare = {"nargs": "?", "const": True} if kind == "bool" else {}  # bare --flag means true
        group.add_argument(f"--{f.name}", type=types[kind], default=None, help=text, **bare)
    return p


def parse_known(p: argparse.ArgumentParser, argv, module: str) -> argparse.Namespace:
    """p.parse_known_args for `python -m MODULE` with its own flags: a bad value or unknown flag is one line."""
    try:
        args, unknown = p.parse_known_args(argv)
    except argparse.ArgumentError as e:
        raise ValueError(str(e)) from None
    need(not unknown, f"unknown argument(s) {unknown}; see python -m {module} --help")
    return args


def parse(cls, argv=None, *, description: str = "", presets: dict | None = None, defaults: dict | None = None,
          inherited: set | None = None, refused: str = "", prog: str | None = None):
    """`cls` from the flags, over the preset, over `defaults` (a checkpoint's), over the dataclass's defaults."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args, unknown = parser(cls, description, presets, argv, defaults, inherited, prog).parse_known_args(argv)
    except argparse.ArgumentError as e:  # a value of the wrong type: one line naming flag and value
        raise ValueError(str(e)) from None
    other = [u for u in unknown if u.startswith("--") and u[2:].split("=")[0] in {f.name for f in fields(cls)}]
    need(not other, f"{', '.join(u.split('=')[0] for u in other)}: {refused or 'not a flag of this command'}; "
         f"drop {'them' if len(other) > 1 else 'it'} (--help lists the flags)")
    if unknown:
        names = [f"--{f.name}" for f in flag_fields(cls, inherited)] + (["--preset"] if presets is not None else [])
        close = {u: difflib.get_close_matches(u.split("=")[0], names, n=1) for u in unknown if u.startswith("--")}
        hint = "".join(f"; did you mean {m[0]} (not {u.split('=')[0]})?" for u, m in close.items() if m)
        raise ValueError(f"unknown argument(s) {unknown}; the flags are the fields of {cls.__name__} (--help){hint}")
    given = {k: expand_home(k, v) if isinstance(v, str) else v for k, v in vars(args).items()
             if v is not None and k != "preset"}
    if presets is not None and args.preset not in presets:
        raise ValueError(f"unknown preset {args.preset!r}; choose one of {', '.join(presets)}")
    preset = dict(presets[args.preset]) if presets is not None else {}
    values = {**(defaults or {}), **preset, **given}
    missing = [f.name for f in fields(cls) if f.default is MISSING and f.name not in values]
    need(not missing, "missing " + ", ".join(f"--{m}" for m in missing))
    obj = cls(**values)
    # What was typed and which preset, for checks that refuse a flag (not fields: config.json omits them).
    obj._given, obj._preset, obj._preset_values = frozenset(given), getattr(args, "preset", None), preset
    return obj


def data_paths(spec: str, name: str) -> dict[str, str]:
    """--train_data / --eval_data "gsm8k=a.jsonl,math=b.jsonl" -> {"gsm8k": "a.jsonl", "math": "b.jsonl"}."""
    known = [t for t in tasks.TASKS if t not in tasks.TOY_TASKS]  # the benchmarks, whose files infra/data.py reads
    out = {}
    for item in filter(None, spec.split(",")):
        task, eq, path = item.partition("=")
        need(eq and path and task in known, f"{name} entry {item!r} must be TASK=PATH, TASK one of {','.join(known)}")
        need(task not in out, f"{name} names task {task} twice ({out.get(task)} and {path}); give one file per task")
        out[task] = path
    return out


def need(ok, msg) -> None:
    if not ok:
        raise ValueError(msg)


def validate_generation(o) -> None:
    """The sampler settings train.Config and sample.py's options share (same names, same rules)."""
    for k, v in vars(o).items():  # inf or nan would pass the range checks below (inf > 0) and fail mid-run
        need(not isinstance(v, float) or math.isfinite(v), f"{k} ({v}) must be a finite number")
    for (op, bound), names in BOUNDS.items():  # train.Config: all; sample.py's options: the sampler's
        for k in filter(functools.partial(hasattr, o), names):
            v = getattr(o, k)
            need(v > bound if op == ">" else v >= bound, f"{k} ({v}) must be {op} {bound}{HINTS.get(k, '')}")
    need(o.steps <= o.gen_length, f"steps ({o.steps}) must be <= gen_length ({o.gen_length}): each step commits at "
         f"least one token, so steps beyond gen_length do nothing; try --steps={o.gen_length}")
    need(o.gen_length % o.block_length == 0, f"gen_length ({o.gen_length}) must be divisible by block_length "
         f"({o.block_length}); try --block_length={o.gen_length}")
    blocks = o.gen_length // o.block_length
    need(o.steps % blocks == 0 and o.steps >= blocks, f"steps ({o.steps}) must be a positive multiple of the number "
         f"of blocks ({blocks}); try --steps={blocks * max(1, o.steps // blocks)}")
    for k in filter(functools.partial(hasattr, o), CHOICES):
        *rest, last = CHOICES[k]
        need((v := getattr(o, k)) in CHOICES[k], f"{k} ({v!r}) must be {', '.join(rest)} or {last}{HINTS.get(k, '')}")
    for k in filter(functools.partial(hasattr, o), ("threshold", "gamma_text", "gamma_image")):  # train.Config: all
        need(0 <= getattr(o, k) < 1, f"{k} ({getattr(o, k)}) must be in [0, 1){HINTS.get(k, '')}")


def validate(cfg) -> None:
    """Refuse impossible settings before any heavy work, naming the value and a fix."""
    validate_generation(cfg)
    if cfg.init_from == "scratch" or cfg.dry_run:  # the sizes of the model built here (else: its config.json)
        for k in SCRATCH_SHAPE:
            need(getattr(cfg, k) >= 1, f"{k} ({getattr(cfg, k)}) must be >= 1: a model needs at least one of each")
        need(cfg.d_model % cfg.n_heads == 0 and (cfg.d_model // cfg.n_heads) % 2 == 0,
             f"d_model ({cfg.d_model}) must be n_heads ({cfg.n_heads}) times an even head size (rotary embeddings)")
    need(cfg.estimator != "trajectory" or cfg.loss_norm == "token", "estimator 'trajectory' scores each token at "
         "its own decoding step, which only the token mean adds up: use --loss_norm=token")
    need(cfg.estimator == "trajectory" or not cfg.trajectory_states, f"trajectory_states ({cfg.trajectory_states}) "
         f"draws decoding states of --estimator=trajectory, not of {cfg.estimator!r}: add it or drop this flag")
    known, chosen = tuple(tasks.TASKS), tasks.task_list(cfg)
    need(cfg.tasks and all(t in known for t in chosen), f"tasks ({cfg.tasks!r}) must be from {','.join(known)}")
    twice = sorted({t for t in chosen if chosen.count(t) > 1})
    need(not twice, f"tasks ({cfg.tasks!r}) names {', '.join(twice)} twice, which would roll out and update it twice "
         f"per step; give each task once (--tasks={','.join(dict.fromkeys(chosen))})")
    real = [t for t in chosen if t not in tasks.TOY_TASKS]
    need(not real or cfg.dry_run or cfg.init_from not in ("", "scratch"),
         f"tasks {real} need a pretrained model: pass --init_from=DIR (a LLaDA/MMaDA checkpoint directory)")
    need(cfg.init_from != "" or cfg.dry_run, "init_from is empty: pass --init_from=DIR, the local checkpoint")
    given = getattr(cfg, "_given", frozenset())  # the flags typed (parse); empty when built in code
    idle = sorted(given & set(SCRATCH_SHAPE)) if cfg.init_from != "scratch" and not cfg.dry_run else []
    need(not idle, f"{', '.join('--' + k for k in idle)} {'sets' if len(idle) == 1 else 'set'} the toy model's "
         f"shape, but --init_from={cfg.init_from} has its own: drop {'it' if len(idle) == 1 else 'them'}")
    idle = [f"--{k} (it acts on {what})" for keys, what, unread in (
        (SCRATCH_SFT, "the SFT stage of a model trained from scratch, not of --init_from", cfg.init_from != "scratch"
         and not cfg.dry_run), (("system_prompt", "prompt_prefill", "reward_shaping"), "benchmark prompts: gsm8k, "
         "math, mbpp, countdown, sudoku", set(real) <= set(tasks.IMAGE_TASKS)), (("text_reward", "text_max_steps"),
         "the toy text task", "text" not in chosen), (("image_scorer_timeout",), "the image scorer of "
         "--image_scorer_url, for geneval", not cfg.image_scorer_url)) if unread for k in keys if k in given]
    idle += [f"--{k} (--estimator={cfg.estimator} does not read it: importance.READ_BY)"
             for k in importance.ignored_settings(cfg, type(cfg)())]
    if idle:  # recorded in config.json, so a silent no-op would read as a setting; a warning keeps old commands working
        print0(f"warning: with --tasks={cfg.tasks}, {'; '.join(idle)} {'does' if len(idle) == 1 else 'do'} nothing: "
               "drop it, or add what it acts on")
    need("eval_data" not in given or cfg.eval_prompts > 0, "--eval_prompts=0 scores no --eval_data: drop one of them")
    train_files = data_paths(cfg.train_data, "train_data")
    for t in real:
        need(t in train_files or cfg.dry_run, f"task {t!r} needs its training file: --train_data={t}=PATH")
    for field_name, paths in (("train_data", train_files), ("eval_data", data_paths(cfg.eval_data, "eval_data"))):
        extra = [t for t in paths if t not in real]
        need(not extra, f"{field_name} names {extra}, which are not among the RL tasks {chosen}")
    need("geneval" not in real or cfg.image_scorer_url or cfg.dry_run, "task geneval needs a reward model: "
         "--image_scorer_url=http://HOST:PORT (scorer.RemoteScorer; `python -m infra.scorer --stub` serves a stand-in)")
    need(cfg.lora_rank == 0 or (cfg.lora_alpha > 0 and 0 <= cfg.lora_dropout < 1),
         f"lora_alpha ({cfg.lora_alpha}) must be > 0 and lora_dropout ({cfg.lora_dropout}) in [0, 1)")
    need(cfg.lora_rank == 0 or cfg.init_from != "scratch", "lora_rank > 0 with init_from=scratch: no pretrained "
         "model to adapt; pass --init_from=DIR (for instance a toy run's out_dir/final)")
    world = int(os.environ.get("WORLD_SIZE", "1"))  # validated before the process group exists
    need(cfg.prompts_per_step % world == 0, f"prompts_per_step ({cfg.prompts_per_step}) must be divisible by the "
         f"world size ({world}); try --prompts_per_step={world * max(1, cfg.prompts_per_step // world)}")
    if not cfg.dry_run:  # a dry run plans for GPUs it need not see
        check_device(cfg.device)
    need(0 <= cfg.p_mask_prompt <= 1, f"p_mask_prompt ({cfg.p_mask_prompt}) must be in [0, 1] (d1 uses 0.15)")
    need(not (all(t in tasks.IMAGE_TASKS for t in chosen) and (cfg.kv_cache != "none" or cfg.threshold)),
         f"kv_cache / threshold apply to text rollouts, but tasks ({cfg.tasks!r}) has no text task; drop them")
    need(not cfg.image_scorer_url or "geneval" in chosen, "image_scorer_url is set but no task uses it: add "
         f"geneval to --tasks={cfg.tasks} or drop the flag")
    tracker.check(cfg)  # an unknown tracker, or its package missing: one line with the install command
    other = [k for k in resume_changes(cfg) if k not in CHANGEABLE]
    need(not other, f"change_on_resume ({cfg.change_on_resume!r}) names {', '.join(other)}: only "
         f"{' or '.join(CHANGEABLE)} may change on resume; for other changes start a run with another --out_dir")
    need(cfg.resume or not cfg.change_on_resume, "--change_on_resume changes settings of a run being continued: "
         "pass --resume=true with it, or drop it")


def check_device(name: str) -> None:
    """auto, cpu, cuda or cuda:N (the maths runs on CPU and CUDA only), and CUDA only where torch sees the GPU."""
    hint = " (Apple GPUs are not supported: use --device=cpu)" if name == "mps" else \
        " (for a GPU: --device=cuda)" if name.lower() in ("gpu", "cuda0", "nvidia") else ""
    need(re.fullmatch(r"auto|cpu|cuda(:\d+)?", name), f"device ({name!r}) must be auto, cpu, cuda or cuda:N{hint}")
    need(not name.startswith("cuda") or torch.cuda.is_available(),
         f"device ({name!r}) asks for CUDA, but torch sees no GPU; use --device=cpu")
    if name.startswith("cuda:") and int(name[5:]) >= torch.cuda.device_count():
        raise ValueError(f"device ({name!r}): torch sees {torch.cuda.device_count()} GPU(s), numbered from 0")


def check_threads(n: int) -> None:
    need(n >= 0, f"threads ({n}) must be >= 0 (0 = torch's default; on a shared machine pass 1)")


def resume_changes(cfg) -> tuple:
    return tuple(k.strip() for k in cfg.change_on_resume.split(",") if k.strip())


def setup(cfg) -> tuple[torch.device, torch.dtype]:
    """Pick device and compute dtype of validated settings once (joining torchrun's process group if any)."""
    device = scale.init(cfg.device)
    if cfg.threads or device.type == "cpu":
        # threads=0 on CPU is one: on busy cores OpenMP's threads wait on each other (toy SFT: 16 s vs 147 s).
        torch.set_num_threads(cfg.threads or 1)
    # auto: bf16 on GPUs that support it (LLaDA's weights are bf16); float32 on CPU, where bf16 matmuls are slow.
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    dtype = getattr(torch, cfg.dtype) if cfg.dtype != "auto" else torch.bfloat16 if bf16 else torch.float32
    print0(f"device {device}, dtype {str(dtype).removeprefix('torch.')}, torch threads {torch.get_num_threads()}, "
           f"world size {scale.world()}")
    return device, dtype


def generation_settings(cfg) -> dict:
    return {k: getattr(cfg, k) for k in GENERATION_TYPES}


def read_generation_settings(path) -> dict:
    """The generation settings saved beside a checkpoint ({} if none); a value of another type is refused."""
    f, fix = Path(path) / GENERATION_FILE, "delete it to use the defaults and flags only"
    saved = hf.read_json(f, fix) if f.is_file() else {}  # an object, or refused naming the file
    for k, v in saved.items():
        kind = GENERATION_TYPES.get(k, type(v))  # a float takes an int; JSON true is a bool, no int
        if type(v) is not kind and not (kind is float and type(v) is int):
            what, like = {int: ("a whole number", 12), float: ("a number", 1.0), str: ("a string", "text")}[kind]
            raise ValueError(f"{f}: {k} is {json.dumps(v)}, not {what}; e.g. \"{k}\": {json.dumps(like)}, or {fix}")
    return saved


@contextmanager
def user_errors(failures: tuple = ()):
    """An entry point's body: ValueError / OSError -> `error: message` on stderr, exit 2 (`failures`: exit 1); Ctrl-C
    -> exit 130; no traceback (programming errors keep theirs). Real stdout/stderr become checkpoint.Unbroken."""
    saved = sys.stdout, sys.stderr
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        with suppress(AttributeError, ValueError, OSError):
            stream.fileno()  # a real file
            if not isinstance(stream, checkpoint.Unbroken):
                setattr(sys, name, checkpoint.Unbroken(stream))
    try:
        yield
    except (ValueError, OSError, *failures) as e:  # one write: print's two would interleave with another rank's
        sys.stderr.write(f"error: {e}\n")
        sys.exit(1 if isinstance(e, failures) else USER_ERROR)
    except KeyboardInterrupt:
        sys.stderr.write("interrupted (Ctrl-C)\n")
        sys.exit(130)
    finally:
        sys.stdout, sys.stderr = saved


def bars_shown(file=None) -> bool:
    """Progress bars only on a terminal: redirected, tqdm's carriage-return updates pile up into one line."""
    return hasattr(file or sys.stderr, "isatty") and (file or sys.stderr).isatty()


def progress_bar(iterable=None, **kwargs):
    """tqdm, drawn on stderr when it is a terminal and silent otherwise: every bar of the project is made here."""
    kwargs.setdefault("disable", not bars_shown(kwargs.get("file")))
    return tqdm(iterable, **kwargs)
