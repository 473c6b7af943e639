"""train.py's settings, each at a non-default value against an expectation written here: where prompts come
from, advantages, the SFT stage, evaluation (greedy at temperature 0), one RL step's callees and train.main.

    python -m pytest tests/test_train_settings.py -q
"""
import copy
import hashlib
import math

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

import evaluate
import grpo
import importance
import rewards
import sample
import tasks
import train
from infra import data, hf
from model import Transformer
from test_train import CPU, parse, toy_model  # noqa: F401 (toy_model: a fixture)

pytestmark = pytest.mark.usefixtures("undrawn_figures")  # no test here checks a picture's pixels


# -----------------------------------------------------------------------------
# Every training setting at a non-default value, against an expectation written here: where prompts come
# from (no held-out prompt ever reaches SFT or RL; a dataset is walked once per epoch), what the SFT stage
# does with its settings (learning-rate schedule at its first and last steps, batch size, caption dropout,
# image loss weight, noise), what evaluation decodes greedily (temperature 0, one completion per prompt) and
# what one RL step hands the samplers, the mask builder, the reward and the loss. The maths of those callees
# is tested against naive re-implementations elsewhere (tests/test_rl_step.py, test_grpo.py,
# test_importance.py, test_sample.py); here each flag must reach them with its value.


def held_out(prompt: str) -> bool:
    """The documented split (tasks.py): the first 8 bytes of a prompt's SHA-1, read as a fraction of 2^64,
    below 0.2 is the test split. Written out again here, so that a changed split rule shows."""
    return int(hashlib.sha1(prompt.encode()).hexdigest()[:16], 16) / 2 ** 64 < 0.2


def spy(monkeypatch, module, name, calls):
    """Record every call of module.name as (name, args, kwargs), then make it."""
    real = getattr(module, name)

    def wrapped(*args, **kwargs):
        calls.append((name, args, kwargs))
        return real(*args, **kwargs)
    monkeypatch.setattr(module, name, wrapped)


def fake_score(b, tok, ids, scorer=None, shaping="none", text_reward="answer"):
    return (b.x[:, b.window_slice].sum(1) % 3).float() / 2


# -----------------------------------------------------------------------------------------------------
# where prompts come from


@pytest.mark.parametrize("task", ["text", "image"])
@pytest.mark.parametrize("seed", [0, 5])
def test_rl_prompts_never_come_from_the_held_out_split(task, seed):
    """300 RL steps of 8 prompts: every one from the train split, none among the held-out prompts; the
    held-out prompts are --eval_prompts draws from the test split; --text_max_steps and --image_width
    reach both."""
    cfg = parse(f"--seed={seed}", "--prompts_per_step=8", "--eval_prompts=40", "--text_max_steps=2", "--image_width=3")
    evals = data.eval_examples(task, cfg, {})
    assert len(evals) == 40 and all(held_out(ex["prompt"]) for ex in evals)
    held = {ex["prompt"] for ex in evals}
    drawn = [ex for step in range(300) for ex in tasks.draw_prompts(task, cfg, step, {})]
    assert len(drawn) == 2400
    assert not any(held_out(ex["prompt"]) for ex in drawn)
    assert not held & {ex["prompt"] for ex in drawn}
    if task == "text":  # 1 or 2 written-out steps, each "a op n = r"
        counts = {ex["solution"].count("=") for ex in drawn + evals}
        assert counts == {1, 2}
    else:
        assert {ex["spec"]["width"] for ex in drawn + evals} == {3}
        assert {len(ex["image"]) for ex in drawn} == {9}
    # the seed picks the prompts
    other = parse(f"--seed={seed + 1}", "--prompts_per_step=8")
    assert [e["prompt"] for e in tasks.draw_prompts(task, other, 0, {})] != [e["prompt"] for e in drawn[:8]]


def test_dataset_prompts_walk_every_train_row_once_per_epoch():
    """A benchmark's train rows (7 of them) at 3 prompts per step: steps 0-6 take 21 prompts, i.e. three
    epochs, each a permutation of the 7 train rows (never a test row), in a seeded order that differs
    between epochs and seeds; the held-out prompts are the first --eval_prompts test rows."""
    rows = [{"prompt": f"train {i}"} for i in range(7)]
    datasets = {"gsm8k": {"train": rows, "test": [{"prompt": f"test {i}"} for i in range(5)]}}
    cfg = parse("--prompts_per_step=3", "--seed=2", "--eval_prompts=3")
    drawn = [ex["prompt"] for s in range(7) for ex in tasks.draw_prompts("gsm8k", cfg, s, datasets)]
    epochs = [drawn[i:i + 7] for i in range(0, 21, 7)]
    for e in epochs:
        assert sorted(e) == sorted(r["prompt"] for r in rows)
    assert len({tuple(e) for e in epochs}) > 1
    again = [ex["prompt"] for s in range(7) for ex in tasks.draw_prompts("gsm8k", parse("--prompts_per_step=3",
                                                                                        "--seed=3"), s, datasets)]
    assert again != drawn
    assert [ex["prompt"] for ex in data.eval_examples("gsm8k", cfg, datasets)] == ["test 0", "test 1", "test 2"]


