"""The sampling command line: `python sample.py --ckpt DIR --prompt TEXT [--image] [--field=value ...]`.

    python sample.py --ckpt out/toy/final --prompt "bob has 3 pens . how many pens does he have ?"
    python sample.py --ckpt out/toy/final --image --prompt "two red blocks"
    python sample.py --ckpt /path/to/LLaDA-8B-Instruct --prompt "What is 7 * 8?" --prompt_format=chat
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

import sample
import tasks
from infra import cli, fast_sample, hf
from infra.hf import load_tokenizer
from infra.run import read_generation_settings
from model import chat_prompt


@dataclass
class Options:
    """python sample.py --ckpt DIR --prompt TEXT [--image] [--field=value ...]. A checkpoint written by
    train.py carries its generation settings (generation.json), used unless a flag overrides them; the
    rest default to LLaDA's own (64 tokens in blocks of 16, 64 steps, greedy)."""
    ckpt: str = ""              # directory with config.json, *.safetensors, tokenizer.json
    prompt: str = ""              # the text to complete, or the caption to draw (--image)
    image: bool = False         # text-to-image (toy checkpoints of train.py): fill the image slots
    gen_length: int = 64          # completion tokens
    block_length: int = 16        # semi-autoregressive block size; divides gen_length
    steps: int = 64               # denoising steps, a multiple of the number of blocks, <= gen_length
    temperature: float = 0.0      # Gumbel-max sampling temperature (0 = greedy)
    seed: int = 0               # seeds the sampling generator (temperature > 0, images)
    prompt_format: str = "auto"  # auto (as train.py trained the checkpoint, else raw) | toy | chat | raw
    prompt_prefill: str = ""    # text that opens the assistant turn (chat format)
    kv_cache: str = "none"      # none (exact) | prefix | dual: Fast-dLLM block KV cache (approximate)
    threshold: float = 0.0      # > 0: also commit every masked token more confident than this
    image_steps: int = 12         # image denoising steps (MaskGRPO: 12 for rollouts, 32 for evaluation)
    image_sampler: str = "emerge" # emerge (MaskGRPO Alg. 4) | maskgit (MMaDA)
    cfg_scale: float = 0.0      # classifier-free guidance weight (images)
    image_width: int = 4        # images are image_width x image_width tokens
    image_text_len: int = 0     # caption part of the t2i prompt (0: the longest toy caption)


def main(argv=None):
    first = cli.parse(Options, argv, description="Sample from a LLaDA/MMaDA-style checkpoint.")
    saved = read_generation_settings(first.ckpt) if first.ckpt else {}
    toy = any(t in ("text", "image") for t in saved.pop("tasks", "").split(","))
    known = {k: v for k, v in saved.items() if k in Options.__dataclass_fields__ and k != "temperature"}
    o = cli.parse(Options, argv, description="Sample from a LLaDA/MMaDA-style checkpoint.", defaults=known)
    if not (o.ckpt and o.prompt):
        raise SystemExit("error: pass --ckpt DIR --prompt TEXT")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    model = hf.from_pretrained(o.ckpt, device=device, dtype=dtype)
    tok = load_tokenizer(o.ckpt, model.config)
    gen = torch.Generator(device).manual_seed(o.seed)
    if o.image:
        return _sample_image(model, tok, o, gen, device)
    # auto: as the checkpoint was trained (toy tasks, or chat for benchmarks); raw for any other checkpoint.
    fmt = o.prompt_format if o.prompt_format != "auto" else "raw" if not saved else "toy" if toy else "chat"
    if fmt == "toy":  # as train.py's toy text task: BOS + question (tasks.encode_text)
        ids = [tasks.token_ids(tok).bos] + tok.encode(o.prompt, add_special_tokens=False).ids
    elif fmt in ("chat", "raw"):  # the chat template already holds BOS
        text = chat_prompt([{"role": "user", "content": o.prompt}]) + o.prompt_prefill if fmt == "chat" else o.prompt
        ids = tok.encode(text, add_special_tokens=False).ids
    else:
        raise SystemExit(f"error: prompt_format ({o.prompt_format!r}) must be auto, toy, chat or raw")
    prompt = torch.tensor([ids], device=device)                                          # (1, P)
    out = fast_sample.generate(model, prompt, gen_length=o.gen_length, block_length=o.block_length, steps=o.steps,
                   temperature=o.temperature, mask_id=model.config.mask_token_id, generator=gen,
                   kv_cache=None if o.kv_cache == "none" else o.kv_cache, threshold=o.threshold or None,
                   progress=True)
    completion = tok.decode(out[0, prompt.shape[1]:].tolist(), skip_special_tokens=True)
    print(completion)
    return completion


def _sample_image(model, tok, o, gen, device):
    # The toy's MMaDA-style t2i layout and grid rendering live in tasks.py.
    cfg = model.config
    if cfg.image_token_offset is None:
        raise SystemExit(f"error: {o.ckpt} has no image tokens (image_token_offset is unset in config.json); "
                         "--image needs a multimodal checkpoint such as train.py's toy output")
    n = o.image_width ** 2
    text_len = o.image_text_len or tasks.image_text_len(tok)
    ids, start, att = tasks.encode_image_prompt(tok, o.prompt, text_len, n)
    uids, _, uatt = tasks.encode_image_prompt(tok, "", text_len, n)
    def t(v):
        return torch.tensor([v], device=device)                                        # (1, L)
    out = sample.generate_image(model, t(ids), image_start=start, num_tokens=n, steps=o.image_steps,
                         sampler=o.image_sampler, cfg_scale=o.cfg_scale, uncond_input_ids=t(uids), generator=gen,
                         attention_mask=t(att), uncond_attention_mask=t(uatt),
                         code_offset=cfg.image_token_offset, codebook_size=cfg.codebook_size,
                         mask_id=cfg.mask_token_id, progress=True)
    codes = [c - cfg.image_token_offset for c in out[0, start:start + n].tolist()]
    print(tasks.render_image(codes, o.image_width))
    return codes


def run() -> None:
    """`python sample.py`: main() with user errors as one line on stderr and exit status 2."""
    try:
        main()
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
