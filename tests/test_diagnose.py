"""tools/diagnose.py (`python -m tools.diagnose`): it runs end to end on a small checkpoint and
prints every estimator row, and its log-ratios are the training code's for the same masks.

    python -m pytest tests/test_diagnose.py -q
"""
import copy
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import importance
import sample
import tasks
import train
from infra import toy
from sample import generator
from tools import diagnose
from infra.budget import scratch_config
from model import Transformer
from infra.hf import load_tokenizer
from infra import hf

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sft_dir(smoke_sft_run):
    return smoke_sft_run / "sft"


def test_log_ratios_are_the_training_codes(sft_dir):
    """After one update, the estimate diagnose computes with the training masks of iteration j equals the
    sum of log pi_theta - logp_old[j], with logp_old[j] as train.rl_step computed it; and the rollout the
    diagnosis redraws with its decoding order is the one rl_step trained on."""
    old = hf.from_pretrained(sft_dir).eval()
    tok = load_tokenizer(sft_dir, old.config)
    ids = tasks.token_ids(tok)
    cfg = train.parse_args(["--preset=smoke", "--tasks=text", "--lr=1e-2"])
    ctx = tasks.Ctx(cfg, tok, ids, torch.device("cpu"), {})
    exs = [ex for ex in tasks.draw_prompts("text", cfg, 0, {}) for _ in range(cfg.group_size)]
    b = tasks.make_batch("text", exs, tok, ids, cfg, ctx.device, with_targets=False)
    gens = [generator("cpu", cfg.seed, "rollout", "text", 0, i) for i in range(len(exs))]
    b, order = sample.rollout(old, b, ctx, gens, cfg.temperature)
    assert (order[:, b.window_slice] >= 0).all() and (order[:, : b.prompt_len] == -1).all()
    theta = copy.deepcopy(old)
    opt = diagnose._Snapshots(theta, torch.optim.AdamW(theta.parameters(), lr=cfg.lr), cfg.mu)
    _, (r,) = train.rl_step(theta, old, opt, ctx, 0, tasks.step_prompts(ctx, 0))  # old: the reference (beta > 0)
    assert torch.equal(r.batch.x, b.x)
    theta1 = opt.thetas[0]  # after update 0: the policy inner iteration 1 scores
    in_mask = r.views.inputs[1] == ids.mask
    est, ratios = diagnose.estimate(theta1, old, r, in_mask, r.views.loss_masks[1], ids)
    lp = importance.token_logprobs(theta1, r.views.inputs[1], r.batch.x, r.views.loss_masks[1], attention_mask=r.batch.attention_mask)
    want = ((lp - r.logp_old[1]) * r.views.loss_masks[1]).sum(-1)
    torch.testing.assert_close(est, want, rtol=0, atol=1e-6)
    assert est.abs().max() > 0  # the update moved the policy
    # and with theta = old every estimate and the exact log-ratio are exactly 0
    est0, _ = diagnose.estimate(old, old, r, in_mask, r.views.loss_masks[1], ids)
    assert torch.equal(est0, torch.zeros_like(est0))


