"""The dry-run figures against a hand derivation, and the start-up disk check sized to what a checkpoint
holds (infra/budget.py).

    python -m pytest tests/test_budget.py -q      # seconds; no weights are loaded
"""
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tasks
import train
from infra import budget, toy
from model import ModelConfig


def test_llada8b_flops_match_the_hand_derivation(capsys):
    """LLaDA-8B, the llada8b preset (LoRA r=128, activation checkpointing, beta > 0, no KV cache).

    By hand, with N = 8.0e9 parameters and 2 N FLOPs per token of a forward (attention, ~2% at 512
    tokens, and the embedding lookup, which costs nothing but is in N, roughly cancel):
      sequences per RL step  S = 16 prompts x G 6 x 1 task = 96, each of T = 256 + 256 = 512 tokens
      rollouts   128 denoising steps, each a forward over the whole sequence:  S T x 128 x 2N
      scoring    old and reference log-probs for each of mu = 12 masks:      S T x 12 x 2 x 2N
      updates    mu = 12 optimizer steps over all S sequences: forward 2N, recomputed forward 2N
                 (checkpointing), backward through frozen weights 2N (input gradients only):  S T x 12 x 6N
      total      S T x 2N x (128 + 24 + 36) = 49,152 x 1.6e10 x 188 = 1.48e17 FLOPs per RL step
    The whole run is that times rl_steps (plus the held-out evaluation); on 8 A100s at 312 TFLOP/s and
    35% MFU one step takes 1.48e17 / (8 x 312e12 x 0.35) = 170 s."""
    res = train.main(["--preset=llada8b", "--dry_run=true"])
    N, S, T = 8.0e9, 16 * 6 * 1, 256 + 256
    by_hand = S * T * 2 * N * (128 + 12 * 2 + 12 * 3)
    f = res["flops"]
    assert f["step"] == pytest.approx(by_hand, rel=0.10)
    assert f["rollout"] == pytest.approx(S * T * 128 * 2 * N, rel=0.10)
    text = capsys.readouterr().out
    assert f"global FLOPs per RL step: {f['step']:.2e}" in text
    # The preset's 667 rollout batches x mu 12, a checkpoint every 42 of them; 170 s a step by hand, so
    # the run takes 667 x 170 s = 31.4 h on 8 GPUs (the held-out evaluation, 2 x 256 greedy rollouts, adds
    # under 1%), 252 GPU-hours.
    assert res["optimizer_steps"] == 8004 and "8,004 optimizer steps" in text
    assert res["checkpoint_every_optimizer_steps"] == 504
    seconds = by_hand / (8 * 312e12 * 0.35)
    assert res["seconds_per_step"] == pytest.approx(seconds, rel=0.10)
    assert f["run"] == pytest.approx(667 * by_hand, rel=0.10)
    assert res["run_hours"] == pytest.approx(667 * seconds / 3600, rel=0.10)
    assert res["gpu_hours"] == pytest.approx(8 * 667 * seconds / 3600, rel=0.10)
    assert budget.GPU_NAME in text and "assumed MFU 35%" in text


def test_schedule_follows_the_config(capsys):
    res = train.main(["--preset=llada8b", "--dry_run=true", "--rl_steps=667", "--checkpoint_every=42"])
    text = capsys.readouterr().out
    assert res["optimizer_steps"] == 8004 and "667 rollout batches x mu 12 = 8,004 optimizer steps" in text
    assert "a checkpoint every 42 rollout batches = 504 optimizer steps" in text


def test_full_fine_tuning_costs_more_to_update():
    """Full fine-tuning's backward adds the weight gradients of every matrix (2 per weight: 7.5e9 weights
    once the 0.52e9-row embedding lookup is left out), but has no adapters, which LoRA runs in the
    forward, the recomputed forward and the backward (input and weight gradients): 8 per adapter weight,
    0.34e9 of them (all seven projections). Rollouts and scoring are the same forwards apart from the adapters."""
    lora = train.main(["--preset=llada8b", "--dry_run=true", "--lora_targets=all"])["flops"]
    full = train.main(["--preset=llada8b", "--dry_run=true", "--lora_rank=0"])["flops"]
    S, T, mu = 96, 512, 12
    assert full["update"] - lora["update"] == pytest.approx(S * T * mu * (2 * 7.5e9 - 8 * 0.34e9), rel=0.05)
    assert lora["rollout"] - full["rollout"] == pytest.approx(S * T * 128 * 2 * 0.34e9, rel=0.05)


