"""train.py: config parsing and validation, the benchmark and remote-scorer paths on a tiny checkpoint, a
failing scorer, the dry run, setup and the policy a run trains. Every training setting at a non-default value is
in tests/test_train_settings.py; the end-to-end runs are in tests/test_end_to_end.py.

    python -m pytest tests/test_train.py -q
"""
import json
from pathlib import Path

import pytest
import torch

import tasks
import train
from infra import hf
from infra import toy as toy_world
from infra.budget import scratch_config
from infra.load import load_policy
from infra.cli import setup
from model import Transformer

pytestmark = pytest.mark.usefixtures("undrawn_figures")  # no test here checks a picture's pixels


@pytest.mark.parametrize("argv,match", [
    (["--gen_length=20", "--block_length=8"], r"gen_length \(20\) must be divisible by block_length \(8\)"),
    (["--steps=5", "--block_length=4"], r"steps \(5\) must be a positive multiple of the number of blocks \(3\)"),
    (["--group_size=1"], r"group_size \(1\) must be >= 2"),
    (["--gamma_text=1.0"], r"gamma_text \(1.0\) must be in \[0, 1\)"),
    (["--clip_eps=0"], r"clip_eps \(0.0\) must be > 0"),
    (["--mu=0"], r"mu \(0\) must be >= 1"),
    (["--estimator=ppo"], r"estimator \('ppo'\) must be maskgrpo, d1, unigrpo or trajectory$"),
    (["--tasks=audio"], r"tasks \('audio'\) must be"),
    (["--dtype=float16"], r"float16 needs a grad scaler"),
    (["--preset", "huge"], r"unknown preset 'huge'"),
    (["--eval_samples=0"], r"eval_samples \(0\) must be >= 1"),
    (["--dry_run_gpus=0"], r"dry_run_gpus \(0\) must be >= 1"),
    (["--sample_every=-1"], r"sample_every \(-1\) must be >= 0"),
    (["--lr=0"], r"lr \(0.0\) must be > 0"),
    (["--grad_clip=0"], r"grad_clip \(0.0\) must be > 0: 0 would zero every gradient"),
    (["--cfg_scale=-1"], r"cfg_scale \(-1.0\) must be >= 0"),
    (["--p_mask_prompt=2"], r"p_mask_prompt \(2.0\) must be in \[0, 1\]"),
    (["--tasks=image", "--threshold=0.9"], r"kv_cache / threshold apply to text rollouts"),
    (["--image_scorer_url=http://x:1"], r"image_scorer_url is set but no task uses it"),
])
def test_bad_config(argv, match):
    with pytest.raises(ValueError, match=match):
        train.parse_args(argv)


def test_overrides_and_types():
    cfg = train.parse_args(["--preset", "smoke", "--lr=1", "--beta=0", "--tasks=text"])
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float) and cfg.beta == 0 and cfg.tasks == "text"
    assert cfg.rl_steps == train.PRESETS["smoke"]["rl_steps"]


@pytest.fixture(scope="module")
def tiny_ckpt(smoke_sft_run):
    """A smoke-trained toy checkpoint (MMaDA-like: text tokens, image codes and the t2i markers)."""
    return smoke_sft_run / "final"


FIXTURES = Path(__file__).parent / "fixtures" / "data"


def test_geneval_with_remote_scorer(tiny_ckpt, tmp_path, monkeypatch):
    """Text-to-image on GenEval prompts with rewards from the stub scorer over HTTP (tools.stub_scorer.serve_stub):
    the logged reward is the stub's rule (fraction of distinct codes) of the rollouts."""
    from tools import stub_scorer
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    server = stub_scorer.serve_stub(0)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        out = tmp_path / "geneval"
        path = FIXTURES / "geneval.jsonl"
        summary = train.main(["--preset", "smoke", f"--out_dir={out}", "--threads=1", f"--init_from={tiny_ckpt}",
                              "--tasks=geneval", f"--train_data=geneval={path}", f"--eval_data=geneval={path}",
                              f"--image_scorer_url={url}", "--rl_steps=1", "--eval_prompts=3", "--image_text_len=24",
                              "--cfg_scale=2.0"])
    finally:
        server.shutdown()
        server.server_close()
    line = json.loads((out / "log.jsonl").read_text())
    assert 0.0 < line["geneval/reward"] <= 1.0  # distinct codes / 16 > 0 for any image
    assert 0.0 < summary["geneval"]["before"] <= 1.0


