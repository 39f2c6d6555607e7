"""`glance-rt serve` end to end: the real server (uvicorn in a subprocess on a free loopback port), the
real `openai` client, raw HTTP for bad inputs. Outputs equal offline `Decoder.generate`."""

import base64
import http.client
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

import glance_rt

openai = pytest.importorskip("openai", reason="the openai client is a dev dependency")

MAX_LENGTH = 256
PIECE = 8  # --prefill-chunk: every prompt here is prefilled in several pieces, as offline


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


class Server:
    def __init__(self, model: str, drafter: str, *extra: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "glance_rt.cli", "serve", "--target", model, "--drafter", drafter, "--port",
             str(self.port), "--max-length", str(MAX_LENGTH), *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        deadline = time.time() + 180
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stdout.read()}")
            try:
                if get(self.url + "/health")[0] == 200:
                    break
            except OSError:
                time.sleep(0.5)
        else:
            raise RuntimeError("server did not come up")
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def close(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.tiny_models import make_tiny

    root = tmp_path_factory.mktemp("serve")
    model, processor = make_tiny("qwen2_5_vl")
    model.save_pretrained(root / "m")
    processor.save_pretrained(root / "m")
    target = glance_rt.load_target(root / "m")
    glance_rt.init_drafter(target, block_size=4, seed=1).save(root / "d")
    return str(root / "m"), str(root / "d")


@pytest.fixture(scope="module")
def server(tiny):
    s = Server(*tiny, "--max-queue", "2", "--max-tokens", "16", "--prefill-chunk", str(PIECE))
    yield s
    s.close()


@pytest.fixture(scope="module")
def offline(tiny):
    """The same method offline (the server's defaults: tree 8 + prompt lookup, eager, same cache size; the
    prompt prefilled in the same pieces)."""
    target = glance_rt.load_target(tiny[0])
    dec = glance_rt.Decoder(target, glance_rt.load_drafter(tiny[1], target), max_length=MAX_LENGTH,
                            prefill_chunk=PIECE)

    def run(prompt: str, images=(), sampling=None, max_tokens=16):
        inputs = target.encode_chat(prompt, images)
        return dec.generate(max_new_tokens=max_tokens, sampling=sampling or glance_rt.Sampling(), **inputs).text

    return run


def png_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_chat_equals_offline_plain_and_streaming(server, offline):
    from tests.tiny_models import make_images

    r = server.client.chat.completions.create(model=server.client.models.list().data[0].id, temperature=0,
                                              messages=[{"role": "user", "content": "Tell me about rivers."}],
                                              max_tokens=16)
    assert r.choices[0].message.content == offline("Tell me about rivers.")
    assert r.usage.completion_tokens > 0 and r.model_extra["glance"]["rounds"] >= 1
    image = make_images(1)[0]
    content = [{"type": "image_url", "image_url": {"url": png_url(image)}}, {"type": "text", "text": "What is it?"}]
    pieces, usage = [], None
    for chunk in server.client.chat.completions.create(model=r.model, temperature=0, stream=True, max_tokens=16,
                                                       messages=[{"role": "user", "content": content}],
                                                       stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        elif chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    assert "".join(pieces) == offline("What is it?", [image])
    assert usage is not None and usage.completion_tokens > 0


def test_sampling_is_seed_exact_through_the_server(server, offline):
    s = glance_rt.Sampling(do_sample=True, temperature=1.5, top_k=0, top_p=0.9, seed=7)
    r = server.client.chat.completions.create(model=server.client.models.list().data[0].id,
                                              messages=[{"role": "user", "content": "Say something."}],
                                              temperature=1.5, top_p=0.9, seed=7, max_tokens=16)
    assert r.choices[0].message.content == offline("Say something.", sampling=s)


def post(server, path: str, body, raw: bool = False) -> tuple[int, dict]:
    data = (body if raw else json.dumps(body)).encode()
    req = urllib.request.Request(server.url + path, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("body,status,param", [
    ("{not json", 400, None),
    ({"messages": "hi"}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, 400, "logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400, "tools"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400, "top_p"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-9"}, 404, "model"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     400, "messages"),
    ({"messages": [{"role": "user", "content": "word " * 400}]}, 400, "messages"),
])
def test_bad_requests_get_openai_errors(server, body, status, param):
    code, reply = post(server, "/v1/chat/completions", body, raw=isinstance(body, str))
    assert code == status, reply
    err = reply["error"]
    assert err["message"] and err["type"] and err["param"] == param
    assert get(server.url + "/health")[0] == 200  # the server lives on


def test_completions_models_metrics(server, offline):
    r = server.client.completions.create(model=server.client.models.list().data[0].id, prompt="Once upon a time",
                                         temperature=0, max_tokens=8)
    assert r.choices[0].text and r.usage.completion_tokens <= 8
    text = get(server.url + "/metrics")[1]
    assert "glance_requests_total" in text and "glance_accepted_tokens_per_round_bucket" in text
    assert "glance_draft_passes_total" in text
    code, body = get(server.url + "/nope")
    assert code == 404 and json.loads(body)["error"]["type"] == "invalid_request_error"


def counters(server) -> dict:
    text = get(server.url + "/metrics")[1]
    return {line.split()[0]: float(line.split()[-1]) for line in text.splitlines()
            if line and not line.startswith("#") and "{" not in line}


def test_load_no_request_lost_or_mixed_and_disconnect_frees_the_decoder(server, offline):
    """8 clients x 3 requests with a queue of 2 (and the default batch of 8): each completes with its own
    prompt's answer (as decoded alone) or gets a 429; the metrics count them, and rounds ran several
    requests at once; a client dropped mid-stream does not block the next request."""
    prompts = [f"Count to {i}." for i in range(8)]
    want = {p: offline(p, max_tokens=8) for p in prompts}
    results, errors = [], []
    before = counters(server)

    def client(p):
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        for _ in range(3):
            try:
                r = c.chat.completions.create(model=server.client.models.list().data[0].id, temperature=0,
                                              messages=[{"role": "user", "content": p}], max_tokens=8)
                results.append((p, r.choices[0].message.content, r.usage.completion_tokens))
            except openai.RateLimitError:
                errors.append(429)

    threads = [threading.Thread(target=client, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert len(results) + len(errors) == 24 and results
    assert all(text == want[p] for p, text, _ in results)
    after = counters(server)  # the metrics add up
    assert after["glance_requests_total"] - before["glance_requests_total"] == len(results)
    assert after["glance_requests_rejected_total"] - before["glance_requests_rejected_total"] == len(errors)
    assert (after["glance_completion_tokens_total"] - before["glance_completion_tokens_total"]
            == sum(n for _, _, n in results))
    rounds = after["glance_batch_rounds_total"] - before["glance_batch_rounds_total"]
    assert after["glance_batch_sequences_total"] - before["glance_batch_sequences_total"] > rounds  # batched
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps({
        "messages": [{"role": "user", "content": "Go on and on."}], "stream": True, "max_tokens": 200,
        "temperature": 0}), {"content-type": "application/json"})
    resp = conn.getresponse()
    resp.readline()  # the first chunk, then hang up
    conn.close()
    start = time.time()
    r = server.client.chat.completions.create(model=server.client.models.list().data[0].id, temperature=0,
                                              messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert r.choices[0].message.content == offline("Hi", max_tokens=4)
    assert time.time() - start < 60


def test_api_key_guards_v1_and_one_at_a_time_still_serves(tiny, offline):
    """--api-key: /v1 routes answer 401 (OpenAI's format) without the key or with a wrong one, and serve
    with it; /health and /metrics stay open. --max-batch 1 decodes one request at a time, same output."""
    s = Server(*tiny, "--api-key", "sesame", "--max-batch", "1", "--max-tokens", "8", "--prefill-chunk", str(PIECE))
    try:
        assert json.loads(get(s.url + "/health")[1])["max_batch"] == 1
        assert get(s.url + "/metrics")[0] == 200
        for key in ("none", "sesame2"):
            c = openai.OpenAI(base_url=s.url + "/v1", api_key=key, max_retries=0)
            with pytest.raises(openai.AuthenticationError) as e:
                c.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}])
            assert e.value.body["code"] == "invalid_api_key"
            with pytest.raises(openai.AuthenticationError):
                c.models.list()
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="sesame", max_retries=0)
        r = c.chat.completions.create(model=c.models.list().data[0].id, temperature=0,
                                      messages=[{"role": "user", "content": "Hi"}])
        assert r.choices[0].message.content == offline("Hi", max_tokens=8)
    finally:
        s.close()