# -----------------------------------------------------------------------------------------------------
# advantages


@pytest.mark.parametrize("adv_std,estimator,scaled", [("auto", "maskgrpo", True), ("auto", "d1", False),
                                                      ("on", "d1", True), ("off", "maskgrpo", False)])
def test_adv_std_setting(adv_std, estimator, scaled):
    """Groups of G = 3: A = (R - mean) / (std + 1e-4) (unbiased std) with adv_std on, or auto for
    MaskGRPO; A = R - mean with off, or auto for d1 (d1's trainer)."""
    cfg = parse("--group_size=3", f"--adv_std={adv_std}", f"--estimator={estimator}")
    r = torch.tensor([0.0, 0.5, 1.0, 1.0, 1.0, 0.0])
    want = []
    for g in (r[:3].tolist(), r[3:].tolist()):
        mean = sum(g) / 3
        std = math.sqrt(sum((v - mean) ** 2 for v in g) / 2)
        want += [(v - mean) / (std + 1e-4) if scaled else v - mean for v in g]
    got = grpo.group_advantages(r, cfg.group_size, scale_by_std=cfg.adv_scaled)  # as train.rl_step calls it
    torch.testing.assert_close(got, torch.tensor(want), rtol=1e-5, atol=1e-6)


# -----------------------------------------------------------------------------------------------------
# the SFT stage


def test_sft_schedule_and_settings(toy_model, monkeypatch):
    """train.sft with 7 steps, warm-up 3, peak 0.01 on both toy tasks. The loss is replaced by one
    weight times 1e-3 (text) or another weight times 1e-3 (image), so each step's gradient is known:
    1e-3 and 1e-3 * image_loss_weight (far below the clip at 1). The learning rate of step s is
        0.01 * min(1, (s + 1) / 3) * (0.1 + 0.9 * (1 + cos(pi s / 7)) / 2)
    (linear warm-up, cosine decay towards 10%: the Config's description), so the first step runs at a
    third of the peak. Batches hold sft_batch_size rows; with
    cond_dropout 1 every caption is the unconditional one; text_noise 1 makes every text target the wrong
    one, image_noise 0 none; all SFT prompts are from the train split."""
    tok, ids, base = toy_model
    model = copy.deepcopy(base).float()
    cfg = parse("--sft_steps=7", "--sft_warmup=3", "--sft_lr=0.01", "--sft_batch_size=5", "--cond_dropout=1",
                "--image_loss_weight=5", "--text_noise=1", "--image_noise=0", "--seed=4")
    first = next(model.parameters())
    batches, examples, steps = [], [], []

    def loss(model_, b, ids_, gen, eps=1e-3):
        batches.append(b)
        return first.flatten()[0 if b.task == "text" else 1] * 1e-3

    make_example = train.make_example

    def example(task, rng, cfg_, split, noise=0.0):
        ex = make_example(task, rng, cfg_, split, noise)
        examples.append((task, split, noise, ex))
        return ex

    def on_step(opt, args, kwargs):
        g = first.grad.flatten()
        steps.append((opt.param_groups[0]["lr"], float(g[0]), float(g[1])))

    monkeypatch.setattr(train, "diffusion_loss", loss)
    monkeypatch.setattr(train, "make_example", example)
    handle = register_optimizer_step_pre_hook(on_step)
    try:
        train.sft(model, tok, ids, cfg, CPU)
    finally:
        handle.remove()
    assert len(steps) == 7
    for s, (lr, g_text, g_image) in enumerate(steps):
        want = 0.01 * min(1.0, (s + 1) / 3) * (0.1 + 0.9 * (1 + math.cos(math.pi * s / 7)) / 2)
        assert lr == pytest.approx(want, rel=1e-9), s
        assert g_text == pytest.approx(1e-3) and g_image == pytest.approx(5e-3)
    assert steps[0][0] == pytest.approx(0.01 / 3)
    assert [b.task for b in batches] == ["text", "image"] * 7 and {b.x.shape[0] for b in batches} == {5}
    for b in batches:
        if b.task == "image":
            assert torch.equal(b.x[:, : b.prompt_len], b.uncond[:, : b.prompt_len])
            assert torch.equal(b.attention_mask, b.uncond_mask)
    assert len(examples) == 70 and {split for _, split, _, _ in examples} == {"train"}
    assert not any(held_out(ex["prompt"]) for *_, ex in examples)
    for task, _, noise, ex in examples:
        if task == "text":
            assert noise == 1.0 and ex["completion"] != ex["solution"]
        else:
            assert noise == 0.0 and rewards.image_reward(ex["image"], {'spec': ex["spec"]}) == 1.0


