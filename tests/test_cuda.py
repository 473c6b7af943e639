"""The first-GPU check: what the CPU suite cannot show, measured on CUDA kernels and printed as a table.
Every check also runs on the CPU at toy size (cuda -> cpu, nccl -> gloo) inside the normal suite, so a
changed signature or a typo fails there, not on the first GPU; on CUDA the same code runs at the sizes below.

    python -m pytest tests/test_cuda.py tests/test_cuda_torchrun.py -v -s      # or: python tests/test_cuda.py
    (at most about 8 minutes on one H100/H200 for both files)

One device:
  1. LoRA over a bf16 base, activation checkpointing, device_batch_size 3, mu 3, text and image: the
     forward computes in bf16, adapters and their gradients stay float32, losses are finite, and the first
     ratio of every step is exactly 1 (update 0 re-scores pi_old: same weights, same input, same chunks),
     while later ones move.
  2. Full fine-tuning with a bf16 compute dtype: float32 master weights, bf16 all-gathered copies (FSDP2's
     MixedPrecisionPolicy from infra/scale.shard, in a one-rank NCCL / gloo group that the check destroys),
     float32 gradients, the first ratio exactly 1. (One process without FSDP2 computes in float32.)
  3. Logits on tests/fixtures/tiny-llada against the public LLaDA code's reference logits (scale 7.9):
     float32 within 1e-3; bf16 within 0.5 at worst and 0.05 on average (CPU bf16 measured 0.23 and
     0.027), with the greedy tokens agreeing at >= 95% of positions (CPU bf16: 97.5%).
  4. Peak memory of one LoRA update chunk of LLaDA-8B's shape (32 layers, d_model 4096, vocab 126,464,
     random bf16 weights, LoRA r 128 on the official targets, activation checkpointing) on a left-padded
     batch of device_batch_size sequences, then the optimizer step: peak allocated and reserved against
     infra/budget.memory(world_size=1)'s "lora_update" (0.5x to 1.5x). The CPU has no allocator
     statistics: there the update runs at toy size and its memory is measured by tests/test_budget.py.
  5. Which SDPA kernel runs with and without the key-padding mask (flash attention takes no mask, so
     padded batches run another kernel): torch's own dispatch choice, printed.
  6. Exact-sampler seconds per denoising step and generated tokens/s per GPU on the 32-layer model (a
     chunk of device_batch_size left-padded prompts), and the llada8b RL step time they imply (the
     measured rollout rate applied to the dry run's FLOPs of every phase) next to the dry run's.
  7. Rows sampled alone equal the same rows sampled in batches of 2 and 4, with per-row generators on
     the device (sample.uniform: one code path on every device).
  8. LoRA dropout under activation checkpointing: the recomputed forward replays the dropout masks, so
     gradients with checkpointing on equal those with it off (same seed); another seed moves them.
Checks 9-11 (torchrun: its kill delay; two processes with FSDP2) are in tests/test_cuda_torchrun.py.

The GPU bounds above have not yet been checked on a GPU; the CPU rehearsal runs in every CI run.
"""
import io
import math
import os
import socket
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.nn.attention import SDPBackend

# `python tests/test_cuda.py` puts tests/ first on the path; the repository root must come before any
# installed copy of the project.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import grpo  # noqa: E402
import importance  # noqa: E402
import sample  # noqa: E402
import train  # noqa: E402
from conftest import REFERENCE  # noqa: E402
from infra import budget, hf, scale  # noqa: E402
from model import ModelConfig, Transformer  # noqa: E402
from test_rl_step import build, run_step, save_tiny_checkpoint  # noqa: E402
from cuda_helpers import (free_port, head_dtype, one_update_chunk, padded_prompts, quiet, random_weights,  # noqa: F401
                          synthetic_rollout)

