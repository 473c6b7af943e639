"""Scale-out on CPU: torchrun with 2 gloo processes and FSDP2 gives the single-process run, with full
fine-tuning and with LoRA; one RL update moves every parameter as in one process for every estimator and
setting (the world-size matrix, tests/world_matrix.py); the LoRA run's merged checkpoint reproduces the adapter model; --dry_run reports
LLaDA-8B's parameter count; every rank of a finished run exits 0, run after run. How a failing rank ends
every rank: tests/test_rank_exits.py.

    python -m pytest tests/test_distributed.py -q      # ~6.5 min on 2 shared CPU cores (the torchrun tests
                                                       # are marked slow: they run in CI, not under
                                                       # -m "not slow"; each has a fast sibling where one
                                                       # can be written)
"""
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from infra import hf
import train
from model import Transformer

ROOT = Path(__file__).resolve().parents[1]
# Fast rollouts (prefix cache + threshold) make ranks run different numbers of forward passes, which
# only works because rollouts hold the unsharded weights (scale.full_weights): exercise that too, and CFG
# (the unconditional rows are sharded with the conditional ones).
ARGS = ["--preset=smoke", "--threads=1", "--sample_every=0", "--block_length=4", "--steps=12",
        "--kv_cache=prefix", "--threshold=0.5", "--rl_steps=2", "--cfg_scale=1.5",
        "--eval_prompts=65"]  # the last eval batch has one row: a rank without rows must not deadlock the other
COMPARED = ("reward", "solved", "loss", "kl", "clipfrac", "ratio_mean", "ratio_max", "num_tokens")