def test_memory_table_has_the_gathered_parts():
    res = train.main(["--preset=llada8b", "--dry_run=true", "--lora_targets=all"])
    one, eight = res["budget"][1], res["budget"][8]
    s, gb = res["shape"], 1024 ** 3
    # the embedding and head (126464 x 4096 each) and the final norm (4096) in bf16, gathered for an
    # update chunk: 1.93 GB
    assert eight["root_gathered"] == pytest.approx((2 * 126464 * 4096 + 4096) * 2 / gb)
    assert one["root_gathered"] == 0 and one["model_gathered"] == 0  # one process gathers nothing
    # A rollout on one of 8 GPUs, by hand: its shard of the bf16 base (8,015,581,184 weights x 2 B / 8) and
    # of the float32 adapters with gradients and AdamW moments (335,544,320 x 16 B / 8: r 128 on 7 matrices
    # of 32 blocks), the whole adapted model gathered in bf16 ((8,015,581,184 + 335,544,320) x 2 B), the
    # all-gather's flat buffer of the largest group, the root (embedding and head, 126464 x 4096 each, and
    # the final norm, in bf16), and the sampling transients below: 2.49 + 15.56 + 1.93 + 0.63 = 20.61 GB.
    base, adapters = 8_015_581_184, 335_544_320
    sampling = 12 * 16 * 126464 * (2 + 26)
    assert s["lora_params"] == adapters
    buffer = (2 * 126464 * 4096 + 4096) * 2
    assert eight["allgather_buffer"] == pytest.approx(buffer / gb) and one["allgather_buffer"] == 0
    by_hand = (base * 2 + adapters * 16) / 8 + (base + adapters) * 2 + buffer + sampling
    assert eight["lora_rollout"] == pytest.approx(by_hand / gb, rel=1e-6)
    assert eight["model_gathered"] == pytest.approx((base + adapters) * 2 / gb)
    # sampling: the bf16 logits of the preset's 12 sequences per chunk over the current block of 16
    # positions (the sampler's head runs there only), and float64 noise plus its bookkeeping over that block
    assert eight["sampling"] == pytest.approx((12 * 16 * 126464 * 2 + 12 * 16 * 126464 * 26) / gb)
    # an update chunk's logits: the float32 head over the 256-token completion window of the 512-token
    # sequence (the columns holding scored positions), float32 logits and their log-softmax (4 + 4 B), plus
    # the float32 copy of the head's 126464 x 4096 weight (importance.token_logprobs, model.Transformer.head)
    assert eight["logits"] == pytest.approx((12 * 126464 * 256 * 8 + 126464 * 4096 * 4) / gb)
    assert eight["weights_gb"] == pytest.approx(8_015_581_184 * 2 / 8 / gb)


def _free(monkeypatch, gb):
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10 ** 13, 10 ** 13 - int(gb * 2 ** 30),
                                                                                  int(gb * 2 ** 30)))


def test_disk_check_lora_passes_full_is_refused(tmp_path, monkeypatch):
    """A LoRA checkpoint of LLaDA-8B on all seven projections holds 335.5M float32 adapters and their two
    AdamW moments: 3.75 GiB; keep_last=2 plus the one being written is 11.25 GiB, and final/ adds the merged
    8.0B parameters in bf16 and the float32 adapters, 8,015,581,184 x 2 + 335,544,320 x 4 B = 16.18 GiB:
    27.43 GiB in all, which 28 GiB free hold and 27 do not (final/ is what tips it: 11.25 alone would fit).
    Full fine-tuning saves float32 weights and moments of all 8.0B parameters (89.6 GiB each) and is refused."""
    lora = train.parse_args(["--preset=llada8b", "--dry_run=true", "--lora_targets=all", "--dtype=bfloat16"])
    mc = budget.model_config(lora)
    one = 335_544_320 * 12 + 2 ** 20  # and 1 MB of metadata
    assert budget.checkpoint_bytes(lora, mc) == one
    need = 3 * one + 8_015_581_184 * 2 + 335_544_320 * 4  # to the byte: room for exactly that passes, a byte less not
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10 ** 13, 10 ** 13 - need, need))
    budget.check_disk(lora, tmp_path, mc)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10 ** 13, 10 ** 13, need - 1))
    with pytest.raises(ValueError, match="rotation keeps 3 at once"):
        budget.check_disk(lora, tmp_path, mc)
    _free(monkeypatch, 28)
    budget.check_disk(lora, tmp_path, mc)
    full = train.parse_args(["--preset=llada8b", "--dry_run=true", "--lora_rank=0", "--dtype=bfloat16"])
    with pytest.raises(ValueError, match=r"has 28.0 GB free, but a checkpoint needs about 89.6 GB \(float32 weights "
                                         r"and AdamW moments \(full fine-tuning\)\), rotation keeps 3 at once "
                                         r"\(--keep_last=2\) and final/ needs 14.9 GB: 283.7 GB; .*--checkpoint_every=0"):
        budget.check_disk(full, tmp_path, mc)
    _free(monkeypatch, 27)
    with pytest.raises(ValueError, match=r"LoRA adapters.*final/ needs 16.2 GB: 27.4 GB"):
        budget.check_disk(lora, tmp_path, mc)


