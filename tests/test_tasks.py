"""Toy tasks, vocabulary and verifiers. Run: python -m pytest tests/test_tasks.py -q"""
import random

import pytest

import rewards
import tasks

from infra import toy
import re
from types import SimpleNamespace
import torch
from conftest import cpu_budget
from tasks import chat_prompt


@pytest.fixture(scope="module")
def tok():
    return toy.build_tokenizer()


def test_specials_resolved_and_distinct(tok):
    s = tasks.token_ids(tok)
    ids = [s.bos, s.eos, s.mask, s.t2i, s.soi, s.eoi, s.ipad]
    assert len(set(ids)) == len(ids)
    assert s.pad == s.eos and s.pad != s.mask
    assert s.image_token_offset == tok.get_vocab_size(with_added_tokens=True)
    assert s.vocab_size == s.image_token_offset + s.codebook_size
    assert tok.id_to_token(s.mask) == "<|mdm_mask|>" and tok.id_to_token(s.bos) == "<|startoftext|>"


def test_model_config_overrides_build_a_model_config(tok):
    from model import ModelConfig
    cfg = ModelConfig(**tasks.model_config_overrides(tok))
    assert cfg.image_token_offset + cfg.codebook_size == cfg.vocab_size


def test_text_round_trip_and_no_unknown_tokens(tok):
    rng, unk = random.Random(0), tok.token_to_id(toy.UNK)
    for _ in range(500):
        ex = toy.make_text_example(rng, noise=0.5, max_value=20, max_steps=3)
        for text in (ex["prompt"], ex["completion"], ex["prompt"] + " " + ex["completion"]):
            ids = tok.encode(text, add_special_tokens=False).ids
            assert unk not in ids
            assert tok.decode(ids) == text
        prompt, completion = tasks.encode_text(tok, tasks.token_ids(tok), ex, 40)
        assert len(completion) == 40 and completion[-1] == tasks.token_ids(tok).eos
        assert tok.decode(completion, skip_special_tokens=True) == ex["completion"]
        assert tok.decode(prompt, skip_special_tokens=True) == ex["prompt"]


def test_boxed_answer_tokens_are_separate(tok):
    assert tok.encode("7 . \\boxed{12}").tokens == ["▁7", "▁.", "▁\\boxed{", "1", "2", "}"]


def test_image_prompt_round_trip(tok):
    rng, unk = random.Random(0), tok.token_to_id(toy.UNK)
    for _ in range(300):
        p = toy.make_image_example(rng)["prompt"]
        ids = tok.encode(p, add_special_tokens=False).ids
        assert unk not in ids and tok.decode(ids) == p


def test_text_reward():
    ex = toy.make_text_example(random.Random(3))
    assert rewards.answer_reward(ex["completion"], ex) == 1.0
    wrong = str(int(ex["answer"]) + 1)
    assert rewards.answer_reward(f"1 + 1 = 2 . \\boxed{{{wrong}}}", ex) == 0.0
    assert rewards.answer_reward(ex["answer"], ex) == 0.0  # no box
    assert rewards.answer_reward(f"\\boxed{{{wrong}}} \\boxed{{{ex['answer']}}}", ex) == 1.0  # last box counts


@pytest.mark.parametrize("noise", [0.0, 1.0])
def test_text_noise_controls_wrong_targets(noise):
    rng = random.Random(1)
    exs = [toy.make_text_example(rng, noise=noise) for _ in range(300)]
    acc = sum(rewards.answer_reward(e["completion"], e) for e in exs) / len(exs)
    assert acc == 1.0 - noise  # every noisy target is wrong, every clean one right


def test_image_reward_target_and_corruptions():
    for seed in range(300):  # the same draws with noise 0 and 1: the same spec, a clean and a corrupted grid
        ex, noisy = (toy.make_image_example(random.Random(seed), noise=noise) for noise in (0.0, 1.0))
        spec, img = ex["spec"], ex["image"]
        assert noisy["spec"] == spec and noisy["prompt"] == ex["prompt"]
        assert rewards.image_reward(img, {'spec': spec}) == 1.0
        assert rewards.image_reward([0] * len(img), {'spec': spec}) == 0.0
        assert rewards.image_reward(noisy["image"], {'spec': spec}) < 1.0
        assert rewards.image_reward(img[:-1], {'spec': spec}) == 0.0  # wrong size


