"""The policy and its reference, loaded and saved: the toy SFT model (trained once, cached in sft_dir), a pretrained
checkpoint, LoRA, FSDP2 sharding that never holds the whole model on one rank; a checkpoint made a model folder:

    python -m infra.load out/toy/checkpoints/step-00000040 out/toy-step-00000040
"""
import argparse
import errno
import hashlib
import itertools
import json
import os
import shutil
from pathlib import Path

import torch

import tasks

from infra import budget, checkpoint, cli, hf, outdir, scale, toy
from infra.scale import print0
from model import Transformer, num_params
from sample import generator


class WriteFailed(OSError):
    """Writing a model folder failed (whatever the writer raised): one line saying what, why, and what is left."""


def writer_error(e: BaseException) -> str:
    """What a writer's exception says, in a few words: an OSError's reason and file, else its first line."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror + (f": {e.filename}" if e.filename else "")
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}{': ' + text if text else ''}"[:200]


def add_lora(model, cfg):
    """cfg's LoRA adapters on `model`, lora_A drawn from the run's seed."""
    return hf.add_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, hf.TARGET_SETS[cfg.lora_targets],
                       generator=generator("cpu", cfg.seed, "lora"))


def sft_key(cfg) -> dict:
    """What the toy SFT model depends on: these settings, its toy tasks, and the source of its data and encoding."""
    keys = ("seed", "d_model", "n_layers", "n_heads", "mlp_hidden_size", "text_noise", "image_noise", "image_width",
            "text_max_steps", "image_loss_weight", "image_text_len", "attend_padding", "sft_steps", "sft_batch_size",
            "sft_lr", "sft_warmup", "cond_dropout", "gen_length")
    source = b"".join(Path(m.__file__).read_bytes() for m in (toy, tasks))
    return {k: getattr(cfg, k) for k in keys} | {"sft_tasks": list(tasks.sft_tasks(cfg)),
                                                 "toy_sha1": hashlib.sha1(source).hexdigest()}


def sft_dir_of(cfg) -> Path:
    return Path(cfg.sft_dir or Path(cfg.out_dir) / "sft")


def check_sft_cache(cfg) -> bool:
    """Whether sft_dir holds an SFT model of cfg's settings (runs share one); others are refused, naming the change."""
    sft_dir = sft_dir_of(cfg)
    if (meta_file := sft_dir / "sft_meta.json").is_file():
        saved, meta = hf.read_json(meta_file, "pass --retrain_sft=true to train the SFT model again"), sft_key(cfg)
        # A model trained on more toy tasks serves a run on fewer; one without sft_tasks was trained on both.
        trained, wanted = saved.pop("sft_tasks", list(tasks.TOY_TASKS)), meta.pop("sft_tasks")
        if (covered := set(wanted) <= set(trained)) and saved == meta:
            return True
        diff = [f"{k} {saved.get(k)!r} -> {meta[k]!r}" for k in meta if k != "toy_sha1" and saved.get(k) != meta[k]]
        if not covered:
            diff.append(f"toy tasks {trained} -> {wanted}")
        if saved.get("toy_sha1") != meta["toy_sha1"]:
            diff.append("infra/toy.py or tasks.py (the toy data or its encoding) changed")
        problem = f"holds an SFT model trained with other settings: {', '.join(diff)}"
    elif sft_dir.is_dir() and any(sft_dir.iterdir()):  # not an SFT model: no flag deletes someone's files
        shown = ", ".join(sorted(p.name for p in sft_dir.iterdir())[:5])
        raise ValueError(f"sft_dir {sft_dir} holds files ({shown}) but no sft_meta.json, so it is not an SFT model "
                         "this code wrote, and it is left as it is; pass --sft_dir=a new or empty folder")
    else:
        return False
    owner = sft_dir.parent  # a run whose own SFT model (RUN/sft, or its --sft_dir) this is: never replaced
    try:
        saved = hf.read_json(owner / "config.json")
    except (OSError, ValueError):
        saved = None
    if (hf.is_run_settings(saved) and owner.resolve() != Path(cfg.out_dir).resolve()
            and Path(saved.get("sft_dir") or owner / "sft").resolve() == sft_dir.resolve()):
        raise ValueError(f"sft_dir {sft_dir} is the SFT model of the run in {owner} and {problem}; --retrain_sft never "
                         f"replaces another run's files: pass --sft_dir={Path(cfg.out_dir) / 'sft'} or drop --sft_dir")
    if not cfg.retrain_sft:
        raise ValueError(f"sft_dir {sft_dir} {problem}; pass --retrain_sft=true to replace it, or give this "
                         "run its own --sft_dir")
    return False


