"""lm-evaluation-harness itself against `dresd serve`: its `local-completions` model on two small
tasks over a local JSON file, one of each path a harness task takes.

- loglikelihood (a multiple-choice task): the harness sends context + continuation as token
  ids with `echo` and `logprobs`, and sums the continuation's logprobs; each sum must be the
  model's own (its float32 forward in this process) and each `is_greedy` its own argmax.
- generate_until: the harness sends the context's ids, concurrently, to a server whose default
  method is `hybrid`; each answer must be `ar`'s greedy output alone, cut at the task's stop.

The harness runs in this process with the Hugging Face libraries offline: the data is a local
file, the tokenizer the default model's cached folder.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from dresd.models.target import ensure_default_model
from dresd.serve.local import LocalServer

MAX_GEN_TOKS = 16
STOP = "\n\n"
QUESTIONS = [
    ("What is 2 plus 3?", ["5", "6", "7"], 0),
    ("What is the capital of France?", ["Paris", "London", "Rome"], 0),
    ("What colour is the sky on a clear day?", ["green", "blue", "red"], 1),
    ("How many legs has a spider?", ["six", "eight", "ten"], 1),
    ("Which is the largest planet?", ["Mars", "Venus", "Jupiter"], 2),
    ("What do bees make?", ["honey", "milk", "silk"], 0),
]
TASK = """\
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {output_type}
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: {target}
{extra}
"""

pytestmark = [pytest.mark.server, pytest.mark.default_model]


@pytest.fixture(scope="module")
def harness_results(tmp_path_factory, default_target):
    """The two tasks' logged samples, from one `simple_evaluate` against a dresd server."""
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):  # local files only
        os.environ.setdefault(name, "1")
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    folder = tmp_path_factory.mktemp("lm_eval")
    data = folder / "questions.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "label": label}) + "\n"
                            for q, c, label in QUESTIONS))
    (folder / "choice.yaml").write_text(TASK.format(
        name="dresd_choice", data=data, output_type="multiple_choice", target="label",
        extra='doc_to_choice: "{{choices}}"\nmetric_list:\n  - metric: acc'))
    (folder / "answer.yaml").write_text(TASK.format(
        name="dresd_answer", data=data, output_type="generate_until",
        target='"{{choices[label]}}"',
        extra=(f"generation_kwargs:\n  until: [{json.dumps(STOP)}]\n  max_gen_toks: "
               f"{MAX_GEN_TOKS}\n  do_sample: false\n  temperature: 0\n"
               "metric_list:\n  - metric: exact_match")))
    server = LocalServer(["--threads", "1", "--dtype", "float32", "--method", "hybrid",
                          "--max-new-tokens", str(MAX_GEN_TOKS)]).start()
    try:
        server.wait_ready()
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=(f"base_url={server.url}/v1/completions,model=SmolLM2-135M-Instruct,"
                        f"tokenizer={ensure_default_model(quiet=True)},tokenizer_backend=huggingface,"
                        "tokenized_requests=True,num_concurrent=3,max_retries=1"),
            tasks=["dresd_choice", "dresd_answer"],
            task_manager=TaskManager(include_path=str(folder)), log_samples=True)
    finally:
        server.stop()
    assert "Traceback" not in server.log()
    return results["samples"]


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_loglikelihoods_are_the_models_own(harness_results, default_target):
    tokenizer, model = default_target.tokenizer, default_target.model
    samples = harness_results["dresd_choice"]
    requests = [(args, resp) for sample in samples
                for args, resp in zip(sample["arguments"], sample["filtered_resps"], strict=True)]
    assert len(requests) == sum(len(choices) for _, choices, _ in QUESTIONS)
    for (context, continuation), (loglikelihood, is_greedy) in requests:
        # the harness's split: the whole text's ids, the context's ids its first ones
        context_ids = encode(tokenizer, context)
        whole = encode(tokenizer, context + continuation)
        assert whole[:len(context_ids)] == context_ids
        with torch.inference_mode():
            logits = model(torch.tensor([whole])).logits[0].float()
        positions = torch.arange(len(context_ids) - 1, len(whole) - 1)
        targets = torch.tensor(whole[len(context_ids):])
        logprobs = torch.log_softmax(logits[positions], -1)
        assert loglikelihood == pytest.approx(logprobs[torch.arange(len(targets)), targets]
                                              .sum().item(), abs=1e-4), (context, continuation)
        assert is_greedy == bool((logprobs.argmax(-1) == targets).all())


def test_generated_answers_are_ar_alone(harness_results, default_target, default_references):
    tokenizer = default_target.tokenizer
    samples = harness_results["dresd_answer"]
    assert len(samples) == len(QUESTIONS)
    answered = 0
    for sample in samples:
        [(context, options)] = sample["arguments"]
        assert options["until"] == [STOP]
        output = default_references(encode(tokenizer, context), MAX_GEN_TOKS)
        expected = tokenizer.decode(output, skip_special_tokens=True).split(STOP)[0]
        assert sample["filtered_resps"][0] == expected, context
        answered += bool(expected.strip())
    assert answered >= len(QUESTIONS) // 2  # the comparison is over real text, not empties
