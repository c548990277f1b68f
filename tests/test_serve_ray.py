"""`dresd serve --ray --replicas 2`: two Ray Serve replicas of the server behind one endpoint, on
a local Ray (2 CPUs, 127.0.0.1), with the official `openai` client.

One deployment for the module (the replicas load the model once each), with an API key and
`--save-outputs`. Concurrent streams come back as `dresd generate` prints them (float32, so
token for token on any machine) and are spread over both replicas; the key is checked as on
the single-process server; /metrics pools both replicas; each replica's saved outputs feed
`dresd build --append`. Last, a replica is killed mid-stream: its client gets an error, never a
shortened success, and the endpoint keeps answering.
"""

from __future__ import annotations

import json
import random
import re
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import torch

from dresd.serve.app import CACHED_TOKENS_BLOCK

ray = pytest.importorskip("ray", reason="Ray is optional: pip install 'dresd[ray]'")
serve = pytest.importorskip("ray.serve", reason="Ray Serve: pip install 'dresd[ray]'")

KEY = "sk-ray-test-51d0"
MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 12
QUESTIONS = [f"What is {a} plus {b}? Answer in one sentence." for a, b in
             [(2, 3), (7, 5), (10, 4), (6, 6), (12, 9), (3, 8)]]


def port_outside_rays_ranges() -> int:
    """A free port that none of Ray's processes takes before the proxy binds it: below Linux's
    ephemeral range (32768 and up, where Ray's own servers bind port 0) and above Ray's worker
    ports (10002-19999). A port from binding port 0 here was taken by a Ray process between the
    check and the proxy's start (CI: "Failed to bind to address '127.0.0.1:38499'")."""
    for port in random.Random().sample(range(20000, 32768), 200):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32767")


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    from dresd.cli.main import build_parser
    from dresd.cli.serve import build_app, served_model_name
    from dresd.serve import ray_serve

    saved = tmp_path_factory.mktemp("ray_serve") / "outputs.jsonl"
    port = port_outside_rays_ranges()
    args = build_parser().parse_args([
        "serve", "--ray", "--replicas", "2", "--threads", "1", "--dtype", "float32",
        "--max-new-tokens", str(MAX_TOKENS), "--method", "pld", "--host", "127.0.0.1",
        "--port", str(port), "--api-key", KEY, "--save-outputs", str(saved)])
    torch.set_num_threads(1)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    try:
        board = ray_serve.deploy(args, build_app, served_model_name(args))
        yield f"http://127.0.0.1:{port}", saved, board
    finally:
        serve.shutdown()
        ray.shutdown()
    # The key is in no log: the replicas', the proxy's, the controller's, Ray's own.
    assert not [path for path in logs.rglob("*") if path.is_file()
                and KEY.encode() in path.read_bytes()]


def client(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def streamed_chat(url: str, prompt: str, max_tokens: int = MAX_TOKENS
                  ) -> tuple[str, str | None, str]:
    """(text, finish reason, the replica that answered) of a streamed chat completion."""
    with client(url).chat.completions.with_streaming_response.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens, stream=True) as response:
        replica = response.headers["x-dresd-replica"]
        pieces, finish = [], None
        for chunk in response.parse():
            for choice in chunk.choices:
                pieces.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
    return "".join(pieces), finish, replica


def user_chat(prompt: str) -> dict:
    return {"messages": [{"role": "user", "content": prompt}]}


def replica_ids() -> list[str]:
    """The live model replicas' ids (what `x-dresd-replica` says)."""
    return [actor["name"].rsplit("#", 1)[1]
            for actor in ray.util.list_named_actors(all_namespaces=True)
            if "DresdServer#" in actor["name"]]


def first_choice(body: dict) -> str:
    """The replica a request body's conversation goes to while no replica's batch is full."""
    from dresd.serve.ray_routing import conversation_key, rank_replicas

    return rank_replicas(conversation_key(body), replica_ids())[0]


def reference(references, prompt: str) -> str:
    """What `dresd generate --prompt PROMPT` prints: greedy, every method prints `ar`'s output,
    generated alone in this process (conftest's `default_references`: test_serve asks for the
    same questions, so the session computes each once)."""
    from dresd.prompts import encode_prompt

    tokenizer = references.target.tokenizer
    output = references(encode_prompt(tokenizer, prompt, True), MAX_TOKENS)
    return tokenizer.decode(output, skip_special_tokens=True)


