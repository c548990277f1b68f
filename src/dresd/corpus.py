"""Read corpora and turn them into the token sequences a datastore is built from.

A corpus is one or more sources, each read into `Document`s:

- a JSON Lines file (`.jsonl`, `.jsonl.gz`): one prompt/response pair per line, the field
  names configurable (`prompt_field`, `response_field`); with `prompt_field=None` the response
  field alone is a plain document;
- a plain text file (`.txt`, `.md`, anything else that is not JSON Lines): one document;
- a folder (a source tree): every file matching `tree_glob` (default `*.py`) is one document;
- `stdlib`: the Python standard library's `.py` files (a shortcut for its folder).

A prompt/response pair is formatted the way generation formats prompts, so that the hidden
states stored at build time are the ones the drafter meets at generation time:

- `chat` (default): the prompt is one user turn of the tokenizer's chat template with the
  assistant turn opened (exactly `prompts.encode_prompt`), and the response fills that
  assistant turn, closed as the template closes it;
- `qa`: the paper's plain `Question: {q}\\nAnswer:\\n` followed by the response and EOS.

Keys are taken at every position that has a next token (the authors' choice) or, with
`keys="response"`, only at positions whose next token belongs to the response. Documents
longer than `max_tokens` are cut into consecutive pieces, each its own document, so that one
forward never exceeds what the model (and memory) allows.

Saved outputs (`dresd generate --save-outputs F.jsonl`) are such pairs with their exact token
ids beside the text: `prompt_ids` (what the model was fed) and `token_ids` (what it said), and
the fingerprints of the model and tokenizer that made them (`output_row`). A row with ids is
taken as those ids, not re-tokenized: re-tokenizing decoded text need not give back the ids the
model produced, and those are what it will produce again. Ids are only meaningful to the
tokenizer (and, for an in-distribution store, the model) that made them, so a row made by
another one is refused (`check_token_ids_origin`).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from dresd.errors import DresdError
from dresd.fingerprint import tokenizer_fingerprint
from dresd.prompts import encode_prompt

STDLIB = "stdlib"
FORMATS = ("chat", "qa")
KEY_POSITIONS = ("all", "response")
QA_TEMPLATE = "Question: {q}\nAnswer:\n"  # the paper's prompt format


class CorpusError(DresdError, ValueError):
    """A corpus that cannot be read or used; the message names the file and the problem."""


@dataclass
class Document:
    """One unit of text: a response (or plain text) and, for pairs, the prompt before it."""

    response: str  # the text that follows the prompt (or the whole text for plain documents)
    prompt: str | None = None  # None for plain text and source files
    source: str = ""  # where it came from, "path:line" for JSON Lines
    # Saved outputs only: the exact ids (prompt as fed, response as generated) and who made them
    prompt_ids: list[int] | None = None
    response_ids: list[int] | None = None
    made_by: dict | None = None  # model name, model_fingerprint, tokenizer_fingerprint


@dataclass
class TokenizedDocument:
    """Token ids of one (piece of a) document and where its keys start.

    Keys are taken at positions `key_start .. len(ids) - 2`: the hidden state at position i
    predicts token i + 1, so the last position has no value and is never a key.
    """

    ids: list[int]
    key_start: int = 0

    @property
    def num_keys(self) -> int:
        return max(0, len(self.ids) - 1 - self.key_start)


@dataclass
class CorpusSpec:
    """Which files to read and how to turn them into token sequences."""

    sources: Sequence[str]  # paths, folders, or "stdlib"
    prompt_field: str | None = "prompt"  # JSON Lines: field holding the prompt (None: none)
    response_field: str = "response"  # JSON Lines: field holding the response
    format: str = "chat"  # how pairs are formatted: "chat" (template) or "qa" (the paper's)
    keys: str = "all"  # key positions: "all" or "response" only
    tree_glob: str = "*.py"  # files read from a folder
    max_tokens: int = 1024  # longer documents are cut into pieces of at most this many tokens
    limit: int | None = None  # read at most this many documents in all (None: every one)

    def __post_init__(self) -> None:
        if not self.sources:
            raise CorpusError("no corpus given")
        if self.format not in FORMATS:
            raise CorpusError(f"unknown format {self.format!r}; choose from {', '.join(FORMATS)}")
        if self.keys not in KEY_POSITIONS:
            raise CorpusError(f"unknown key positions {self.keys!r}; choose from "
                              f"{', '.join(KEY_POSITIONS)}")
        if self.max_tokens < 2:
            raise CorpusError("max_tokens must be at least 2")


def resolve_source(source: str) -> Path:
    """The path a source names: `stdlib` is the running Python's standard library folder."""
    if source == STDLIB:
        return Path(sysconfig.get_paths()["stdlib"])
    return Path(source)


def is_jsonl(path: Path) -> bool:
    return path.name.endswith((".jsonl", ".jsonl.gz"))