def load_or_train_sft(cfg, device, dtype, sft) -> tuple[Path, object, dict, float]:
    """The toy SFT model: sft_dir when it matches cfg, else trained by `sft` on rank 0 and renamed onto sft_dir."""
    sft_dir, tok, cached, failed = sft_dir_of(cfg), toy.build_tokenizer(), check_sft_cache(cfg), []
    ids = tasks.token_ids(tok)
    if not cached and scale.rank() == 0:
        mc = budget.scratch_config(cfg, **tasks.model_config_overrides(tok))
        model = Transformer(mc).init_weights(generator("cpu", cfg.seed, "init")).to(device=device, dtype=dtype)
        print(f"SFT from scratch: {num_params(model) / 1e6:.2f}M parameters, {cfg.sft_steps} steps")
        seconds = sft(model, tok, ids, cfg, device)
        sft_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp, old = (sft_dir.with_name(f".{sft_dir.name}.{kind}-{os.getpid()}") for kind in ("tmp", "old"))
        try:
            with outdir.holding():  # a signal waits until the model is saved and renamed
                try:
                    hf.save_pretrained(model, tmp)
                    tok.save(str(tmp / "tokenizer.json"))
                    (tmp / "sft_seconds.json").write_text(json.dumps({"seconds": seconds}))
                    (tmp / "sft_meta.json").write_text(json.dumps(sft_key(cfg), indent=2))
                    checkpoint.fsync_tree(tmp)
                    if sft_dir.exists():  # the model being replaced stays whole until the new one is in
                        os.rename(sft_dir, old)
                    try:
                        os.rename(tmp, sft_dir)
                    except OSError:
                        if old.exists():
                            os.rename(old, sft_dir)
                        raise
                except Exception as e:  # whatever the writer raised: one line (train.py adds the command)
                    raise WriteFailed(f"saving the SFT model to {sft_dir} failed ({writer_error(e)}): SFT keeps no "
                                      f"checkpoint, so the trained SFT model is lost; {sft_dir} is unchanged") from e
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
                shutil.rmtree(old, ignore_errors=True)
                print(f"saved the SFT model to {sft_dir} (later runs with the same settings reuse it)")
        except WriteFailed as e:  # every rank raises it below, with the writer's errno (run.explain_failure reads it)
            cause = next((x for x in outdir.root_causes(e.__cause__) if isinstance(x, OSError) and x.errno), None)
            failed = [str(e), *((cause.errno, cause.strerror, cause.filename) if cause else ())]
    # Before any rank reads sft_dir, rank 0's failure (as bytes maxed over the others' zeros) ends every rank alike.
    sent = json.dumps(failed, default=str).encode() if failed else b""
    if n := int(scale.all_max(torch.tensor([len(sent)], device=device)).item()):
        got = scale.all_max(torch.tensor(list(sent.ljust(n, b"\0")), device=device))
        message, *cause = json.loads(bytes(got.tolist()))
        raise WriteFailed(message) from OSError(*cause) if cause else None
    if cached:
        print0(f"loading the SFT model from {sft_dir} (trained with these settings; --retrain_sft=true retrains it)")
    seconds = hf.read_json(sft_dir / "sft_seconds.json", "pass --retrain_sft=true to train it again")["seconds"]
    return sft_dir, tok, ids, seconds