def test_keep_all_counts_every_checkpoint(tmp_path, monkeypatch):
    cfg = train.parse_args(["--preset=smoke", "--rl_steps=10", "--checkpoint_every=3", "--keep_last=0"])
    _free(monkeypatch, 0)
    with pytest.raises(ValueError, match=r"rotation keeps 4 at once \(--keep_last=0\)"):  # steps 3, 6, 9 and
        budget.check_disk(cfg, tmp_path, budget.scratch_config(cfg, vocab_size=128))  # one written on a stop signal


@pytest.mark.parametrize("env, step, ckpt, fires", [
    ({}, 500.0, 50.0, False),                                                   # no launcher: the user's kill decides
    ({"TORCHELASTIC_RUN_ID": "x"}, 20.0, 5.0, False),                           # torchrun default 30 s > 25 s
    ({"TORCHELASTIC_RUN_ID": "x"}, 26.0, 5.0, True),                            # 31 s > 30 s
    ({"TORCHELASTIC_RUN_ID": "x", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "400"}, 165.0, 8.0, False),
    ({"TORCHELASTIC_RUN_ID": "x", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "120"}, 165.0, 8.0, True),
    ({"SLURM_JOB_ID": "7"}, 10.0, 1.0, False), ({"SLURM_JOB_ID": "7"}, 40.0, 1.0, True),
    # inside Slurm a raised torchrun timeout does not lift KillWait's (assumed) 30 s
    ({"SLURM_JOB_ID": "7", "TORCHELASTIC_RUN_ID": "x", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "400"}, 165.0, 8.0, True)])
def test_kill_delay_warning(env, step, ckpt, fires):
    """The start-up warning fires exactly when the launcher's SIGKILL would come before one step plus a
    checkpoint (by hand: the delay is TORCH_ELASTIC_SHUTDOWN_TIMEOUT under torchrun, 30 s by default, and
    Slurm's KillWait default 30 s), and names what to set: twice the need, rounded up."""
    text = budget.kill_delay_warning(env, step, ckpt)
    assert (text is not None) == fires
    if fires:
        assert text.startswith("warning: a SIGTERM gets SIGKILL") and "\n" not in text
        if "TORCHELASTIC_RUN_ID" in env:
            assert f"export TORCH_ELASTIC_SHUTDOWN_TIMEOUT={2 * math.ceil(step + ckpt)}" in text
        if "SLURM_JOB_ID" in env:
            assert f"--signal=TERM@{2 * math.ceil(step + ckpt)}" in text and "KillWait" in text


def test_kill_delay_warning_when_torchrun_ignores_the_variable(monkeypatch):
    """A torchrun that does not read TORCH_ELASTIC_SHUTDOWN_TIMEOUT (before torch 2.12: no shutdown_timeout
    in its LaunchConfig) kills 30 s after SIGTERM whatever the variable says: the warning fires at 400 s
    set for a 173 s need, and says to upgrade torch; the detection reads the installed LaunchConfig."""
    env = {"TORCHELASTIC_RUN_ID": "x", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "400"}
    import dataclasses as dc
    from torch.distributed.launcher import api
    assert budget.torchrun_reads_shutdown_timeout() == ("shutdown_timeout" in {f.name for f in dc.fields(api.LaunchConfig)})
    with monkeypatch.context() as m:
        m.setattr(budget, "torchrun_reads_shutdown_timeout", lambda: True)
        assert budget.kill_delay_warning(env, 165.0, 8.0) is None
        m.setattr(budget, "torchrun_reads_shutdown_timeout", lambda: False)
        text = budget.kill_delay_warning(env, 165.0, 8.0)
    assert "SIGKILL 30 s later (torchrun's fixed 30 s)" in text and "upgrade torch to 2.12 or later" in text

    @dc.dataclass
    class OldLaunchConfig:  # an older torch's launch configuration, without shutdown_timeout
        min_nodes: int
        max_nodes: int
        nproc_per_node: int

    monkeypatch.setattr(api, "LaunchConfig", OldLaunchConfig)
    assert not budget.torchrun_reads_shutdown_timeout()
    assert "upgrade torch" in budget.kill_delay_warning(env, 165.0, 8.0)


