"""infra/diagnose.py (`python importance.py --diagnose`): it runs end to end on a small checkpoint and
prints every estimator row, and its log-ratios are the training code's for the same masks.

    python -m pytest tests/test_diagnose.py -q
"""
import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import importance
import tasks
import train
from infra import diagnose, rng
from model import Transformer
from infra.hf import load_tokenizer
from infra import hf

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("diag")
    train.main(["--preset=smoke", "--rl_steps=0", "--eval_prompts=2", f"--out_dir={out}", "--threads=1"])
    return out / "sft"


def test_log_ratios_are_the_training_codes(sft_dir):
    """After one update, the estimate diagnose computes with the training masks of iteration j equals the
    sum of log pi_theta - logp_old[j], with logp_old[j] as train.rl_step computed it; and the rollout the
    diagnosis redraws with its decoding order is the one rl_step trained on."""
    old = hf.from_pretrained(sft_dir).eval()
    tok = load_tokenizer(sft_dir, old.config)
    ids = tasks.token_ids(tok)
    cfg = train.parse_args(["--preset=smoke", "--tasks=text", "--lr=1e-2"])
    ctx = train.Ctx(cfg, tok, ids, torch.device("cpu"), {})
    exs = [ex for ex in tasks.draw_prompts("text", cfg, 0, {}) for _ in range(cfg.group_size)]
    b = tasks.make_batch("text", exs, tok, ids, cfg, ctx.device, with_targets=False)
    gens = [rng.generator("cpu", cfg.seed, "rollout", "text", 0, i) for i in range(len(exs))]
    b, order = train.rollout(old, b, ctx, gens, cfg.temperature, fast=True)
    assert (order[:, b.window_slice] >= 0).all() and (order[:, : b.prompt_len] == -1).all()
    theta = copy.deepcopy(old)
    opt = diagnose._Snapshots(theta, torch.optim.AdamW(theta.parameters(), lr=cfg.lr), cfg.num_iterations)
    _, (r,) = train.rl_step(theta, None, opt, ctx, 0, train.step_prompts(ctx, 0))
    assert torch.equal(r.batch.x, b.x)
    theta1 = opt.thetas[0]  # after update 0: the policy inner iteration 1 scores
    in_mask = r.inputs[1] == ids.mask
    est, ratios = diagnose.estimate(theta1, old, r, in_mask, r.loss_masks[1], ids)
    lp = importance.token_logprobs(theta1, r.inputs[1], r.batch.x, r.loss_masks[1], attention_mask=r.batch.attention_mask)
    want = ((lp - r.logp_old[1]) * r.loss_masks[1]).sum(-1)
    torch.testing.assert_close(est, want, rtol=0, atol=1e-6)
    assert est.abs().max() > 0  # the update moved the policy
    # and with theta = old every estimate and the exact log-ratio are exactly 0
    est0, _ = diagnose.estimate(old, old, r, in_mask, r.loss_masks[1], ids)
    assert torch.equal(est0, torch.zeros_like(est0))


@pytest.mark.slow
def test_cli_prints_every_row(sft_dir, tmp_path):
    png = tmp_path / "d.png"
    p = subprocess.run([sys.executable, "importance.py", "--diagnose", f"--ckpt={sft_dir}", "--preset=smoke",
                        "--draws=2", "--threads=1", f"--png={png}"], cwd=ROOT, capture_output=True, text=True,
                       env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr[-2000:]
    for task in ("text", "image"):
        assert f"{task}: estimate vs exact" in p.stdout
    for label, *_ in diagnose.ESTIMATORS:
        assert f"| {label} |" in p.stdout
    assert png.is_file()
    bad = subprocess.run([sys.executable, "importance.py", f"--ckpt={sft_dir}"], cwd=ROOT, capture_output=True,
                         text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("error: usage")  # a user error: one line, status 2
