"""A build's forwards on a Ray cluster (`dresd build --ray [ADDRESS]`), optional.

Only the expensive step moves: the forward of each chunk's documents through the target. Ray
actors each load the model once (`load`, called on the actor: a 7B model is loaded from its
name on every node rather than shipped through the object store), and each returns a chunk's
raw hidden states and stream offsets. Everything else stays in the single-process build
(dense.py): the chunk plan, the seeded transform sample (fit chunks first, the transform
fitted on the driver), the chunk files and their done markers (so a build resumes by chunk,
with or without Ray), the join, the values, the index and the manifest. A chunk's states are
transformed into keys on the driver by the same code as without Ray; so the datastore is the
one a single process writes, up to the forward's own rounding where actors run another number
of threads or another machine.

Ray is imported here only: without `--ray` nothing of it is loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from dresd.corpus import TokenizedDocument
from dresd.models import Target

# Chunks queued per actor beyond the one it is running: its next chunk is ready when it
# finishes, and the driver holds few chunks' states at once.
QUEUED_PER_ACTOR = 1


@dataclass
class ChunkJob:
    """One chunk's forward: its documents (sorted by length) and where each starts in the
    token stream."""

    number: int
    docs: list[TokenizedDocument]
    starts: np.ndarray


class _ForwardActor:
    """Holds the target once; forwards chunks (wrapped by `ray.remote` when Ray is started)."""

    def __init__(self, load: Callable[[], Target], threads: int) -> None:
        torch.set_num_threads(threads)
        self.target = load()

    def forward(self, job: ChunkJob, batch_tokens: int, pad_id: int
                ) -> tuple[int, np.ndarray, np.ndarray]:
        from dresd.datastore.dense import key_states

        raw, offsets = key_states(self.target.model, job.docs, job.starts, batch_tokens, pad_id)
        return job.number, raw, offsets


class RayForward:
    """Ray actors that forward a build's chunks; `address`: a cluster's (None: start a local
    one, or join the one `RAY_ADDRESS` names). `actors`: how many (default: one per `threads`
    CPUs of the cluster)."""

    def __init__(self, load: Callable[[], Target], address: str | None = None,
                 actors: int | None = None, threads: int = 1) -> None:
        ray = import_ray()
        if not ray.is_initialized():
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
        cpus = int(ray.cluster_resources().get("CPU", 1))
        count = actors or max(1, cpus // threads)
        actor = ray.remote(num_cpus=threads)(_ForwardActor)
        self.actors = [actor.remote(load, threads) for _ in range(count)]

    def states(self, jobs: list[ChunkJob], batch_tokens: int, pad_id: int
               ) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """(chunk number, raw fp16 states, offsets) of every job, in the order they finish;
        each actor is kept busy with at most QUEUED_PER_ACTOR chunks waiting."""
        ray = import_ray()
        waiting = list(reversed(jobs))
        running: dict = {}  # object ref -> actor

        def submit(actor) -> None:
            if waiting:
                running[actor.forward.remote(waiting.pop(), batch_tokens, pad_id)] = actor

        for actor in self.actors:
            for _ in range(1 + QUEUED_PER_ACTOR):
                submit(actor)
        while running:
            [done], _ = ray.wait(list(running), num_returns=1)
            submit(running.pop(done))
            yield ray.get(done)

    def close(self) -> None:
        ray = import_ray()
        for actor in self.actors:
            ray.kill(actor)


def import_ray():
    try:
        import ray
    except ImportError as err:
        raise ImportError("--ray needs the optional package: pip install 'dresd[ray]'") from err
    return ray