def test_sft_keeps_ten_percent_of_the_peak_at_the_end(toy_model, monkeypatch):
    """With warm-up 1 the first step runs at the peak; over 40 steps the cosine ends at
    0.1 + 0.45 (1 + cos(pi 39 / 40)) of it, 0.1006: never below 10%."""
    tok, ids, base = toy_model
    cfg = parse("--tasks=text", "--sft_steps=40", "--sft_warmup=1", "--sft_lr=0.002", "--sft_batch_size=1")
    model = copy.deepcopy(base).float()
    first = next(model.parameters())
    monkeypatch.setattr(train, "diffusion_loss", lambda m, b, i, g, eps=1e-3: first.flatten()[0] * 1e-3)
    lrs = []
    handle = register_optimizer_step_pre_hook(
        lambda opt, a, k: lrs.append(opt.param_groups[0]["lr"]))
    try:
        train.sft(model, tok, ids, cfg, CPU)
    finally:
        handle.remove()
    assert lrs[0] == pytest.approx(0.002)
    assert lrs[-1] == pytest.approx(0.002 * (0.1 + 0.45 * (1 + math.cos(math.pi * 39 / 40))))
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


# -----------------------------------------------------------------------------------------------------
# evaluation: sampled at the temperature, greedy at 0


def test_greedy_evaluation_decodes_at_temperature_zero(toy_model, monkeypatch):
    """evaluate_all at --temperature=0.7 with 3 held-out prompts and 2 samples each: the sampled text
    score draws 6 completions at 0.7, the greedy one 3 at temperature 0, and images are sampled only. A
    greedy decode has no noise: under another seed's generators (same prompts) every greedy completion is
    the same, while the sampled ones change."""
    tok, ids, model = toy_model
    calls = []
    spy(monkeypatch, sample, "generate", calls)
    spy(monkeypatch, sample, "generate_image", calls)
    monkeypatch.setattr(tasks, "score", fake_score)
    cfg = parse("--temperature=0.7", "--eval_prompts=3", "--eval_samples=2")
    res = data.evaluate_all(model, tasks.Ctx(cfg, tok, ids, CPU, {}))
    assert set(res) == {"text", "text_greedy", "image"}
    text = [(c[2]["temperature"], c[1][1].shape[0]) for c in calls if c[0] == "generate"]
    assert [t for t, _ in text] == [0.7, 0.0]  # one batch each (at most 64 rows)
    assert [n for _, n in text] == [6, 3]
    assert sum(c[1][1].shape[0] for c in calls if c[0] == "generate_image") == 6

    prompts = data.eval_examples("text", cfg, {})
    monkeypatch.setattr(data, "eval_examples", lambda task, cfg_, datasets: prompts)

    def outputs(seed, temperature):
        records = []
        c = tasks.Ctx(parse("--tasks=text", f"--seed={seed}", "--eval_samples=2", "--eval_prompts=3"), tok, ids, CPU, {})
        data.evaluate(model, c, "text", temperature, records)
        return [r["output"] for r in records]

    assert outputs(0, 0.0) == outputs(1, 0.0)
    assert outputs(0, 0.7) != outputs(1, 0.7)


def test_evaluate_cli_greedy_and_sampled_modes(toy_model, tmp_path, monkeypatch, capsys):
    """python evaluate.py --ckpt DIR --task text --temperature=0.6 --samples=2 --limit=2: the greedy mode
    decodes the 2 prompts once at temperature 0, the sampled mode twice each at 0.6."""
    tok, ids, model = toy_model
    ckpt = tmp_path / "ckpt"
    hf.save_pretrained(model.float(), ckpt)
    tok.save(str(ckpt / "tokenizer.json"))
    calls = []
    spy(monkeypatch, sample, "generate", calls)
    out = tmp_path / "eval.jsonl"
    assert evaluate.main(["--ckpt", str(ckpt), "--task", "text", "--temperature=0.6", "--samples=2", "--limit=2",
                          "--threads=1", "--out", str(out)]) == 0
    assert [(c[2]["temperature"], c[1][1].shape[0]) for c in calls] == [(0.0, 2), (0.6, 4)]
    modes = [line.split('"mode": "')[1].split('"')[0] for line in out.read_text().splitlines()]
    assert modes == ["greedy"] * 2 + ["sampled"] * 4


