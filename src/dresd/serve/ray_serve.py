"""`dresd serve --ray [ADDRESS] --replicas N`: the same FastAPI app on Ray Serve replicas, behind
one endpoint (Ray Serve's HTTP proxy on --host:--port).

- Each replica is a Ray actor that builds the app exactly as the single-process server does
  (`build_app(args)`: model, datastores memory-mapped read-only, drafters, engine), once, at
  start. The datastore folders must be readable at the same path on every node.
- Replicas: `--replicas N`, or with `--max-replicas M` Ray Serve's autoscaling between N and M,
  aiming at `--max-batch-size` requests in flight per replica.
- Routing (`--replica-routing`): `prefix` (the default, with more than one replica) sends every
  turn of a conversation to the replica that holds its prefix cache, through a small ingress
  deployment that reads the body and a request router that ranks the replicas by the
  conversation's key (ray_routing.py); a replica with a full batch yields its requests to one
  with room. `power-of-two`: Ray Serve's default router, straight from its proxy: two replicas
  picked at random, the request to the one with fewer requests in flight. Either never sends a
  replica more than `max_ongoing_requests`: here `--max-queue` + `--max-batch-size`, so a
  replica is never handed more than its batch and queue hold; past that, requests wait in Ray
  Serve's router.
- The API key is checked by each replica's app (the same middleware), so the endpoint behaves
  as the single-process server, and with affinity by the ingress too, before it reads a body.
  Ray Serve's own `/-/healthz` and `/-/routes` stay open.
- With affinity the ingress holds at most `ingress_max_requests` requests (503 past it) and
  routes around a replica whose /health is not 200 (ray_routing.py).
- `/metrics`: every replica sends its figures to one small actor (`MetricsBoard`) when a request
  ends and every few seconds; whichever replica answers /metrics renders the sum (every figure
  is a count or a sum, so the pooled ratios are exact), with the in-flight gauges of the
  replicas heard from recently, and the per-replica gauges `dresd:replica_num_requests_running`
  and `..._waiting` labelled `replica`.
- A replica's process that dies: Ray Serve starts another (it loads the model again); its
  in-flight requests end in an error for their clients (the proxy drops the connection: a
  stream stops without its finish reason and `[DONE]`, and the `openai` client raises
  `APIConnectionError`), never in a shortened success; new requests go to the live replicas.
- What a replica does not see: `suffix` and `hybrid` learn from the outputs their own replica
  generates; another replica's requests are unknown to them, and what they learned is lost when
  the replica stops. `--save-outputs FILE` on a shared folder writes each replica's outputs to
  FILE with the replica's name before the suffix (`outputs.r0ab12.jsonl`); `dresd build
  --append` adds them to a datastore, which every replica reads at its next start.

Ray is imported in functions here (through `raypool.import_ray`), and this module only with
`--ray`: a server without it never loads Ray.
"""

from __future__ import annotations

import argparse
import copy
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dresd.raypool import import_ray
from dresd.serve.metrics import PREFIX, ServerMetrics

APP_NAME = "dresd"
DEPLOYMENT_NAME = "DresdServer"
INGRESS_NAME = "DresdIngress"  # with conversation affinity: reads a request, picks its replica
REPLICA_HEADER = b"x-dresd-replica"  # which replica answered: for logs and the kill test
# A replica sends its figures at least this often (the in-flight gauges move without requests
# ending); one not heard from for STALE_S is left out of the in-flight gauges.
REPORT_EVERY_S = 2.0
STALE_S = 10.0
# What a replica runs at its start: (the app, its engine) of one server process, given the
# command line, the replica's figures and how /metrics renders the deployment's
# (dresd.cli.serve.build_app).
BuildApp = Callable[..., tuple[Any, Any]]


class MetricsBoard:
    """The replicas' latest figures (a Ray actor; one per deployment)."""

    def __init__(self) -> None:
        self.reports: dict[str, tuple[float, ServerMetrics, int, int]] = {}
        self.health: dict[str, tuple[float, int]] = {}  # (when, /health status): for routing

    def put(self, replica: str, metrics: ServerMetrics, running: int, waiting: int) -> None:
        self.reports[replica] = (time.time(), metrics, running, waiting)

    def get(self) -> dict[str, tuple[float, ServerMetrics, int, int]]:
        return self.reports

    def put_health(self, replica: str, status: int) -> None:
        self.health[replica] = (time.time(), status)

    def get_health(self) -> dict[str, tuple[float, int]]:
        return self.health


