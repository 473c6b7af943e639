"""The same lines on CUDA in bfloat16 (skipped without a GPU; this project's machines have none, so
these have not run yet): a smoke training run, and rows sampled with per-row CUDA generators that do not
depend on their batch.

    python -m pytest tests/test_cuda.py -q
"""
import json
import math

import pytest
import torch

import sample
import train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_smoke_run_bf16_on_cuda(tmp_path):
    train.main(["--preset", "smoke", f"--out_dir={tmp_path}", "--device=cuda"])
    line = json.loads((tmp_path / "log.jsonl").read_text().splitlines()[-1])
    assert math.isfinite(line["image/loss"]) and math.isfinite(line["grad_norm"])
    assert json.loads((tmp_path / "final" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_per_row_cuda_generators():
    """Row i's noise comes from its own CUDA generator, whatever the batch (the logits of a bf16 batch may
    differ from a single row's by kernel choice, so this checks the noise, which is what train.py needs)."""
    gens = lambda idx: [torch.Generator("cuda").manual_seed(i) for i in idx]
    whole = sample._uniform((3, 4, 5), gens(range(3)), "cuda")
    alone = sample._uniform((1, 4, 5), gens([1]), "cuda")
    assert whole.device.type == "cuda" and torch.equal(alone[0], whole[1]) and not torch.equal(whole[0], whole[1])