# -----------------------------------------------------------------------------------------------------
# one RL step: each setting reaches its callee


def rl_step(toy_model, monkeypatch, *flags, calls):
    tok, ids, model = toy_model
    for module, name in ((sample, "generate"), (sample, "fast_generate"), (sample, "generate_image"),
                         (importance, "reverse_mask"), (importance, "d1_masks"), (grpo, "policy_loss")):
        spy(monkeypatch, module, name, calls)
    scored = []

    def score(*args, **kwargs):
        scored.append(args)
        return fake_score(*args)
    monkeypatch.setattr(tasks, "score", score)
    cfg = parse(*flags)
    policy = copy.deepcopy(model)
    ref = copy.deepcopy(model) if cfg.beta > 0 else None
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr)
    fast = cfg.kv_cache != "none" or cfg.threshold > 0  # as train.main builds its Ctx
    ctx = tasks.Ctx(cfg, tok, ids, CPU, {},
                    text_sampler=sample.FastSampler(cfg.kv_cache, cfg.threshold) if fast else None)
    log, rolls = train.rl_step(policy, ref, opt, ctx, 0, tasks.step_prompts(ctx, 0))
    return cfg, log, rolls, scored


def named(calls, name, module=None):
    return [c for c in calls if c[0] == name and (module is None or c[1] is not None)]


def test_rl_step_hands_every_setting_to_its_callee(toy_model, monkeypatch):
    calls = []
    cfg, log, rolls, scored = rl_step(
        toy_model, monkeypatch, "--tasks=text,image", "--temperature=0.7", "--gen_length=12", "--block_length=6",
        "--steps=4", "--image_steps=3", "--image_sampler=maskgit", "--cfg_scale=1.5", "--gamma_text=0.3",
        "--gamma_image=0.5", "--mu=2", "--text_reversing=random", "--clip_eps=0.1", "--beta=0.2",
        "--loss_norm=sequence", "--prompts_per_step=2", "--group_size=3", "--device_batch_size=4",
        "--reward_shaping=official", "--text_reward=solution", "--lr=1e-3", calls=calls)
    gens = [c for c in calls if c[0] == "generate"]
    assert [c[1][1].shape[0] for c in gens] == [4, 2]  # 6 rows in chunks of device_batch_size
    for _, args, kw in gens:
        assert (kw["gen_length"], kw["block_length"], kw["steps"], kw["temperature"]) == (12, 6, 4, 0.7)
        assert "kv_cache" not in kw and "threshold" not in kw  # the exact sampler (sample.generate)
    images = [c for c in calls if c[0] == "generate_image"]
    assert [c[1][1].shape[0] for c in images] == [4, 2]
    for _, args, kw in images:
        assert (kw["steps"], kw["sampler"], kw["cfg_scale"], kw["num_tokens"]) == (3, "maskgit", 1.5, 16)
    # maskgrpo_views: mu ratios t_j = gamma + (1 - gamma)(j + 1) / mu per row (the last clamped to 0.999)
    masks = [args for name, args, _ in calls if name == "reverse_mask"]
    assert [(args[3], len(set(args[1])), len(args[1])) for args in masks] == [("random", 1, 6)] * 4
    assert [args[1][0] for args in masks] == [pytest.approx(0.3 + 0.7 / 2), 0.999, pytest.approx(0.5 + 0.5 / 2), 0.999]
    losses = [kw for name, _, kw in calls if name == "policy_loss"]
    assert len(losses) == 2 * 2 * 2  # mu x tasks x chunks
    assert {(kw["clip_eps"], kw["beta"], kw["norm"]) for kw in losses} == {(0.1, 0.2, "sequence")}
    # the verifier --text_reward names for the toy text task (--reward_shaping picks benchmarks' only), the grid's
    assert [(a[0].task, a[1]) for a in scored] == [("text", rewards.solution_reward), ("image", rewards.image_reward)]
    for r in rolls:  # groups of 3: every row's advantage within its own group
        assert r.rewards.shape == (6,)
        assert len(r.views.inputs) == 2 and r.views.loss_masks.shape[0] == 2