def find_model(cfg, device, dtype, sft) -> tuple[Path, object, dict, float]:
    """(checkpoint directory, tokenizer, special ids, SFT seconds) to start from: init_from, or the toy SFT model."""
    if cfg.init_from == "scratch":
        return load_or_train_sft(cfg, device, dtype, sft)
    config, _ = hf.read_checkpoint(cfg.init_from)  # checks the directory; reads no weights
    tok = hf.load_tokenizer(cfg.init_from, config)
    toy_only = all(t in tasks.TOY_TASKS for t in tasks.task_list(cfg))  # a toy run's final/: ids by name
    return Path(cfg.init_from), tok, tasks.token_ids(tok) if toy_only else hf.token_ids(tok, config), 0.0


def load_model(cfg, device, dtype, sft):
    """(model, tokenizer, special ids, SFT seconds): the toy SFT model, or a pretrained checkpoint, whole."""
    path, tok, ids, seconds = find_model(cfg, device, dtype, sft)
    return hf.from_pretrained(path, device=device, dtype=dtype), tok, ids, seconds


def load_policy(cfg, device, dtype, sft):
    """(policy, reference or None when beta = 0, tokenizer, special ids, SFT seconds), sharded under torchrun.
    Full fine-tuning keeps float32 master weights: AdamW's steps at lr 3e-6 would round away in bf16."""
    master = torch.float32 if cfg.lora_rank == 0 else dtype
    if master != dtype:
        compute = "bf16 compute (FSDP2)" if scale.world() > 1 else "float32 compute"
        print0(f"full fine-tuning: float32 master weights, {compute}")
    path, tok, ids, sft_seconds = find_model(cfg, device, master, sft)
    model = load_sharded(path, device, master, dtype, (lambda m: add_lora(m, cfg)) if cfg.lora_rank else None)
    if cfg.lora_rank:
        print0("LoRA: {modules} modules, {lora_params:,} trainable of {total_params:,} parameters".format(
            **hf.lora_stats(model)))
    ref = None if not cfg.beta > 0 else hf.AdaptersOff(model) if cfg.lora_rank else \
        load_sharded(path, device, master, dtype, lambda m: m.requires_grad_(False))
    model.set_activation_checkpointing(cfg.activation_checkpointing)
    return model, ref, tok, ids, sft_seconds


def load_sharded(path, device, dtype, compute_dtype, adapt=None) -> Transformer:
    """from_pretrained in `dtype`, adapt, shard; under torchrun each rank fills only its rows (scale.fill_shard)."""
    if scale.world() == 1:
        model = hf.from_pretrained(path, device=device, dtype=dtype)
        return adapt(model) if adapt else model
    config, tensors = hf.read_checkpoint(path)  # on the CPU
    with torch.device("meta"):
        model = Transformer(config).to(dtype).eval()  # eval(): as from_pretrained returns it

    def put(name, p):
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, p)

    # adapt() runs on empty CPU stand-ins, as on meta LoRA's draws would be lost; what it adds keeps its CPU value.
    before, added = dict(model.named_parameters()), {}
    for name, p in before.items():
        put(name, torch.nn.Parameter(torch.empty(0), p.requires_grad))
    if adapt:
        adapt(model)
    for name, p in list(model.named_parameters()):
        if name in before:
            put(name, before[name].requires_grad_(p.requires_grad))
        else:
            added[name] = p.detach()
            put(name, torch.nn.Parameter(p.detach().to("meta"), p.requires_grad))
    model = scale.shard(model, compute_dtype=compute_dtype)
    model.to_empty(device=device)
    targets = dict(model.named_parameters()) | dict(model.named_buffers())
    with torch.no_grad():
        for name, full in itertools.chain(tensors, added.items()):
            scale.fill_shard(targets.pop(name), full)
    if targets:  # a tensor to_empty left uninitialised would silently train from garbage
        raise RuntimeError(f"{path}: no values for {sorted(targets)[:8]}")
    return model