ROOT = Path(__file__).resolve().parents[1]
HAS_CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if HAS_CUDA else "cpu")
BACKEND = "nccl" if HAS_CUDA else "gloo"
# Two processes: two GPUs under CUDA; on the CPU two gloo ranks, slow (torchrun starts two interpreters).
TWO_PROCS = [pytest.mark.skipif(HAS_CUDA and torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
             *([] if HAS_CUDA else [pytest.mark.slow])]


# A torchrun launch on the CPU belongs to the slow suite; on a GPU it is part of the first-GPU check.
SLOW_ON_CPU = (lambda fn: fn) if HAS_CUDA else pytest.mark.slow


def two_procs(fn):
    for mark in TWO_PROCS:
        fn = mark(fn)
    return fn

# What was measured: (check, measured, bound), printed as one table when the module ends.
TABLE: list[tuple[str, str, str]] = []


def record(check: str, measured, bound: str) -> None:
    TABLE.append((check, measured if isinstance(measured, str) else f"{measured:.6g}", bound))


def format_table(rows) -> str:
    widths = [max(len(r[i]) for r in [("check", "measured", "bound"), *rows]) for i in range(3)]
    line = lambda r: " | ".join(c.ljust(w) for c, w in zip(r, widths))
    return "\n".join([line(("check", "measured", "bound")), "-+-".join("-" * w for w in widths), *map(line, rows)])


@pytest.fixture(scope="module", autouse=True)
def print_table():
    yield
    if TABLE:
        where = torch.cuda.get_device_name() if HAS_CUDA else "CPU (toy-size rehearsal)"
        print(f"\n\nfirst-GPU check on {where}\n" + format_table(TABLE))
        TABLE.clear()  # tests/test_cuda_torchrun.py records into the same table and prints its own rows


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


# The CPU rehearsal of checks 1 and 2 decodes shorter windows: the same code in a fraction of the time.
SHORT = [] if HAS_CUDA else ["--gen_length=12", "--block_length=12", "--steps=4", "--image_steps=2"]


# -----------------------------------------------------------------------------------------------------
# sizes: LLaDA-8B's on CUDA, a toy on the CPU


def llada8b_config(layers=32) -> ModelConfig:
    """LLaDA-8B's shape (its config.json) with `layers` blocks."""
    return ModelConfig(d_model=4096, n_layers=layers, n_heads=32, n_kv_heads=32, mlp_hidden_size=12288,
                       vocab_size=126464, max_sequence_length=4096, mask_token_id=126336, eos_token_id=126081,
                       pad_token_id=126081)


def toy_config() -> ModelConfig:
    return ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, mlp_hidden_size=192, vocab_size=600,
                       max_sequence_length=64, mask_token_id=599, eos_token_id=1, pad_token_id=1)


PRESET = train.parse_args(["--preset=llada8b", "--dry_run=true"])
# chunk rows, padded prompt length, completion, block, timed denoising steps
BIG = dict(mc=llada8b_config(), chunk=PRESET.device_batch_size, prompt_len=256, gen_len=PRESET.gen_length,
           block=PRESET.block_length, timed_steps=8) if HAS_CUDA else \
    dict(mc=toy_config(), chunk=3, prompt_len=12, gen_len=8, block=4, timed_steps=4)


# -----------------------------------------------------------------------------------------------------
# helpers


def check_ratios(updates, tasks_, label):
    """Update 0 of a step re-scores pi_old: exactly 1 at its largest, its mean 1 up to the chunk shares'
    float rounding; the last update has moved (lr 1e-2)."""
    for t in tasks_:
        first = updates[0].stats
        record(f"{label} {t}: first ratio max", first[f"{t}/ratio_max"], "== 1 exactly")
        assert first[f"{t}/ratio_max"] == 1.0 and first[f"{t}/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
        last = updates[-1].stats
        assert abs(last[f"{t}/ratio_mean"] - 1) > 1e-4 or abs(last[f"{t}/ratio_max"] - 1) > 1e-3
        for u in updates:
            assert math.isfinite(u.stats[f"{t}/loss"])


def sync():
    if HAS_CUDA:
        torch.cuda.synchronize()


@pytest.fixture(scope="module")
def big():
    """The 32-layer LLaDA-8B-shaped model in bf16 (CUDA) or the toy (CPU), random weights, LoRA r 128 on
    the llada8b preset's targets, activation checkpointing: shared by checks 4 and 6."""
    mc = BIG["mc"]
    model = random_weights(mc, DEV, torch.bfloat16)
    model = hf.add_lora(model, PRESET.lora_rank, PRESET.lora_alpha, 0.0,
                        targets=hf.TARGET_SETS[PRESET.lora_targets], generator=torch.Generator().manual_seed(0))
    return mc, model.set_activation_checkpointing(True)


# -----------------------------------------------------------------------------------------------------
# one device


def test_lora_bf16_base_with_checkpointing_and_chunks(ckpt):
    flags = ["--tasks=text,image", f"--device={DEV.type}", "--dtype=bfloat16", "--lora_rank=4", "--lora_alpha=8",
             "--activation_checkpointing=true", "--device_batch_size=3", "--lr=1e-2", *SHORT]
    cfg, policy, ref, opt, tok, ids = build(ckpt, *flags, device=DEV, dtype=torch.bfloat16)
    base = [p for n, p in policy.named_parameters() if "lora_" not in n]
    adapters = hf.trainable_parameters(policy)
    assert all(p.dtype == torch.bfloat16 for p in base) and all(p.dtype == torch.float32 for p in adapters)
    seen = head_dtype(policy)
    t0 = time.time()
    for step in (0, 1) if HAS_CUDA else (0,):
        log, rolls, updates = run_step(cfg, policy, ref, opt, tok, ids, step, device=DEV)
        check_ratios(updates, ("text", "image"), f"1. LoRA bf16 step {step}")
        for u in updates:
            grads = [g for n, g in u.grads.items() if "lora_" in n]
            assert grads and all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)
    assert set(seen) == {torch.bfloat16}, seen
    record("1. LoRA bf16 + checkpointing + chunks", f"{time.time() - t0:.1f} s", "finite, bf16 head")