def read_documents(spec: CorpusSpec) -> list[Document]:
    """Every document of the corpus, in source order; errors name the file and the problem."""
    documents: list[Document] = []
    for source in spec.sources:
        path = resolve_source(source)
        before = len(documents)
        if path.is_dir():
            documents.extend(_read_tree(path, spec.tree_glob))
        elif path.is_file():
            if is_jsonl(path):
                documents.extend(read_jsonl_documents(path, spec.prompt_field, spec.response_field))
            else:
                documents.append(Document(response=_read_text(path), source=str(path)))
        else:
            raise CorpusError(f"corpus source {source!r} does not exist")
        if len(documents) == before:
            raise CorpusError(f"corpus source {source!r} holds no documents")
        if spec.limit is not None and len(documents) >= spec.limit:
            documents = documents[: spec.limit]
            break
    documents = [d for d in documents if d.response.strip() or (d.prompt or "").strip()]
    if not documents:
        raise CorpusError(f"the corpus {', '.join(spec.sources)} holds only empty documents")
    return documents


def iter_jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, object) for every non-blank line; a line that is not an object is an error."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise CorpusError(f"{path}:{number}: not valid JSON ({err})") from err
                if not isinstance(row, dict):
                    raise CorpusError(f"{path}:{number}: expected a JSON object")
                yield number, row
    except (OSError, UnicodeDecodeError) as err:
        raise CorpusError(f"cannot read corpus file {path}: {err}") from err


def read_jsonl_documents(
    path: Path, prompt_field: str | None, response_field: str
) -> list[Document]:
    """Prompt/response pairs from a JSON Lines file; a missing or non-text field is an error."""
    documents = []
    for number, row in iter_jsonl(path):
        fields = ([prompt_field] if prompt_field else []) + [response_field]
        for name in fields:
            if name not in row:
                raise CorpusError(f"{path}:{number}: no field {name!r} (fields: "
                                  f"{', '.join(row) or 'none'}); set --prompt-field / "
                                  "--response-field")
            if not isinstance(row[name], str):
                raise CorpusError(f"{path}:{number}: field {name!r} is not text")
        documents.append(Document(response=row[response_field],
                                  prompt=row[prompt_field] if prompt_field else None,
                                  source=f"{path}:{number}", **_saved_ids(row, path, number)))
    return documents


OUTPUT_ID_FIELDS = ("prompt_ids", "token_ids", "model", "model_fingerprint",
                    "tokenizer_fingerprint")


def output_row(prompt: str, response: str, prompt_ids: Sequence[int], token_ids: Sequence[int],
               made_by: dict) -> dict:
    """One saved output, a corpus row: text fields `prompt` and `response` (so any build reads
    it as a pair) and the exact ids with `made_by`'s `model`, `model_fingerprint` and
    `tokenizer_fingerprint`."""
    return {"prompt": prompt, "response": response, "prompt_ids": [int(t) for t in prompt_ids],
            "token_ids": [int(t) for t in token_ids],
            **{key: made_by[key] for key in OUTPUT_ID_FIELDS[2:]}}


def save_output(path: Path, row: dict) -> None:
    """Append one row to a JSON Lines file (each row whole: one write, flushed)."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def _saved_ids(row: dict, path: Path, number: int) -> dict:
    """The Document fields of a saved output's ids (none for a plain pair)."""
    if "token_ids" not in row:
        return {}
    missing = [name for name in OUTPUT_ID_FIELDS if name not in row]
    ids = [row.get("prompt_ids"), row["token_ids"]]
    if missing or not all(isinstance(x, list) and all(type(t) is int and t >= 0 for t in x)
                          for x in ids):
        raise CorpusError(f"{path}:{number}: a row with token_ids needs the fields "
                          f"{', '.join(OUTPUT_ID_FIELDS)} (as `dresd generate --save-outputs` "
                          "writes them), ids as lists of non-negative integers")
    return {"prompt_ids": ids[0], "response_ids": ids[1],
            "made_by": {name: row[name] for name in OUTPUT_ID_FIELDS[2:]}}


def check_token_ids_origin(documents: Sequence[Document], tokenizer: PreTrainedTokenizerBase,
                           model_fingerprint: str | None) -> None:
    """Refuse saved outputs made by another tokenizer (their ids would be garbage here) or,
    when `model_fingerprint` is given, by another model (they are not this model's outputs)."""
    expected: dict[str, str | None] | None = None  # computed once, if any row has ids
    for doc in documents:
        if doc.made_by is None:
            continue
        if expected is None:
            expected = {"tokenizer": tokenizer_fingerprint(tokenizer), "model": model_fingerprint}
        for part, want in expected.items():
            got = doc.made_by[f"{part}_fingerprint"]
            if want is not None and got != want:
                raise CorpusError(
                    f"{doc.source}: its token ids were made by {doc.made_by['model']!r} "
                    f"({part} fingerprint {got[:12]}), but this datastore's {part} has "
                    f"fingerprint {want[:12]}: they are not this model's outputs. To use the "
                    f"text only, drop the fields {', '.join(OUTPUT_ID_FIELDS)}")


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise CorpusError(f"cannot read corpus file {path}: {err}") from err