def launch(args, nproc=1, script="train.py"):
    """Run script in one process, or under torchrun with nproc gloo ranks; torchrun exits 0 only when
    every rank did."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_SHOW_CPP_STACKTRACES="1")
    cmd = [sys.executable, script, *args] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script, *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def run(args, nproc=1):
    res = launch(args, nproc)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "terminate called" not in res.stderr, res.stderr[-3000:]
    return res.stdout


def logs(out):
    return [json.loads(s) for s in (out / "log.jsonl").read_text().splitlines()]


def assert_same_run(one, two, lr=1e-4, sequences=8, eval_sequences=65):
    """The two runs are the same run, as far as floating point lets them be. Returns the number of steps
    compared in full.

    Ranks sample their own rows, so their forward passes multiply matrices of other shapes than one
    process does, and another kernel rounds by ~1e-7 differently: on some CPU that can flip a near-tie in
    the sampler, change one token, and with it one sequence's reward. So for as long as every reward of a
    step agrees exactly (the same rollouts), losses and statistics must agree to float32 rounding (rel
    1e-4); a step whose rewards differ may differ by one sequence's worth (`sequences` per task and step),
    and from there on the runs are two different, equally valid trajectories: the later steps and the
    final weights are not compared, with a warning. Held-out rewards may differ by one sequence of the
    `eval_sequences` (rollouts are split over ranks there too). When every step agreed, the final weights
    are compared as AdamW allows: it divides by sqrt(v), so a gradient that is rounding noise in both runs
    can take a step of ~lr of either sign (4 updates: at most ~4 lr apart), while all but a few weights
    agree to float32 rounding (1e-6)."""
    a, b = logs(one), logs(two)
    assert len(a) == len(b) == 2
    agreed = 0
    for x, y in zip(a, b):
        per_seq = {"reward": 1 / sequences, "solved": 1 / sequences, "zero_adv_groups": 1 / 2}
        rewards = [k for k in x if k.split("/")[-1] in per_seq]
        assert rewards and all(k in y for k in rewards)
        if any(x[k] != y[k] for k in rewards):
            for k in rewards:
                assert abs(x[k] - y[k]) <= per_seq[k.split("/")[-1]] + 1e-9, (k, x[k], y[k])
            warnings.warn(f"step {x['step']}: a reward differs by one sequence (a near-tie rounded the other "
                          f"way); the runs are compared up to step {x['step'] - 1} only")
            break
        for k, v in x.items():
            if k.split("/")[-1] in COMPARED or k in ("grad_norm_max", "grad_norm_mean"):
                assert y[k] == pytest.approx(v, rel=1e-4, abs=1e-7), (k, v, y[k])
        agreed += 1
    s1, s2 = (json.loads((d / "summary.json").read_text()) for d in (one, two))
    if agreed == len(a):
        for task in ("text", "text_greedy", "image"):
            assert s1[task] == pytest.approx(s2[task], abs=1 / eval_sequences + 1e-6), task
        m1, m2 = (hf.from_pretrained(d / "final") for d in (one, two))
        close = total = 0
        for (name, p), q in zip(m1.named_parameters(), m2.parameters()):
            assert torch.allclose(p, q, rtol=0, atol=4 * lr), name
            close += int(((p - q).abs() <= 1e-6).sum())
            total += p.numel()
        assert close >= 0.99 * total, f"only {close} of {total} weights agree within 1e-6"
    return agreed


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    run(ARGS + [f"--out_dir={out}"])
    return out


@pytest.mark.slow
def test_two_processes_match_one(single, tmp_path):
    """Same global batch on 1 and 2 processes: identical rewards, the same first-step loss and weights."""
    out = tmp_path / "two"
    text = run(ARGS + [f"--out_dir={out}", f"--sft_dir={single / 'sft'}"], nproc=2)
    assert "2 process(es)" in text and text.count("step 1/2") == 1  # logged once, by rank 0
    agreed = assert_same_run(single, out)
    first = logs(single)[0]
    assert first["image/loss"] != 0.0
    if agreed:  # the same rollouts at the first step: the same loss to float32 rounding
        assert logs(out)[0]["image/loss"] == pytest.approx(first["image/loss"], rel=1e-5)


@pytest.mark.slow
def test_lora_two_processes_and_merge(single, tmp_path):
    """LoRA from the single run's checkpoint, on 1 and on 2 processes: the same run; the merged checkpoint
    loads with infra.hf.from_pretrained and gives the adapter model's logits (float32, atol 1e-5)."""
    base = single / "final"
    lora_args = ARGS + [f"--init_from={base}", "--lora_rank=4", "--lora_alpha=8", "--lr=1e-2"]
    one, two = tmp_path / "one", tmp_path / "two"
    run(lora_args + [f"--out_dir={one}"])
    run(lora_args + [f"--out_dir={two}"], nproc=2)
    assert_same_run(one, two, lr=1e-2)

    merged = hf.from_pretrained(one / "final")
    adapted = hf.load_adapters(hf.from_pretrained(base), one / "final")
    assert hf.lora_stats(adapted)["modules"] == 7 * merged.config.n_layers
    x = torch.randint(0, merged.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got, start = adapted(x), merged(x), hf.from_pretrained(base)(x)
    assert (want - start).abs().max() > 1e-3  # the adapters learned something, so the check has teeth
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


@pytest.mark.slow
def test_every_rank_exits_cleanly_run_after_run(single, tmp_path):
    """A finished 2-process run exits 0 on every rank, run after run: the finished rank waits at a
    barrier in scale.close instead of entering interpreter shutdown while the other still writes (a
    rare SIGABRT at exit, "terminate called without an active exception", otherwise). Then an error
    on every rank (a fresh run into an out_dir with checkpoints) exits 1 with its message, no abort."""
    quick = ARGS + [f"--sft_dir={single / 'sft'}", "--rl_steps=1", "--eval_prompts=2", "--checkpoint_every=1"]
    for i in range(3):
        res = launch(quick + [f"--out_dir={tmp_path / str(i)}"], nproc=2)
        assert res.returncode == 0 and "terminate called" not in res.stderr, (i, res.stderr[-3000:])
        assert "wrote" in res.stdout
    res = launch(quick + [f"--out_dir={tmp_path / '0'}"], nproc=2)
    assert res.returncode == 1 and "already holds checkpoints" in res.stderr, res.stderr[-3000:]
    assert "terminate called" not in res.stderr and "SIGABRT" not in res.stderr, res.stderr[-3000:]


# The world-size matrix (tests/world_matrix.py runs every case in one launch per world size). Statistics
# compared to rel 1e-4; with --loss_norm=sequence the token-mean statistics (clipfrac, kl, ratio_mean) are
# weighted by each chunk's share of sequences, so they depend on how the rows are chunked (rank boundaries
# included) and are left out there; loss, num_tokens, ratio_max and the gradient norm are compared always.
TOKEN_MEANS = ("clipfrac", "kl", "ratio_mean")


@pytest.fixture(scope="module")
def world_matrix(tmp_path_factory):
    from test_rl_step import save_tiny_checkpoint

    base = tmp_path_factory.mktemp("matrix")
    ckpt = save_tiny_checkpoint(base / "ckpt")
    script, rollouts = str(ROOT / "tests" / "world_matrix.py"), base / "rollouts.pt"
    for nproc in (1, 2):
        res = launch([str(ckpt), str(base / str(nproc)), str(rollouts)], nproc=nproc, script=script)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    from world_matrix import CASES
    return {name: [torch.load(base / str(n) / f"{name}.pt") for n in (1, 2)] for name, _ in CASES}


@pytest.mark.slow
def test_one_update_is_the_same_on_one_and_two_processes(world_matrix):
    """One rl_step (mu = 3, text and image, CFG) at world 1 and world 2 on the same rollouts: every
    parameter moves by the same amount to float32 rounding (1e-5 of the largest change), and the logged
    statistics agree, for every estimator (--trajectory_states at K < T too), both loss norms, LoRA on and
    off, device_batch_size chunks and a binding gradient clip (tests/world_matrix.CASES). A normaliser
    reduced over ranks in place once per update scales update j by 2^-j on two processes."""
    assert len(world_matrix) >= 11
    for name, (one, two) in world_matrix.items():
        assert one["differed"] == 0
        biggest = max(d.abs().max().item() for d in one["delta"].values())
        assert biggest > 1e-4, name  # the step moved the weights: the comparison has teeth
        assert one["delta"].keys() == two["delta"].keys(), name
        for k, d in one["delta"].items():
            assert torch.allclose(two["delta"][k], d, rtol=0, atol=1e-5 * biggest), \
                (name, k, (two["delta"][k] - d).abs().max().item(), biggest)
        sequence = "_seq" in name
        compared = 0
        for k, v in one["log"].items():
            stat = k.split("/")[-1]
            if stat in COMPARED + ("grad_norm_max", "grad_norm_mean", "zero_adv_groups", "adv_abs_mean") and not (sequence and stat in TOKEN_MEANS):
                assert two["log"][k] == pytest.approx(v, rel=1e-4, abs=1e-7), (name, k, v, two["log"][k])
                compared += 1
        assert compared >= 15, (name, compared)


LORA_GATHERS = """
import json, sys, torch
import torch.distributed as dist
import tasks, train
from infra import load, scale
from world_matrix import score
device = scale.init("cpu")
cfg = train.parse_args(["--preset=smoke", "--tasks=text", "--prompts_per_step=2", "--group_size=4", "--mu=3",
                        "--beta=0.05", "--lora_rank=4", "--lora_alpha=8", f"--init_from={sys.argv[1]}"])
policy, ref, tok, ids, _ = load.load_policy(cfg, device, torch.float32, sft=None)
opt = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=cfg.lr)
tasks.score = score
gathers = []
for name in ("all_gather_single", "all_gather_into_tensor"):  # FSDP2's all-gather (torch 2.13; older torch)
    real = getattr(dist, name, None)
    if real is not None:
        def counted(*a, _real=real, **k):
            gathers.append(1)
            return _real(*a, **k)
        setattr(dist, name, counted)
ctx = tasks.Ctx(cfg, tok, ids, device, {})
train.rl_step(policy, ref, opt, ctx, 0, tasks.step_prompts(ctx, 0))
if scale.rank() == 0:
    json.dump({"gathers": len(gathers)}, open(sys.argv[2], "w"))
with scale.process_exit():
    pass
"""


@pytest.mark.slow
def test_lora_step_all_gathers_each_unit_once_per_pass(tmp_path):
    """The all-gathers of one LoRA RL step on 2 ranks (text, mu = 3, K = 3 views, one chunk, 2 blocks: 3
    FSDP2 units, the root and a block each), counted by hand: the rollout holds the weights, and the old and
    the reference pass share one hold (scale.full_weights: one gather per unit, 3 + 3); each of the 3 updates'
    forward gathers every unit and its backward gathers the 2 blocks again (the root stays gathered from its
    forward to its backward), 3 x (3 + 2) = 15. Total 21. The LoRA reference is hf.AdaptersOff around the
    policy: a hold marked on the wrapper instead of the policy let the root reshard after each reference
    forward and gather again at the next (12 extra 2 GB gathers per step at LLaDA-8B)."""
    from test_rl_step import save_tiny_checkpoint

    ckpt = save_tiny_checkpoint(tmp_path / "ckpt")
    script = tmp_path / "lora_gathers.py"
    script.write_text(f"import sys; sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]\n" + LORA_GATHERS)
    res = launch([str(ckpt), str(tmp_path / "count.json")], nproc=2, script=str(script))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert json.loads((tmp_path / "count.json").read_text())["gathers"] == 3 + 3 + 3 * (3 + 2)


def test_full_weights_holds_the_root_of_a_wrapped_policy(monkeypatch):
    """The fast sibling of the all-gather count: inside scale.full_weights(hf.AdaptersOff(policy)) the
    root's no-gradient forward hook does not reshard the policy (two ranks simulated by fake FSDP modules
    that record unshard / reshard); outside it, it does."""
    from infra import hf, scale

    class Unit(torch.nn.Module):
        def __init__(self, log, name, children=()):
            super().__init__()
            self.log, self.name, self.kids = log, name, torch.nn.ModuleList(children)

        def unshard(self):
            self.log.append(("unshard", self.name))

        def reshard(self):
            self.log.append(("reshard", self.name))

        def set_reshard_after_forward(self, value, recurse=True):
            self.log.append(("after_forward", self.name, value))

    log = []
    policy = Unit(log, "root", [Unit(log, "block")])
    monkeypatch.setattr(scale, "world", lambda: 2)
    monkeypatch.setattr(scale, "_fsdp_modules", lambda m: [u for u in m.modules() if isinstance(u, Unit)])
    with torch.no_grad():
        with scale.full_weights(hf.AdaptersOff(policy)):
            scale._reshard_root_without_grad(policy, (), None)  # the hook after a reference forward
            with scale.full_weights(policy):  # nested: nothing more
                pass
            held = list(log)
        scale._reshard_root_without_grad(policy, (), None)
    assert held == [("unshard", "root"), ("after_forward", "block", False), ("unshard", "block")], held
    assert log[len(held):] == [("reshard", "root"), ("reshard", "block"), ("after_forward", "block", True),
                               ("reshard", "root")], log


BF16_LOGITS = """
import sys, torch
from infra import scale
from model import ModelConfig, Transformer
scale.init("cpu")
mc = ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, mlp_hidden_size=128, vocab_size=96,
                 max_sequence_length=64, mask_token_id=95)
model = Transformer(mc)
model.init_weights(torch.Generator().manual_seed(0))
x = torch.randint(0, 96, (4, 40), generator=torch.Generator().manual_seed(1))
mask = torch.ones_like(x)
mask[0, :5] = 0  # left padding in one row
if scale.world() == 1:
    model = model.to(torch.bfloat16)  # the bf16 weights a single process computes with
else:
    model = scale.shard(model, compute_dtype=torch.bfloat16)  # float32 shards, gathered in bf16
with torch.no_grad():
    plain = model(x[scale.shard_rows(4)], mask[scale.shard_rows(4)])
    with scale.full_weights(model):
        held = model(x[scale.shard_rows(4)], mask[scale.shard_rows(4)])
plain, held = scale.all_gather_rows(plain), scale.all_gather_rows(held)
states = []
if scale.world() > 1:  # is the root (embedding, norm, head) sharded: after a forward without gradients,
    from torch.distributed.tensor import DTensor  # inside a gradient forward, after its backward
    sharded = lambda: isinstance(model.wte.weight, DTensor)
    with torch.no_grad():
        model(x[scale.shard_rows(4)])
    states.append(sharded())
    loss = model(x[scale.shard_rows(4)]).float().square().mean()
    states.append(sharded())
    loss.backward()
    states.append(sharded())
if scale.rank() == 0:
    torch.save({"plain": plain, "held": held, "root_sharded": states}, sys.argv[1])
with scale.process_exit():  # leave the group and end the rank without interpreter teardown (gloo threads)
    pass
"""


@pytest.mark.slow
def test_bf16_logits_do_not_depend_on_the_world_size(tmp_path):
    """bf16 compute on 2 gloo ranks (FSDP2 gathers bf16 copies of float32 shards) gives exactly the logits
    of one process computing with the same weights in bf16, sharded forwards and full_weights alike.
    FSDP2's default cast_forward_inputs=True would round the float32 RoPE tables to bf16 on the way into
    each block (logits then differ by up to ~1e-2)."""
    script = tmp_path / "bf16_logits.py"
    script.write_text(f"import sys; sys.path.insert(0, {str(ROOT)!r})\n" + BF16_LOGITS)
    for nproc, name in ((1, "one.pt"), (2, "two.pt")):
        res = launch([str(tmp_path / name)], nproc=nproc, script=str(script))
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert one["plain"].dtype == torch.bfloat16 and one["plain"].shape == (4, 40, 96)
    assert torch.equal(one["plain"], two["plain"]), (one["plain"].float() - two["plain"].float()).abs().max()
    assert torch.equal(one["held"], two["held"])
    # The root is FSDP2's to manage: kept gathered from a gradient forward to its backward (one all-gather
    # per update chunk, not two), resharded after a forward without gradients (scale.shard).
    assert two["root_sharded"] == [True, False, True]


def test_dry_run_llada8b(capsys):
    res = train.main(["--preset=llada8b", "--dry_run=true"])
    assert res["params"] == 8_015_581_184
    assert res["lora_params"] == 167_772_160  # r=128 on the official q/k/v/up (hf.py; all seven: 335,544,320)
    text = capsys.readouterr().out
    assert "8,015,581,184 parameters" in text and "| LoRA, update peak |" in text
    b8 = res["budget"][8]
    # 8B bf16 weights over 8 GPUs = 1.87 GB; full fine-tuning adds 2 + 8 B/param sharded: ~7.5 GB more.
    assert b8["weights_gb"] == pytest.approx(8_015_581_184 * 2 / 8 / 2**30)
    assert b8["full_peak"] > b8["lora_peak"] > b8["weights_gb"]


def test_dry_run_mmada8b():
    res = train.main(["--preset=mmada8b", "--dry_run=true"])
    assert res["params"] == 8_015_581_184 + 2 * 8192 * 4096  # 8192 image-code rows in embedding and head
    assert res["seqs_per_step"] == 4 * 9 and res["seq_len"] == 257 + 2 + 32 * 32  # t2i_grpo_train.sh: 36




def test_reductions_leave_their_argument_unchanged(monkeypatch):
    """The fast sibling of the world-size matrix: scale.all_sum / all_max return the reduction as a new
    tensor and leave their argument as it was, so a value reduced once per inner update (the
    --trajectory_states normaliser) is not multiplied by the world size each time. Two ranks holding the
    same tensor are simulated: the collective doubles (sum) or keeps (max) what it is given, in place."""
    from infra import scale

    def fake_all_reduce(t, op=None):
        if op is None:
            t.mul_(2)

    monkeypatch.setattr(scale, "world", lambda: 2)
    monkeypatch.setattr(scale.dist, "all_reduce", fake_all_reduce)
    n = torch.tensor(3.0)
    assert [scale.all_sum(n).item() for _ in range(3)] == [6.0, 6.0, 6.0] and n.item() == 3.0
    m = torch.tensor([1.0, 5.0])
    assert scale.all_max(m).tolist() == [1.0, 5.0] and m.tolist() == [1.0, 5.0]