def test_full_finetuning_with_bf16_compute(ckpt, monkeypatch):
    """One process holds float32 weights and computes in float32 (load_policy); bf16 compute of full
    fine-tuning is FSDP2's: the all-gathered copies are cast to bf16. Here scale.shard's own FSDP2 wrap
    runs in a one-rank group (scale.world() is made to say 2 for the wrap alone, the one way to reach it
    in one process), so the exact wrap train.py uses under torchrun computes this update. The group is
    destroyed at the end, whatever happens."""
    import torch.distributed as dist
    assert not dist.is_initialized(), "another test left a process group behind"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group(BACKEND, rank=0, world_size=1)
    try:
        cfg, policy, ref, _, tok, ids = build(ckpt, "--tasks=text", f"--device={DEV.type}", "--dtype=bfloat16",
                                             "--lr=1e-2", "--beta=0.5", *SHORT, device=DEV, dtype=torch.bfloat16)
        assert all(p.dtype == torch.float32 for p in policy.parameters()), "full fine-tuning: float32 master weights"
        with monkeypatch.context() as m:
            m.setattr(scale, "world", lambda: 2)
            policy = scale.shard(policy, compute_dtype=torch.bfloat16)
            ref = scale.shard(ref, compute_dtype=torch.bfloat16)
        opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, betas=(0.9, 0.99))
        seen = head_dtype(policy)
        log, rolls, updates = run_step(cfg, policy, ref, opt, tok, ids, 0, device=DEV, keep_weights=False)
        check_ratios(updates, ("text",), "2. full FT bf16 compute")
        assert set(seen) == {torch.bfloat16}, seen
        assert all(p.dtype == torch.float32 for p in policy.parameters())
        assert all(g.dtype == torch.float32 and torch.isfinite(g).all() for u in updates for g in u.grads.values())
        record("2. full FT, bf16 compute: head dtype", str(seen[0]).removeprefix("torch."), "bfloat16")
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized()


@pytest.mark.parametrize("dtype, worst, mean", [(torch.float32, 1e-3, 1e-4), (torch.bfloat16, 0.5, 0.05)])
def test_logits_match_the_reference(dtype, worst, mean):
    ref = load_file(str(REFERENCE / "reference_logits.safetensors"))
    model = hf.from_pretrained(REFERENCE, device=DEV, dtype=dtype)
    with torch.no_grad():
        got = model(ref["input_ids"].to(DEV)).float().cpu()
    err = (got - ref["logits"]).abs()
    agree = (got.argmax(-1) == ref["logits"].argmax(-1)).float().mean().item()
    name = str(dtype).removeprefix("torch.")
    record(f"3. {DEV.type} {name} logits vs reference: max |diff|", err.max().item(), f"<= {worst}")
    record(f"3. {DEV.type} {name} logits: mean |diff|", err.mean().item(), f"<= {mean}")
    record(f"3. {DEV.type} {name} greedy tokens agreeing", agree, ">= 0.95")
    assert err.max() <= worst and err.mean() <= mean and agree >= 0.95


