"""The sampling command line: `python -m tools.sample --ckpt DIR --prompt TEXT [--image [--png FILE]] [--field=value ...]`.

    python -m tools.sample --ckpt out/toy/final --prompt "bob has 3 pens . how many pens does he have ?"
    python -m tools.sample --ckpt out/toy/final --image --prompt "two red blocks" --png red.png
    python -m tools.sample --ckpt /path/to/LLaDA-8B-Instruct --prompt "What is 7 * 8?" --prompt_format=chat

Every setting is checked before the weights are read, with the rules train.py applies to the same names
(infra/cli.validate_generation), and the prompt is checked against the checkpoint: characters the
tokenizer does not know are named (they become its unknown token), and a prompt that does not fit the
model's max_sequence_length is refused. A user error is one line and exit status 2 (infra/cli.py).
"""
from __future__ import annotations

import shlex
import sys

if __name__ == "__main__" and not __package__:  # run as a file, tools/ would shadow the project's modules
    sys.exit("run it from the project's root as a module: "
             + shlex.join(["python", "-m", "tools.sample", *sys.argv[1:]]))

import math
from dataclasses import dataclass
from pathlib import Path

import torch

import sample
import tasks
from infra import cli, hf, plots
from infra.hf import load_tokenizer
from infra.load import refuse_training_checkpoint
from infra.cli import GENERATION_FILE, read_generation_settings, validate_generation
from tasks import chat_prompt

FORMATS = ("auto", "toy", "chat", "raw")
PROG = "python -m tools.sample"
DESCRIPTION = ("Sample from a LLaDA/MMaDA-style checkpoint. A checkpoint written by train.py carries the settings it "
               "was trained to generate with (its generation.json): they replace the defaults shown below; a flag "
               "still overrides them.")


@dataclass
class Options:
    """python -m tools.sample --ckpt DIR --prompt TEXT [--image] [--field=value ...]. A checkpoint written by
    train.py carries its generation settings (generation.json), used unless a flag overrides them; the
    rest default to LLaDA's own (64 tokens in blocks of 16, 64 steps, greedy)."""
    ckpt: str = ""              # directory with config.json, *.safetensors, tokenizer.json
    prompt: str = ""              # the text to complete, or the caption to draw (--image)
    image: bool = False         # text-to-image (toy checkpoints of train.py): fill the image slots
    png: str = ""                 # with --image: also write the picture to this PNG file (needs matplotlib)
    gen_length: int = 64          # completion tokens
    block_length: int = 16        # semi-autoregressive block size; divides gen_length
    steps: int = 64               # denoising steps, a multiple of the number of blocks, <= gen_length
    temperature: float = 0.0      # Gumbel-max sampling temperature (0 = greedy)
    seed: int = 0               # seeds the sampling generator (temperature > 0, images)
    prompt_format: str = "auto"  # auto (as train.py trained the checkpoint, else raw) | toy | chat | raw
    prompt_prefill: str = ""    # text that opens the assistant turn (chat format)
    kv_cache: str = "none"      # none (exact) | prefix | dual: Fast-dLLM block KV cache (approximate)
    threshold: float = 0.0      # > 0: also commit every masked token more confident than this
    remasking: str = "low_confidence"  # text: reveal the most confident positions, or random ones (LLaDA's options)
    text_cfg_scale: float = 0.0  # text classifier-free guidance weight, the prompt masked for the unconditional pass
    image_steps: int = 12         # image denoising steps (MaskGRPO: 12 for rollouts, 32 for evaluation)
    image_sampler: str = "emerge" # emerge (MaskGRPO Alg. 4) | maskgit (MMaDA)
    cfg_scale: float = 0.0      # classifier-free guidance weight (images)
    image_width: int = 4        # images are image_width x image_width tokens
    image_text_len: int = 0     # caption part of the t2i prompt (0: the longest toy caption)