@pytest.mark.parametrize("argv,match", [
    (["--tasks=gsm8k"], r"need a pretrained model: pass --init_from"),
    (["--tasks=gsm8k", "--init_from=x"], r"task 'gsm8k' needs its training file: --train_data=gsm8k=PATH"),
    (["--tasks=gsm8k", "--init_from=x", "--train_data=gsm8k"], r"must be TASK=PATH"),
    (["--tasks=gsm8k", "--init_from=x", "--train_data=gsm8k=a", "--eval_data=math=b"], r"eval_data names \['math'\]"),
    (["--tasks=geneval", "--init_from=x", "--train_data=geneval=a"], r"needs a reward model: --image_scorer_url"),
    (["--lora_rank=4"], r"lora_rank > 0 with init_from=scratch"),
    (["--lora_rank=-1"], r"lora_rank \(-1\) must be >= 0"),
])
def test_benchmark_config_errors(argv, match):
    with pytest.raises(ValueError, match=match):
        train.parse_args(["--preset", "smoke", *argv])


def test_prompts_must_split_over_ranks(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match=r"prompts_per_step \(2\) must be divisible by the world size \(3\)"):
        train.parse_args(["--preset", "smoke"])


def test_missing_data_file_fails_before_model(tmp_path):
    with pytest.raises(FileNotFoundError, match="dataset file not found"):
        train.main(["--preset", "smoke", f"--out_dir={tmp_path}", f"--init_from={tmp_path / 'nope'}",
                    "--tasks=gsm8k", f"--train_data=gsm8k={tmp_path / 'missing.jsonl'}"])


