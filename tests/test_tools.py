"""The command lines of tools/ and infra/ at non-default options: tools/sample.py's flags reach the samplers as given
(and a checkpoint's generation.json fills the rest), tools.bench's tables and argument checks, infra.data's
file check, the stub scorer's refusal of a mismatched request.

    python -m pytest tests/test_tools.py -q
"""
import json
import re
import urllib.error
import urllib.request

import pytest
import torch

import rewards
import sample
import tasks
from conftest import ROOT
from infra import data, hf, toy
from tools import bench
from tools import sample as sample_cli
from tools import stub_scorer
from model import ModelConfig, Transformer
from tasks import chat_prompt


@pytest.fixture(scope="module")
def toy_ckpt(tmp_path_factory):
    """A one-layer model on the toy vocabulary (text and image ids), with its tokenizer."""
    path = tmp_path_factory.mktemp("toy")
    tok = toy.build_tokenizer()
    cfg = ModelConfig(d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, mlp_hidden_size=32, max_sequence_length=64,
                      **tasks.model_config_overrides(tok))
    hf.save_pretrained(Transformer(cfg).init_weights(torch.Generator().manual_seed(0)), path)
    tok.save(str(path / "tokenizer.json"))
    return path, tok


@pytest.fixture
def spy(monkeypatch):
    calls = []

    def text(model, prompt, **kw):
        calls.append(dict(kw, prompt=prompt.clone(), seed=kw["generator"].initial_seed()))
        return torch.cat([prompt, prompt.new_full((1, kw["gen_length"]), 5)], 1)

    def image(model, ids, **kw):
        calls.append(dict(kw, ids=ids.clone(), seed=kw["generator"].initial_seed()))
        out = ids.clone()
        out[:, kw["image_start"]:kw["image_start"] + kw["num_tokens"]] = kw["code_offset"] + 2
        return out
    monkeypatch.setattr(sample, "fast_generate", text)
    monkeypatch.setattr(sample, "generate_image", image)
    return calls


def test_text_flags_reach_the_sampler(toy_ckpt, spy, capsys):
    path, tok = toy_ckpt
    sample_cli.main(["--ckpt", str(path), "--prompt", "bob has 3 pens", "--gen_length", "8", "--block_length", "4",
                     "--steps", "4", "--temperature", "0.7", "--seed", "3", "--kv_cache", "dual", "--threshold", "0.5",
                     "--prompt_format", "raw"])
    (kw,) = spy
    assert (kw["gen_length"], kw["block_length"], kw["steps"], kw["temperature"], kw["kv_cache"], kw["threshold"]) == \
        (8, 4, 4, 0.7, "dual", 0.5)
    assert kw["seed"] == 3 and kw["mask_id"] == tasks.token_ids(tok).mask
    assert kw["prompt"][0].tolist() == tok.encode("bob has 3 pens", add_special_tokens=False).ids  # raw: no BOS
    assert capsys.readouterr().out.strip() == tok.decode([5] * 8, skip_special_tokens=True)


@pytest.mark.parametrize("fmt", ["toy", "chat"])
def test_prompt_formats(toy_ckpt, spy, fmt):
    path, tok = toy_ckpt
    sample_cli.main(["--ckpt", str(path), "--prompt", "bob has 3 pens", "--gen_length", "8", "--block_length", "8",
                     "--steps", "8", "--prompt_format", fmt, "--prompt_prefill", "3 +"])
    got = spy[0]["prompt"][0].tolist()
    if fmt == "toy":  # BOS + the question, as train.py's toy text task; the prefill is a chat-format option
        assert got == [tasks.token_ids(tok).bos] + tok.encode("bob has 3 pens", add_special_tokens=False).ids
    else:
        text = chat_prompt([{"role": "user", "content": "bob has 3 pens"}]) + "3 +"
        assert got == tok.encode(text, add_special_tokens=False).ids


def test_generation_json_fills_unset_flags(toy_ckpt, spy, tmp_path):
    """A train.py checkpoint's generation.json sets the defaults (its temperature excepted: sampling stays
    greedy unless asked) and the toy prompt format; a flag still wins."""
    path, tok = toy_ckpt
    (path / "generation.json").write_text(json.dumps({"tasks": "text", "gen_length": 12, "block_length": 4, "steps": 6,
                                                      "temperature": 0.9, "kv_cache": "prefix"}))
    try:
        sample_cli.main(["--ckpt", str(path), "--prompt", "bob has 3 pens", "--steps", "12"])
    finally:
        (path / "generation.json").unlink()
    kw = spy[0]
    assert (kw["gen_length"], kw["block_length"], kw["steps"], kw["temperature"], kw["kv_cache"]) == \
        (12, 4, 12, 0.0, "prefix")
    assert kw["prompt"][0, 0] == tasks.token_ids(tok).bos