def test_image_reward_examples():
    spec = {"width": 2, "counts": {"red": 1}, "relation": None, "place": None}
    assert rewards.image_reward([1, 0, 0, 0], {'spec': spec}) == 1.0
    assert rewards.image_reward([1, 1, 0, 0], {'spec': spec}) == 0.5
    assert rewards.image_reward([1, 2, 0, 0], {'spec': spec}) == 0.5
    rel = {"width": 2, "counts": {"red": 1, "blue": 1}, "relation": ["red", "left of", "blue"], "place": None}
    assert rewards.image_reward([1, 3, 0, 0], {'spec': rel}) == 1.0
    assert rewards.image_reward([3, 1, 0, 0], {'spec': rel}) == 0.75
    top = {"width": 2, "counts": {"red": 1}, "relation": None, "place": ["red", "bottom row"]}
    assert rewards.image_reward([0, 0, 0, 1], {'spec': top}) == 1.0 and rewards.image_reward([1, 0, 0, 0], {'spec': top}) == 2 / 3


def test_image_ids_map_to_codes(tok):
    """decode_window reads an image window's token ids as codes: code c is token id offset + c."""
    s = tasks.token_ids(tok)
    codes = list(range(s.codebook_size))
    x = torch.tensor([[s.soi] + [s.image_token_offset + c for c in codes] + [s.eoi]])
    assert tasks.decode_window(tasks.Batch("image", x, torch.ones_like(x), 1, len(codes)), tok, s) == [codes]


def test_encode_image_prompt_layout(tok):
    s = tasks.token_ids(tok)
    ids, start, att = tasks.encode_image_prompt(tok, tasks.token_ids(tok), "two red blocks", 12, 16)
    caption = tok.encode("two red blocks", add_special_tokens=False).ids
    pad = 12 - (len(caption) + 3)
    assert ids == [s.ipad] * pad + [s.t2i, s.bos] + caption + [s.eos, s.soi] + [s.mask] * 16 + [s.eoi]
    assert start == 13 and att == [0] * pad + [1] * (len(ids) - pad)
    uncond, ustart, _ = tasks.encode_image_prompt(tok, tasks.token_ids(tok), "", 12, 16)
    assert uncond[:13] == [s.ipad] * 9 + [s.t2i, s.bos, s.eos, s.soi] and ustart == start
    long, _, _ = tasks.encode_image_prompt(tok, tasks.token_ids(tok), "a red block left of a blue block", 6, 4)
    assert long[5] == s.eos and len(long) == 6 + 4 + 2  # truncated and re-terminated


def test_render_image():
    out = toy.render_image([0, 1, 2, 3], 2)
    assert out.count("\n") == 1 and out.count("\x1b[48;5;") == 4


def test_determinism():
    a = [toy.make_text_example(random.Random(7), noise=0.3) for _ in range(2)]
    b = [toy.make_image_example(random.Random(7), noise=0.3) for _ in range(2)]
    assert a[0] == a[1] and b[0] == b[1]


def test_heldout_split_disjoint():
    rng = random.Random(0)
    train = {toy.make_text_example(rng, "train")["prompt"] for _ in range(2000)}
    test = {toy.make_text_example(rng, "test")["prompt"] for _ in range(500)}
    assert train and test and not train & test
    itrain = {toy.make_image_example(rng, "train")["prompt"] for _ in range(2000)}
    itest = {toy.make_image_example(rng, "test")["prompt"] for _ in range(500)}
    assert itrain and itest and not itrain & itest
    with pytest.raises(ValueError):
        toy.make_text_example(rng, "valid")


def test_docstring_examples(tok):
    ex = toy.make_text_example(random.Random(0))
    assert ex["completion"] == "1 - 1 = 0 , 0 + 6 = 6 . \\boxed{6}" and ex["answer"] == "6"
    assert toy.make_image_example(random.Random(1))["prompt"] == "three purple blocks"
    assert tok.encode("ann has 3 apples").tokens == ["▁ann", "▁has", "▁3", "▁apples"]
    assert tasks.image_text_len(tok) == tasks.TOY_CAPTION_LEN == 11


# The default toy's text data, pinned: the `toy` preset (text_max_steps 1, text_noise 0.4) must keep drawing
# exactly these examples, so that its runs reproduce. A digest of 500 draws per setting, plus the first two.
DEFAULT_TEXT_DATA = [
    # (max_steps, noise, split): sha1 of the JSON of 500 draws from random.Random(0), first 16 hex digits
    ((1, 0.4, "train"), "3c358dc5def4ed5a"),
    ((1, 0.0, "test"), "4cef12d3ce7081e1"),
    ((2, 0.4, "train"), "f0be1e6a3ec27208"),
    ((2, 0.0, "any"), "da7739b8e03597b9"),
]