def get(url: str, key: str | None = None) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                    timeout=30) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def pooled_successes(url: str) -> float:
    status, text = get(url + "/metrics", key=KEY)
    assert status == 200
    found = re.findall(r'^dresd:request_success_total\{[^}]*\} (\S+)$', text, re.MULTILINE)
    return sum(float(value) for value in found)


def test_two_replicas_stream_what_generate_prints(deployment, default_references):
    url, _, _ = deployment
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        replies = list(pool.map(lambda prompt: streamed_chat(url, prompt), QUESTIONS))
    for prompt, (text, finish, _) in zip(QUESTIONS, replies, strict=True):
        assert text == reference(default_references, prompt)
        assert finish in ("stop", "length")
    # each question on the replica its conversation key ranks first (none of them has a full
    # batch): which ones that is depends on the replicas' random ids
    assert [replica for _, _, replica in replies] == [
        first_choice(user_chat(prompt)) for prompt in QUESTIONS]

    # /metrics counts both replicas' requests (the pooled counters, then each replica's gauges)
    deadline = time.monotonic() + 20
    while pooled_successes(url) < len(QUESTIONS) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert pooled_successes(url) == len(QUESTIONS)
    # a replica's gauges are listed while it has reported in the last STALE_S; it reports every
    # REPORT_EVERY_S from a thread, which a loaded machine can hold up: wait for both
    while replica_gauges(url) < 2 and time.monotonic() < deadline + 20:
        time.sleep(0.5)
    assert replica_gauges(url) == 2


def replica_gauges(url: str) -> int:
    """How many replicas /metrics lists a `replica_num_requests_running` gauge for."""
    text = get(url + "/metrics", key=KEY)[1]
    return len(re.findall(r'^dresd:replica_num_requests_running\{', text, re.MULTILINE))


def test_conversation_key():
    """One key for every turn of a conversation; another for another first question, another
    cache_salt, another first message; the system prompt alone does not decide it."""
    from dresd.serve.ray_routing import conversation_key, rank_replicas

    system = {"role": "system", "content": "You are terse."}
    first = [system, {"role": "user", "content": "Hi?"}]
    key = conversation_key({"messages": first})
    later = [*first, {"role": "assistant", "content": "Hello."},
             {"role": "user", "content": "Bye?"}]
    assert conversation_key({"messages": later, "max_tokens": 3}) == key
    assert conversation_key({"messages": [system, {"role": "user", "content": "Yo?"}]}) != key
    assert conversation_key({"messages": first, "cache_salt": "tenant-b"}) != key
    assert conversation_key({"prompt": "x" * 300}) == conversation_key({"prompt": "x" * 400})
    assert conversation_key({"prompt": [1, 2, 3]}) != conversation_key({"prompt": [1, 2, 4]})
    assert conversation_key({"model": "m"}) is None and conversation_key([1]) is None
    # rendezvous: a replica gone moves only the keys it held
    keys = [conversation_key({"prompt": f"document {i}"}) for i in range(200)]
    before = {k: rank_replicas(k, ["a", "b", "c"])[0] for k in keys}
    after = {k: rank_replicas(k, ["a", "b"])[0] for k in keys}
    assert all(after[k] == before[k] for k in keys if before[k] != "c")
    assert 40 < sum(before[k] == "c" for k in keys) < 100  # a third each, roughly


def test_the_router_ranks_by_key_and_spills_a_full_batch():
    """PrefixAffinityRouter.choose_replicas on stand-ins (no Ray started): the key's ranking,
    one rank per replica; a replica known to hold a full batch goes after those with room;
    no key: one rank of all; a one-replica key: that replica alone."""
    import asyncio
    from types import SimpleNamespace

    from dresd.serve.ray_routing import (
        ONE_REPLICA,
        PrefixAffinityRouter,
        ReplicaHealth,
        rank_replicas,
    )

    replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=name)) for name in "abc"]
    queue_lens: dict = {}
    router = SimpleNamespace(spill_at=4, health=ReplicaHealth(),
                             replica_queue_len_cache=SimpleNamespace(
                                 get=lambda replica_id: queue_lens.get(replica_id.unique_id)))
    router.busy = lambda replica: PrefixAffinityRouter.busy(router, replica)

    def choose(key: str) -> list[list[str]]:
        request = SimpleNamespace(metadata=SimpleNamespace(session_id=key),
                                  routing_context=SimpleNamespace(should_backoff=False))
        ranks = asyncio.run(PrefixAffinityRouter.choose_replicas(router, replicas, request))
        return [[replica.replica_id.unique_id for replica in rank] for rank in ranks]

    order = rank_replicas("k1", ["a", "b", "c"])
    assert choose("k1") == [[name] for name in order]
    queue_lens[order[0]] = 4  # the first choice's batch is full: the others first
    assert choose("k1") == [[order[1]], [order[2]], [order[0]]]
    queue_lens.update({order[1]: 5, order[2]: 9})  # all full: the key's own order
    assert choose("k1") == [[name] for name in order]
    assert choose("") == [["a", "b", "c"]]
    assert choose(ONE_REPLICA + "b") == [["b"]] and choose(ONE_REPLICA + "z") == []


