"""Host reads in the hot loops: each value the host reads from a tensor (.item(), bool(), int(), .tolist(), a
data-dependent shape such as nonzero or unique) waits on a GPU for every kernel queued before it, so the host
stops queueing work ahead. Counted here on the CPU, where the same calls are made: a TorchDispatchMode sees the
dispatched reads (_local_scalar_dense behind item/bool/int, nonzero, unique) and a wrapper counts .tolist().

    python -m pytest tests/test_host_reads.py -q
"""
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import grpo
import importance
import train
import sample
from test_sample import gen, prompts, tiny_model

READS = ("aten._local_scalar_dense.default", "aten.nonzero.default", "aten._unique2.default",
         "aten.unique_dim.default", "aten.is_nonzero.default")


class HostReads(TorchDispatchMode):
    def __init__(self, monkeypatch):
        super().__init__()
        self.count, tolist = Counter(), torch.Tensor.tolist

        def counted(t):
            self.count["tolist"] += 1
            return tolist(t)
        monkeypatch.setattr(torch.Tensor, "tolist", counted)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in READS:
            self.count[str(func).split(".")[1]] += 1
        return func(*args, **(kwargs or {}))


def test_the_text_sampler_reads_once_per_step(monkeypatch):
    """8 steps in 2 blocks on padded prompts: one read per step (the first masked column, where the head
    starts), one per block (each step's transfer counts), one per call (whether the mask holds padding)."""
    p, model = prompts(B=3, P=5), tiny_model().eval()
    am = torch.ones_like(p)
    am[1, :2] = 0
    with HostReads(monkeypatch) as reads:
        sample.generate(model, p, gen_length=16, block_length=8, steps=8, mask_id=63, attention_mask=am)
    assert reads.count == {"_local_scalar_dense": 8 + 1, "tolist": 2}, reads.count


@pytest.mark.parametrize("kv_cache, threshold", [("dual", 0.0), ("prefix", 0.05)])
def test_the_fast_sampler_reads_once_per_step(monkeypatch, kv_cache, threshold):
    """Fast-dLLM on padded prompts, 8 steps in 2 blocks, with the decoding order and statistics: one read per
    step (each row's masks left in the block: the step's counts and active rows), and one more where the
    threshold finished a block early (the read that finds it done), one per call (padding). The statistics
    wait on the device for FastSampler.take_log."""
    p, model = prompts(B=3, P=5), tiny_model().eval()
    am = torch.ones_like(p)
    am[1, :2] = 0
    forwards, stats = [], {}
    model.register_forward_pre_hook(lambda *_: forwards.append(1))
    with HostReads(monkeypatch) as reads:
        _, order = sample.fast_generate(model, p, gen_length=16, block_length=8, steps=8, mask_id=63,
                                        attention_mask=am, kv_cache=kv_cache, threshold=threshold, stats=stats,
                                        return_order=True)
    used = [int(order[:, 5 + 8 * b:13 + 8 * b].max()) - 4 * b + 1 for b in range(2)]  # steps each block took
    assert len(forwards) == sum(used) and (threshold == 0) == (sum(used) == 8), used
    assert reads.count == {"_local_scalar_dense": 1, "tolist": sum(used) + sum(u < 4 for u in used)}, reads.count
    assert len(stats["steps"]) == sum(used)
    sampler = sample.FastSampler(kv_cache, threshold)
    sampler.stats = stats
    sampler.take_log("cpu")
    assert stats["tokens"] == 3 * 16 and "steps" not in stats  # each completion position committed once


def test_scoring_reads_twice_per_call_whatever_the_chunks(monkeypatch):
    """token_logprobs over 3 chunks of 2 rows: one read of every row's scored columns and padding, and one at
    the end (a scored target outside the vocabulary slice); none per chunk."""
    model = tiny_model().eval()
    x = torch.randint(0, 60, (6, 20), generator=gen(1))
    pos = torch.zeros(6, 20, dtype=torch.bool)
    pos[:, 8:18] = torch.rand(6, 10, generator=gen(2)) < 0.6
    am = torch.ones(6, 20, dtype=torch.long)
    am[0, :3] = 0
    with HostReads(monkeypatch) as reads:
        importance.token_logprobs(model, x.masked_fill(pos, 63), x, pos, attention_mask=am, device_batch_size=2)
    assert reads.count == {"_local_scalar_dense": 1, "tolist": 1}, reads.count


def test_the_loss_of_an_update_chunk_reads_nothing(monkeypatch):
    """grpo.policy_loss returns its sums as tensors (train.reduce_sums reads them once per update)."""
    lp = torch.randn(4, 6, generator=gen(3), requires_grad=True)
    mask = torch.rand(4, 6, generator=gen(4)) < 0.5
    with HostReads(monkeypatch) as reads:
        loss, sums = grpo.policy_loss(lp, lp.detach() + 0.01, torch.randn(4, generator=gen(5)), mask, clip_eps=0.2,
                                      beta=0.1, logp_ref=lp.detach() - 0.02)
        both = train.add_sums(sums, sums)
    assert reads.count == {}, reads.count
    assert all(torch.is_tensor(v) and v.dim() == 0 for v in both.values())