def render_pooled(model_name: str, reports: dict[str, tuple[float, ServerMetrics, int, int]],
                  now: float) -> str:
    """/metrics for the deployment: the replicas' figures summed, then the per-replica gauges."""
    pooled = ServerMetrics(model_name)
    running = waiting = 0
    fresh = {}
    for replica, (at, metrics, replica_running, replica_waiting) in sorted(reports.items()):
        pooled.add(metrics)  # a replica gone keeps its counts: those requests did happen
        if now - at <= STALE_S:
            fresh[replica] = (replica_running, replica_waiting)
            running += replica_running
            waiting += replica_waiting
    lines = [pooled.render(running, waiting).rstrip("\n")]
    lines += [f"# HELP {PREFIX}num_replicas Replicas that reported in the last {STALE_S:.0f} s.",
              f"# TYPE {PREFIX}num_replicas gauge",
              f'{PREFIX}num_replicas{{model_name="{model_name}"}} {len(fresh)}']
    for index, name in ((0, "running"), (1, "waiting")):
        lines += [f"# HELP {PREFIX}replica_num_requests_{name} Requests {name} on one replica.",
                  f"# TYPE {PREFIX}replica_num_requests_{name} gauge"]
        lines += [f'{PREFIX}replica_num_requests_{name}{{model_name="{model_name}",'
                  f'replica="{replica}"}} {gauges[index]}' for replica, gauges in fresh.items()]
    return "\n".join(lines) + "\n"


REPLICA_ONLY = ("replica", "board", "gauges")


class ReplicaMetrics(ServerMetrics):
    """A replica's figures: sent to the board whenever a request ends."""

    def __init__(self, model_name: str, replica: str, board) -> None:
        super().__init__(model_name)
        self.replica = replica
        self.board = board
        self.gauges: Callable[[], tuple[int, int]] = lambda: (0, 0)

    def report(self) -> None:
        # A plain ServerMetrics copy (the board needs neither `board` nor `gauges`), taken at
        # once: the periodic report runs on another thread than the one recording.
        snapshot = ServerMetrics.__new__(ServerMetrics)
        snapshot.__dict__.update(copy.deepcopy({key: value for key, value in vars(self).items()
                                                if key not in REPLICA_ONLY}))
        self.board.put.remote(self.replica, snapshot, *self.gauges())

    def record_finished(self, *args, **kwargs) -> None:
        super().record_finished(*args, **kwargs)
        self.report()

    def record_rejected(self, status: int) -> None:
        super().record_rejected(status)
        self.report()


class ReplicaHeader:
    """ASGI wrapper: every response says which replica sent it (`x-dresd-replica`)."""

    def __init__(self, app, replica: str) -> None:
        self.app = app
        self.replica = replica.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()),
                                                   (REPLICA_HEADER, self.replica)]}
            await send(message)

        await self.app(scope, receive, send_with_header)


def replica_output_path(path: Path | None, replica: str) -> Path | None:
    """`--save-outputs` of one replica: the file's name with the replica's before its suffix,
    so that replicas on a shared folder never write the same file."""
    if path is None:
        return None
    return path.with_name(f"{path.stem}.{replica}{path.suffix}")


def build_replica_app(args: argparse.Namespace, build_app: BuildApp, model_name: str, board):
    """Run on each replica at its start: the single-process app, reporting to the board."""
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from dresd.serve.ray_routing import replica_name  # (Ray's modules: with --ray only)

    replica = replica_name()
    args = argparse.Namespace(**{**vars(args),
                                 "save_outputs": replica_output_path(args.save_outputs, replica)})
    metrics = ReplicaMetrics(model_name, replica, board)

    async def metrics_text() -> str:
        try:
            metrics.report()  # this replica's own figures are current; the board keeps order
            return render_pooled(model_name, await board.get.remote(), time.time())
        except Exception:  # noqa: BLE001 - the board died with its driver: this replica alone
            return metrics.render(*metrics.gauges())

    app, engine = build_app(args, metrics=metrics, metrics_text=metrics_text)
    metrics.gauges = lambda: (engine.running, engine.waiting)

    def report_periodically() -> None:
        while True:
            time.sleep(REPORT_EVERY_S)
            try:
                metrics.report()
            except Exception:  # noqa: BLE001 - a copy that met a write, or the board gone
                continue  # (this thread ends with the replica's process)

    threading.Thread(target=report_periodically, name="dresd-metrics-report",
                     daemon=True).start()
    return ReplicaHeader(app, replica)


def max_ongoing_requests(args: argparse.Namespace) -> int:
    """Requests one replica holds at most: its queue plus what it generates at once."""
    # --max-batch-size comes with the batched engine; the one-at-a-time engine runs one.
    return args.max_queue + getattr(args, "max_batch_size", 1)