def test_image_flags_reach_the_sampler(toy_ckpt, spy, tmp_path, capsys):
    path, tok = toy_ckpt
    sample_cli.main(["--ckpt", str(path), "--image", "--prompt", "two red blocks", "--image_sampler", "maskgit",
                     "--image_steps", "5", "--cfg_scale", "2.5", "--image_width", "3", "--image_text_len", "10",
                     "--seed", "4"])
    kw = spy[0]
    ids = tasks.token_ids(tok)
    assert (kw["sampler"], kw["steps"], kw["cfg_scale"], kw["num_tokens"], kw["image_start"], kw["seed"]) == \
        ("maskgit", 5, 2.5, 9, 11, 4)
    assert (kw["code_offset"], kw["codebook_size"], kw["mask_id"]) == (ids.image_token_offset, toy.CODEBOOK_SIZE, ids.mask)
    want, _, att = tasks.encode_image_prompt(tok, tasks.token_ids(tok), "two red blocks", 10, 9)
    assert kw["ids"][0].tolist() == want and kw["attention_mask"][0].tolist() == att
    assert kw["uncond_input_ids"][0].tolist() == tasks.encode_image_prompt(tok, tasks.token_ids(tok), "", 10, 9)[0]
    assert len(capsys.readouterr().out.strip().splitlines()) == 3  # a 3 x 3 picture


@pytest.mark.parametrize("flags, match", [
    (["--prompt_format", "yaml"], "prompt_format .*'yaml'.* must be one of auto, toy, chat, raw"),
    (["--png", "x.png"], "draws an image sample: add --image"),
    (["--image", "--png", "/nonexistent-dir/x.png"], "the directory /nonexistent-dir does not exist"),
    (["--gen_length", "64", "--block_length", "8", "--steps", "64", "--prompt", "bob " * 10],
     r"the prompt is \d+ tokens and --gen_length=64: .* > the model's max_sequence_length 64"),
    (["--prompt", "   "], "only whitespace"),
])
def test_sample_cli_refusals(toy_ckpt, spy, flags, match):
    path, _ = toy_ckpt
    args = ["--ckpt", str(path), "--prompt", "bob"] + flags
    with pytest.raises(ValueError, match=match):
        sample_cli.main(args)
    assert not spy


def test_sample_cli_run_exits_2(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["tools/sample.py", "--prompt", "x"])
    with pytest.raises(SystemExit) as e:
        sample_cli.run()
    assert e.value.code == 2 and "--ckpt is missing" in capsys.readouterr().err


# -----------------------------------------------------------------------------------------------------
# tools.bench, infra.data, the stub scorer


def test_bench_table_agrees_with_the_public_loop(capsys):
    """On a toy-shaped random model: the exact rows give LLaDA generate()'s tokens (100% agreement), every
    row counts its forward passes (one per step without a threshold), the prompt is untouched."""
    model, prompts, mask = bench.random_model(150, 64, 2, 4, 16.0)
    bench.bench("toy", model, prompts[:2], mask[:2], (32, 32, 8), 1, bench.CONFIGS)
    rows = {r[2].strip(): r for r in (line.split("|") for line in capsys.readouterr().out.splitlines())}
    assert len(rows) == len(bench.CONFIGS)
    for name in ("LLaDA generate()", "exact, full head", "exact"):
        assert rows[name][7].strip() == "100.0%", rows[name]
    for name in ("LLaDA generate()", "exact", "prefix", "dual"):
        assert int(rows[name][3]) == 8


@pytest.mark.parametrize("argv, match", [(["--reps", "0"], "--reps must be >= 1"),
                                         (["--gen_length", "48"], "positive multiple of the block length 32"),
                                         (["--sandbox", "--programs", "0"], "--programs must be >= 1"),
                                         (["--preset", "toy_long"], "--preset toy_long chooses the prompts of --ckpt"),
                                         (["--ckpt", "x", "--preset", "llada8b"], "argument --preset: invalid choice")])
def test_bench_refuses(argv, match):
    with pytest.raises(ValueError, match=match):
        bench.main(argv)


def test_bench_sandbox(capsys):
    bench.bench_sandbox(2, loop_timeout=0.5)
    out = capsys.readouterr().out
    assert re.search(r"2 programs, 6 tests in", out) and "endless loop, timeout 0.5s: reward 0.0" in out