def test_kill_delay_start_up_hook(capsys, monkeypatch):
    """warn_kill_delay prices the llada8b step on the dry run's numbers (1.48e17 FLOPs on 8 A100s at 35%:
    about 170 s, tests above) plus its 2 GB LoRA checkpoint: under torchrun's default 30 s it warns; the
    smoke preset (a toy step of microseconds at that speed) does not; without a launcher it computes nothing."""
    env = {"TORCHELASTIC_RUN_ID": "x"}
    budget.warn_kill_delay(train.parse_args(["--preset=llada8b", "--dry_run=true"]), 8, env=env)
    out = capsys.readouterr().out
    assert "warning: a SIGTERM gets SIGKILL 30 s later" in out and "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=" in out
    budget.warn_kill_delay(train.parse_args(["--preset=smoke"]), 2, env=env)
    monkeypatch.setattr(budget, "model_config", lambda cfg: 1 / 0)
    budget.warn_kill_delay(train.parse_args(["--preset=llada8b", "--dry_run=true"]), 8, env={})
    assert capsys.readouterr().out == ""


# One RL update (a rollout and the old and reference scoring under scale.full_weights, one LoRA update with
# AdamW) on FSDP2 over 2 gloo ranks; each rank prints how far its resident set grew over its size before
# the model existed, after each phase.
RANK = """import json, os, resource, sys
sys.path.insert(0, sys.argv[1])
import torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
import grpo, importance, sample
from infra import budget, hf, scale
from model import ModelConfig, Transformer
D, V, MLP, B, P, N, R = (int(v) for v in sys.argv[2:9])
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
mc = ModelConfig(d_model=D, n_layers=2, n_heads=D // 128, n_kv_heads=D // 128, mlp_hidden_size=MLP, vocab_size=V,
                 max_sequence_length=P + N, mask_token_id=V - 1, eos_token_id=1, pad_token_id=1)
g = torch.Generator().manual_seed(0)
x = torch.randint(0, V - 1, (B, P + N), generator=g)
base = rss()
with torch.device("meta"):
    model = Transformer(mc)
hf.add_lora(model, R, 2.0 * R, 0.0, targets=hf.TARGET_SETS["official"])
model = scale.shard(model, compute_dtype=torch.float32)
model.to_empty(device="cpu")
with torch.no_grad():
    for n, p in model.named_parameters():
        t = p.to_local()
        t.fill_(1.0) if p.dim() == 1 else t.normal_(0, 0.02, generator=g)
model.set_activation_checkpointing(True).eval()
out = {"setup": peak() - base}
with scale.full_weights(model):
    sample.generate(model, x[:, :P], gen_length=N, block_length=N, steps=2, temperature=0.9, mask_id=V - 1,
                    generator=[torch.Generator().manual_seed(i) for i in range(B)])
out["rollout"] = peak() - base
mask = torch.zeros(B, P + N, dtype=torch.bool)
mask[:, P:] = True
inp = x.masked_fill(mask, V - 1)
with torch.no_grad(), scale.full_weights(model):  # as train.rl_step scores: on the gathered model
    old = importance.token_logprobs(model, inp, x, mask)
    ref = importance.token_logprobs(model, inp, x, mask)
out["scoring"] = peak() - base
opt = torch.optim.AdamW(hf.trainable_parameters(model), lr=1e-4)
model.train()
logp = importance.token_logprobs(model, inp, x, mask)
loss, _ = grpo.policy_loss(logp, old, torch.randn(B, generator=g), mask, clip_eps=0.2, beta=0.01, logp_ref=ref,
                           norm="token")
loss.backward()
opt.step()
out["update"] = peak() - base
# one write per line: torchrun starts ranks unbuffered, where print writes the text and its newline apart
sys.stdout.write("MEM " + json.dumps({"rank": dist.get_rank(), **out}) + "\\n")
sys.stdout.flush()
from infra import scale
with scale.process_exit():  # leave the group and end the rank without interpreter teardown (gloo threads)
    pass
"""