def test_a_conversation_stays_on_its_replica(deployment):
    """Two conversations, one whose key ranks each replica first: both turns of each reach that
    replica, and the second turn reads its history from that replica's prefix cache; then
    /reset_prefix_cache empties every replica's cache."""
    url, _, _ = deployment
    ids = replica_ids()
    chats = {}
    for index in range(64):  # a first question for each replica
        question = [{"role": "user", "content": f"Name a color, please ({index})."}]
        chats.setdefault(first_choice({"messages": question}), question)
        if len(chats) == len(ids):
            break
    for replica, messages in chats.items():
        first = client(url).chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=MAX_TOKENS)
        answer = first.parse()
        second = client(url).chat.completions.with_raw_response.create(
            model=MODEL, messages=[*messages, {"role": "assistant",
                                               "content": answer.choices[0].message.content},
                                   {"role": "user", "content": "And another one?"}],
            max_tokens=MAX_TOKENS)
        assert first.headers["x-dresd-replica"] == second.headers["x-dresd-replica"] == replica
        cached = second.parse().usage.prompt_tokens_details.cached_tokens
        print(f"replica {replica}: second turn read {cached} of "
              f"{second.parse().usage.prompt_tokens} prompt tokens from the cache")
        # the first turn's prompt at least, as the server reports it: in whole blocks
        whole_blocks = answer.usage.prompt_tokens // CACHED_TOKENS_BLOCK * CACHED_TOKENS_BLOCK
        assert cached >= whole_blocks > 0
    request = urllib.request.Request(url + "/reset_prefix_cache", data=b"", method="POST",
                                     headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        assert sorted(json.loads(reply.read())["replicas"]) == sorted(ids)
    for messages in chats.values():  # nothing cached anywhere now
        again = client(url).chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
        assert again.usage.prompt_tokens_details.cached_tokens == 0


def test_the_api_key_is_checked_on_every_replica(deployment):
    url, _, _ = deployment
    for _ in range(4):  # requests land on either replica
        with pytest.raises(openai.AuthenticationError) as caught:
            client(url, "sk-wrong").models.list()
        assert caught.value.body["code"] == "invalid_api_key"
        assert get(url + "/v1/models")[0] == 401
        assert get(url + "/metrics")[0] == 401
        assert get(url + "/health")[0] == 200
    assert [m.id for m in client(url).models.list().data] == [MODEL]


def test_each_replica_saves_its_outputs_for_build_append(deployment, default_target, tmp_path):
    """What the replicas generated, appended to a datastore, is retrieved from it after: REST
    on the grown store drafts a served prompt's answer, and needs fewer forwards for it."""
    from dresd.corpus import CorpusSpec
    from dresd.datastore.append import append_to_datastore
    from dresd.datastore.format import read_manifest
    from dresd.datastore.sparse_store import build_sparse_datastore
    from dresd.prompts import encode_prompt
    from dresd.runner import GenerationSettings, MethodRunner

    def forwards(store) -> int:
        """Target forwards of `dresd generate --method rest` on QUESTIONS[0] with `store`."""
        runner = MethodRunner(default_target, "rest", GenerationSettings(MAX_TOKENS, None, []),
                              datastore=str(store), max_tree_nodes=16)
        prompt_ids = encode_prompt(default_target.tokenizer, QUESTIONS[0], True)
        return runner.generate(prompt_ids).num_target_forwards

    url, saved, _ = deployment
    answered = set()
    for prompt in QUESTIONS * 2:  # until both replicas have generated (alone, this test too)
        if len(answered) == 2 and prompt != QUESTIONS[0]:
            break
        answered.add(streamed_chat(url, prompt)[2])
    files = sorted(saved.parent.glob(f"{saved.stem}.*{saved.suffix}"))
    assert len(files) == 2  # one file per replica: they never write the same one
    rows = [json.loads(line) for path in files for line in path.read_text().splitlines()]
    assert all(row["token_ids"] for row in rows)
    seed = tmp_path / "seed.jsonl"
    seed.write_text(json.dumps({"prompt": "Hello?", "response": "Hello there."}) + "\n")
    store = build_sparse_datastore(default_target, CorpusSpec([str(seed)]), tmp_path / "store",
                                   progress=False)
    before, forwards_before = read_manifest(store).num_documents, forwards(store)
    append_to_datastore(default_target, CorpusSpec([str(path) for path in files]), store,
                        progress=False)
    assert read_manifest(store).num_documents == before + len(rows)
    forwards_after = forwards(store)
    print(f"REST forwards for a served prompt: {forwards_before} before the append, "
          f"{forwards_after} after")
    assert forwards_after < forwards_before  # the served answer is drafted from the store


def test_a_client_gone_stops_its_generation_behind_the_ingress(deployment):
    """A client that leaves mid-stream: the ingress cancels its call, the replica's app sees
    the client gone, and the generation ends as "abort" (a generation that went on would end
    with "length" after 400 tokens)."""
    import http.client
    import socket

    url, _, _ = deployment

    def aborted() -> float:
        text = get(url + "/metrics", key=KEY)[1]
        return sum(float(v) for v in re.findall(
            r'^dresd:request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)$', text,
            re.MULTILINE))

    before = aborted()
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 400, "stream": True}
    connection.request("POST", "/v1/chat/completions", json.dumps(body),
                       {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    reply = connection.getresponse()
    assert reply.status == 200
    while not re.search(rb'"content": ?"[^"]', reply.readline()):
        pass  # until the first piece of text
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()
    deadline = time.monotonic() + 120  # bounds a hang only; the verdict is the finish reason
    while aborted() <= before:
        assert time.monotonic() < deadline, "the generation went on after its client left"
        time.sleep(0.5)


def test_a_replica_reported_unhealthy_gets_no_requests(deployment):
    """A replica whose /health is not 200 on the board (what its health check reports once its
    worker thread has died) gets no more requests through the ingress: a conversation it ranks
    first goes to the other replica; when it reports 200 again (Ray Serve's next check, every
    5 s), the conversation comes back to it."""
    import threading

    from dresd.serve.ray_routing import HEALTH_EVERY_S

    url, _, board = deployment
    down = replica_ids()[0]
    question = next(chat for chat in (user_chat(f"Name a fruit ({i}).") for i in range(64))
                    if first_choice(chat) == down)

    def answered_by() -> str:
        reply = client(url).chat.completions.with_raw_response.create(
            model=MODEL, max_tokens=1, **question)
        return reply.headers["x-dresd-replica"]

    assert answered_by() == down
    stop = threading.Event()

    def report_down() -> None:  # more often than Ray Serve's own checks (200) overwrite it
        while not stop.is_set():
            board.put_health.remote(down, 503)
            time.sleep(0.05)

    reporter = threading.Thread(target=report_down, daemon=True)
    reporter.start()
    try:
        # The ingress reads the board every HEALTH_EVERY_S; Ray Serve's own check writes 200
        # between the reporter's 503s, and a loaded machine (CI) can delay the reporter's puts
        # past a read, so the verdict is the first answer from another replica within a bound
        # (without health routing the conversation never leaves `down`).
        deadline = time.monotonic() + 30 * HEALTH_EVERY_S
        while answered_by() == down:
            assert time.monotonic() < deadline, "the replica reported down kept its requests"
            time.sleep(HEALTH_EVERY_S)
    finally:
        stop.set()
        reporter.join()
    deadline = time.monotonic() + 30
    while answered_by() != down:
        assert time.monotonic() < deadline, "the replica got no requests after 200 again"
        time.sleep(1)


def test_a_killed_replica_fails_its_stream_and_the_other_answers(deployment):
    url, _, _ = deployment
    stream = client(url).chat.completions.with_streaming_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a long story."}],
        max_tokens=400, stream=True)
    finish, chunks = None, 0
    with pytest.raises(openai.APIError), stream as response:
        replica = response.headers["x-dresd-replica"]
        for chunk in response.parse():
            chunks += 1
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
            if chunks == 3:
                [actor] = [a for a in ray.util.list_named_actors(all_namespaces=True)
                           if a["name"].endswith("#" + replica)]
                ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]))
    assert finish is None  # no finish reason: the client never took the stream for whole
    for prompt in QUESTIONS[:3]:
        text, finish, answered_by = streamed_chat(url, prompt)
        assert text and finish in ("stop", "length") and answered_by != replica
