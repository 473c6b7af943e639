"""The held-out evaluation (infra/data.evaluate, evaluate_all: train.py's before/after scores and evaluate.py's)
over more than one batch of 64 rows, on more than one process, and under the fast-rollout flags.

The expectation is a naive re-implementation of what infra/data.evaluate documents: held-out prompts repeated
eval_samples times, batches of 64 rows, row j (its GLOBAL index) sampled by LLaDA's exact sampler
(sample.generate with no KV cache and no threshold: "the held-out evaluations always use the exact
sampler", docs/results.md; sample.rollout: "evaluation keeps the exact sampler") from the generator
(seed, "eval-sampling", task, temperature, j). 20 prompts x 4 samples = 80 rows: rows 64..79 are the second
batch's, and must not reuse rows 0..15's noise. A float64 model, so that a batch of another size (another
process's share) cannot flip a near-tie in the sampler.

    python -m pytest tests/test_evaluate_batches.py -q
"""
import copy

import pytest
import torch

import evaluate
import sample
import tasks
import train
from infra import data, scale

from test_trajectory import base, fake_score  # noqa: F401 (base: the tiny random smoke model, a fixture)

FLAGS = ["--preset=smoke", "--tasks=text", "--eval_prompts=20", "--eval_samples=4"]
FAST = ["--kv_cache=dual", "--threshold=0.0101"]  # 100-token vocabulary: the argmax is often just above 1/100


def run_evaluate(model, ctx, temperature, prompt_means=None):
    """(mean, records) of data.evaluate on the toy text task: the one call into the code under test."""
    records = []
    mean = data.evaluate(model, ctx, "text", temperature, records, prompt_means=prompt_means)
    return mean, {r["index"]: r for r in records}


def naive(model, ctx, temperature, **fast):
    """{global row index: (completion text, reward)} by the documented recipe, batch by batch of 64."""
    cfg, tok, ids = ctx.cfg, ctx.tok, ctx.ids
    k = cfg.eval_samples if temperature > 0 else 1
    rows = [ex for ex in data.eval_examples("text", cfg, {}) for _ in range(k)]
    out = {}
    for start in range(0, len(rows), 64):
        b = tasks.make_batch("text", rows[start:start + 64], tok, ids, cfg, ctx.device, with_targets=False)
        gens = [sample.generator("cpu", cfg.seed, "eval-sampling", "text", temperature, j)
                for j in range(start, start + b.x.shape[0])]
        x = sample.fast_generate(model, b.x[:, :b.prompt_len], gen_length=cfg.gen_length,
                                 block_length=cfg.block_length, steps=cfg.steps, temperature=temperature,
                                 mask_id=ids.mask, generator=gens, attention_mask=b.attention_mask[:, :b.prompt_len],
                                 **fast)
        done = tasks.Batch("text", x, b.attention_mask, b.prompt_len, b.window, examples=b.examples)
        texts = [tok.decode(w, skip_special_tokens=True) for w in x[:, b.window_slice].tolist()]
        rewards = tasks.score(done, tasks.verifier("text", cfg.text_reward), tok, ids).tolist()
        out.update({start + i: (t, r) for i, (t, r) in enumerate(zip(texts, rewards))})
    return out


@pytest.fixture(autouse=True)
def spread_rewards(monkeypatch):
    """The random model solves nothing: a reward in {0, 0.5, 1} from the completion's tokens, so that the
    means tell samplers apart."""
    monkeypatch.setattr(tasks, "score", fake_score)


@pytest.fixture(scope="module")
def model64(base):
    return copy.deepcopy(base[2]).double()


def ctx_of(base, *flags):
    tok, ids, _ = base
    return tasks.Ctx(train.parse_args([*FLAGS, *flags]), tok, ids, torch.device("cpu"), {})


@pytest.mark.parametrize("flags", [[], FAST], ids=["exact", "fast-rollout flags"])
def test_rows_past_the_first_batch_and_fast_flags(base, model64, flags):
    ctx = ctx_of(base, *flags)
    want = naive(model64, ctx, 1.0)
    means = []
    mean, got = run_evaluate(model64, ctx, 1.0, means)
    assert sorted(got) == list(range(80))
    assert {j: (r["output"], r["reward"]) for j, r in got.items()} == want
    assert mean == pytest.approx(sum(r for _, r in want.values()) / 80)
    # Each held-out prompt's mean over its 4 samples, rows 4p .. 4p + 3 (for the gain's paired error).
    assert means == pytest.approx([sum(want[4 * p + s][1] for s in range(4)) / 4 for p in range(20)])
    # The test can fail: rows 64.. differ from what rows 0..'s noise gives them, and so does the fast sampler.
    second = [got[j]["output"] for j in range(64, 80)]
    if flags:
        fast = naive(model64, ctx, 1.0, kv_cache="dual", threshold=0.0101)
        assert sum(fast[j][0] != want[j][0] for j in want) > 40
    else:
        assert len(set(second)) > 8


def test_each_process_scores_its_rows_as_one_process_does(base, model64, monkeypatch):
    """Rank 1 of 2 (scale.rank / world faked, the reductions the identity): it scores the odd rows of every
    batch, each exactly as the naive one-process evaluation does."""
    ctx = ctx_of(base)
    want = naive(model64, ctx, 1.0)
    monkeypatch.setattr(scale, "rank", lambda: 1)
    monkeypatch.setattr(scale, "world", lambda: 2)
    monkeypatch.setattr(scale, "all_sum", lambda t: t)
    _, got = run_evaluate(model64, ctx, 1.0)
    assert sorted(got) == list(range(1, 80, 2))
    assert all((got[j]["output"], got[j]["reward"]) == want[j] for j in got)


def test_evaluate_all_ignores_the_fast_rollout_flags(base, model64):
    """train.py's before/after scores (sampled and greedy) are the exact sampler's under --kv_cache/--threshold."""
    fast = data.evaluate_all(model64, ctx_of(base, *FAST))
    assert set(fast) == {"text", "text_greedy"}
    for key, temperature in (("text", 1.0), ("text_greedy", 0.0)):
        want = naive(model64, ctx_of(base), temperature)
        assert len(want) == (80 if temperature else 20)
        assert fast[key] == pytest.approx(sum(r for _, r in want.values()) / len(want))


@pytest.mark.parametrize("flag", ["--kv_cache=dual", "--threshold=0.9"])
def test_evaluate_py_refuses_the_fast_rollout_flags(flag, tmp_path):
    """evaluate.py scores with the exact sampler: it refuses the rollout-only flags instead of ignoring them."""
    with pytest.raises(ValueError, match=flag.split("=")[0] + ": a train.py setting that evaluate.py does not use"):
        evaluate.parse_options(["--ckpt", str(tmp_path), "--task", "text", flag])
