"""`dresd build`: a datastore from a corpus; with `--append`, a corpus added to one.

The corpus is read and checked (text only: cheap) before the model loads, so a malformed
corpus fails in a second. Dense stores run the target over the corpus (optionally on Ray
actors); sparse ones need its tokenizer only.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dresd.cli.options import (
    add_device_option,
    add_dtype_option,
    add_ray_options,
    add_threads_option,
    check_limit,
    finite_float,
    load_target_from_args,
    load_tokenizer_target,
    ray_pool,
    set_threads,
)
from dresd.corpus import FORMATS, KEY_POSITIONS, CorpusSpec, read_documents
from dresd.datastore.append import append_to_datastore
from dresd.datastore.dense import DenseBuildConfig, build_dense
from dresd.datastore.format import read_manifest
from dresd.datastore.sparse_store import build_sparse_datastore
from dresd.errors import UserError
from dresd.models.target import DEFAULT_MODEL

BUILD_KINDS = ["dense", "sparse", "dense,sparse"]


def add_parser(commands: argparse._SubParsersAction) -> None:
    build = commands.add_parser("build", help="build a datastore from a corpus")
    build.add_argument("--kind", choices=BUILD_KINDS, default=None,
                       help="dense (default): DReSD (hidden-state keys); sparse: REST (suffix "
                            "array of the token ids); dense,sparse: both from one pass, in one "
                            "folder")
    build.add_argument("--model", default=DEFAULT_MODEL, help="the target the datastore is for")
    build.add_argument("--out", type=Path, required=True,
                       help="the datastore folder to create (with --append: to grow)")
    build.add_argument("--append", action="store_true",
                       help="add the corpus to the existing datastore --out, atomically: its "
                            "transform, format and settings are kept (saved outputs from "
                            "`dresd generate --save-outputs` keep their token ids)")
    add_corpus_options(build)
    build.add_argument("--pca-dim", type=int, default=64, help="key dimensions (default 64)")
    build.add_argument("--value-len", type=int, default=20,
                       help="tokens stored after each position (default 20)")
    build.add_argument("--index", choices=["auto", "exact", "ivf", "ivfpq", "scann"],
                       default="auto", help="auto: exact search for small stores, FAISS IVF "
                       "above; ivfpq: PQ codes + exact re-ranking on memory-mapped keys, for "
                       "stores past RAM")
    build.add_argument("--recall-target", type=finite_float, default=0.9,
                       help="ivf, ivfpq: nprobe is raised until recall@10 reaches this "
                       "(default 0.9)")
    build.add_argument("--chunk-tokens", type=int, default=65_536,
                       help="corpus tokens per resumable chunk")
    build.add_argument("--batch-tokens", type=int, default=8_192,
                       help="padded tokens per forward (lower it if memory is short)")
    build.add_argument("--keep-states", action="store_true",
                       help="dense: also keep the raw fp16 hidden states (states.npy, "
                            "hidden size x 2 bytes per entry) for studies that refit the keys")
    add_threads_option(build, "PyTorch threads (with --ray: per actor, default 1)")
    add_ray_options(build, "dense: forward the chunks")
    add_dtype_option(build)
    add_device_option(build)
    build.add_argument("--quiet", action="store_true", help="no progress bar")
    build.set_defaults(func=run)


def add_corpus_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--corpus", action="append", required=True,
                   help="a .jsonl file, a text file, a folder (source tree) or 'stdlib' "
                        "(repeatable)")
    p.add_argument("--prompt-field", default="prompt",
                   help="JSON Lines prompt field ('' for none: the response field is plain text)")
    p.add_argument("--response-field", default="response", help="JSON Lines response field")
    p.add_argument("--format", choices=FORMATS, default="chat",
                   help="chat: the tokenizer's chat template (default); qa: the paper's "
                        "'Question: ...\\nAnswer:\\n'")
    p.add_argument("--keys", choices=KEY_POSITIONS, default="all",
                   help="key positions: all (default, as the authors) or response only")
    p.add_argument("--glob", default="*.py", help="files read from a folder (default *.py)")
    p.add_argument("--max-doc-tokens", type=int, default=1024,
                   help="longer documents are cut into pieces of this many tokens")
    p.add_argument("--limit", type=int, default=None, help="read at most this many documents")


def corpus_spec_from_args(args: argparse.Namespace) -> CorpusSpec:
    check_limit(args)
    return CorpusSpec(sources=args.corpus, prompt_field=args.prompt_field or None,
                      response_field=args.response_field, format=args.format, keys=args.keys,
                      tree_glob=args.glob, max_tokens=args.max_doc_tokens, limit=args.limit)


def run(args: argparse.Namespace) -> int:
    set_threads(args)
    spec = corpus_spec_from_args(args)
    if not 0 < args.recall_target <= 1:
        raise UserError(f"--recall-target must be in (0, 1], got {args.recall_target}")
    read_documents(spec)  # a malformed corpus fails before the model loads (text only: cheap)
    if args.append:
        return run_append(args, spec)
    args.kind = args.kind or "dense"
    if args.kind == "sparse":  # no forward pass: the dense options (and --device) do not apply
        out = build_sparse_datastore(load_tokenizer_target(args.model), spec, args.out,
                                     progress=not args.quiet)
        print(out)
        return 0
    config = DenseBuildConfig(pca_dim=args.pca_dim, value_len=args.value_len, index=args.index,
                              recall_target=args.recall_target, chunk_tokens=args.chunk_tokens,
                              batch_tokens=args.batch_tokens, keep_states=args.keep_states)
    target = load_target_from_args(args)
    ray = ray_pool(args, target) if args.ray is not None else None
    out = build_dense(target, spec, args.out, config, progress=not args.quiet,
                      with_sparse=args.kind == "dense,sparse", ray=ray)
    print(out)
    return 0


def run_append(args: argparse.Namespace, spec: CorpusSpec) -> int:
    """`dresd build --append`: grow the datastore --out by the corpus (datastore/append.py)."""
    manifest = read_manifest(args.out)
    if args.kind is not None and args.kind != manifest.kind:
        raise UserError(f"--append: {args.out} is a {manifest.kind} datastore, not {args.kind}")
    if "dense" not in manifest.kind:  # no forward pass: a sparse store needs the tokenizer only
        target = load_tokenizer_target(args.model)
    else:
        if args.dtype == "auto":  # keys from the dtype the stored ones came from
            args.dtype = manifest.settings.get("build_dtype", "float32")
        target = load_target_from_args(args)
    out = append_to_datastore(target, spec, args.out, batch_tokens=args.batch_tokens,
                              progress=not args.quiet)
    print(out)
    return 0
