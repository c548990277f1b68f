"""A grammar changes what is allowed, never what is chosen among the allowed: constrained
speculative output is token for token constrained plain decoding's (greedy), and draws the same
tokens as it for a seed (sampling), whatever the drafter proposes, batched or alone; the
grammar's forced tokens are drafted, so even `ar` takes fewer forwards than tokens."""

from __future__ import annotations

import json
from dataclasses import replace

import llguidance
import llguidance.hf
import numpy as np
import pytest
import torch
from drafters_for_tests import OracleDrafter, RandomTreeDrafter
from test_batch import run_batched
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from dresd.decoding import SamplingConfig
from dresd.decoding.batch import Request
from dresd.decoding.constraint import Grammar, GrammarError, ThinkTokens
from dresd.drafters import NoDrafter, PromptLookupDrafter, SuffixDrafter
from dresd.models.target import ensure_default_model

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["colour", "count", "ok"],
          "properties": {"colour": {"enum": ["red", "green", "blue"]},
                         "count": {"type": "integer"}, "ok": {"type": "boolean"}}}
GRAMMARS = [("json_schema", SCHEMA), ("json_object", None), ("regex", r"[a-z]{2,6}( [0-9]+)?"),
            ("choice", ["yes", "no", "maybe not"]),
            ("lark", 'start: "Answer: " ANSWER "."\nANSWER: /[0-9]{1,3}/')]
MAX_NEW = 40


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ensure_default_model())