def test_data_check_command(capsys):
    rows = data.main(["gsm8k", str(ROOT / "tests" / "fixtures" / "data" / "gsm8k.jsonl")])
    assert capsys.readouterr().out.startswith(f"{len(rows)} valid gsm8k examples; the first prompt:")
    with pytest.raises(ValueError, match="usage: python -m infra.data TASK PATH"):
        data.main(["gsm8k"])


def test_stub_scorer_refuses_prompts_and_images_of_different_counts():
    server = stub_scorer.serve_stub()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        body = json.dumps({"prompts": ["a", "b"], "image_codes": [[1]]}).encode()
        request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with pytest.raises(urllib.error.HTTPError) as e:
            opener.open(request, timeout=10)
        assert e.value.code == 400 and "2 prompts but 1 images" in e.value.read().decode()
    finally:
        server.shutdown()
        server.server_close()


def test_bench_on_a_checkpoint(toy_ckpt, capsys):
    """--ckpt: held-out toy prompts at the checkpoint's toy settings and 4x longer, with a reward column."""
    path, _ = toy_ckpt
    bench.main(["--ckpt", str(path), "--prompts", "2", "--threads", "1"])
    out = capsys.readouterr().out
    tables = re.findall(r"2 toy text prompts \(\d+ tokens, left-padded\), gen (\d+), block (\d+), steps (\d+)", out)
    assert len(tables) == 2 and int(tables[1][0]) == 4 * int(tables[0][0]) and int(tables[1][2]) == 4 * int(tables[0][2])
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| ckpt")]
    assert len(rows) == 2 * len(bench.CONFIGS) and all(0 <= float(r[9]) <= 1 for r in rows)
    for r in rows:
        if r[2].strip() in ("exact, full head", "exact"):
            assert r[7].strip() == "100.0%"


def test_image_needs_image_tokens_matplotlib_warns_of_a_cut_caption(toy_ckpt, spy, tmp_path, monkeypatch, capsys):
    path, tok = toy_ckpt
    text_only = tmp_path / "text"
    hf.save_pretrained(Transformer(ModelConfig(d_model=32, n_layers=1, n_heads=4, n_kv_heads=4, mlp_hidden_size=32,
                                               vocab_size=len(tok.get_vocab()), mask_token_id=7)), text_only)
    tok.save(str(text_only / "tokenizer.json"))
    with pytest.raises(ValueError, match="has no image tokens"):
        sample_cli.main(["--ckpt", str(text_only), "--image", "--prompt", "a red block"])
    monkeypatch.setattr(sample_cli.plots, "have_matplotlib", lambda: False)
    with pytest.raises(ValueError, match="needs matplotlib, which is not installed"):
        sample_cli.main(["--ckpt", str(path), "--image", "--prompt", "a red block", "--png", str(tmp_path / "x.png")])
    assert not spy
    sample_cli.main(["--ckpt", str(path), "--image", "--prompt", "a red block and a green block", "--image_text_len", "6"])
    assert "the caption is 7 tokens; only its first 3 fit the text part (--image_text_len=6)" in capsys.readouterr().err


def test_bench_on_a_checkpoint_with_the_long_toy(tmp_path, capsys, monkeypatch):
    """--preset toy_long: the long toy's prompts (3-4 steps of working), its lengths (32 tokens in blocks of
    8, one token per step, and 4x that) and its whole-solution reward, as train.py's toy_long preset says."""
    tok = toy.build_tokenizer()
    cfg = ModelConfig(d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, mlp_hidden_size=32, max_sequence_length=256,
                      **tasks.model_config_overrides(tok))
    hf.save_pretrained(Transformer(cfg).init_weights(torch.Generator().manual_seed(0)), tmp_path)
    tok.save(str(tmp_path / "tokenizer.json"))
    seen, score, make = [], tasks.score, tasks.make_example
    monkeypatch.setattr(tasks, "score", lambda b, verify, *a: seen.append(verify) or score(b, verify, *a))
    monkeypatch.setattr(tasks, "make_example", lambda t, rng, c, *a: seen.append(c.text_max_steps) or make(t, rng, c, *a))
    monkeypatch.setattr(bench, "CONFIGS", bench.CONFIGS[2:4])  # exact and one cache row keep it quick
    bench.main(["--ckpt", str(tmp_path), "--preset", "toy_long", "--prompts", "2", "--threads", "1"])
    out = capsys.readouterr().out
    tables = re.findall(r"2 toy text prompts \(\d+ tokens, left-padded\), gen (\d+), block (\d+), steps (\d+)", out)
    assert tables == [("32", "8", "32"), ("128", "8", "128")], tables
    assert seen[:2] == [4, 4] and set(seen[2:]) == {rewards.solution_reward}, seen