def save_model(model, cfg, path: Path, tok, dtype: torch.dtype) -> None:
    """The policy as a LLaDA model folder (with LoRA, its adapters beside the merged weights); rank 0 writes."""
    state = scale.full_state_dict(model)
    if scale.rank() != 0:
        return
    existed = path.is_dir()  # an empty folder given for an export stays, emptied
    try:
        if cfg.lora_rank:  # merged into an unsharded CPU copy (16 GB for LLaDA-8B in bf16, on rank 0 only)
            dtype = next(v for k, v in state.items() if k.endswith(".weight")).dtype
            with torch.device("meta"):
                plain = Transformer(model.config)
            plain = add_lora(plain.to(dtype).to_empty(device="cpu"), cfg)
            plain.load_state_dict(state)
            hf.save_adapters(plain, path)
            hf.save_pretrained(hf.merge_lora(plain), path)
        else:
            hf.save_pretrained(model, path, state_dict={k: v.to(dtype) for k, v in state.items()})
        tok.save(str(path / "tokenizer.json"))
        (path / cli.GENERATION_FILE).write_text(json.dumps(cli.generation_settings(cfg), indent=2) + "\n")
    except Exception as e:  # whatever the writer raised (SafetensorError is no OSError): one line, no half model
        for p in (path.iterdir() if existed and path.is_dir() else [path]):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        raise WriteFailed(f"writing the model to {path} failed ({writer_error(e)}); what it wrote is removed") from e


def file_fingerprint(f: Path, digest, blocks: int = 256, block_bytes: int = 1 << 16) -> None:
    """Feed digest with f's size and content, or `blocks` evenly spaced blocks of a larger file (16 MiB read): hashing
    16 GB at every start would take minutes, and a block every few hundred MB tells trained models apart."""
    size = f.stat().st_size
    digest.update(f"{size}:".encode())
    with open(f, "rb") as fh:
        if size <= blocks * block_bytes:
            digest.update(fh.read())
            return
        for i in range(blocks):
            fh.seek((size - block_bytes) * i // (blocks - 1))
            digest.update(fh.read(block_bytes))


def reference_identity(cfg) -> dict:
    """The starting model (the KL anchor) a resume must keep: the SFT cache key, or init_from's content."""
    if cfg.init_from == "scratch":
        meta = sft_dir_of(cfg) / "sft_meta.json"
        return {"sft_meta": hf.read_json(meta) if meta.is_file() else None}
    root, digest = Path(cfg.init_from), hashlib.sha1()
    for name in ("config.json", "model.safetensors.index.json"):
        if (root / name).is_file():
            digest.update((root / name).read_bytes())
    for f in sorted(root.glob("*.safetensors")):
        digest.update(f.name.encode())
        file_fingerprint(f, digest)
    return {"init_from_content": digest.hexdigest()}


def report_truncation(cfg, tok, datasets: dict) -> dict:
    """{(task, split): (cut, total, longest)} of the prompts --max_prompt_len cuts to their last tokens, printed."""
    cut = {}
    for task, splits in datasets.items():
        if task in tasks.IMAGE_TASKS:
            continue
        for split, exs in splits.items():
            texts = [tasks.chat_prompt([{"role": "user", "content": ex["prompt"]}]) + cfg.prompt_prefill for ex in exs]
            lengths = [len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False)]
            if n := sum(length > cfg.max_prompt_len for length in lengths):
                cut[(task, split)] = (n, len(lengths), max(lengths))
                print0(f"note: {n} of {len(lengths)} {task} {split} prompts are longer than --max_prompt_len="
                       f"{cfg.max_prompt_len} tokens (the longest {max(lengths)}) and keep only their last "
                       f"{cfg.max_prompt_len}; raise --max_prompt_len to keep them whole")
    return cut