def _text_draws(max_steps, noise, split, n=500):
    rng = random.Random(0)
    return [toy.make_text_example(rng, split, noise, max_steps=max_steps) for _ in range(n)]


@pytest.mark.parametrize("args,digest", DEFAULT_TEXT_DATA)
def test_default_text_data_unchanged(args, digest):
    import hashlib
    import json
    # The fields the default toy trains and scores on; `solution` (the long toy's verifier) is left out.
    draws = [{k: ex[k] for k in ("prompt", "answer", "completion")} for ex in _text_draws(*args)]
    assert hashlib.sha1(json.dumps(draws).encode()).hexdigest()[:16] == digest


def test_default_text_data_first_examples():
    assert _text_draws(1, 0.4, "train", 2) == [
        {"prompt": "sue has 1 shells . she loses 1 . how many shells does she have ?", "answer": "0",
         "completion": "1 - 1 = 0 . \\boxed{0}", "solution": "1 - 1 = 0 . \\boxed{0}"},
        {"prompt": "sam has 9 cards . he gives 3 away . how many cards does he have ?", "answer": "6",
         "completion": "9 - 3 = 6 . \\boxed{6}", "solution": "9 - 3 = 6 . \\boxed{6}"}]
    assert _text_draws(1, 0.0, "test", 2)[1] == {
        "prompt": "ann has 7 eggs . she finds 2 more . how many eggs does she have ?", "answer": "9",
        "completion": "7 + 2 = 9 . \\boxed{9}", "solution": "7 + 2 = 9 . \\boxed{9}"}
    assert _text_draws(2, 0.4, "train", 2)[1] == {
        "prompt": "bob has 2 coins . he sells 2 . how many coins does he have ?", "answer": "0",
        "completion": "2 - 2 = 0 . \\boxed{2}",  # a noisy target: the box holds the amount before the step
        "solution": "2 - 2 = 0 . \\boxed{0}"}  # what the long toy's verifier compares with


def test_solution_reward_reads_every_step_and_the_box():
    ex = {"prompt": "amy has 4 pens . she buys 3 more and sells 5 . how many pens does she have ?", "answer": "2",
          "solution": "4 + 3 = 7 , 7 - 5 = 2 . \\boxed{2}"}
    right = "4 + 3 = 7 , 7 - 5 = 2 . \\boxed{2}"
    assert rewards.solution_reward(right, ex) == 1.0 and rewards.answer_reward(right, ex) == 1.0
    for wrong in ("4 + 3 = 8 , 8 - 5 = 2 . \\boxed{2}",  # wrong working, right box: the box-only reward pays
                  "4 + 3 = 7 , 7 - 5 = 2 . \\boxed{7}",  # right working, the amount before the last step boxed
                  "4 + 3 = 7 . \\boxed{2}",                # a step left out
                  "4 + 3 = 7 , 7 - 5 = 2 . \\boxed{2} 3"):  # text after the box
        assert rewards.solution_reward(wrong, ex) == 0.0
    assert rewards.answer_reward("4 + 3 = 8 , 8 - 5 = 2 . \\boxed{2}", ex) == 1.0
    # The scorer picks the verifier by name; the toy runs' decoded completions have no leading/trailing space.
    assert tasks.TASKS["text"].reward == {"answer": rewards.answer_reward, "solution": rewards.solution_reward}
    assert tasks.TEXT_REWARDS == ("answer", "solution")


def test_long_toy_is_scored_by_its_solution():
    import train
    assert train.PRESETS["toy_long"]["text_reward"] == "solution" and train.Config().text_reward == "answer"


def _steps_of(completion):
    work = completion.split(" . ")[0]
    return [s.split() for s in work.split(" , ")]  # each: [a, op, n, "=", r]


def test_long_examples_chain_and_length(tok):
    rng = random.Random(2)
    counts = set()
    for _ in range(400):
        ex = toy.make_text_example(rng, noise=0.0, max_steps=6)
        steps = _steps_of(ex["completion"])
        counts.add(len(steps))
        for k, (a, op, n, eq, r) in enumerate(steps):
            assert eq == "=" and int(r) == (int(a) + int(n) if op == "+" else int(a) - int(n))
            assert 0 <= int(r) <= 9 and (k == 0 or a == steps[k - 1][4])  # each step starts from the last result
        assert steps[-1][4] == ex["answer"] and rewards.answer_reward(ex["completion"], ex) == 1.0
        n_tok = len(tok.encode(ex["completion"], add_special_tokens=False).ids)
        assert n_tok == 6 * len(steps) + 3 and n_tok >= 32  # 5 per step, a comma between, ". \boxed{ d }"
    assert counts == {5, 6}  # max_steps - 1 or max_steps


