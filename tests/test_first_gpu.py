"""tests/first_gpu.py on the CPU at a small width (LLaDA-8B's vocabulary, the toy tokenizer): the same
script the first GPU runs, so that there only the device changes. And the one property of the real path that
an 8B vocabulary with a toy tokenizer relies on: sampled ids the tokenizer does not know decode as nothing,
so the toy verifier scores them, never crashes on them.

    python -m pytest tests/test_first_gpu.py -q
"""
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tasks
import train
from infra import toy

ROOT = Path(__file__).resolve().parents[1]
LLADA_VOCAB = 126464


def toy_text_batch(n=2):
    tok = toy.build_tokenizer()
    ids = tasks.token_ids(tok)
    cfg = train.parse_args(["--preset=smoke", "--tasks=text", "--gen_length=32", "--block_length=32", "--steps=32"])
    rng = random.Random(0)
    examples = [tasks.make_example("text", rng, cfg, "train") for _ in range(n)]
    return tok, ids, tasks.make_batch("text", examples, tok, ids, cfg, "cpu", with_targets=True)


def test_ids_outside_the_toy_tokenizer_decode_as_nothing():
    tok, ids, b = toy_text_batch()
    w, B = b.window_slice, b.x.shape[0]
    size = tok.get_vocab_size(with_added_tokens=True)
    assert ids.vocab_size < LLADA_VOCAB
    with_window = lambda window: tasks.Batch(**{**b.__dict__, "x": torch.cat([b.x[:, :w.start], window], 1)})
    target = b.x[:, w]                                                                  # (B, 32)
    # the targets themselves: the verifier's reward is 1 (its definition: the true answer boxed)
    assert tasks.score(b, tasks.verifier("text"), tok, ids).tolist() == [1.0] * B
    # every window id unknown to the tokenizer (model rows up to LLaDA's 126,464): reward 0, no error
    unknown = torch.arange(size, size + target.shape[1]).expand(B, -1)
    assert tasks.score(with_window(unknown), tasks.verifier("text"), tok, ids).tolist() == [0.0] * B
    # the true answer with an unknown id after each of its tokens: they are dropped, the answer scores 1
    half = target.shape[1] // 2
    assert (target[:, half:] == ids.eos).all()  # the answer fits in the first half (then EOS padding)
    after = torch.arange(LLADA_VOCAB - half, LLADA_VOCAB).expand(B, -1)
    mixed = torch.stack([target[:, :half], after], 2).reshape(B, 2 * half)
    assert tasks.score(with_window(mixed), tasks.verifier("text"), tok, ids).tolist() == [1.0] * B