def main(argv=None):
    first = cli.parse(Options, argv, description=DESCRIPTION, prog=PROG)
    if not first.ckpt:
        raise ValueError("--ckpt is missing: pass --ckpt DIR, a folder with config.json, *.safetensors and "
                         "tokenizer.json (e.g. out/toy/final)")
    refuse_training_checkpoint(first.ckpt, "--ckpt")
    saved = read_generation_settings(first.ckpt) if Path(first.ckpt).is_dir() else {}
    trained = [t for t in saved.pop("tasks", "").split(",") if t]
    toy = any(t in ("text", "image") for t in trained)
    known = {k: v for k, v in saved.items() if k in Options.__dataclass_fields__ and k != "temperature"}
    o = cli.parse(Options, argv, description=DESCRIPTION, defaults=known, prog=PROG)
    check_options(o)
    if o.image and trained and not set(trained) & set(tasks.IMAGE_TASKS):
        raise ValueError(f"--image: {o.ckpt} was trained for {', '.join(trained)} only (its {GENERATION_FILE}), "
                         "never to draw, so its picture would be noise; drop --image, or pass a checkpoint of a run "
                         "with an image task (e.g. --tasks=text,image)")
    config = hf.read_config(o.ckpt, "--ckpt")  # config.json and tokenizer.json first: the prompt is checked before
    tok = load_tokenizer(o.ckpt, config)  # gigabytes of weights are read
    if o.image:
        return _sample_image(config, tok, o)
    # auto: as the checkpoint was trained (toy tasks, or chat for benchmarks); raw for any other checkpoint.
    fmt = o.prompt_format if o.prompt_format != "auto" else "raw" if not saved else "toy" if toy else "chat"
    if fmt == "toy":  # as train.py's toy text task: BOS + question (tasks.encode_text)
        text, head = o.prompt, [tasks.token_ids(tok).bos]
    else:  # the chat template already holds BOS
        text = chat_prompt([{"role": "user", "content": o.prompt}]) + o.prompt_prefill if fmt == "chat" else o.prompt
        head = []
    ids = head + encode_checked(tok, text)
    check_length(len(ids), o.gen_length, config, o.ckpt)
    model, device, gen = _load(o)
    prompt = torch.tensor([ids], device=device)                                          # (1, P)
    out = sample.fast_generate(model, prompt, gen_length=o.gen_length, block_length=o.block_length, steps=o.steps,
                               temperature=o.temperature, mask_id=model.config.mask_token_id, generator=gen,
                               kv_cache=o.kv_cache, threshold=o.threshold, remasking=o.remasking,
                               cfg_scale=o.text_cfg_scale, progress=cli.bars_shown())
    completion = tok.decode(out[0, prompt.shape[1]:].tolist(), skip_special_tokens=True)
    print(completion)
    return completion


def check_options(o: Options) -> None:
    """Every setting, before anything is read: the rules train.py applies to the same names, then sample.py's own."""
    if not o.prompt.strip():
        raise ValueError(f"--prompt is {'empty' if not o.prompt else 'only whitespace'}: pass the text to "
                         "complete, e.g. --prompt \"What is 7 * 8?\"")
    validate_generation(o)
    if o.remasking not in sample.REMASKING:
        raise ValueError(f"remasking ({o.remasking!r}) must be one of {', '.join(sample.REMASKING)}")
    if o.remasking != "low_confidence" and o.threshold > 0:
        raise ValueError(f"--threshold={o.threshold} compares the model's confidences: it needs "
                         f"--remasking=low_confidence, not {o.remasking}")
    if not (o.text_cfg_scale >= 0 and math.isfinite(o.text_cfg_scale)):
        raise ValueError(f"text_cfg_scale ({o.text_cfg_scale}) must be a finite number >= 0 (0 = no guidance)")
    if o.prompt_format not in FORMATS:
        raise ValueError(f"prompt_format ({o.prompt_format!r}) must be one of {', '.join(FORMATS)}")
    if o.png and not o.image:
        raise ValueError(f"--png {o.png} draws an image sample: add --image, or drop --png")
    if o.png and not plots.have_matplotlib():
        raise ValueError(f"--png {o.png} needs matplotlib, which is not installed: pip install matplotlib")
    if o.png and not Path(o.png).parent.is_dir():
        raise ValueError(f"--png {o.png}: the directory {Path(o.png).parent} does not exist")
    png = Path(o.png)
    if o.png and (png.is_dir() or png.suffix.lower() != ".png"):  # savefig would fail after the sampling
        problem, example = ("is a folder", png / "sample.png") if png.is_dir() else \
            ("does not end in .png", png.with_suffix(".png"))
        raise ValueError(f"--png {o.png} {problem}: pass the picture's file name, e.g. --png {example}")