def test_toy_long_preset_is_long_and_fits(tok):
    import train
    from infra.cli import validate
    cfg = train.Config(**train.PRESETS["toy_long"])
    validate(cfg)
    rng = random.Random(0)
    longest = max(len(tok.encode(toy.make_text_example(rng, "any", 0.5, 9, cfg.text_max_steps)["completion"],
                                 add_special_tokens=False).ids) for _ in range(2000))
    # 4 steps at most: 6 * 4 + 3 = 27 tokens, in a window of at least 32 decoded tokens (EOS padding after)
    assert cfg.tasks == "text" and longest == 27 and cfg.gen_length >= 32
    assert cfg.gen_length // cfg.block_length >= 4 and cfg.steps == cfg.gen_length  # one token per step, 4+ blocks


# -----------------------------------------------------------------------------
# tasks.py's generators and batch layouts at non-default settings, checked by re-deriving what each example
# says (the arithmetic from the written working, the grid from the spec) rather than by calling the generator.
#
#     python -m pytest tests/test_tasks.py -q


@pytest.mark.parametrize("max_value, max_steps", [(20, 4), (9, 1), (3, 3)])
def test_text_examples_at_other_sizes(max_value, max_steps):
    """max_steps - 1 or max_steps steps (at least one), each `a op n = r` true, chained, within [0, max_value],
    starting from the prompt's amount, the box holding the last result (noise 0) or the amount before the last
    step (noise 1); `answer` is always the true result."""
    rng = random.Random(7)
    seen_counts = set()
    for noise in (0.0, 1.0):
        for _ in range(60):
            ex = toy.make_text_example(rng, split="any", noise=noise, max_value=max_value, max_steps=max_steps)
            steps = re.findall(r"(\d+) ([+-]) (\d+) = (\d+)", ex["solution"])
            seen_counts.add(len(steps))
            assert max(1, max_steps - 1) <= len(steps) <= max_steps
            amount = int(re.match(r"\w+ has (\d+) ", ex["prompt"]).group(1))
            for a, op, n, r in steps:
                a, n, r = int(a), int(n), int(r)
                assert a == amount and r == (a + n if op == "+" else a - n) and 0 <= r <= max_value and n >= 1
                amount = r
            assert ex["answer"] == str(amount) and ex["solution"].endswith(f"\\boxed{{{amount}}}")
            boxed = int(re.search(r"\\boxed\{(\d+)\}", ex["completion"]).group(1))
            assert boxed == (amount if noise == 0 else int(steps[-1][0]))
    assert seen_counts == {max(1, max_steps - 1), max_steps}


@pytest.mark.parametrize("width", [2, 5])
def test_image_examples_at_other_widths(width):
    """width x width codes; the target satisfies every check of its spec by the definition written here
    (counts of each named colour, no other colour); noise 1 breaks the first colour's count."""
    rng = random.Random(3)
    for noise in (0.0, 1.0):
        for _ in range(40):
            with cpu_budget(10.0):  # a spec that no grid satisfies would make the generator's rejection loop hang
                ex = toy.make_image_example(rng, split="any", noise=noise, width=width)
            spec, image = ex["spec"], ex["image"]
            assert spec["width"] == width and len(image) == width * width
            counts = {c: image.count(toy.COLOURS.index(c) + 1) for c in toy.COLOURS}
            right = all(counts[c] == n for c, n in spec["counts"].items()) and \
                {c for c, n in counts.items() if n} == set(spec["counts"])
            assert right == (noise == 0.0)
            assert (rewards.image_reward(image, {'spec': spec}) == 1.0) == right


def test_encode_text_refuses_a_short_window(tok):
    ex = toy.make_text_example(random.Random(0), max_steps=4)
    with pytest.raises(ValueError, match=r"completion needs \d+ tokens \+ 1 EOS but gen_length is 5"):
        tasks.encode_text(tok, tasks.token_ids(tok), ex, 5)


