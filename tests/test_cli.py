"""Bad input ends with one clear line and exit status 2, never a traceback; a bug ends with one
line that says so (exit status 1), and with --debug its traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dresd.cli.main import main
from dresd.corpus import CorpusError
from dresd.datastore.format import DatastoreError
from dresd.device import DeviceError
from dresd.errors import DresdError, MissingPackageError, UserError
from dresd.models.target import ModelError


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    try:
        code = main(list(argv))
    except SystemExit as stop:  # argparse's own usage errors
        code = stop.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


@pytest.mark.parametrize("argv, message", [
    (["--prompt", ""], "prompt is empty"),
    (["--prompt", "   \n"], "prompt is empty"),
    (["--prompt", "hi", "--temperature", "-1"], "--temperature must be >= 0"),
    (["--prompt", "hi", "--temperature", "0.7", "--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["--prompt", "hi", "--temperature", "0.7", "--top-k", "-2"], "top_k must be >= 0"),
    (["--prompt", "hi", "--top-p", "0.9"], "also give --temperature"),
    (["--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--prompt", "hi", "--threads", "0"], "--threads: must be in [1, 4096]"),
    (["--prompt-file", "/no/such/file.txt"], "does not exist"),
    (["--prompt", "hi", "--model", "/no/such/model"], "does not exist"),
])
def test_bad_input_is_a_clear_error(capsys, argv, message):
    code, err = run_cli(capsys, "generate", *argv)
    assert code == 2
    assert err.startswith("dresd: error:") and message in err


def test_jsonl_prompt_file_without_the_field(capsys, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "a"}\n{"question": "b"}\n')
    code, err = run_cli(capsys, "generate", "--prompt-file", str(path))
    assert code == 2 and f"{path}:2: no 'prompt' field" in err


def test_unknown_method_is_a_usage_error(capsys):
    code, err = run_cli(capsys, "generate", "--prompt", "hi", "--method", "magic")
    assert code == 2 and "invalid choice: 'magic'" in err


def test_prompt_longer_than_the_context(capsys, default_target):
    code, err = run_cli(capsys, "generate", "--prompt", "word " * 9000, "--max-new-tokens", "4")
    assert code == 2
    assert "tokens; the model's context is 8192 tokens" in err


@pytest.fixture(scope="module")
def real_processes(tmp_path_factory) -> dict:
    """`dresd generate` in two real processes, started at once (each spends ~4 s loading torch
    and would otherwise wait for the other): an unknown Hub model offline, and the default
    model offline with an empty cache and no package index. {name: (completed run, cache)}."""
    cache = tmp_path_factory.mktemp("empty-cache")
    runs = {
        "unknown hub model": (
            ["generate", "--model", "nobody/no-such-model", "--prompt", "hi"],
            dict(os.environ, HF_HUB_OFFLINE="1")),
        "default model not cached": (
            ["generate", "--prompt", "hi"],
            dict(os.environ, DRESD_CACHE=str(cache), PIP_NO_INDEX="1", PIP_FIND_LINKS="",
                 PIP_CONFIG_FILE=os.devnull)),
    }
    started = {name: subprocess.Popen([sys.executable, "-m", "dresd.cli", *argv], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True)
               for name, (argv, env) in runs.items()}
    done = {}
    for name, process in started.items():
        stdout, stderr = process.communicate(timeout=300)
        done[name] = (subprocess.CompletedProcess(process.args, process.returncode, stdout,
                                                  stderr), cache)
    return done


@pytest.mark.subprocess
def test_unknown_hub_model_in_a_real_process(real_processes):
    done, _ = real_processes["unknown hub model"]
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "dresd: error: Could not load model 'nobody/no-such-model'" in done.stderr


@pytest.mark.subprocess
def test_default_model_offline_and_not_cached_says_what_to_do(real_processes):
    """No cache and no package index: one paragraph on what to do, exit status 2."""
    done, cache = real_processes["default model not cached"]
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "is not cached" in done.stderr and "dresd fetch-model" in done.stderr
    assert not (cache / "models" / "SmolLM2-135M-Instruct").exists()


def test_every_error_a_user_can_cause_is_a_dresd_error():
    for error in (UserError, MissingPackageError, ModelError, DeviceError, CorpusError,
                  DatastoreError):
        assert issubclass(error, DresdError), error


def broken_describe(*args, **kwargs):
    raise ValueError("a check that should have raised a DresdError")


def test_a_bug_is_an_internal_error_that_points_to_debug(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr("dresd.cli.inspect.describe", broken_describe)
    code, err = run_cli(capsys, "inspect", str(tmp_path))
    assert code == 1
    assert err == ("dresd: internal error: ValueError: a check that should have raised a "
                   "DresdError (rerun with --debug for the traceback)\n")
    for argv in (["--debug", "inspect", str(tmp_path)], ["inspect", str(tmp_path), "--debug"]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err.startswith("Traceback") and "in broken_describe" in err
