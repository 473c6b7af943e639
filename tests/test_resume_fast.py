"""A run stopped after a checkpoint and continued with --resume ends exactly where the uninterrupted run does
(the fast sibling of test_resume.py's slow kill-anywhere test): the same log.jsonl, the same final weights
and the same held-out score, bit for bit, with mu = 2 updates per step on both toy tasks. The stop is a
finished 2-step run, extended to 3 steps (--resume --extend), which continues from its step-2 checkpoint
with the optimiser state, the step counter and every seed of the run.

    python -m pytest tests/test_resume_fast.py -q
"""
import json

import torch

import train
from infra import hf

RUN = ["--preset=smoke", "--threads=1", "--sample_every=0", "--checkpoint_every=1", "--eval_prompts=2",
       "--prompts_per_step=1", "--group_size=4"]


def test_extended_run_equals_the_uninterrupted_one(smoke_sft_run, tmp_path):
    base = [*RUN, f"--sft_dir={smoke_sft_run / 'sft'}"]
    ref, out = tmp_path / "uninterrupted", tmp_path / "stopped"
    train.main([*base, f"--out_dir={ref}", "--rl_steps=3"])
    train.main([*base, f"--out_dir={out}", "--rl_steps=2"])
    train.main([*base, f"--out_dir={out}", "--rl_steps=3", "--resume=true", "--extend=true"])
    logs = [[json.loads(line) for line in (d / "log.jsonl").read_text().splitlines()] for d in (ref, out)]
    assert [r["step"] for r in logs[0]] == [0, 1, 2] and logs[0] == logs[1]
    assert logs[0][2]["text/loss"] != logs[0][1]["text/loss"]
    a, b = (dict(hf.from_pretrained(d / "final").named_parameters()) for d in (ref, out))
    assert all(torch.equal(a[k], b[k]) for k in a)
    s = [json.loads((d / "summary.json").read_text()) for d in (ref, out)]
    assert {k: s[0][k]["after"] for k in ("text", "image")} == {k: s[1][k]["after"] for k in ("text", "image")}
