"""tasks.py's generators and batch layouts at non-default settings, checked by re-deriving what each example
says (the arithmetic from the written working, the grid from the spec) rather than by calling the generator.

    python -m pytest tests/test_tasks_settings.py -q
"""
import random
import re
from types import SimpleNamespace

import pytest
import torch

import rewards
import tasks

from infra import toy
from conftest import cpu_budget
from tasks import chat_prompt


@pytest.fixture(scope="module")
def tok():
    return toy.build_tokenizer()


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
    off = tasks.token_ids(tok).image_token_offset
    assert tasks.ids_to_codes(tok, [off - 1, off, off + toy.CODEBOOK_SIZE - 1, off + toy.CODEBOOK_SIZE]) == \
        [-1, 0, toy.CODEBOOK_SIZE - 1, -1]
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
    assert b.prompt_len == P and b.window == 6
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
    assert tasks.vocab_slice("image", ids) == (ids.image_token_offset, ids.image_token_offset + toy.CODEBOOK_SIZE)
    assert tasks.vocab_slice("gsm8k", ids) is None
    half = b.rows(slice(1, 2))
    assert half.x.shape[0] == 1 and half.examples == [ex] and torch.equal(half.uncond, b.uncond[1:2])
