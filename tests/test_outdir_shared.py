"""A multi-node run whose ranks cannot see rank 0's out_dir is refused at start-up (infra/outdir.check_shared).

Two ranks simulated in one process: rank 1 is played by swapping rank(), the collectives and the file system's
answer; the expectation is by hand (what each rank must conclude), not from the function under test."""
import pytest
import torch

from infra import outdir, scale


def play(monkeypatch, tmp_path, rank1_sees: bool):
    """Run check_shared as rank 0 of 2, with rank 1 reporting whether it saw rank 0's probe file."""
    monkeypatch.setattr(scale, "world", lambda: 2)
    monkeypatch.setattr(scale, "rank", lambda: 0)
    monkeypatch.setattr(scale, "barrier", lambda: None)
    seen = []

    def all_max(t):  # rank 1 contributes 0 to the nonce, and "not seen" when its disk is its own
        other = torch.zeros_like(t) if not seen else torch.tensor([int(not rank1_sees)], dtype=t.dtype)
        seen.append(t.clone())
        return torch.maximum(t, other)
    monkeypatch.setattr(scale, "all_max", all_max)
    outdir.check_shared(tmp_path, torch.device("cpu"))
    return seen


def test_every_rank_sees_the_probe(tmp_path, monkeypatch):
    calls = play(monkeypatch, tmp_path, rank1_sees=True)
    assert len(calls) == 2 and calls[0].item() > 0  # rank 0's random number, then "seen" (0)
    assert calls[1].item() == 0
    assert list(tmp_path.iterdir()) == []  # the probe is removed: nothing of it stays in out_dir


def test_a_node_local_out_dir_is_refused(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="cannot see rank 0.s files; pass a folder all share"):
        play(monkeypatch, tmp_path, rank1_sees=False)
    assert list(tmp_path.iterdir()) == []


def test_one_process_writes_nothing(tmp_path):
    outdir.check_shared(tmp_path, torch.device("cpu"))
    assert list(tmp_path.iterdir()) == []