def test_scorer_failure_skips_the_step(tiny_ckpt, tmp_path, monkeypatch, capsys):
    """A scorer that is down gives NaN rewards: the step is skipped on every rank, logged, and the run
    stops after max_bad_steps of them in a row, instead of a traceback (or a hang under torchrun)."""
    from infra import sandbox

    def down(self, prompts, codes):
        raise ConnectionError("image scorer at http://127.0.0.1:9 failed 4 attempts")
    monkeypatch.setattr(sandbox.RemoteScorer, "__call__", down)
    out = tmp_path / "down"
    path = FIXTURES / "geneval.jsonl"
    with pytest.raises(train.TrainingStopped, match="2 consecutive bad steps"):
        train.main(["--preset", "smoke", f"--out_dir={out}", "--threads=1", f"--init_from={tiny_ckpt}",
                    "--tasks=geneval", f"--train_data=geneval={path}", "--image_scorer_url=http://127.0.0.1:9",
                    "--rl_steps=3", "--max_bad_steps=2", "--image_text_len=24"])
    lines = [json.loads(s) for s in (out / "log.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and all("not a finite number" in l["bad_reward"] for l in lines)
    assert "warning: image scorer failed (image scorer at http://127.0.0.1:9" in capsys.readouterr().out


CPU = torch.device("cpu")


def parse(*flags):
    return train.parse_args(["--preset=smoke", *flags])


@pytest.fixture(scope="module")
def toy_model():
    """(tokenizer, special ids, a random toy-vocabulary model at smoke size in float64)."""
    tok = toy_world.build_tokenizer()
    ids = tasks.token_ids(tok)
    model = Transformer(scratch_config(parse(), **tasks.model_config_overrides(tok)))
    model.init_weights(torch.Generator().manual_seed(0))
    return tok, ids, model.double().eval()


@pytest.mark.parametrize("gpus", [2, 4])
def test_dry_run_model_shape_and_gpus(capsys, gpus):
    """--dry_run at a non-default shape: the parameter count is the LLaDA layout's by hand (embedding and
    output head V x d each; per block q, k, v, o d x d each, the SwiGLU's three d x h, two RMSNorm
    weights; the final norm), and --dry_run_gpus divides the time per step but not the GPU-hours."""
    d, V, L, h = 48, 1000, 3, 80
    flags = ["--preset=smoke", "--dry_run", f"--vocab_size={V}", f"--d_model={d}", f"--n_layers={L}", "--n_heads=6",
             f"--mlp_hidden_size={h}"]
    r = train.main(flags + [f"--dry_run_gpus={gpus}"])
    one = train.main(flags + ["--dry_run_gpus=1"])
    assert r["params"] == 2 * V * d + L * (4 * d * d + 3 * d * h + 2 * d) + d
    assert r["gpus"] == gpus
    assert r["seconds_per_step"] == pytest.approx(one["seconds_per_step"] / gpus)
    assert r["gpu_hours"] == pytest.approx(one["gpu_hours"])


# -----------------------------------------------------------------------------------------------------
# setup and the policy a run trains


def test_setup_takes_threads_dtype_and_device():
    """--threads=2 sets torch's CPU threads; --dtype=bfloat16 is the compute dtype; auto on a CPU is
    float32; --device=cpu is the CPU."""
    before = torch.get_num_threads()
    try:
        device, dtype = setup(parse("--threads=2", "--dtype=bfloat16", "--device=cpu"))
        assert (device, dtype, torch.get_num_threads()) == (CPU, torch.bfloat16, 2)
    finally:
        torch.set_num_threads(before)
    assert setup(parse("--device=cpu"))[1] == torch.float32


@pytest.mark.parametrize("targets,names", [("official", {"q_proj", "k_proj", "v_proj", "up_proj"}),
                                           ("all", {"q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj",
                                                    "ff_out"})])
def test_load_policy_adapts_what_the_lora_flags_say(toy_model, tmp_path, targets, names):
    """--lora_rank=4 --lora_alpha=6 --lora_dropout=0.2: exactly the named projections of every block get
    an adapter, of rank 4, whose output (in eval mode, B set to ones) is the base layer's plus
    (6 / 4) x A^T B^T, the LoRA update at scale alpha / r (arXiv:2106.09685 §4.1), computed here by hand;
    only adapter weights train; the reference is the policy with adapters off (none is built). Without
    LoRA and with beta > 0 a frozen second copy is the reference; with beta = 0 none is built."""
    tok, ids, model = toy_model
    ckpt = tmp_path / "ckpt"
    hf.save_pretrained(model.float(), ckpt)
    tok.save(str(ckpt / "tokenizer.json"))
    cfg = parse(f"--init_from={ckpt}", "--tasks=text", "--lora_rank=4", "--lora_alpha=6", "--lora_dropout=0.2",
                f"--lora_targets={targets}")
    policy, ref, *_ = load_policy(cfg, CPU, torch.float32, train.sft)
    assert isinstance(ref, hf.AdaptersOff) and ref.policy is policy  # beta 0.01 > 0: the adapters-off policy
    adapted = {n.rsplit(".", 1)[0] for n, p in policy.named_parameters() if n.endswith(".lora_A")}
    want = {f"blocks.{i}.{m}" for i in range(len(policy.blocks)) for m in names}
    assert adapted == want
    assert {n for n, p in policy.named_parameters() if p.requires_grad} == \
        {f"{m}.lora_{x}" for m in want for x in "AB"}
    layer = policy.get_submodule(f"blocks.0.{sorted(names)[0]}")
    assert layer.lora_A.shape[0] == 4 and layer.lora_dropout == 0.2
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        layer.lora_B.fill_(1.0)
        got = layer.eval()(x)
        base = x @ layer.weight.T
        torch.testing.assert_close(got, base + 1.5 * (x @ layer.lora_A.T) @ layer.lora_B.T, rtol=1e-5, atol=1e-5)

    full, ref, *_ = load_policy(parse(f"--init_from={ckpt}", "--tasks=text", "--beta=0.3"), CPU, torch.float32,
                                      train.sft)
    assert ref is not full and not any(p.requires_grad for p in ref.parameters())
    assert load_policy(parse(f"--init_from={ckpt}", "--tasks=text", "--beta=0"), CPU, torch.float32,
                             train.sft)[1] is None


def test_benchmark_prompt_prefill_and_length():
    """A benchmark prompt is the chat template of the question, then --prompt_prefill (the official
    GSM8K evaluation opens the answer with "<reasoning>"), encoded and cut to its last --max_prompt_len
    tokens (the official code cuts from the left)."""
    seen = []

    class Tok:
        def encode(self, text, add_special_tokens=False):
            seen.append(text)
            return type("Enc", (), {"ids": list(range(100, 120))})()

    ids = tasks.token_ids(toy_world.build_tokenizer())
    cfg = parse("--prompt_prefill=<reasoning>", "--max_prompt_len=8")
    b = tasks.make_batch("gsm8k", [{"prompt": "Q?"}], Tok(), ids, cfg, CPU, with_targets=False)
    assert seen == ["<|startoftext|><|start_header_id|>user<|end_header_id|>\n\nQ?<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n<reasoning>"]
    assert b.prompt_len == 8 and b.x[0, :8].tolist() == list(range(112, 120))
    assert (b.x[0, 8:] == ids.mask).all() and b.window == cfg.gen_length