def deployment_options(args: argparse.Namespace) -> dict:
    """Ray Serve's options for the deployment: a fixed number of replicas, or with
    --max-replicas its autoscaling between --replicas and that, aiming at a full batch of
    requests in flight per replica (Ray Serve adds replicas when they hold more)."""
    options = dict(max_ongoing_requests=max_ongoing_requests(args),
                   ray_actor_options={"num_cpus": args.threads or 1},
                   health_check_period_s=5, graceful_shutdown_timeout_s=15)
    if args.max_replicas is None:
        return {**options, "num_replicas": args.replicas}
    return {**options, "autoscaling_config": {
        "min_replicas": args.replicas, "initial_replicas": args.replicas,
        "max_replicas": args.max_replicas,
        "target_ongoing_requests": getattr(args, "max_batch_size", 1)}}


def deploy(args: argparse.Namespace, build_app: BuildApp, model_name: str):
    """Start `args.replicas` replicas of `build_app(args)` on the Ray instance this process is
    connected to, Ray Serve's proxy on --host:--port; returns the metrics board's handle.
    Returns when every replica has loaded its model."""
    ray = import_ray()
    from ray import serve

    board = ray.remote(num_cpus=0)(MetricsBoard).remote()

    def build():  # a closure: Ray Serve calls it on each replica at its start
        return build_replica_app(args, build_app, model_name, board)

    serve.start(http_options={"host": args.host, "port": args.port})
    if not uses_affinity(args):
        ingress = serve.ingress(build)(type("DresdReplica", (), {}))
        deployment = serve.deployment(ingress, name=DEPLOYMENT_NAME, **deployment_options(args))
        serve.run(deployment.bind(), name=APP_NAME, route_prefix="/")
        return board
    from dresd.serve import ray_routing

    replicas = serve.deployment(
        ray_routing.ModelReplica, name=DEPLOYMENT_NAME, **deployment_options(args),
        request_router_config=ray_routing.affinity_router_config(
            spill_at=getattr(args, "max_batch_size", 1)))
    bound = ingress_max_requests(args)
    ingress = serve.deployment(
        serve.ingress()(ray_routing.IngressDeployment), name=INGRESS_NAME, num_replicas=1,
        # It only waits on the replicas, with no CPU of its own. Ray Serve hands it more than
        # it holds, so that those past its bound get its 503 (OpenAI's error object) at once;
        # past that too, Ray Serve's proxy answers 503 rather than queue without end.
        max_ongoing_requests=bound + ray_routing.INGRESS_HEADROOM, max_queued_requests=bound,
        ray_actor_options={"num_cpus": 0}, health_check_period_s=5)
    body_cap = getattr(args, "max_body_bytes", None) or ray_routing.INGRESS_BODY_CAP
    serve.run(ingress.bind(replicas.bind(build, board), body_cap, board, STALE_S,
                           api_key=args.api_key, metrics_open=args.metrics_open,
                           max_in_flight=bound),
              name=APP_NAME, route_prefix="/")
    return board


def ingress_max_requests(args: argparse.Namespace) -> int:
    """Requests the affinity ingress holds at once (`--ingress-max-requests` where the command
    line has it): by default what the replicas hold, each its batch and queue, at the most
    replicas there can be. More would only wait in Ray Serve's router for a replica's slot."""
    given = getattr(args, "ingress_max_requests", None)
    return given or (args.max_replicas or args.replicas) * max_ongoing_requests(args)


def uses_affinity(args: argparse.Namespace) -> bool:
    """Conversation affinity (ray_routing.py) where there is more than one replica to choose
    from; one replica takes every request straight from Ray Serve's proxy."""
    return (getattr(args, "replica_routing", "prefix") == "prefix"
            and (args.replicas > 1 or args.max_replicas is not None))


def serve_on_ray(args: argparse.Namespace, build_app: BuildApp, model_name: str) -> int:
    """`dresd serve --ray`: deploy, then wait for Ctrl-C and take the deployment down."""
    ray = import_ray()
    from ray import serve

    started_here = not ray.is_initialized()
    if started_here:
        # Only the HTTP endpoint follows --host: Ray's own ports (GCS, raylet, workers) listen
        # as Ray configures them (Ray 2.60: every interface, behind its token authentication).
        ray.init(address=args.ray or None, include_dashboard=False, log_to_driver=True)
    board = None
    try:  # Ctrl-C while the replicas load takes the deployment down too
        board = deploy(args, build_app, model_name)
        count = (f"{args.replicas}-{args.max_replicas}" if args.max_replicas is not None
                 else str(args.replicas))
        print(f"dresd serve: {count} replica(s) on Ray Serve at "
              f"http://{args.host}:{args.port}/v1 (Ctrl-C stops)", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.delete(APP_NAME)
        if board is not None:
            ray.kill(board)
        if started_here:
            serve.shutdown()
            ray.shutdown()
    return 0