@pytest.mark.parametrize("estimator", ["d1", "unigrpo"])
def test_fast_sampler_and_estimator_settings(toy_model, monkeypatch, estimator):
    """--kv_cache=prefix --threshold=0.5 send text rollouts to the fast sampler with both; the estimator
    and d1's prompt-masking rate reach the mask builder; d1 (adv_std auto) takes A = R - mean."""
    calls = []
    cfg, log, (r,), _ = rl_step(toy_model, monkeypatch, "--tasks=text", "--kv_cache=prefix", "--threshold=0.5",
                                f"--estimator={estimator}", "--p_mask_prompt=0.3", "--mu=2",
                                "--temperature=0.9", calls=calls)
    fast = [kw for name, _, kw in calls if name == "fast_generate" and "kv_cache" in kw]
    assert fast and all((kw["kv_cache"], kw["threshold"], kw["temperature"]) == ("prefix", 0.5, 0.9) for kw in fast)
    if estimator == "d1":
        (kw,) = [kw for name, _, kw in calls if name == "d1_masks"]
        assert (kw["p_mask_prompt"], kw["mu"]) == (0.3, 2)
    else:  # UniGRPO: random reversing at mu ratios of its own
        masks = [args for name, args, _ in calls if name == "reverse_mask"]
        assert [args[3] for args in masks] == ["random"] * 2  # one call per ratio j < mu
    g = r.rewards.view(-1, cfg.group_size)
    centred = (g - g.mean(1, keepdim=True)).flatten()
    if estimator == "d1":
        torch.testing.assert_close(r.adv, centred)


def test_seed_changes_the_rollouts(toy_model, monkeypatch):
    """The same prompts under --seed=0 and --seed=7: other rollout noise, so other completions."""
    prompts = tasks.draw_prompts("text", parse(), 0, {})[:2]
    monkeypatch.setattr(tasks, "draw_prompts", lambda task, cfg, step, datasets: prompts)
    windows = []
    for seed in (0, 7):
        _, _, (r,), _ = rl_step(toy_model, monkeypatch, "--tasks=text", f"--seed={seed}", "--mu=1", calls=[])
        windows.append(r.batch.x[:, r.batch.window_slice])
    assert (windows[0] != windows[1]).any(1).float().mean() >= 0.5


# -----------------------------------------------------------------------------------------------------
# the whole entry point at non-default settings


def test_main_passes_its_settings_to_the_optimizer_and_the_run(toy_model, tmp_path, monkeypatch, capsys):
    """train.main from a checkpoint (no SFT), two RL steps: AdamW gets --lr=3e-4 and --weight_decay=0.05
    (betas 0.9, 0.99), keeps that learning rate at every optimizer step (constant in RL), and the model
    gets --activation_checkpointing; --sample_every=2 prints a rollout after step 1 only; the summary
    holds the sampled and the greedy held-out scores of --eval_prompts=3 prompts, with a paired SE."""
    tok, ids, model = toy_model
    ckpt = tmp_path / "ckpt"
    hf.save_pretrained(model.float(), ckpt)
    tok.save(str(ckpt / "tokenizer.json"))
    made, lrs, checkpointing = [], [], []

    class AdamW(torch.optim.AdamW):
        def __init__(self, params, **kwargs):
            made.append(kwargs)
            super().__init__(params, **kwargs)

    real = Transformer.set_activation_checkpointing

    def set_ac(self, on=True):
        checkpointing.append(on)
        return real(self, on)

    monkeypatch.setattr(torch.optim, "AdamW", AdamW)
    monkeypatch.setattr(Transformer, "set_activation_checkpointing", set_ac)
    monkeypatch.setattr(tasks, "score", fake_score)
    handle = register_optimizer_step_pre_hook(lambda opt, a, k: lrs.append(
        (opt.param_groups[0]["lr"], opt.param_groups[0]["weight_decay"])))
    try:
        summary = train.main(["--preset=smoke", f"--init_from={ckpt}", "--tasks=text", f"--out_dir={tmp_path / 'out'}",
                              "--threads=1", "--rl_steps=2", "--lr=3e-4", "--weight_decay=0.05", "--mu=2",
                              "--activation_checkpointing=true", "--sample_every=2", "--eval_prompts=3",
                              "--eval_samples=2", "--checkpoint_every=0", "--dtype=float32", "--device=cpu"])
    finally:
        handle.remove()
    assert made == [{"lr": 3e-4, "betas": (0.9, 0.99), "weight_decay": 0.05}]
    assert lrs == [(3e-4, 0.05)] * 4
    assert checkpointing == [True]
    out = capsys.readouterr().out
    assert out.count("  [text] ") == 1 and out.index("  [text] ") > out.index("step 1/2")
    assert set(summary) == {"text", "text_greedy", "seconds"} and "gain_se" in summary["text_greedy"]
