"""Evaluation prompts from the public data sets in `../shared/data` (or `$DRESD_DATA`)."""

from __future__ import annotations

import ast
import gzip
import json
import os
from pathlib import Path


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


def read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def humaneval() -> list[dict]:
    return read_jsonl(data_dir() / "humaneval" / "HumanEval.jsonl.gz")


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