def test_update_chunk_memory_on_a_padded_batch(big):
    mc, model = big
    B, P, N = BIG["chunk"], BIG["prompt_len"], BIG["gen_len"]
    opt = torch.optim.AdamW(hf.trainable_parameters(model), lr=PRESET.lr)
    r = synthetic_rollout(model, mc, B, P, N, DEV)
    assert not bool(r.batch.attention_mask.all())  # padded: the key-mask attention path
    if HAS_CUDA:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    model.train()
    stats = one_update_chunk(model, r, PRESET)
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.eval()
    sync()
    s = budget.shape(mc, PRESET.lora_rank, PRESET.lora_targets)
    est = budget.memory(mc, s, world_size=1, chunk=B, seq_len=P + N, sampled=BIG["block"], image=False,
                        cfg_scale=0.0, beta=PRESET.beta, activation_checkpointing=True,
                        head_len=N)["lora_update"]
    assert math.isfinite(stats["loss"]) and est > 0
    what = f"4. update chunk, {mc.n_layers} layers, {B} x {P + N} padded"
    if not HAS_CUDA:
        record(what, "ran (no CPU allocator stats)", f"estimate {est:.3g} GiB")
        return
    peak, reserved = torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30
    record(what + ": peak allocated GiB", peak, f"0.5-1.5 x estimate {est:.2f}")
    record(what + ": peak reserved GiB", reserved, "printed")
    assert 0.5 * est <= peak <= 1.5 * est


def test_sdpa_kernel_with_and_without_the_key_mask(big, monkeypatch):
    """torch's own dispatch choice (torch._fused_sdp_choice) for the attention model.py calls, recorded
    for an unpadded and a left-padded batch."""
    mc, model = big
    chosen, real = [], F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        chosen.append(SDPBackend(torch._fused_sdp_choice(q, k, v, attn_mask, dropout_p, is_causal)).name)
        return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    x, am = padded_prompts(mc, 2, BIG["prompt_len"], DEV)
    kernels = {}
    with torch.no_grad():
        for label, mask in (("no mask", None), ("key mask (padded)", am)):
            chosen.clear()
            model(x, mask, logits_at=slice(0, 1))
            assert len(chosen) == mc.n_layers and len(set(chosen)) == 1, chosen
            kernels[label] = chosen[0]
            record(f"5. SDPA kernel, {label}", chosen[0], "printed")
    assert "ERROR" not in kernels.values()


def test_exact_sampler_speed_and_the_step_time_it_implies(big):
    mc, model = big
    B, P, K, steps = BIG["chunk"], BIG["prompt_len"], BIG["block"], BIG["timed_steps"]
    x, am = padded_prompts(mc, B, P, DEV)
    gens = lambda: [torch.Generator(device=DEV).manual_seed(i) for i in range(B)]
    kw = dict(gen_length=K, block_length=K, temperature=PRESET.temperature, mask_id=mc.mask_token_id,
              attention_mask=am)
    sample.generate(model, x, steps=1, generator=gens(), **kw)  # warm-up: kernels, RoPE cache
    # The exact sampler's forward spans the whole sequence at every step, so a step's time depends on the
    # sequence length, not on which step it is: time `steps` steps of one block over P + gen_length tokens.
    xs = torch.cat([x, x.new_full((B, PRESET.gen_length - K), mc.pad_token_id)], 1) if HAS_CUDA else x
    ams = torch.cat([am, am.new_ones(B, xs.shape[1] - P)], 1)
    sync()
    t0 = time.time()
    out = sample.generate(model, xs, steps=steps, generator=gens(), **{**kw, "attention_mask": ams})
    sync()
    per_step = (time.time() - t0) / steps
    assert not (out[:, xs.shape[1]:] == mc.mask_token_id).any()
    res = quiet(budget.report, PRESET)
    gpus, f = res["gpus"], res["flops"]
    per_gpu = res["seqs_per_step"] // gpus
    rollout_s = math.ceil(per_gpu / B) * PRESET.steps * per_step         # one RL step's rollouts on one GPU
    tok_s = per_gpu * PRESET.gen_length / rollout_s
    implied = rollout_s * f["step"] / f["rollout"]
    size = f"{mc.n_layers} layers, {B} x {xs.shape[1] + K} tokens"
    record(f"6. exact sampler s per denoising step ({size})", per_step, "printed")
    record("6. generated tokens/s per GPU (exact sampler)", tok_s, "printed (d1's A100 record: about 60)")
    record(f"6. implied llada8b RL step on {gpus} GPUs, s", implied,
           f"dry run: {res['seconds_per_step']:.0f} s" + ("" if HAS_CUDA else " (toy timing: not comparable)"))
    assert per_step > 0 and math.isfinite(implied)


