"""Toy tasks, vocabulary and verifiers. Run: python -m pytest tests/test_tasks.py -q"""
import random

import pytest

import tasks


@pytest.fixture(scope="module")
def tok():
    return tasks.build_tokenizer()


def test_specials_resolved_and_distinct(tok):
    s = tasks.specials(tok)
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
    rng, unk = random.Random(0), tok.token_to_id(tasks.UNK)
    for _ in range(500):
        ex = tasks.make_text_example(rng, noise=0.5, max_value=20, max_steps=3)
        for text in (ex["prompt"], ex["completion"], ex["prompt"] + " " + ex["completion"]):
            ids = tok.encode(text, add_special_tokens=False).ids
            assert unk not in ids
            assert tok.decode(ids) == text
        prompt, completion = tasks.encode_text(tok, ex, 40)
        assert len(completion) == 40 and completion[-1] == tasks.specials(tok).eos
        assert tok.decode(completion, skip_special_tokens=True) == ex["completion"]
        assert tok.decode(prompt, skip_special_tokens=True) == ex["prompt"]


def test_boxed_answer_tokens_are_separate(tok):
    assert tok.encode("7 . \\boxed{12}").tokens == ["▁7", "▁.", "▁\\boxed{", "1", "2", "}"]


def test_image_prompt_round_trip(tok):
    rng, unk = random.Random(0), tok.token_to_id(tasks.UNK)
    for _ in range(300):
        p = tasks.make_image_example(rng)["prompt"]
        ids = tok.encode(p, add_special_tokens=False).ids
        assert unk not in ids and tok.decode(ids) == p


def test_text_reward():
    ex = tasks.make_text_example(random.Random(3))
    assert tasks.text_reward(ex["completion"], ex) == 1.0
    wrong = str(int(ex["answer"]) + 1)
    assert tasks.text_reward(f"1 + 1 = 2 . \\boxed{{{wrong}}}", ex) == 0.0
    assert tasks.text_reward(ex["answer"], ex) == 0.0  # no box
    assert tasks.text_reward(f"\\boxed{{{wrong}}} \\boxed{{{ex['answer']}}}", ex) == 1.0  # last box counts


@pytest.mark.parametrize("noise", [0.0, 1.0])
def test_text_noise_controls_wrong_targets(noise):
    rng = random.Random(1)
    exs = [tasks.make_text_example(rng, noise=noise) for _ in range(300)]
    acc = sum(tasks.text_reward(e["completion"], e) for e in exs) / len(exs)
    assert acc == 1.0 - noise  # every noisy target is wrong, every clean one right


def test_image_reward_target_and_corruptions():
    rng = random.Random(0)
    for _ in range(300):
        ex = tasks.make_image_example(rng)
        spec, img = ex["spec"], ex["image"]
        assert tasks.image_reward(img, spec) == 1.0
        assert tasks.image_reward([0] * len(img), spec) == 0.0
        assert tasks.image_reward(tasks._corrupt(rng, img, spec), spec) < 1.0
        assert tasks.image_reward(img[:-1], spec) == 0.0  # wrong size


def test_image_reward_examples():
    spec = {"width": 2, "counts": {"red": 1}, "relation": None, "place": None}
    assert tasks.image_reward([1, 0, 0, 0], spec) == 1.0
    assert tasks.image_reward([1, 1, 0, 0], spec) == 0.5
    assert tasks.image_reward([1, 2, 0, 0], spec) == 0.5
    rel = {"width": 2, "counts": {"red": 1, "blue": 1}, "relation": ["red", "left of", "blue"], "place": None}
    assert tasks.image_reward([1, 3, 0, 0], rel) == 1.0
    assert tasks.image_reward([3, 1, 0, 0], rel) == 0.75
    top = {"width": 2, "counts": {"red": 1}, "relation": None, "place": ["red", "bottom row"]}
    assert tasks.image_reward([0, 0, 0, 1], top) == 1.0 and tasks.image_reward([1, 0, 0, 0], top) == 2 / 3


def test_image_codes_map_to_ids_and_back(tok):
    s = tasks.specials(tok)
    codes = list(range(s.codebook_size))
    ids = tasks.codes_to_ids(tok, codes)
    assert ids == [s.image_token_offset + c for c in codes]
    assert tasks.ids_to_codes(tok, ids) == codes
    assert tasks.ids_to_codes(tok, [s.mask]) == [-1]


def test_encode_image_prompt_layout(tok):
    s = tasks.specials(tok)
    ids, start, att = tasks.encode_image_prompt(tok, "two red blocks", 12, 16)
    caption = tok.encode("two red blocks", add_special_tokens=False).ids
    pad = 12 - (len(caption) + 3)
    assert ids == [s.ipad] * pad + [s.t2i, s.bos] + caption + [s.eos, s.soi] + [s.mask] * 16 + [s.eoi]
    assert start == 13 and att == [0] * pad + [1] * (len(ids) - pad)
    uncond, ustart, _ = tasks.encode_image_prompt(tok, "", 12, 16)
    assert uncond[:13] == [s.ipad] * 9 + [s.t2i, s.bos, s.eos, s.soi] and ustart == start
    long, _, _ = tasks.encode_image_prompt(tok, "a red block left of a blue block", 6, 4)
    assert long[5] == s.eos and len(long) == 6 + 4 + 2  # truncated and re-terminated


def test_render_image():
    out = tasks.render_image([0, 1, 2, 3], 2)
    assert out.count("\n") == 1 and out.count("\x1b[48;5;") == 4


def test_determinism():
    a = [tasks.make_text_example(random.Random(7), noise=0.3) for _ in range(2)]
    b = [tasks.make_image_example(random.Random(7), noise=0.3) for _ in range(2)]
    assert a[0] == a[1] and b[0] == b[1]


def test_heldout_split_disjoint():
    rng = random.Random(0)
    train = {tasks.make_text_example(rng, "train")["prompt"] for _ in range(2000)}
    test = {tasks.make_text_example(rng, "test")["prompt"] for _ in range(500)}
    assert train and test and not train & test
    itrain = {tasks.make_image_example(rng, "train")["prompt"] for _ in range(2000)}
    itest = {tasks.make_image_example(rng, "test")["prompt"] for _ in range(500)}
    assert itrain and itest and not itrain & itest
    with pytest.raises(ValueError):
        tasks.make_text_example(rng, "valid")


def test_docstring_examples(tok):
    ex = tasks.make_text_example(random.Random(0))
    assert ex["completion"] == "1 - 1 = 0 , 0 + 6 = 6 . \\boxed{6}" and ex["answer"] == "6"
    assert tasks.make_image_example(random.Random(1))["prompt"] == "three purple blocks"
    assert tok.encode("ann has 3 apples").tokens == ["▁ann", "▁has", "▁3", "▁apples"]
    assert tasks.image_text_len(tok) == 11
