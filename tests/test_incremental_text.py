"""The server's streamed text (`protocol.IncrementalText`): the same text as decoding the whole
output at once, cut where the first stop string begins, in time linear in the output."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from dresd.models.target import ensure_default_model
from dresd.serve import protocol

SAMPLES = ["Drachen 🐉 fliegen über Zürich, 東京 too.", "def f(a, b):\n    return a + b\n",
           "one two three four five six", "### Answer: 42 ✓ done — ok?"]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ensure_default_model())


def stream(tokenizer, ids: list[int], stop: list[str], rng: random.Random) -> tuple[str, bool]:
    """The text IncrementalText sends for `ids` arriving in random-sized steps."""
    pieces = protocol.IncrementalText(tokenizer, stop)
    sent, at = [], 0
    while at < len(ids):
        step = rng.randint(1, 4)
        sent.append(pieces.add(ids[at:at + step]))
        at += step
    sent.append(pieces.finish())
    assert pieces.text == "".join(sent)
    return "".join(sent), pieces.stopped


def whole_text(tokenizer, ids: list[int], stop: list[str]) -> tuple[str, bool]:
    """What the stream must come to: the output decoded whole, cut where a stop string begins
    in the first prefix of tokens whose text holds one (where generation stops)."""
    for end in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:end], skip_special_tokens=True)
        cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
        if cuts:
            return text[:min(cuts)], True
    return tokenizer.decode(ids, skip_special_tokens=True), False


def test_streamed_text_is_the_whole_decode_cut_at_the_first_stop_found(tokenizer):
    rng = random.Random(0)
    cases = 0
    for trial in range(300):
        if trial % 2:  # real text, with stop strings taken from inside it (and beyond it)
            text = rng.choice(SAMPLES)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            stop = [text[i:i + rng.randint(1, 6)] for i in rng.sample(range(len(text)), 2)]
        else:  # random tokens: byte-level pieces of characters, special tokens, anything
            ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 60))]
            stop = rng.sample(["e", "the", "\n", "🐉", "zz", " a"], rng.randint(0, 2))
        assert stream(tokenizer, ids, stop, rng) == whole_text(tokenizer, ids, stop), (ids, stop)
        cases += 1
    assert cases == 300


def test_streaming_decodes_each_token_a_bounded_number_of_times(tokenizer):
    """Linear, not quadratic: a 3,000-token output decodes each token a few times at most
    (the old stream decoded all of it again at every step: 4.5 million token decodes)."""
    decoded = []

    class Counting:
        def decode(self, ids, **kwargs):
            decoded.append(len(ids))
            return tokenizer.decode(ids, **kwargs)

    ids = tokenizer(" ".join(SAMPLES) * 40, add_special_tokens=False)["input_ids"][:3000]
    pieces = protocol.IncrementalText(Counting(), stop=["never there", "nor this"])
    for token in ids:
        pieces.add([token])
    pieces.finish()
    assert sum(decoded) <= 12 * len(ids), sum(decoded) / len(ids)
    assert pieces.text == tokenizer.decode(ids, skip_special_tokens=True)