@pytest.mark.slow
def test_memory_formula_matches_a_two_rank_run(tmp_path):
    """budget.memory against a measured 2-rank CPU run, within 25% per rank. The slice keeps LLaDA-8B's
    proportions where they set the peak (the root, embedding + head over a 32,768 vocabulary, outweighs
    a block 5 to 1; LoRA r 128 on the official targets; activation checkpointing; every completion
    position scored) in float32, which the CPU computes fastest, at 2 x 64 tokens.
    The measure: the growth of the process's peak resident set (getrusage ru_maxrss) over its resident
    set just before the model is built. The CPU allocator is glibc malloc, and MALLOC_MMAP_THRESHOLD_
    makes every allocation of 1 MB or more its own mapping, returned to the system when the tensor is
    freed, so the resident set follows the live tensors (which torch counts on CUDA only) instead of
    malloc's cached arenas; libraries and the interpreter, loaded before, are not counted."""
    D, V, MLP, B, P, N, R = 1024, 32768, 2816, 2, 32, 32, 128
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_=str(2 ** 20))
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(script), root, *map(str, (D, V, MLP, B, P, N, R))], env=env, capture_output=True,
                         text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    ranks = [json.loads(line[4:]) for line in res.stdout.splitlines() if line.startswith("MEM ")]
    assert len(ranks) == 2
    mc = ModelConfig(d_model=D, n_layers=2, n_heads=D // 128, n_kv_heads=D // 128, mlp_hidden_size=MLP,
                     vocab_size=V, max_sequence_length=P + N, mask_token_id=V - 1, eos_token_id=1, pad_token_id=1)
    s = budget.shape(mc, R, "official")
    est = budget.memory(mc, s, world_size=2, chunk=B, seq_len=P + N, sampled=N, image=False, cfg_scale=0.0,
                        beta=0.01, activation_checkpointing=True, compute_bytes=4, head_len=N)
    formula = est["lora_peak"]
    for r in ranks:
        measured = max(r["rollout"], r["scoring"], r["update"]) / 2 ** 30
        print(f"rank {r['rank']}: measured peak {measured:.3f} GiB (rollout {r['rollout'] / 2 ** 30:.3f}, "
              f"scoring {r['scoring'] / 2 ** 30:.3f}, update {r['update'] / 2 ** 30:.3f}); formula {formula:.3f} "
              f"GiB (update {est['lora_update']:.3f}, rollout {est['lora_rollout']:.3f}, scoring "
              f"{est['lora_scoring']:.3f}), of which the all-gather buffer {est['allgather_buffer']:.3f}")
        assert measured == pytest.approx(formula, rel=0.25)


def test_dry_run_states_the_batch_its_headroom_and_the_rollout_rate(capsys):
    """llada8b on 8 GPUs: device_batch_size 12 holds a GPU's 12 sequences in one chunk; the printed headroom
    is the H100's 80 GB and the H200's 141 GB minus the LoRA peak, which is the scoring phase's (below);
    the rollout rate by hand: 96 x 256 generated tokens per step from 96 x 512 x 128 x 2 x 8.0e9 FLOPs
    (at --max_prompt_len, no data given) at 312e12 x 0.35 FLOP/s per A100: 27 tokens/s per GPU (the head
    over a 16-token block instead of 512 positions makes it about 7% more), 86 on an H100's 989e12."""
    res = train.main(["--preset=llada8b", "--dry_run=true"])
    text = capsys.readouterr().out
    b8 = res["budget"][8]
    peak = b8["lora_peak"]
    assert peak == max(b8["lora_update"], b8["lora_rollout"], b8["lora_scoring"]) == b8["lora_scoring"]
    # in GiB on both sides: the cards' totals as nvidia-smi lists them, 81,559 and 143,771 MiB
    h100, h200 = 81559 / 1024, 143771 / 1024
    assert (f"device_batch_size 12 of 12 sequences per task and GPU on 8 GPUs: LoRA peak {peak:.1f} GiB (scoring), "
            f"headroom {h100 - peak:.0f} GiB of 79.6 on an H100, {h200 - peak:.0f} GiB of 140.4 on an H200") in text
    # a LoRA run's table has no full fine-tuning rows, and every memory figure says GiB
    assert "| GiB per GPU (estimate) |" in text and "full fine-tuning" not in text.split("| GiB per GPU")[1]
    by_hand = 96 * 256 / (96 * 512 * 128 * 2 * 8.0e9 / (312e12 * 0.35))
    assert res["tokens_per_s_per_gpu"]["A100"] == pytest.approx(by_hand, rel=0.10)
    assert res["tokens_per_s_per_gpu"]["H100"] == pytest.approx(by_hand * 989 / 312, rel=0.10)
    assert "rollouts at a padded prompt length of 256 tokens (--max_prompt_len, an upper bound" in text