@pytest.mark.slow
def test_cli_prints_every_row(sft_dir, tmp_path):
    png = tmp_path / "d.png"
    p = subprocess.run([sys.executable, "-m", "tools.diagnose", f"--ckpt={sft_dir}", "--preset=smoke",
                        "--draws=2", "--threads=1", f"--png={png}"], cwd=ROOT, capture_output=True, text=True,
                       env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr[-2000:]
    for task in ("text", "image"):
        assert f"{task}: estimate vs exact" in p.stdout
    for label, *_ in diagnose.ESTIMATORS:
        assert f"| {label} |" in p.stdout
    assert png.is_file()
    bad = subprocess.run([sys.executable, "-m", "tools.diagnose", "--draws=2"], cwd=ROOT, capture_output=True,
                         text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("error: usage")  # a user error: one line, status 2


def test_main_at_small_non_default_settings(tmp_path, capsys, monkeypatch):
    """`python -m tools.diagnose` in-process on a random toy-vocabulary checkpoint, text only, at
    settings of its own (mu 2, 2 draws, G 2, gamma 0.3, clip 1e-9): a table row per text estimator, the PNG,
    most ratios outside a clip range of 1e-9 after an update at lr 1e-2 (the column reads --clip_eps), and the Fig. 2 curves of the reversing operators at t = gamma
    by hand (random: t everywhere; AR-like, Alg. 1: 1 - min(1, 2 (1 - t)(1 - n / (N - 1))))."""
    tok = toy.build_tokenizer()
    model = Transformer(scratch_config(train.parse_args(["--preset=smoke"]), **tasks.model_config_overrides(tok)))
    model.init_weights(torch.Generator().manual_seed(3))
    ckpt = tmp_path / "ckpt"
    hf.save_pretrained(model, ckpt)
    tok.save(str(ckpt / "tokenizer.json"))
    png = tmp_path / "d.png"
    # A random model solves nothing: rewards from the sampled tokens instead, so that groups carry signal
    # and the update moves the policy.
    monkeypatch.setattr(tasks, "score", lambda b, *a, **k: (b.x[:, b.window_slice].sum(1) % 3).float() / 2)
    res = diagnose.main([f"--ckpt={ckpt}", "--preset=smoke", "--tasks=text", "--draws=2",
                         "--mu=2", "--prompts_per_step=1", "--group_size=2", "--gamma_text=0.3",
                         "--clip_eps=1e-9", "--lr=1e-2", "--threads=1", f"--png={png}"])
    out = capsys.readouterr().out
    labels = [label for label, *_ in diagnose.ESTIMATORS]
    assert set(res) == {"text"} and set(res["text"]) == set(labels) | {"_order"}
    for label in labels:
        assert f"| {label} |" in out
        m = res["text"][label]
        assert m["in_clip"] < 0.5 and 0 <= m["sign"] <= 1 and len(m["scatter"][0]) == 2  # (mu - 1) x B
    curve = res["text"]["_order"]
    N = len(curve["random"])
    assert curve["ratio"] == 0.3 and curve["random"] == [0.3] * N
    want = [1 - min(1.0, 2 * 0.7 * (1 - n / (N - 1))) for n in range(N)]
    assert curve["arlike"] == pytest.approx(want, abs=1e-12)
    assert png.is_file() and png.stat().st_size > 0


def test_official_ratio_table_rows():
    """--official_ratios: one row per (gamma, t_j) of the official text run (mu 12), t_j = gamma +
    (1 - gamma)(j + 1) / 12 (kept below 1), and one column per prompt length."""
    lines = diagnose.main(["--official_ratios"]) or None
    assert lines is None  # prints, returns {}
    table = diagnose.official_ratio_table(prompt_lens=(20, 256), gammas=(0.6,), mu=12).splitlines()
    assert len(table) == 2 + 12
    ts = [float(l.split("|")[2]) for l in table[2:]]
    assert ts == pytest.approx([min(0.6 + 0.4 * (j + 1) / 12, 0.999) for j in range(12)], abs=5e-4)
    assert all(len(l.split("|")) == 2 + 2 + 2 for l in table[2:])


def test_pearson_and_spearman_by_hand():
    a, b = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([2.0, 4.0, 7.0])
    assert diagnose.pearson(a, b) == pytest.approx(15 / math.sqrt(228))
    assert diagnose.spearman(a, b) == pytest.approx(1.0)
    assert diagnose.spearman(a, -b) == pytest.approx(-1.0)
    assert math.isnan(diagnose.pearson(a, torch.ones(3)))


@pytest.mark.parametrize("argv,match", [([], "usage: python -m tools.diagnose --ckpt DIR"),
                                        (["--ckpt=x", "--draws=1"], r"draws \(1\) must be >= 2"),
                                        (["--ckpt=x", "--mu=1"],
                                         r"mu \(1\) and draws \(4\) must be >= 2")])
def test_main_refuses(argv, match):
    with pytest.raises(ValueError, match=match):
        diagnose.main(argv)