def test_serve_refuses_an_open_bind_without_a_key(tiny):
    from click.testing import CliRunner

    from glance_rt.cli import main

    env = {"GLANCE_RT_API_KEY": ""}
    out = CliRunner().invoke(main, ["serve", "--target", tiny[0], "--host", "0.0.0.0"], env=env)
    assert out.exit_code != 0 and "--api-key" in out.output
    out = CliRunner().invoke(main, ["serve", "--target", tiny[0], "--max-batch", "0"], env=env)
    assert out.exit_code != 0 and "--max-batch" in out.output
    out = CliRunner().invoke(main, ["serve", "--target", tiny[0], "--prefill-chunk", "-1"], env=env)
    assert out.exit_code != 0 and "--prefill-chunk" in out.output


def test_metrics_are_prometheus_exposition_with_the_documented_names():
    """/metrics is prometheus_client's exposition of the server's own registry: it parses with the client's
    parser, carries every documented name, and the values add up (a chunk of n tokens is n ITL samples)."""
    from types import SimpleNamespace

    from prometheus_client.parser import text_string_to_metric_families

    from glance_rt.server.metrics import Metrics

    m, other = Metrics(), Metrics()  # two servers in one process keep their own counts
    m.requests.inc()
    m.observe_round(3)
    m.observe_itl(0.01, 4)
    m.observe_request(SimpleNamespace(prompt_tokens=5, rounds=2, draft_passes=1, drafted=[0], accepted_lengths=[3, 1]),
                      4, 1.0, "stop")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(m.text()) for s in f.samples}
    assert samples[("glance_requests_total", ())] == 1 and samples[("glance_batch_sequences_total", ())] == 3
    assert samples[("glance_requests_finished_total", (("reason", "stop"),))] == 1
    assert samples[("glance_completion_tokens_total", ())] == 4 and samples[("glance_batch_size", ())] == 3
    assert samples[("glance_inter_token_latency_seconds_count", ())] == 4
    assert samples[("glance_accepted_tokens_per_round_bucket", (("le", "3.0"),))] == 1
    assert samples[("glance_accepted_tokens_per_round_bucket", (("le", "2.0"),))] == 0
    assert "glance_requests_total 0.0" in other.text()