def test_scoring_peak_holds_the_gathered_model_and_a_chunks_logits():
    """The old and reference log-probs run inside scale.full_weights (train.rl_step step 5): on each of 8
    GPUs, by hand for llada8b (LoRA r 128 on q/k/v/up: 167,772,160 adapters), the sharded state (bf16 base
    and float32 adapters with gradients and moments, / 8), the whole adapted model gathered in bf16, the
    all-gather's flat buffer of the root (embedding and head, 126464 x 4096 each, and the final norm), one
    block's activations of a 12-sequence chunk (16 x 4096 + 3 x 12288 values per token, bf16, 512 tokens),
    and the chunk's float32 logits and log-softmax over the 256-token window (8 B per entry) with the float32
    copy of the head's weight: about 25.4 GiB, above the rollout's 20.0 and the update's 14.4."""
    res = train.main(["--preset=llada8b", "--dry_run=true"])
    base, adapters, gb = 8_015_581_184, 167_772_160, 1024 ** 3
    state = (base * 2 + adapters * 16) / 8
    gathered = (base + adapters) * 2
    buffer = (2 * 126464 * 4096 + 4096) * 2
    block = 12 * 512 * (16 * 4096 + 3 * 12288) * 2
    logits = 12 * 256 * 126464 * 8 + 126464 * 4096 * 4
    by_hand = (state + gathered + buffer + block + logits) / gb
    assert res["budget"][8]["lora_scoring"] == pytest.approx(by_hand, rel=1e-9)
    assert 25.0 < by_hand < 25.5


def test_a_run_that_does_not_fit_says_so(capsys):
    """Full fine-tuning of LLaDA-8B on one GPU: 16 B per parameter of float32 weights, gradients and AdamW
    moments, and a 4 B float32 reference: 8.0e9 x 20 B = 149 GiB before activations. The dry run says it does
    not fit on an 80 GB H100 (79.6 GiB) nor a 141 GB H200 (140.4 GiB), never "headroom -76 GiB"."""
    res = train.main(["--preset=llada8b", "--dry_run=true", "--dry_run_gpus=1", "--lora_rank=0"])
    text = capsys.readouterr().out
    assert res["budget"][1]["full_state"] == pytest.approx(8_015_581_184 * 20 / 1024 ** 3)
    peak = res["budget"][1]["full_peak"]
    assert f"does not fit on an H100 (79.6 GiB, {peak - 79.6:.0f} GiB short)" in text
    assert f"does not fit on an H200 (140.4 GiB, {peak - 140.4:.0f} GiB short)" in text
    assert "this run does not fit on 1 GPU(s)" in text and "headroom -" not in text
    # --lora_rank=0: no LoRA rows in the table, no LoRA figures in the model and settings lines
    assert "LoRA" not in text.split("| GiB per GPU")[1].split("device_batch_size")[0]
    model_line, settings = (next(ln for ln in text.splitlines() if ln.startswith(k)) for k in ("model:", "settings:"))
    assert model_line.endswith("full fine-tuning (--lora_rank=0): every parameter trained") and "LoRA r" not in settings


# -----------------------------------------------------------------------------------------------------
# every preset, cache mode and fine-tuning mode against a count by hand

