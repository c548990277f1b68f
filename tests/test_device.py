"""One device everywhere: the loop makes its tensors on the model's device, and CUDA just works.

On a CPU, a TorchFunctionMode records every tensor factory (`torch.tensor`, `zeros`, `arange`,
...) that dresd's own code calls while the loop runs, and every move to the host
(`.cpu()`, `.to("cpu")`, `.numpy()`); a factory without `device=` (it would land on the CPU
whatever the model's device) or with another device than the model's fails the test, and so
does a move to the host. (Injected by hand into generate.py, a `torch.tensor(tree.depths)` and
a `.cpu()` on the query each failed it.) What a CPU run cannot tell apart is a factory that
names the CPU literally; on CUDA this same test catches that too. Where CUDA exists, the
greedy-equality, sampling and calibration tests also run there; elsewhere they skip.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY_VOCAB, tiny_model
from drafters_for_tests import OracleDrafter, RandomTreeDrafter
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

import dresd
from dresd.decoding import SamplingConfig, speculative_generate
from dresd.device import DeviceError, resolve_device
from dresd.drafters import DraftModelDrafter, HybridDrafter, NoDrafter, PromptLookupDrafter
from dresd.runner import GenerationSettings, MethodRunner

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]

FACTORIES = _device_constructors()  # what `with torch.device(...)` redirects: every factory
TO_HOST = {torch.Tensor.cpu, torch.Tensor.numpy}
TORCH_DIR = str(Path(torch.__file__).parent)
DRESD_DIR = str(Path(dresd.__file__).parent)


class StrayTensorRecorder(TorchFunctionMode):
    """Records, for code under `root`: each factory call that names no device or another
    than `device`, and each move of a tensor off `device` (`.cpu()`, `.numpy()`, `.to(...)`)."""

    def __init__(self, device: torch.device, root: str = DRESD_DIR) -> None:
        super().__init__()
        self.device, self.root = torch.device(device), root
        self.strays: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        where = self._caller()
        if where is None:
            return result
        if func in FACTORIES and (kwargs.get("device") is None
                                  or torch.device(kwargs["device"]) != self.device):
            self.strays.append(f"{where}: torch.{func.__name__}(device={kwargs.get('device')})")
        leaves = func in TO_HOST or (func is torch.Tensor.to and isinstance(result, torch.Tensor)
                                     and result.device != self.device)
        if leaves:
            self.strays.append(f"{where}: Tensor.{func.__name__} off the model's device")
        return result

    def _caller(self) -> str | None:
        """`file:line` of the first caller outside torch, if it is under `root`."""
        frame = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename.startswith(TORCH_DIR):
            frame = frame.f_back
        if frame is None or not frame.f_code.co_filename.startswith(self.root):
            return None
        return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"


def test_the_recorder_catches_a_stray_tensor():
    """The check has teeth: a factory without a device, or a move to the host, is recorded."""
    with StrayTensorRecorder(torch.device("cpu"), root=__file__) as recorder:
        torch.tensor([1, 2])  # no device: on the CPU whatever the model's device is
        torch.zeros(3, device="meta")  # another device than the model's
        torch.ones(2, device="cpu").cpu()  # a right one, then a move to the host
    assert len(recorder.strays) == 3, recorder.strays


def tiny_on(device: str, seed: int = 0) -> torch.nn.Module:
    return tiny_model(seed=seed).to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_the_loop_makes_every_tensor_on_the_models_device(device):
    """Greedy and sampling, trees with branches (mask, cache compaction), a learning drafter
    (hidden states kept), a draft model, the tree-attention probe, and the runner."""
    model, draft = tiny_on(device), tiny_on(device, seed=1)
    prompt = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])  # the caller's, on the CPU: allowed
    drafters = [NoDrafter(), PromptLookupDrafter(), RandomTreeDrafter(TINY_VOCAB, seed=1),
                HybridDrafter(cost={1: 1.0, 64: 1.0}), DraftModelDrafter(model=draft)]
    with StrayTensorRecorder(model.device) as recorder:
        for drafter in drafters:
            speculative_generate(model, drafter, prompt, max_new_tokens=12)
        speculative_generate(model, RandomTreeDrafter(TINY_VOCAB, seed=2), prompt,
                             max_new_tokens=12, sampling=SamplingConfig(0.8, seed=1))
    assert recorder.strays == []


def test_the_runner_and_server_make_their_prompt_on_the_models_device(default_target):
    from dresd.serve.engine import Engine, Job, Plan

    settings = GenerationSettings(max_new_tokens=4)
    engine = Engine(default_target, {}, settings, "pld", [])
    loop = asyncio.new_event_loop()  # the job posts its tokens there; nothing reads them
    with StrayTensorRecorder(default_target.device) as recorder:
        for method in ("ar", "pld"):
            MethodRunner(default_target, method, settings).generate([1, 2, 3, 4])
        engine.start()  # the worker thread runs the batched loop on the model's device
        job = Job([1, 2, 3, 4], Plan("pld", PromptLookupDrafter(), settings), loop)
        engine.submit(job)

        async def until_done() -> str:
            while (kind := (await job.events.get())[0]) not in ("done", "error"):
                pass
            return kind

        assert loop.run_until_complete(asyncio.wait_for(until_done(), 120)) == "done"
        engine.stop()
    loop.close()
    assert recorder.strays == []


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu",
                                                  0 if torch.cuda.is_available() else None)
    for bad in ("tpu", "cuda:x", "meta"):
        with pytest.raises(DeviceError, match="unknown device"):
            resolve_device(bad)
    with pytest.raises(DeviceError, match="asked for, but"):
        resolve_device(f"cuda:{torch.cuda.device_count()}")  # one past the last (or none)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_without_cuda_is_one_clear_error(capsys):
    from dresd.cli.main import main

    code = main(["generate", "--device", "cuda", "--method", "none", "--prompt", "hi",
                 "--max-new-tokens", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("dresd: error: device 'cuda' asked for, but")


def test_gpu_benchmark_runs_on_a_tiny_model(tmp_path):
    """benchmarks/gpu.py --smoke: the script the GPU machine runs, on the CPU in a second."""
    path = Path(__file__).parents[1] / "benchmarks" / "gpu.py"
    spec = importlib.util.spec_from_file_location("gpu_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--smoke", "--out", str(tmp_path / "gpu.json")]) == 0
    report = json.loads((tmp_path / "gpu.json").read_text())
    tiny = report["models"]["tiny"]
    assert list(tiny["verify_cost"]) == ["1", "2", "4", "8"] and tiny["verify_cost"]["1"] == 1.0
    assert set(tiny["loop_parts_ms"]["4"]) == {"tree_tensors", "forward", "accept", "compact"}
    methods = tiny["end_to_end"]
    assert list(methods) == ["ar", "none", "pld", "hybrid", "oracle 1x8", "oracle 4x8"]
    assert all(r["output"] in ("identical", "near_tie") for m, r in methods.items() if m != "ar")
    assert methods["oracle 4x8"]["mean_accepted_length"] > 4  # its branch is found
    assert "| oracle 4x8 |" in (tmp_path / "gpu.md").read_text()


# -- on CUDA: the same losslessness tests as on the CPU -------------------------------------


@CUDA
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_matches_generate_on_cuda(arch):
    from test_lossless_greedy import varied_prompts

    model = tiny_model(arch).to("cuda")
    for prompt in varied_prompts(12):
        ids = torch.tensor([prompt], device="cuda")
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
        ref = ref[0, len(prompt):].tolist()
        for drafter in (NoDrafter(), PromptLookupDrafter(num_drafts=3),
                        RandomTreeDrafter(TINY_VOCAB, seed=len(prompt)),
                        OracleDrafter(len(prompt), ref, draft_len=12, corrupt=0.3,
                                      seed=len(prompt), vocab_size=TINY_VOCAB),
                        HybridDrafter(cost={1: 1.0, 64: 1.0})):
            result = speculative_generate(model, drafter, torch.tensor([prompt]),
                                          max_new_tokens=30)
            assert result.token_ids == ref, f"{type(drafter).__name__}, prompt {prompt}"


@CUDA
def test_speculative_sampling_matches_model_distribution_on_cuda():
    import test_sampling as ts

    config = SamplingConfig(temperature=0.7)
    # Exact distributions from the CPU copy (same seed, same weights); samples drawn on CUDA.
    next_probs, pair_probs = ts.exact_distributions(ts.make_small_vocab_model(), config)
    model = ts.make_small_vocab_model().to("cuda")
    next_counts, pair_counts, accepted = ts.sampled_counts(model, config)
    assert accepted > ts.RUNS // 10, "the draft trees should often be accepted"
    assert ts.goodness_of_fit(next_counts, next_probs) > ts.ALPHA
    assert ts.goodness_of_fit(pair_counts, pair_probs) > ts.ALPHA


@CUDA
def test_calibrate_on_cuda_keys_the_curve_by_gpu(tmp_path, monkeypatch):
    from dresd.calibrate import curve_path, load_or_measure
    from dresd.models.target import Target

    monkeypatch.setenv("DRESD_CACHE", str(tmp_path))
    target = Target(model=tiny_on("cuda"), tokenizer=None, name="tiny")
    curve = load_or_measure(target, quiet=True)
    assert curve[1] == 1.0 and all(cost > 0 for cost in curve.values())
    gpu = torch.cuda.get_device_name(0).replace(" ", "-")  # "NVIDIA H200" -> "NVIDIA-H200"
    assert curve_path(target).name.endswith(f"-cuda-{gpu}.json")  # another GPU, another curve
    assert json.loads(curve_path(target).read_text())["device"].startswith("cuda:0 (")