def test_image_prompt_truncation_and_missing_markers(tok):
    """A caption longer than text_len is cut and re-terminated with EOS; a tokenizer without MMaDA's markers
    is refused by name."""
    ids = tasks.token_ids(tok)
    out, start, att = tasks.encode_image_prompt(tok, tasks.token_ids(tok), "a red block and a green block", 5, 4)
    assert start == 6 and len(out) == 5 + 1 + 4 + 1 and att == [1] * 11
    assert out[:2] == [ids.t2i, ids.bos] and out[4] == ids.eos and out[5] == ids.soi and out[-1] == ids.eoi
    assert out[2:4] == tok.encode("a red", add_special_tokens=False).ids
    no_markers = tasks.TokenIds(bos=0, eos=1, pad=1, mask=7, vocab_size=8)
    with pytest.raises(ValueError, match="lacks MMaDA's"):
        tasks.encode_image_prompt(tok, no_markers, "a red block", 8, 4)
    from tokenizers import Tokenizer, models
    with pytest.raises(ValueError, match="tokenizer has no '<\\|startoftext\\|>'"):
        tasks.token_ids(Tokenizer(models.WordLevel({"a": 0}, unk_token="a")))


def test_codes_outside_the_codebook_and_render(tok):
    assert toy.render_image([0, 99, -1, 1], 2).splitlines()[1] == "??\x1b[48;5;196m  \x1b[0m"


def cfg(**kw):
    base = dict(gen_length=6, system_prompt="", prompt_prefill="", max_prompt_len=10_000, attend_padding="auto",
                image_width=3, image_text_len=0, seed=0, text_max_steps=2, prompts_per_step=2, eval_prompts=2)
    return SimpleNamespace(**{**base, **kw})


def test_benchmark_batch_system_prompt_prefill_and_cut(tok):
    """system_prompt becomes a system turn, prompt_prefill opens the answer, max_prompt_len keeps the last
    tokens; prompts are left-padded with the pad id and masked (attend_padding auto for a text task)."""
    ids = tasks.token_ids(tok)
    exs = [{"prompt": "how many pens"}, {"prompt": "bob has 3 pens . how many pens does he have"}]
    c = cfg(system_prompt="ann has", prompt_prefill="3 +")
    b = tasks.make_batch("gsm8k", exs, tok, ids, c, "cpu", with_targets=False)
    want = [tok.encode(chat_prompt([{"role": "system", "content": "ann has"}, {"role": "user", "content": e["prompt"]}])
                       + "3 +", add_special_tokens=False).ids for e in exs]
    P = max(map(len, want))
    assert b.prompt_len == P and b.window == 6 and b.vocab_slice is None  # text: scored over the whole vocabulary
    for row, w, am in zip(b.x.tolist(), want, b.attention_mask.tolist()):
        pad = P - len(w)
        assert row == [ids.pad] * pad + w + [ids.mask] * 6 and am == [0] * pad + [1] * (len(w) + 6)
    cut = tasks.make_batch("gsm8k", exs, tok, ids, cfg(max_prompt_len=4), "cpu", with_targets=False)
    plain = tok.encode(chat_prompt([{"role": "user", "content": exs[1]["prompt"]}]), add_special_tokens=False).ids
    assert cut.prompt_len == 4 and cut.x[1, :4].tolist() == plain[-4:]
    on = tasks.make_batch("gsm8k", exs, tok, ids, cfg(attend_padding="on"), "cpu", with_targets=False)
    assert (on.attention_mask == 1).all()


def test_image_batch_width_text_len_and_padding(tok):
    """image_width sets the slots, image_text_len the caption part; attend_padding "on" unmasks both the
    prompt and CFG's unconditional prompt; "auto" masks them for the toy image task."""
    ids = tasks.token_ids(tok)
    ex = toy.make_image_example(random.Random(0), width=3)
    b = tasks.make_batch("image", [ex, ex], tok, ids, cfg(image_width=3, image_text_len=12), "cpu", with_targets=True)
    assert b.prompt_len == 13 and b.window == 9 and b.x.shape == (2, 13 + 9 + 1)
    assert b.x[0, 13:22].tolist() == [ids.image_token_offset + c for c in ex["image"]]
    assert (b.attention_mask[:, 0] == 0).all() and (b.uncond_mask[:, 0] == 0).all()
    on = tasks.make_batch("image", [ex], tok, ids, cfg(image_width=3, image_text_len=12, attend_padding="on"), "cpu",
                          with_targets=False)
    assert (on.attention_mask == 1).all() and (on.uncond_mask == 1).all() and (on.x[0, 13:22] == ids.mask).all()
    assert b.vocab_slice == (ids.image_token_offset, ids.image_token_offset + toy.CODEBOOK_SIZE)  # the code columns
    half = b.rows(slice(1, 2))
    assert half.x.shape[0] == 1 and half.examples == [ex] and torch.equal(half.uncond, b.uncond[1:2])
    assert half.vocab_slice == b.vocab_slice