def hand_flops(preset: str, kv_cache: str, lora_rank: int, *extra) -> dict:
    """FLOPs of one RL step and of one held-out evaluation, counted here from the model's shape and the
    preset's settings, phase by phase, on the cost model budget.flops states (a multiply-add is 2 FLOPs):
    a token through the blocks costs 2 per block matrix weight (LLaDA: q, k, v, attn_out d x d each with as
    many key/value heads as heads; ff_proj, up_proj d x h; ff_out h x d), 2 per adapter weight, and attention
    4 x keys x d per layer; the head 2 x V x d per position it runs at; a backward costs 2x the forward's
    matrix FLOPs for full fine-tuning (input and weight gradients), 1x for frozen matrices and the head
    under LoRA plus 2x for the adapters, and 2x attention; activation checkpointing adds the blocks'
    forward once more. Where the head runs: a text rollout step over the block (the exact sampler's
    block from its first masked position: an upper bound) and an image step over the image slots;
    scoring and updates over the window (completion or image), as importance.token_logprobs. The
    trajectory estimator scores T decoding states instead of mu masks: each update takes K of them
    (--trajectory_states, all T when 0), the old and reference passes min(mu K, T)."""
    cfg = train.parse_args([f"--preset={preset}", "--dry_run=true", f"--kv_cache={kv_cache}",
                            f"--lora_rank={lora_rank}", "--lora_targets=all", "--init_from=", *extra])
    d, nl, h = cfg.d_model, cfg.n_layers, cfg.mlp_hidden_size
    V = cfg.vocab_size or tasks.model_config_overrides(toy.build_tokenizer())["vocab_size"]
    r = cfg.lora_rank
    # LoRA on all seven projections: r x (in + out) each
    adapters = nl * r * (4 * (d + d) + 2 * (d + h) + (h + d))
    blocks = 2 * nl * (4 * d * d + 3 * d * h)           # per token, frozen or trained matrices
    M = blocks + 2 * adapters                            # per token through the blocks
    H = 2 * V * d                                        # per head position
    att = lambda keys: 4 * keys * d * nl                # per query token
    out = {"rollout": 0, "scoring": 0, "update": 0, "evaluation": 0}
    for task in cfg.tasks.split(","):
        image = task in ("image", "geneval")
        n = cfg.prompts_per_step * cfg.group_size
        if image:
            P, W, T = (cfg.image_text_len or 32) + 2, cfg.image_width ** 2, cfg.image_steps
        else:
            P, W, T = cfg.max_prompt_len, cfg.gen_length, cfg.steps
        L = P + W

        def exact_seq():  # one rollout sequence of the exact sampler (CFG: twice the rows, images only)
            if image:
                return (2 if cfg.cfg_scale > 0 else 1) * T * (L * (M + att(L)) + W * H)
            return T * (L * (M + att(L)) + cfg.block_length * H)

        if image or kv_cache == "none":
            roll = exact_seq()
        else:
            nb, B = W // cfg.block_length, cfg.block_length
            spb = T // nb
            roll = 0
            for b in range(nb):
                queries = (L - (P + b * B)) if kv_cache == "prefix" else B
                roll += L * (M + att(L)) + B * H + (spb - 1) * (queries * (M + att(L)) + B * H)
        fwd = L * (M + att(L)) + W * H
        if r:
            bwd = L * (blocks + 2 * 2 * adapters + 2 * att(L)) + W * H
        else:
            bwd = 2 * (L * (blocks + att(L)) + W * H)
        again = L * (M + att(L)) if cfg.activation_checkpointing else 0
        mu = cfg.mu
        per_update = (min(cfg.trajectory_states, T) if cfg.trajectory_states else T) \
            if cfg.estimator == "trajectory" else 1
        scored = min(mu * per_update, T) if cfg.estimator == "trajectory" else mu
        out["rollout"] += n * roll
        out["scoring"] += n * scored * (2 if cfg.beta > 0 else 1) * fwd
        out["update"] += n * mu * per_update * (fwd + bwd + again)
        # evaluation: eval_samples sampled per prompt, and one greedy for text; the exact sampler always
        out["evaluation"] += cfg.eval_prompts * (cfg.eval_samples + (0 if image else 1)) * exact_seq()
    return out


MODES = [(p, kv, lr, ()) for p in train.PRESETS for kv in ("none", "prefix", "dual") for lr in (0, 8)
         if kv == "none" or "text" in train.parse_args([f"--preset={p}", "--dry_run=true"]).tasks
         or "gsm8k" in train.parse_args([f"--preset={p}", "--dry_run=true"]).tasks]
