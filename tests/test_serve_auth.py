"""`dresd serve --api-key`: a real server on 127.0.0.1 and the official `openai` client.

One server with the key from `DRESD_API_KEY` (so the environment path is the one exercised;
the option is the same value through argparse) and `/metrics` closed; one with `--api-key` and
`--metrics-open`. Both use the default model with `--method pld`, no datastore.
"""

from __future__ import annotations

import urllib.error
import urllib.request

import openai
import pytest

from dresd.serve.auth import exposure_warning, is_loopback, unauthorized_body
from dresd.serve.local import LocalServer

KEY = "sk-dresd-test-7f3a9c"
MODEL = "SmolLM2-135M-Instruct"
COMMON = ["--threads", "1", "--max-new-tokens", "6", "--dtype", "float32", "--method", "pld"]


@pytest.fixture(scope="module")
def servers():
    closed = LocalServer(COMMON, env={"DRESD_API_KEY": KEY}).start()
    open_metrics = LocalServer([*COMMON, "--api-key", KEY, "--metrics-open"]).start()
    try:
        yield closed.wait_ready(), open_metrics.wait_ready()
    finally:
        closed.stop()
        open_metrics.stop()
    for server in (closed, open_metrics):
        assert KEY not in server.log()  # neither the banner nor a request's line shows it
        assert "Traceback" not in server.log()


def client(server: LocalServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


def get(url: str, key: str | None = None) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                    timeout=30) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_the_right_key_is_served(servers):
    for server in servers:
        reply = client(server, KEY).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=6)
        assert reply.choices[0].message.content
        stream = client(server, KEY).completions.create(model=MODEL, prompt="One, two,",
                                                        max_tokens=4, stream=True)
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices)


@pytest.mark.parametrize("key", ["sk-wrong", KEY + "x", KEY[:-1], KEY.upper()])
def test_a_wrong_key_is_401_with_openais_error(servers, key):
    server = servers[0]
    with pytest.raises(openai.AuthenticationError) as caught:
        client(server, key).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=6)
    assert caught.value.status_code == 401
    assert caught.value.body["code"] == "invalid_api_key"
    assert caught.value.body["type"] == "invalid_request_error"
    assert KEY not in caught.value.body["message"]
    with pytest.raises(openai.AuthenticationError):
        client(server, key).models.list()


def test_no_key_is_401(servers):
    for server in servers:
        status, body = get(server.url + "/v1/models")
        assert status == 401
        assert "didn't provide an API key" in body
        for path in ("/docs", "/openapi.json", "/nowhere"):  # every path, not just /v1
            assert get(server.url + path)[0] == 401
        status, _ = get(server.url + "/v1/models", key=KEY)
        assert status == 200
        # Another scheme than Bearer is no key.
        request = urllib.request.Request(server.url + "/v1/models",
                                         headers={"Authorization": f"Basic {KEY}"})
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=30)
        assert caught.value.code == 401


def test_emptying_the_prefix_cache_takes_the_key(servers):
    """POST /reset_prefix_cache is behind the key, --metrics-open or not."""
    for server in servers:
        for key, status in ((None, 401), ("sk-wrong", 401), (KEY, 200)):
            headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
            request = urllib.request.Request(server.url + "/reset_prefix_cache", data=b"",
                                             headers=headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=30) as reply:
                    assert reply.status == status
            except urllib.error.HTTPError as err:
                assert err.code == status


def test_health_is_open_and_metrics_only_when_asked(servers):
    closed, open_metrics = servers
    for server in servers:
        assert get(server.url + "/health")[0] == 200
    assert get(closed.url + "/metrics")[0] == 401
    status, text = get(closed.url + "/metrics", key=KEY)
    assert status == 200 and "dresd:num_requests_running" in text
    status, text = get(open_metrics.url + "/metrics")
    assert status == 200 and "dresd:num_requests_running" in text
    assert KEY not in text


def test_the_exposure_warning():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.5")
    assert not is_loopback("myhost.example")
    assert exposure_warning("127.0.0.1", None) is None
    assert exposure_warning("0.0.0.0", KEY) is None
    warning = exposure_warning("0.0.0.0", None)
    assert "--api-key" in warning and "0.0.0.0" in warning
    assert unauthorized_body(True)["error"]["code"] == "invalid_api_key"


def test_options_that_cannot_serve_are_refused(monkeypatch):
    from dresd.cli.main import build_parser
    from dresd.cli.serve import check_args
    from dresd.errors import UserError

    monkeypatch.delenv("DRESD_API_KEY", raising=False)
    parser = build_parser()
    for argv, message in [(["--replicas", "2"], "need --ray"),
                          (["--ray", "--replicas", "0"], "--replicas must be >= 1"),
                          (["--max-replicas", "3"], "need --ray"),
                          (["--ray", "--replicas", "2", "--max-replicas", "1"],
                           "--max-replicas \\(1\\) must be >= --replicas"),
                          (["--metrics-open"], "--metrics-open needs an API key")]:
        with pytest.raises(UserError, match=message):
            check_args(parser.parse_args(["serve", *argv]))
    check_args(parser.parse_args(["serve", "--metrics-open", "--api-key", KEY]))
    check_args(parser.parse_args(["serve", "--ray", "--replicas", "2", "--max-replicas", "4"]))
    monkeypatch.setenv("DRESD_API_KEY", KEY)
    check_args(parser.parse_args(["serve", "--metrics-open"]))


def test_ray_serve_deployment_options():
    """Fixed replicas, or Ray Serve's autoscaling with --max-replicas (Ray not imported)."""
    from dresd.cli.main import build_parser
    from dresd.serve.ray_serve import deployment_options

    parser = build_parser()
    fixed = deployment_options(parser.parse_args(["serve", "--ray", "--replicas", "3",
                                                  "--threads", "2", "--max-queue", "8"]))
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"] == {"num_cpus": 2}
    assert fixed["max_ongoing_requests"] == 8 + 16  # the queue and the batch
    scaled = deployment_options(parser.parse_args(["serve", "--ray", "--replicas", "1",
                                                   "--max-replicas", "4"]))
    assert "num_replicas" not in scaled
    assert scaled["autoscaling_config"] == {"min_replicas": 1, "initial_replicas": 1,
                                            "max_replicas": 4, "target_ongoing_requests": 16}