def refuse_training_checkpoint(path, flag: str) -> None:
    """Refuse a training checkpoint given where a model folder is needed, naming the command that converts it."""
    path = Path(path)
    if (path / "state.json").is_file() and not (path / "config.json").is_file():
        raise ValueError(f"{flag} {path} is a training checkpoint, not a model folder; turn it into one: python -m "
                         f"infra.load {path} {path.parents[1].with_name(f'{path.parents[1].name}-{path.name}')}")


def export_checkpoint(ckpt, dest) -> Path:
    """Write checkpoint `ckpt`'s policy as a new model folder `dest`, from the run's unchanged starting model."""
    ckpt, dest = Path(ckpt), Path(dest)
    if not (ckpt / "state.json").is_file():
        raise ValueError(f"{ckpt} is not a complete checkpoint (no state.json); pass a folder "
                         f"OUT_DIR/{checkpoint.DIRNAME}/{checkpoint.PREFIX}N")
    if problem := checkpoint.damage(ckpt):
        raise ValueError(f"checkpoint {ckpt} is damaged: {problem}; export an older one")
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ValueError(f"{dest} already exists and is not an empty folder (it is left as it is); pass a new folder")
    state = hf.read_json(ckpt / "state.json", "export another checkpoint")
    cfg = argparse.Namespace(**state["config"])
    cfg.out_dir = str(ckpt.parent.parent)  # the run's folder wherever it now is (its sft/ by default)
    start = sft_dir_of(cfg) if cfg.init_from == "scratch" else cfg.init_from
    if cfg.init_from == "scratch" and not (start / "config.json").is_file():
        raise ValueError(f"the SFT model this run started from ({start}) is missing; restore it (tokenizer and shapes)")
    if reference_identity(cfg) != state["reference"]:
        raise ValueError(f"the starting model of this run ({start}) is not the one the checkpoint was trained from "
                         "(its content changed); restore it to export")
    model = hf.from_pretrained(start, dtype=torch.float32)
    tok = toy.build_tokenizer() if cfg.init_from == "scratch" else hf.load_tokenizer(start, model.config)
    model = add_lora(model, cfg) if cfg.lora_rank else model
    opt = torch.optim.AdamW(hf.trainable_parameters(model), lr=cfg.lr)  # DCP restores model and optimizer together
    checkpoint.load(ckpt, model, opt, trainable_only=cfg.lora_rank > 0)
    dtype = torch.float32 if cfg.init_from == "scratch" or cfg.dtype == "float32" else torch.bfloat16  # as final/
    # Written beside dest, then renamed onto it (a rename replaces only an empty folder): another export to the
    # same dest at the same time makes this one fail, never a folder mixing the files of two.
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    try:
        save_model(model, cfg, tmp, tok, dtype)
        try:
            os.rename(tmp, dest)
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            raise ValueError(f"{dest} was filled by another process while this export ran (it is left as it is); "
                             "pass a new folder") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def main(argv=None) -> Path:
    p = argparse.ArgumentParser(description="Turn a train.py checkpoint (out_dir/checkpoints/step-N) into a model "
                                "folder that sample.py and evaluate.py take", allow_abbrev=False, exit_on_error=False)
    p.add_argument("checkpoint", nargs="?", help="OUT_DIR/checkpoints/step-N")
    p.add_argument("dest", nargs="?", help="a new folder for the model")
    args = cli.parse_known(p, argv, "infra.load")
    if args.dest is None:
        raise ValueError("pass a checkpoint and a new folder: python -m infra.load OUT_DIR/checkpoints/step-N DEST")
    # ~ as a shell user means it (a shell leaves it alone inside a word)
    dest = export_checkpoint(Path(args.checkpoint).expanduser(), Path(args.dest).expanduser())
    print(f"wrote {dest}: python -m tools.sample --ckpt={dest} --prompt=\"...\"; "
          f"python evaluate.py --ckpt={dest} --task=TASK")
    return dest


if __name__ == "__main__":
    with cli.user_errors():
        main()
