"""`--ray`: the target's work on Ray actors gives the single-process output.

A local Ray (2 CPUs, 2 actors) builds a tiny random model's store over a small corpus; keys,
offsets, values and transform must match a build in this process. It regenerates a small
prompt file's responses; the file must be byte for byte the one this process writes. The
actors run the same model on the same CPU, one thread each as here, so the keys come out
bitwise equal; the check allows 1e-3 (fp16 keys of unit length) for a forward that rounds
otherwise on another machine.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tiny_targets import tiny_target, word_corpus

from dresd.corpus import CorpusSpec
from dresd.datastore import dense
from dresd.datastore.format import read_manifest
from dresd.regenerate import RegenerateConfig, regenerate

ray = pytest.importorskip("ray", reason="Ray is optional: pip install 'dresd[ray]'")

CONFIG = dict(pca_dim=16, index="exact", chunk_tokens=200, sample_min=150,
              sample_fraction=0.0)


@pytest.fixture(scope="module")
def local_ray():
    torch.set_num_threads(1)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_ray_build_equals_the_single_process_build(tmp_path, local_ray):
    from dresd.raypool import RayPool

    target = tiny_target()
    corpus = word_corpus(tmp_path / "corpus.jsonl", documents=16)
    spec = CorpusSpec([str(corpus)])
    config = dense.DenseBuildConfig(**CONFIG)
    here = dense.build_dense(target, spec, tmp_path / "here", config, progress=False)
    forward = RayPool(lambda: target, actors=2)
    assert len(forward.actors) == 2
    chunks = dense.plan_chunks(dense.tokenize_corpus(target.tokenizer, spec), config)
    assert len(chunks) >= 4 and any(c.fit for c in chunks)  # both actors, both phases
    there = dense.build_dense(target, spec, tmp_path / "there", config, progress=False,
                              ray=forward)
    forward.close()
    for name in ("offsets.npy", "stream.npy", "doc_starts.npy"):
        assert np.array_equal(np.load(here / name), np.load(there / name)), name
    keys_here, keys_there = np.load(here / "keys.npy"), np.load(there / "keys.npy")
    np.testing.assert_allclose(keys_there, keys_here, atol=1e-3)
    print("max key difference:", np.abs(keys_there.astype(np.float32) - keys_here).max())
    assert read_manifest(there).num_entries == read_manifest(here).num_entries
    transform_here = np.load(here / "transform.npz")
    transform_there = np.load(there / "transform.npz")
    for name in transform_here.files:
        np.testing.assert_allclose(transform_there[name], transform_here[name], atol=1e-5)


def test_ray_regenerate_writes_the_same_file(tmp_path, local_ray):
    from dresd.raypool import RayPool

    target = tiny_target()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Say {i} words"}) + "\n"
                               for i in range(5)))
    config = RegenerateConfig(max_new_tokens=6, batch_size=2)  # 3 batches, the last short
    regenerate(target, prompts, tmp_path / "here.jsonl", config, progress=False)
    pool = RayPool(lambda: target, actors=2)
    regenerate(target, prompts, tmp_path / "there.jsonl", config, progress=False, ray=pool)
    pool.close()
    assert (tmp_path / "there.jsonl").read_bytes() == (tmp_path / "here.jsonl").read_bytes()
