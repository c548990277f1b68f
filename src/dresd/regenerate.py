"""In-distribution corpora: the target's own responses to a corpus's prompts.

The paper's "ID" datastores, built from the target's own outputs, retrieve far better than
"OOD" ones built from reference responses: at generation time the target repeats itself, not
the references. `regenerate` writes one JSON line per prompt (the input row with the response
field added or replaced), in input order, generating in batches through the batched
speculative loop (`decoding/batch.py`; `method` drafts, suffix by default).

The output appears complete or not at all, like a datastore: rows are appended to
`OUT.partial`, each batch flushed to disk, and the file is renamed to `OUT` when every prompt
has its response. Resumable: a rerun continues `OUT.partial` from its last whole batch (a
half-written line or batch, left by a kill, is cut off and redone), so the batches, and with
them the bytes written, are those of an uninterrupted run. One process writes at a time: an
exclusive `flock` on `OUT.partial` refuses a second one (and dies with its holder).
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from dresd.corpus import CorpusError, format_prompt_ids, iter_jsonl
from dresd.decoding import SamplingConfig
from dresd.models.target import Target
from dresd.runner import GenerationSettings, MethodRunner

if TYPE_CHECKING:  # Ray is optional, and imported only by a run that uses it
    from dresd.raypool import RayPool


@dataclass
class RegenerateConfig:
    prompt_field: str = "prompt"  # the input's prompt field
    response_field: str = "response"  # the field written with the target's response
    format: str = "chat"  # prompt format, as for `dresd build` (chat | qa)
    max_new_tokens: int = 256  # tokens per response at most
    batch_size: int = 8  # prompts generated together (one batch of the batched loop)
    # drafts for each response: suffix learns from the responses already written (no datastore
    # is needed); the output is the model's own whatever the method
    method: str = "suffix"
    temperature: float = 0.0  # 0: greedy (default)
    seed: int = 0  # sampling seed (temperature > 0)
    limit: int | None = None  # the first this many prompts only
    # prompts' and responses' keys and values kept for the prompts after (decoding/
    # prefix_cache.py), at most this many MB; None: none. The output is the same either way.
    prefix_cache_mb: float | None = None


def count_done(out: Path) -> int:
    """Complete rows in `out`; a trailing partial line is cut off so that appending is safe."""
    if not out.exists():
        return 0
    data = out.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    if len(complete) != len(data):
        os.truncate(out, len(complete))  # in place: a kill now loses nothing already written
    return sum(1 for line in complete.splitlines() if line.strip())


def keep_rows(path: Path, rows: int) -> None:
    """Cut `path` after its first `rows` rows (blank lines do not count)."""
    data, end, seen = path.read_bytes(), 0, 0
    while seen < rows:
        newline = data.index(b"\n", end)
        seen += bool(data[end:newline].strip())
        end = newline + 1
    os.truncate(path, end)


def partial_path(out: Path) -> Path:
    """Where `regenerate` writes before the output is complete."""
    return out.with_name(out.name + ".partial")


def read_prompt_rows(corpus: Path, config: RegenerateConfig) -> list[dict]:
    """The rows of a prompts file (up to `config.limit`); each must have a text prompt field."""
    rows = []
    for number, row in iter_jsonl(corpus):
        if config.prompt_field not in row or not isinstance(row[config.prompt_field], str):
            raise CorpusError(f"{corpus}:{number}: no text field {config.prompt_field!r} "
                              f"(fields: {', '.join(row) or 'none'}); set --prompt-field")
        rows.append(row)
    if not rows:
        raise CorpusError(f"{corpus} holds no prompts")
    return rows[: config.limit]


@torch.inference_mode()
def regenerate(target: Target, corpus: Path, out: Path, config: RegenerateConfig,
               progress: bool = True, ray: RayPool | None = None) -> int:
    """Write the target's responses to the prompts of `corpus` into `out` (through
    `out.partial`, resumed if it exists); returns the rows in `out`. With `ray`, the batches
    are generated on its actors (raypool.py) and written in order: the same file."""
    rows = read_prompt_rows(corpus, config)
    if out.exists():
        return _check_finished(out, corpus, len(rows))
    partial = partial_path(out)
    partial.parent.mkdir(parents=True, exist_ok=True)  # a fresh clone has no runs/ folder
    with open(partial, "a", encoding="utf-8") as f:
        _lock(f, partial)
        if out.exists():  # another run finished while we opened the file
            return _check_finished(out, corpus, len(rows))
        done = _resume_point(partial, corpus, len(rows), config.batch_size)
        if done and progress:
            print(f"dresd: {done} of {len(rows)} responses already in {partial}; continuing",
                  file=sys.stderr)
        _generate_rows(target, rows, done, f, config, progress, ray)
        os.replace(partial, out)  # every row is on disk: the output appears whole
    return len(rows)


def _check_finished(out: Path, corpus: Path, expected: int) -> int:
    done = count_done(out)
    if done != expected:
        raise CorpusError(f"{out} exists with {done} rows, but {corpus} has {expected} "
                          "prompts: is it the output of another corpus? Choose another --out")
    return done


def _lock(f, partial: Path) -> None:
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise CorpusError(f"another `dresd corpus regenerate` is writing {partial} right now; "
                          "wait for it to finish, or stop it and run this one again to "
                          "resume") from None


def _resume_point(partial: Path, corpus: Path, total: int, batch_size: int) -> int:
    """Rows kept in `partial`: its complete rows, cut back to a whole number of batches so that
    the remaining batches are the ones an uninterrupted run generates."""
    done = count_done(partial)
    if done > total:
        raise CorpusError(f"{partial} has {done} rows but {corpus} only {total} prompts: "
                          "is it the output of another corpus?")
    if done % batch_size:
        done -= done % batch_size
        keep_rows(partial, done)
    return done


def _generate_rows(target: Target, rows: list[dict], done: int, f, config: RegenerateConfig,
                   progress: bool, ray: RayPool | None = None) -> None:
    """Append the responses of rows[done:] to the open file `f`, a batch at a time (batches
    generated here, or on the Ray actors and written in order)."""
    bar = tqdm(total=len(rows), initial=done, unit="prompt", disable=not progress,
               desc="dresd regenerate")
    jobs = [(rows[start : start + config.batch_size], start, config)
            for start in range(done, len(rows), config.batch_size)]
    if ray is None:
        batches = (response_lines(target, *job) for job in jobs)
    else:
        batches = ray.map(response_lines, jobs)
    for (batch, _, _), lines in zip(jobs, batches, strict=True):
        f.write(lines)
        f.flush()
        os.fsync(f.fileno())  # a batch on disk before the next one starts
        bar.update(len(batch))
    bar.close()


def response_lines(target: Target, batch: list[dict], start: int,
                   config: RegenerateConfig) -> str:
    """The output lines of one batch of prompt rows, generated together by the batched
    speculative loop with `config.method`'s drafter (`start`: the first row's number; row i
    samples with seed `config.seed * 1_000_003 + i`, so that a resumed or distributed run
    samples what one run does, whatever its batches)."""
    tokenizer = target.tokenizer
    runner = _runner(target, config)
    engine = runner.batch(len(batch))
    states = []
    for offset, row in enumerate(batch):
        request = runner.request(format_prompt_ids(tokenizer, row[config.prompt_field],
                                                   config.format), runner.drafter.fork())
        if config.temperature > 0:
            request.sampling = SamplingConfig(temperature=config.temperature,
                                              seed=config.seed * 1_000_003 + start + offset)
        states.append(engine.add(request))
    engine.run()
    lines = []
    eos = target.eos_token_ids
    for row, state in zip(batch, states, strict=True):
        new = state.result.token_ids
        if new and new[-1] in eos:  # the response ends before its EOS token
            new = new[:-1]
        text = tokenizer.decode(new, skip_special_tokens=True)
        lines.append(json.dumps({**row, config.response_field: text}) + "\n")
    return "".join(lines)


# One runner per (target, method) in this process: its drafter's forks share what it learned
# from the responses before (suffix: their suffix tries), batch after batch.
_RUNNERS: dict[tuple[int, str, int], MethodRunner] = {}


def _runner(target: Target, config: RegenerateConfig) -> MethodRunner:
    key = (id(target), config.method, config.max_new_tokens, config.prefix_cache_mb)
    if key not in _RUNNERS:
        _RUNNERS[key] = MethodRunner(target, config.method,
                                     GenerationSettings(config.max_new_tokens),
                                     prefix_cache_mb=config.prefix_cache_mb)
    return _RUNNERS[key]
