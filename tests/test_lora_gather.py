"""With LoRA the reference pass is the policy with its adapters off (hf.AdaptersOff): train.rl_step scores
pi_old and pi_ref inside ONE scale.full_weights hold of the policy, so FSDP2 gathers the weights once for
both (at LLaDA-8B one 16 GB all-gather per task and step instead of two). A full fine-tuning run's reference
is a separate copy: no hold of the policy around its pass.

    python -m pytest tests/test_lora_gather.py -q
"""
import contextlib

import pytest

import train
from infra import hf, scale
from test_rl_step import build, ckpt, run_step  # noqa: F401


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_old_and_reference_passes_share_one_hold(ckpt, monkeypatch, lora_rank):  # noqa: F811
    flags = ["--tasks=text", "--beta=0.5"] + ([f"--lora_rank={lora_rank}", "--lora_alpha=8"] if lora_rank else [])
    cfg, policy, ref, opt, tok, ids = build(ckpt, *flags)
    holds, passes, real_hold, real_frozen = [], [], scale.full_weights, train.frozen_logprobs

    @contextlib.contextmanager
    def hold(model):
        holds.append(model)
        with real_hold(model) as m:
            yield m
        holds.pop()

    def frozen(model, b, views, ctx):  # which holds are open when each frozen pass runs
        passes.append((model, list(holds)))
        return real_frozen(model, b, views, ctx)

    monkeypatch.setattr(scale, "full_weights", hold)
    monkeypatch.setattr(train, "frozen_logprobs", frozen)
    run_step(cfg, policy, ref, opt, tok, ids, 0)
    (old, old_holds), (ref_model, ref_holds) = passes
    assert old is policy and ref_model is ref
    if lora_rank:
        assert isinstance(ref, hf.AdaptersOff)
        assert old_holds == [policy] and ref_holds == [policy]  # the policy's hold is open for both passes
    else:
        assert old_holds == [] and ref_holds == []  # each pass holds its own model (inside frozen_logprobs)