def encode_checked(tok, text: str) -> list[int]:
    """tok's ids of text, with a warning naming the characters that become the unknown token (a word-level
    tokenizer's [UNK], say): the model sees none of them, and silently dropping meaning is a bad surprise."""
    enc = tok.encode(text, add_special_tokens=False)
    unk = getattr(tok.model, "unk_token", None)
    unk_id = tok.token_to_id(unk) if unk else None
    if unk_id is not None:
        # Offsets include the space a Metaspace pre-tokenizer folds into a piece: shown without it.
        lost = [text[a:b].strip() or text[a:b] for (a, b), i in zip(enc.offsets, enc.ids)
                if i == unk_id and text[a:b] != unk]
        if lost:
            print(f"warning: {len(lost)} piece(s) of the prompt are not in the tokenizer's vocabulary and become "
                  f"{unk}: {', '.join(map(repr, lost[:10]))}{' ...' if len(lost) > 10 else ''}", file=sys.stderr)
    return enc.ids


def check_length(prompt_len: int, gen_length: int, config, ckpt: str, flag: str = "") -> None:
    """Refuse a sequence longer than the model's positions: past them the output is garbage, slowly. flag:
    the option that set gen_length, as the user gave it (default --gen_length)."""
    flag = flag or f"--gen_length={gen_length}"
    if prompt_len + gen_length > config.max_sequence_length:
        raise ValueError(f"the prompt is {prompt_len} tokens and {flag}: {prompt_len + gen_length} "
                         f"> the model's max_sequence_length {config.max_sequence_length} ({Path(ckpt) / 'config.json'}); "
                         f"shorten the prompt or lower {flag.split('=')[0]}")


def _load(o: Options):
    """(model, device, generator): the weights on the GPU when there is one, in bf16 when it supports it."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    return hf.from_pretrained(o.ckpt, device=device, dtype=dtype), device, torch.Generator(device).manual_seed(o.seed)


def _sample_image(cfg, tok, o):
    # The toy's MMaDA-style t2i layout lives in tasks.py; its pictures in infra/plots.py.
    if cfg.image_token_offset is None:
        raise ValueError(f"{o.ckpt} has no image tokens (image_token_offset is unset in config.json); "
                         "--image needs a multimodal checkpoint such as train.py's toy output")
    n = o.image_width ** 2
    text_len = o.image_text_len or tasks.image_text_len(tok)
    caption = encode_checked(tok, o.prompt)
    if len(caption) + 3 > text_len:  # <|t2i|> BOS caption EOS, cut to text_len by tasks.encode_image_prompt
        print(f"warning: the caption is {len(caption)} tokens; only its first {text_len - 3} fit the text part "
              f"(--image_text_len={text_len})", file=sys.stderr)
    ids, start, att = tasks.encode_image_prompt(tok, tasks.token_ids(tok), o.prompt, text_len, n)
    check_length(len(ids) - n, n, cfg, o.ckpt, f"--image_width={o.image_width} ({n} image tokens)")
    uids, _, uatt = tasks.encode_image_prompt(tok, tasks.token_ids(tok), "", text_len, n)
    model, device, gen = _load(o)

    def t(v):
        return torch.tensor([v], device=device)                                        # (1, L)
    out = sample.generate_image(model, t(ids), image_start=start, num_tokens=n, steps=o.image_steps,
                         sampler=o.image_sampler, cfg_scale=o.cfg_scale, uncond_input_ids=t(uids), generator=gen,
                         attention_mask=t(att), uncond_attention_mask=t(uatt),
                         code_offset=cfg.image_token_offset, codebook_size=cfg.codebook_size,
                         mask_id=cfg.mask_token_id, progress=cli.bars_shown())
    codes = [c - cfg.image_token_offset for c in out[0, start:start + n].tolist()]
    print(plots.text_image(codes, o.image_width, sys.stdout))
    if o.png:
        plots.image_grid([("sample", [codes])], [o.prompt], o.image_width, o.png)
        print(f"wrote {o.png}", file=sys.stderr)
    return codes


def run() -> None:
    """`python -m tools.sample`: main() with user errors as one line on stderr and exit status 2."""
    with cli.user_errors():
        main()


if __name__ == "__main__":
    run()