def run_script(out, *args):
    return subprocess.run([sys.executable, str(ROOT / "tests" / "first_gpu.py"), "--device=cpu", f"--out_dir={out}",
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def table(stdout: str) -> dict:
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) == 3:
            rows[cells[0]] = cells[1:]
    return rows


@pytest.mark.slow  # the whole script end to end (about 15 s); its decisions are tested fast below
def test_first_gpu_script_on_cpu(tmp_path):
    out = tmp_path / "fg"
    p = run_script(out)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = table(p.stdout)
    assert p.stdout.splitlines()[0] == "first-GPU run on CPU"
    for name in ("torch", "CUDA", "device", "torch floor (scale.check_torch)", "FSDPModule methods of torch 2.8",
                 "TORCH_ELASTIC_SHUTDOWN_TIMEOUT read by torchrun", "random checkpoint (infra/hf)",
                 "train.main, one RL step", "generated tokens/s per rank", "checkpoints/ on disk", "final/ on disk"):
        assert name in rows, (name, p.stdout)
    assert rows["torch floor (scale.check_torch)"][0].startswith("ok")
    assert rows["FSDPModule methods of torch 2.8"][0] == "present"
    assert rows["random checkpoint (infra/hf)"][0].startswith("32 layers, d_model 64, vocab 126464")
    for phase in ("rollout", "reward", "scoring", "update", "checkpoint", "final"):
        assert rows[f"{phase}: peak memory"][0] == "n/a (CPU)"
        assert "(CPU)" in rows[f"{phase}: seconds"][0]
    for phase in ("rollout", "scoring", "update"):  # the dry run's row beside each
        assert rows[f"{phase}: peak memory"][1].endswith(" GiB")
    assert "(CPU)" in rows["generated tokens/s per rank"][0]
    assert rows["seconds per RL step"][1] == "no dry-run figure for a CPU"
    # nearly every sampled id lies outside the toy tokenizer, and the verifier scores them 0
    assert float(rows["sampled ids outside the toy tokenizer"][0].rstrip("%")) > 90
    assert rows["toy verifier's reward on them"][0].startswith("max 0.000 over 8")
    # the update trained: update 0 re-scores pi_old exactly (LoRA's B is 0), the later ones moved
    assert rows["update 0: first ratio (max, mean)"][0] == "1, 1"
    assert float(rows["ratio mean over the step's updates (log.jsonl)"][0]) != 1.0
    assert rows["losses, gradient norms"][0] == "8 of 8 finite, 4 of 4 finite"
    assert rows["resume: next step, tensors differing"][0] == "1, 0"  # the next step; every tensor given back
    assert p.stdout.splitlines()[-1] == "first-GPU check: passed" and p.stderr == ""
    run = out / "run"
    assert (run / "checkpoints" / "step-00000001").is_dir()
    assert (run / "final" / "model.safetensors.index.json").is_file() or any((run / "final").glob("*.safetensors"))
    assert (run / "times.jsonl").is_file() and (run / "log.jsonl").is_file()
    # a second run into the same directory is refused in one line, before anything is written
    import first_gpu
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    with pytest.raises(SystemExit) as e:
        first_gpu.main(["--device=cpu", f"--out_dir={out}"])
    assert str(e.value) == f"error: --out_dir {out} is not empty; choose a new directory or delete it"
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before


@pytest.mark.slow  # two torchrun ranks (about 25 s); test_each_condition_alone_fails_the_decision is its fast sibling
def test_each_planted_fault_fails_the_check_on_two_ranks(tmp_path):
    """torchrun --nproc_per_node=2 (gloo: FSDP2 over two ranks) with the four faults planted (FIRST_GPU_FAULTS):
    pi_old's log-probs of view 0 raised by 0.05, so update 0's ratio is exp(-0.05); one NaN log-prob in the
    last view, so update mu-1's loss and gradient norm are NaN (and the step, skipped, stops the one-step run);
    a rollout holding twice the dry run's rollout figure; a checkpoint whose state.json says step 0. Every
    rank exits non-zero and names each figure, with its value."""
    env = dict(os.environ, FIRST_GPU_FAULTS="ratio,nan,peak,resume", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(ROOT / "tests" / "first_gpu.py"), "--device=cpu", f"--out_dir={tmp_path / 'fg'}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode != 0
    assert "first-GPU check: FAILED, 12 figure(s)" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error: rank ")]
    assert "ending, because rank" not in p.stderr  # a verdict every rank reaches: no rank ends another
    for rank in (0, 1):
        mine = [ln[len(f"error: rank {rank}: "):] for ln in errors if ln.startswith(f"error: rank {rank}: ")]
        assert len(mine) == 6, mine
        assert mine[0].startswith("train.main stopped: every one of the 1 RL steps was skipped")
        assert mine[1].startswith(f"update 0's first ratio (max, mean) = {math.exp(-0.05):.6g}, {math.exp(-0.05):.6g}: "
                                  "not 1 within 0.001")
        assert mine[2] == "loss not finite in 1 of 4 update chunks (first: chunk 3, nan)"
        assert mine[3] == "gradient norm not finite in 1 of 4 updates (first: update 3, nan)"
        assert mine[4].startswith("rollout: peak memory ") and "100% above the dry run's" in mine[4]
        assert mine[5] == "resume: the checkpoint resumes at step 0, the run's next step is 1"


def test_each_condition_alone_fails_the_decision():
    """first_gpu.decide on the figures of a good run gives nothing; each condition alone gives one line naming it."""
    import first_gpu
    good = dict(first_ratio=(1.0, 1.0), losses=[0.1, -0.2], grad_norms=[0.5, 0.4],
                peaks={"rollout": (int(1.25 * 2 ** 30), 1.0)}, resumed=(1, 1, 0))
    assert first_gpu.decide(**good) == []
    bad = {"first_ratio": [(1.002, 1.0), (1.0, 0.998), (float("nan"), 1.0), None],
           "losses": [[0.1, float("nan")], [float("inf")], []],
           "grad_norms": [[float("nan"), 0.4], []],
           "peaks": [{"rollout": (int(1.26 * 2 ** 30), 1.0)}, {"update": (3 * 2 ** 30, 2.0)}],
           "resumed": [(0, 1, 0), (1, 1, 3), None]}
    names = {"first_ratio": "update 0's first ratio", "losses": "loss", "grad_norms": "gradient norm",
             "peaks": "peak memory", "resumed": "resume:"}
    for key, values in bad.items():
        for v in values:
            fails = first_gpu.decide(**{**good, key: v})
            assert len(fails) == 1 and names[key] in fails[0], (key, v, fails)


def test_time_is_compared_with_the_dry_run_of_the_gpu_it_runs_on():
    """The device names torch reports pick the peak the dry run's time is scaled to (budget.GPU_PEAKS)."""
    import first_gpu
    from infra import budget
    names = {"NVIDIA A100-SXM4-80GB": "A100", "NVIDIA H100 80GB HBM3": "H100", "NVIDIA H200": "H200",
             "NVIDIA GeForce RTX 4090": None}
    assert {n: first_gpu.gpu_kind(n) for n in names} == names
    assert budget.GPU_PEAKS == {"A100": 312e12, "H100": 989e12, "H200": 989e12}  # NVIDIA's dense bf16 figures


def test_phase_peaks_are_the_largest_while_each_phase_was_current(monkeypatch):
    """The CUDA side of the meter with the allocator's statistics replaced by a script: each phase keeps the
    largest peak seen while it was current, over every time it was entered; the peak is reset on entry."""
    import first_gpu
    peaks = iter([(5, 8), (2, 9), (7, 7), (1, 1)])  # what max_memory_allocated/reserved return at each close
    now = {}
    resets = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: resets.append(1))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: now["a"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: now["r"])

    def advance():
        now["a"], now["r"] = next(peaks)

    m = first_gpu.PhaseMeter(cuda=True)
    m.enter("rollout")
    advance()
    m.enter("scoring")       # rollout closes at (5, 8)
    m.enter("scoring")       # same phase: nothing closes, nothing reset
    advance()
    m.enter("rollout")       # scoring closes at (2, 9)
    advance()
    m.enter("update")        # rollout again: (7, 7), so rollout keeps (7, 8)
    advance()
    m.close()                # update (1, 1)
    assert m.peak == {"rollout": (7, 8), "scoring": (2, 9), "update": (1, 1)}
    assert len(resets) == 4 and set(m.seconds) == {"rollout", "scoring", "update"}


def test_cuda_asked_without_a_gpu_is_one_line(tmp_path):
    import first_gpu
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the refusal cannot be shown")  # never on the CPU CI
    with pytest.raises(SystemExit) as e:
        first_gpu.main(["--device=cuda", f"--out_dir={tmp_path / 'x'}"])
    assert str(e.value) == "error: --device=cuda but torch sees no CUDA device; pass --device=cpu"
    assert not (tmp_path / "x").exists()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