def test_rows_alone_equal_rows_in_a_batch():
    """Per-row generators on the device: rows alone and in batches of 2 and 4 give the same tokens.
    float64, so that a kernel chosen for another row count cannot flip a near-tie (only the noise can)."""
    mc = toy_config()
    model = Transformer(mc).init_weights(torch.Generator().manual_seed(0), std=0.3).to(DEV, torch.float64).eval()
    x, am = padded_prompts(mc, 4, 10, DEV, seed=3)
    kw = dict(gen_length=12, block_length=4, steps=12, temperature=1.0, mask_id=mc.mask_token_id)
    gens = lambda rows: [torch.Generator(device=DEV).manual_seed(40 + i) for i in rows]
    out = {size: torch.cat([sample.generate(model, x[a:a + size], generator=gens(range(a, a + size)),
                                            attention_mask=am[a:a + size], **kw) for a in range(0, 4, size)])
           for size in (1, 2, 4)}
    same = sum(bool(torch.equal(out[1][i], out[4][i])) for i in range(4))
    record("7. rows alone == rows in a batch of 4 (per-row device generators)", f"{same} of 4", "4 of 4")
    assert torch.equal(out[2], out[1]) and torch.equal(out[4], out[1])


def test_rows_alone_and_in_a_batch_in_bf16_agree_mostly():
    """Check 7 in bf16, reported, not asserted: the noise is the same (per-row generators), but in bf16 the
    kernels for another row count round differently and can flip a near-tie, so a row's tokens may differ
    between its batch and alone. The fraction of tokens that agree is printed; the test asserts only that
    the comparison ran on whole completions (and, as a floor, that most tokens agree)."""
    mc = toy_config()
    model = Transformer(mc).init_weights(torch.Generator().manual_seed(0), std=0.3).to(DEV, torch.bfloat16).eval()
    x, am = padded_prompts(mc, 4, 10, DEV, seed=3)
    kw = dict(gen_length=12, block_length=4, steps=12, temperature=1.0, mask_id=mc.mask_token_id)
    gens = lambda rows: [torch.Generator(device=DEV).manual_seed(40 + i) for i in rows]
    alone = torch.cat([sample.generate(model, x[a:a + 1], generator=gens([a]), attention_mask=am[a:a + 1], **kw)
                       for a in range(4)])
    batch = sample.generate(model, x, generator=gens(range(4)), attention_mask=am, **kw)
    window = slice(x.shape[1], None)
    agree = (alone[:, window] == batch[:, window]).float().mean().item()
    record("7b. bf16: tokens alone == in a batch of 4", f"{agree:.1%}", "reported (kernels may round apart)")
    assert alone.shape == batch.shape == (4, 22) and agree >= 0.5


def test_dropout_replays_under_activation_checkpointing():
    mc = toy_config()
    x, am = padded_prompts(mc, 2, 16, DEV, seed=1)

    def grads(checkpointing, seed):
        model = Transformer(mc).init_weights(torch.Generator().manual_seed(0)).to(DEV)
        hf.add_lora(model, 4, 8.0, 0.3, generator=torch.Generator().manual_seed(1))
        for n, p in model.named_parameters():  # B starts at 0; move it so that A's gradient is not 0 too
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(2))
        model.set_activation_checkpointing(checkpointing).train()
        torch.manual_seed(seed)  # dropout draws from the default generators, which checkpointing replays
        model(x, am).float().logsumexp(-1).mean().backward()
        return torch.cat([p.grad.flatten() for p in hf.trainable_parameters(model)])

    on, off, other = grads(True, 0), grads(False, 0), grads(True, 1)
    diff = (on - off).abs().max().item()
    record("8. LoRA dropout grads, checkpointing on vs off: max |diff|", diff,
           f"<= 1e-6 x max |grad| ({on.abs().max().item():.3g}); another seed differs")
    assert diff <= 1e-6 * on.abs().max().item()
    assert not torch.allclose(on, other)




if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-s"]))