# the trajectory estimator: every state, and K < T per update (mu K above and below T)
MODES += [("llada8b", "none", 128, ("--estimator=trajectory",)),
          ("llada8b", "none", 0, ("--estimator=trajectory", "--trajectory_states=12")),
          ("llada8b", "prefix", 128, ("--estimator=trajectory", "--trajectory_states=3")),
          ("smoke", "none", 0, ("--estimator=trajectory", "--trajectory_states=2", "--mu=3")),
          ("mmada8b", "none", 128, ("--estimator=trajectory", "--trajectory_states=5"))]


@pytest.mark.parametrize("preset, kv_cache, lora_rank, extra", MODES)
def test_dry_run_flops_match_a_count_by_hand(preset, kv_cache, lora_rank, extra, capsys):
    """Every preset, every cache mode its tasks allow, LoRA and full fine-tuning, and the trajectory
    estimator: the dry run's FLOPs per phase, per held-out evaluation and per run equal hand_flops' count
    (float rounding only), and the printed figures are those."""
    res = train.main([f"--preset={preset}", "--dry_run=true", f"--kv_cache={kv_cache}", f"--lora_rank={lora_rank}",
                      "--lora_targets=all", "--init_from=", *extra])  # no folder: the preset's (or scratch) shape
    text = capsys.readouterr().out
    want, f = hand_flops(preset, kv_cache, lora_rank, *extra), res["flops"]
    for phase in ("rollout", "scoring", "update"):
        assert f[phase] == pytest.approx(want[phase], rel=1e-12), phase
    assert f["eval_once"] == pytest.approx(want["evaluation"], rel=1e-12)
    step = want["rollout"] + want["scoring"] + want["update"]
    cfg = train.parse_args([f"--preset={preset}", "--dry_run=true"])
    assert f["run"] == pytest.approx(cfg.rl_steps * step + 2 * want["evaluation"], rel=1e-12)
    assert f"global FLOPs per RL step: {step:.2e} (rollouts {want['rollout']:.2e}" in text
    minutes = want["evaluation"] / (cfg.dry_run_gpus * 312e12 * 0.35) / 60
    assert f"{minutes:.0f} min per held-out evaluation" in text


def test_cfg_doubles_the_image_rollouts_only():
    """mmada8b's classifier-free guidance runs every rollout step on the unconditional rows too, doubling
    the rollout FLOPs (and the held-out evaluation's), never the scoring or the updates (conditional only)."""
    on = train.main(["--preset=mmada8b", "--dry_run=true"])["flops"]
    off = train.main(["--preset=mmada8b", "--dry_run=true", "--cfg_scale=0"])["flops"]
    assert on["rollout"] == pytest.approx(2 * off["rollout"]) and on["eval_once"] == pytest.approx(2 * off["eval_once"])
    assert on["scoring"] == off["scoring"] and on["update"] == off["update"]


def test_padded_prompt_length_is_measured_from_the_data(tmp_path):
    """With --init_from's tokenizer and --train_data, the rollout figure uses the mean longest prompt of
    each batch of prompts_per_step, as tasks.make_batch pads it; by hand from the tokenizer itself, on the
    user turn infra/data.py writes (the task's instruction, then the question) in the chat template."""
    from test_rl_step import save_tiny_checkpoint
    from tasks import chat_prompt
    from infra.data import MATH_INSTRUCTION
    ckpt = save_tiny_checkpoint(tmp_path / "ckpt")
    questions = ["bob has 3 pens", "ann has 2 cats and 4 dogs . how many pets", "how many", "tom has 7",
                 "sam has 5 red and 2 blue blocks"]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": "x #### 3"}) + "\n" for q in questions))
    cfg = train.parse_args(["--preset=llada8b", "--dry_run=true", f"--init_from={ckpt}", f"--train_data=gsm8k={data}",
                            "--prompts_per_step=2"])
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    turn = lambda q: chat_prompt([{"role": "user", "content": f"{MATH_INSTRUCTION}\n\nQuestion: {q}"}])
    n = [len(tok.encode(turn(q), add_special_tokens=False).ids) for q in questions]
    want = round((max(n[0:2]) + max(n[2:4])) / 2)  # two full batches of 2; the fifth prompt makes none
    got, source = budget.padded_prompt_len(cfg)
    assert got == want and "measured over 2 batches of 2 gsm8k prompts" == source
