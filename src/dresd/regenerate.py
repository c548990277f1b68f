"""In-distribution corpora: the target's own responses to a corpus's prompts.

The paper's "ID" datastores, built from the target's own outputs, retrieve far better than
"OOD" ones built from reference responses: at generation time the target repeats itself, not
the references. `regenerate` writes one JSON line per prompt (the input row with the response
field added or replaced), in input order, generating in batches (left-padded `generate`).

Resumable: rows already in the output file are skipped, new ones appended, each batch flushed,
so an interrupted run continues where it stopped. A half-written last line (a crash mid-write)
is dropped and redone.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from dresd.corpus import CorpusError, format_prompt_ids, iter_jsonl
from dresd.models import Target


@dataclass
class RegenerateConfig:
    prompt_field: str = "prompt"  # the input's prompt field
    response_field: str = "response"  # the field written with the target's response
    format: str = "chat"  # prompt format, as for `dresd build` (chat | qa)
    max_new_tokens: int = 256  # tokens per response at most
    batch_size: int = 8  # prompts per `generate` call
    temperature: float = 0.0  # 0: greedy (default)
    seed: int = 0  # sampling seed (temperature > 0)
    limit: int | None = None  # the first this many prompts only


def count_done(out: Path) -> int:
    """Complete rows in `out`; a trailing partial line is cut off so that appending is safe."""
    if not out.exists():
        return 0
    data = out.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    if len(complete) != len(data):
        out.write_bytes(complete)
    return sum(1 for line in complete.splitlines() if line.strip())


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
               progress: bool = True) -> int:
    """Append the target's responses for the prompts of `corpus` to `out`; returns rows done."""
    rows = read_prompt_rows(corpus, config)
    done = count_done(out)
    if done > len(rows):
        raise CorpusError(f"{out} has {done} rows but {corpus} only {len(rows)} prompts: "
                          "is it the output of another corpus?")
    if done and progress:
        print(f"dresd: {done} of {len(rows)} responses already in {out}; continuing",
              file=sys.stderr)
    tokenizer, model = target.tokenizer, target.model
    eos = target.eos_token_ids
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or [0])[0]
    options: dict = {"do_sample": False}
    if config.temperature > 0:
        torch.manual_seed(config.seed)
        options = {"do_sample": True, "temperature": config.temperature, "top_k": 0}
    bar = tqdm(total=len(rows), initial=done, unit="prompt", disable=not progress,
               desc="dresd regenerate")
    with open(out, "a", encoding="utf-8") as f:
        for start in range(done, len(rows), config.batch_size):
            batch = rows[start : start + config.batch_size]
            prompts = [format_prompt_ids(tokenizer, r[config.prompt_field], config.format)
                       for r in batch]
            width = max(len(p) for p in prompts)
            # Left padding: every prompt ends at the same column, where generation continues.
            ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for i, p in enumerate(prompts):
                ids[i, width - len(p) :] = torch.tensor(p)
                mask[i, width - len(p) :] = 1
            device = next(model.parameters()).device
            output = model.generate(ids.to(device), attention_mask=mask.to(device),
                                    max_new_tokens=config.max_new_tokens,
                                    eos_token_id=eos or None, pad_token_id=pad_id, **options)
            for row, new in zip(batch, output[:, width:].tolist(), strict=True):
                if eos and any(t in eos for t in new):  # cut at the first EOS (then padding)
                    new = new[: min(new.index(t) for t in eos if t in new)]
                text = tokenizer.decode(new, skip_special_tokens=True)
                f.write(json.dumps({**row, config.response_field: text}) + "\n")
            f.flush()
            bar.update(len(batch))
    bar.close()
    return len(rows)