# Installed third-party packages are not the tree's own source (the stdlib folder holds them).
SKIPPED_FOLDERS = {"site-packages", "dist-packages", "__pycache__"}


def tree_files(folder: Path, glob: str) -> list[Path]:
    """The files of a source tree matching `glob`, sorted, without installed packages."""
    return sorted(p for p in folder.rglob(glob)
                  if p.is_file() and not SKIPPED_FOLDERS.intersection(p.relative_to(folder).parts))


def _read_tree(folder: Path, glob: str) -> list[Document]:
    documents = []
    for path in tree_files(folder, glob):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # a source tree may hold a few files in other encodings: skip those
        documents.append(Document(response=text, source=str(path)))
    return documents


def format_prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: str, fmt: str) -> list[int]:
    """The prompt's token ids as generation would feed them to the model."""
    if fmt == "chat":
        return encode_prompt(tokenizer, prompt, chat_template=True)
    return tokenizer(QA_TEMPLATE.format(q=prompt), add_special_tokens=True)["input_ids"]


def tokenize_document(
    tokenizer: PreTrainedTokenizerBase, doc: Document, fmt: str = "chat", keys: str = "all"
) -> TokenizedDocument:
    """Token ids of a document formatted as generation formats it, and where keys start."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if doc.response_ids is not None:  # a saved output: the ids the model saw and produced
        ids = doc.prompt_ids + doc.response_ids
        key_start = max(0, len(doc.prompt_ids) - 1) if keys == "response" else 0
        return TokenizedDocument(ids, key_start)
    if doc.prompt is None:
        return TokenizedDocument(tokenizer(doc.response, add_special_tokens=False)["input_ids"])
    prompt_ids = format_prompt_ids(tokenizer, doc.prompt, fmt)
    ids = None
    if fmt == "chat" and tokenizer.chat_template:
        conversation = [{"role": "user", "content": doc.prompt},
                        {"role": "assistant", "content": doc.response}]
        encoded = tokenizer.apply_chat_template(conversation, tokenize=True)
        full = list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
        # Templates close the turn their own way (`<|im_end|>\n` ...); use the template's ids
        # when they extend the generation prompt exactly, so that states match generation's.
        if full[: len(prompt_ids)] == prompt_ids:
            ids = full
    if ids is None:
        ids = prompt_ids + tokenizer(doc.response, add_special_tokens=False)["input_ids"] + eos
    # The state at position len(prompt)-1 predicts the first response token: the first key.
    key_start = max(0, len(prompt_ids) - 1) if keys == "response" else 0
    return TokenizedDocument(ids, key_start)


def split_document(doc: TokenizedDocument, max_tokens: int) -> list[TokenizedDocument]:
    """Cut a long document into consecutive pieces of at most `max_tokens` tokens."""
    if len(doc.ids) <= max_tokens:
        return [doc]
    pieces = []
    for start in range(0, len(doc.ids), max_tokens):
        ids = doc.ids[start : start + max_tokens]
        piece = TokenizedDocument(ids, max(0, doc.key_start - start))
        if len(ids) >= 2:
            pieces.append(piece)
    return pieces


def tokenize_corpus(
    tokenizer: PreTrainedTokenizerBase, spec: CorpusSpec, model_fingerprint: str | None = None
) -> list[TokenizedDocument]:
    """Every document of the corpus tokenized and cut to `spec.max_tokens`; at least one key.

    Saved outputs keep their ids; they must come from this tokenizer and, if
    `model_fingerprint` is given, from that model."""
    documents = read_documents(spec)
    check_token_ids_origin(documents, tokenizer, model_fingerprint)
    tokenized = []
    for doc in documents:
        whole = tokenize_document(tokenizer, doc, spec.format, spec.keys)
        tokenized.extend(p for p in split_document(whole, spec.max_tokens) if p.num_keys > 0)
    if not tokenized:
        raise CorpusError(f"the corpus {', '.join(spec.sources)} yields no key positions "
                          "(every document is shorter than two tokens)")
    return tokenized


def corpus_fingerprint(spec: CorpusSpec) -> list[dict]:
    """Per source: its path, size and a sha256 of its bytes (folders: of their files' names and
    bytes), so that a manifest says what was read and a resumed build can tell it is the same."""
    entries = []
    for source in spec.sources:
        path = resolve_source(source)
        digest = hashlib.sha256()
        size = 0
        files = tree_files(path, spec.tree_glob) if path.is_dir() else [path]
        for file in files:
            digest.update(str(file.relative_to(path) if path.is_dir() else file.name).encode())
            data = file.read_bytes()
            size += len(data)
            digest.update(data)
        entries.append({"source": source, "path": str(path), "bytes": size,
                        "files": len(files), "sha256": digest.hexdigest()})
    return entries