@pytest.fixture(scope="module")
def model(tokenizer):
    """A 2-layer random Llama over the default tokenizer's vocabulary, in float64 (ties
    cannot flip between a tree row and a one-token step)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=None, pad_token_id=0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float64).eval()


def grammar(tokenizer, model, kind: str, spec) -> Grammar:
    return Grammar.compile(kind, spec, tokenizer, model.config.vocab_size)


def allowed(matcher, width: int) -> np.ndarray:
    """bool [width]: the tokens a fresh llguidance matcher allows next."""
    return np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8),
                         bitorder="little")[:width].astype(bool)


@torch.inference_mode()
def constrained_plain(model, tokenizer, compiled: Grammar, prompt: list[int]) -> list[int]:
    """The reference, written apart from the loop: one forward per token over the whole
    sequence, the logits masked by a fresh llguidance matcher, the argmax."""
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer), compiled.text)
    ids, out = list(prompt), []
    for _ in range(MAX_NEW):
        logits = model(torch.tensor([ids])).logits[0, -1].clone()
        logits[~torch.from_numpy(allowed(matcher, logits.shape[-1]))] = float("-inf")
        token = int(logits.argmax())
        out.append(token)
        ids.append(token)
        if token == tokenizer.eos_token_id:
            break
        assert matcher.consume_token(token)
        if matcher.is_stopped():  # the grammar allows only the end: the output ends here
            break
    return out


def drafters(index: int, prompt: list[int], reference: list[int], vocab: int):
    """Every kind of drafter: none, prompt lookup, suffix, random trees over the whole
    vocabulary (nearly all forbidden), and the answer itself with one token spoiled."""
    return [NoDrafter(), PromptLookupDrafter(num_drafts=3), SuffixDrafter(),
            RandomTreeDrafter(vocab, seed=index, max_drafts=4),
            OracleDrafter(len(prompt), reference, draft_len=8, corrupt=0.5, seed=index,
                          vocab_size=vocab)]


def prompts(tokenizer) -> list[list[int]]:
    texts = ["Give the answer as JSON:", "Reply in a word or two.", "{\"colour\": \"red\"",
             "Answer: 12. Answer: 7. Answer:"]
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


@pytest.mark.parametrize("kind,spec", GRAMMARS, ids=[g[0] for g in GRAMMARS])
def test_constrained_greedy_is_constrained_plain_decoding(model, tokenizer, kind, spec):
    compiled = grammar(tokenizer, model, kind, spec)
    eos = [tokenizer.eos_token_id]
    requests, references = [], []
    for index, prompt in enumerate(prompts(tokenizer)):
        reference = constrained_plain(model, tokenizer, compiled, prompt)
        for drafter in drafters(index, prompt, reference, model.config.vocab_size):
            requests.append(Request(prompt=prompt, drafter=drafter, max_new_tokens=MAX_NEW,
                                    eos_token_ids=eos, constraint=compiled.start()))
            references.append(reference)
    arrivals = np.random.default_rng(1).integers(0, 6, len(requests)).tolist()
    results = run_batched(model, requests, arrivals, max_batch_size=7)
    for request, result, reference in zip(requests, results, references, strict=True):
        assert result.token_ids == reference, type(request.drafter).__name__
    if kind == "json_schema":  # what finished is an object of the schema
        for result in results:
            if result.stop_reason == "eos":
                text = tokenizer.decode(result.token_ids, skip_special_tokens=True)
                value = json.loads(text)
                assert set(value) == {"colour", "count", "ok"}


def test_constrained_sampling_draws_what_plain_sampling_draws(model, tokenizer):
    """Each position's token is a sample of the masked distribution from the sequence's own
    seeded generator: with the same seed every drafter gives the same tokens as none."""
    compiled = grammar(tokenizer, model, "json_schema", SCHEMA)
    prompt = prompts(tokenizer)[0]
    for seed in range(6):
        sampling = SamplingConfig(temperature=1.3, top_p=0.95, seed=seed)
        requests = [Request(prompt=prompt, drafter=drafter, max_new_tokens=MAX_NEW,
                            sampling=sampling, eos_token_ids=[tokenizer.eos_token_id],
                            constraint=compiled.start())
                    for drafter in drafters(seed, prompt, [], model.config.vocab_size)[:4]]
        results = run_batched(model, requests, [0, 1, 2, 3], max_batch_size=4)
        assert all(result.token_ids == results[0].token_ids for result in results), seed
        assert compiled.start().allowed_prefix(results[0].token_ids) >= len(
            results[0].token_ids) - 1  # every token the grammar's (the last may be its EOS)


def test_forced_tokens_are_drafted_even_for_ar(model, tokenizer):
    """A schema of fixed keys: the keys are forced, verified as drafts, so `ar` under it
    emits more than one token per forward."""
    long_keys = {"type": "object", "additionalProperties": False,
                 "required": ["the_first_rather_long_key", "the_second_rather_long_key"],
                 "properties": {"the_first_rather_long_key": {"type": "boolean"},
                                "the_second_rather_long_key": {"type": "boolean"}}}
    compiled = grammar(tokenizer, model, "json_schema", long_keys)
    prompt = prompts(tokenizer)[0]
    reference = constrained_plain(model, tokenizer, compiled, prompt)
    result = run_batched(model, [Request(prompt=prompt, drafter=NoDrafter(),
                                         max_new_tokens=MAX_NEW,
                                         eos_token_ids=[tokenizer.eos_token_id],
                                         constraint=compiled.start())], [0], 1)[0]
    assert result.token_ids == reference
    assert result.num_target_forwards < len(result.token_ids) / 2


@pytest.mark.parametrize("kind,spec", [("json_schema", {"type": "nonsense"}),
                                       ("regex", "(unclosed"), ("choice", []),
                                       ("lark", "start: undefined_rule"), ("yaml", "a: b")])
def test_a_bad_grammar_is_one_clear_error(model, tokenizer, kind, spec):
    with pytest.raises(GrammarError):
        grammar(tokenizer, model, kind, spec)


def test_the_grammars_end_is_the_outputs_end(model, tokenizer):
    """A request whose stop tokens are not the grammar's end-of-text token (a chat that stops
    at <|im_end|> over a GGUF tokenizer whose EOS is <|endoftext|>) still ends where the
    grammar allows nothing more, for every drafter, instead of emitting end-of-text tokens up
    to max_new_tokens."""
    compiled = grammar(tokenizer, model, "choice", ["yes", "no", "maybe not"])
    prompt = prompts(tokenizer)[1]
    requests = [Request(prompt=prompt, drafter=drafter, max_new_tokens=MAX_NEW,
                        eos_token_ids=(), constraint=compiled.start())
                for drafter in drafters(0, prompt, [], model.config.vocab_size)[:4]]
    results = run_batched(model, requests, [0] * len(requests), max_batch_size=4)
    assert len({tuple(r.token_ids) for r in results}) == 1
    for result in results:
        assert result.stop_reason == "eos" and len(result.token_ids) < MAX_NEW
        assert tokenizer.decode(result.token_ids) in ("yes", "no", "maybe not")


@torch.inference_mode()
def plain_after_thinking(model, tokenizer, compiled: Grammar, prompt: list[int],
                         think: ThinkTokens) -> list[int]:
    """The reference for a model that thinks first, written apart from AfterThinking: free
    argmax inside the think block, the grammar's masked argmax from the token after its end
    (or from the first token, where the output opens no block)."""
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer), compiled.text)
    state = "thinking" if think.starts_inside else "open"
    ids, out = list(prompt), []
    for _ in range(MAX_NEW):
        logits = model(torch.tensor([ids])).logits[0, -1].clone()
        if state != "thinking":
            bits = allowed(matcher, logits.shape[-1])
            if state == "open":
                bits[think.start] = True
            logits[~torch.from_numpy(bits)] = float("-inf")
        token = int(logits.argmax())
        out.append(token)
        ids.append(token)
        if token == tokenizer.eos_token_id:
            break
        if state == "open" and token == think.start or state == "thinking":
            state = "answer" if state == "thinking" and token == think.end else "thinking"
            continue
        state = "answer"
        assert matcher.consume_token(token)
        if matcher.is_stopped():
            break
    return out


def test_a_grammar_after_thinking_holds_the_answer_alone(model, tokenizer):
    """A reasoning model's grammar applies from the end of its think block: free tokens inside
    it, the grammar's from the next one, for every drafter and batched as alone (drafts run
    across the block's end within one step). The random model stands in for one that thinks:
    its own unconstrained greedy tokens serve as the block's marks, so that it opens the
    block (or not) and closes it at a known place."""
    compiled = grammar(tokenizer, model, "json_schema", SCHEMA)
    eos = [tokenizer.eos_token_id]
    requests, references, thinks = [], [], []
    for index, prompt in enumerate(prompts(tokenizer)):
        free = constrained_plain(model, tokenizer, grammar(tokenizer, model, "regex", "(.|\n)*"),
                                 prompt)
        for think in (ThinkTokens(free[0], free[4], starts_inside=False),  # opens, closes
                      ThinkTokens(free[1], free[3], starts_inside=True),  # opened in the prompt
                      ThinkTokens(free[0] + 1, free[4], starts_inside=False)):  # never opens
            reference = plain_after_thinking(model, tokenizer, compiled, prompt, think)
            thinking = replace(compiled, think=think)
            for drafter in drafters(index, prompt, reference, model.config.vocab_size):
                requests.append(Request(prompt=prompt, drafter=drafter, max_new_tokens=MAX_NEW,
                                        eos_token_ids=eos, constraint=thinking.start()))
                references.append(reference)
            thinks.append((think, reference, free))
    arrivals = np.random.default_rng(2).integers(0, 6, len(requests)).tolist()
    results = run_batched(model, requests, arrivals, max_batch_size=7)
    for request, result, reference in zip(requests, results, references, strict=True):
        assert result.token_ids == reference, type(request.drafter).__name__
    for think, reference, free in thinks:
        if think.start == reference[0] or think.starts_inside:  # thought freely, then answered
            end = reference.index(think.end)
            assert reference[:end + 1] == free[:end + 1]
            answer = reference[end + 1:]
        else:  # no block: the grammar from the first token
            answer = reference
        assert answer and compiled.start().allowed_prefix(answer) >= len(answer) - 1
