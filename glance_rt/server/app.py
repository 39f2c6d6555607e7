"""`glance-rt serve`: an OpenAI-compatible HTTP server over one Decoder (FastAPI + uvicorn).

One worker owns the decoder and decodes requests in a batch that runs continuously
(`glance_rt.round.batch.Batch`): a waiting request joins at the next round boundary while the decoder
has a free slot (`--max-batch`), and leaves when done; requests beyond the batch wait in a bounded
queue (429 with Retry-After when it is full). `glance-rt serve` runs the worker in the main thread and uvicorn in a
second one: torch's CPU kernels ran generation about 25% slower from a non-main thread on the
development machine (measured; OpenMP's spinning worker team serves the main thread). Between rounds the
worker checks whether each client went away or its request timed out, and drops it there, so a
disconnect frees its slot within one round. Each request's tokens are the ones it gets alone.
"""

import asyncio
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

from glance_rt.errors import GlanceError
from glance_rt.round.loop import Stats
from glance_rt.server.metrics import Metrics
from glance_rt.server.protocol import ApiError, Request, parse

MAX_BODY = 32 << 20  # bytes: a request with a few images fits


@dataclass
class Job:
    request: Request
    inputs: dict
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue  # ("text", str) pieces, then ("done", info) or ("error", ApiError)
    deadline: float
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    cancelled: threading.Event = field(default_factory=threading.Event)
    enqueued: float = field(default_factory=time.perf_counter)

    def put(self, kind: str, value) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


@dataclass
class Active:
    """A job in the running batch: what its client has been sent so far."""

    job: Job
    handle: int
    start: float = field(default_factory=time.perf_counter)
    tokens: list[int] = field(default_factory=list)
    shown: str = ""
    first: float | None = None
    last: float | None = None


class Worker:
    """The thread that runs the decoder: every waiting job joins the running batch (`glance_rt.round.batch`)
    at a round boundary while the decoder has a free slot, and leaves when done, cancelled or timed out."""

    def __init__(self, decoder, metrics: Metrics, max_queue: int):
        from glance_rt.round.batch import Batch

        self.decoder, self.metrics = decoder, metrics
        self.jobs: queue.Queue = queue.Queue(maxsize=max_queue)
        self.batch = Batch(decoder)
        self.active: dict[int, Active] = {}
        metrics.max_batch.set(decoder.max_batch)

    def submit(self, job: Job) -> None:
        try:
            self.jobs.put_nowait(job)
        except queue.Full as e:
            self.metrics.rejected.inc()
            raise ApiError(429, f"the server is busy ({self.jobs.maxsize} requests queued): retry shortly",
                           kind="rate_limit_error", code="queue_full") from e
        self.metrics.queue_depth.set(self.jobs.qsize())

    def serve_forever(self) -> None:
        """Decode forever (the caller's thread: run it in the main one)."""
        while True:
            self.serve_step()

    def serve_step(self, wait: float | None = None) -> None:
        """Admit waiting jobs while slots are free (with none running, wait `wait` seconds for one; None:
        as long as it takes), then run one round of the batch and hand each job its tokens."""
        while not self.batch.full:
            try:
                job = self.jobs.get(timeout=wait) if not self.active else self.jobs.get_nowait()
            except queue.Empty:
                break
            self.metrics.queue_depth.set(self.jobs.qsize())
            self._admit(job)
        if not self.active:
            return
        self.metrics.observe_round(len(self.active))
        try:
            for ev in self.batch.step():  # a new request's first token as soon as its prefill is done
                self._on_event(ev)
        except Exception as e:  # never let one round take the server down: fail the jobs in it
            for act in list(self.active.values()):
                self.batch.cancel(act.handle)
                self._leave(act, "error", ApiError(500, f"internal error: {type(e).__name__}: {e}",
                                                   kind="server_error"))
        now = time.perf_counter()
        for act in list(self.active.values()):  # the client left, or the request ran out of time
            if act.job.cancelled.is_set() or now > act.job.deadline:
                stats = self.batch.stats(act.handle)
                self.batch.cancel(act.handle)
                self._leave(act, "cancelled" if act.job.cancelled.is_set() else "timeout", stats=stats)

    def _on_event(self, ev) -> None:
        act = self.active.get(ev.handle)
        if act is None:
            return
        self._send(act, ev.tokens, time.perf_counter())
        if ev.error is not None:
            status = 400 if isinstance(ev.error, GlanceError) else 500
            kind = "invalid_request_error" if status == 400 else "server_error"
            self._leave(act, "error", ApiError(status, str(ev.error), kind=kind), ev.stats)
        elif ev.done:
            max_tokens = act.job.request.max_tokens
            stop = len(act.tokens) < max_tokens or (act.tokens and act.tokens[-1] in self.decoder.eos_ids)
            self._leave(act, "stop" if stop else "length", stats=ev.stats)

    def _admit(self, job: Job) -> None:
        if job.cancelled.is_set():  # the client left while it waited
            return
        if time.perf_counter() > job.deadline:
            job.put("error", ApiError(408, "the request waited past the server's --request-timeout", kind="timeout"))
            return
        try:
            handle = self.batch.add(job.request.max_tokens, job.request.sampling, **job.inputs)
        except GlanceError as e:
            job.put("error", ApiError(400, str(e)))
            return
        self.active[handle] = Active(job, handle)

    def _send(self, act: Active, run: list[int], now: float) -> None:
        """A round's tokens: first-token and inter-token times, and the text they complete, streamed."""
        if act.first is None:
            act.first = now
            self.metrics.observe_ttft(now - act.job.enqueued)
        elif run:
            self.metrics.observe_itl((now - act.last) / len(run), len(run))
        act.last = now
        act.tokens += run
        text = self.decoder.target.decode(act.tokens) or ""
        if not text.endswith("\ufffd") and text.startswith(act.shown) and len(text) > len(act.shown):
            act.job.put("text", text[len(act.shown):])
            act.shown = text

    def _leave(self, act: Active, reason: str, error: ApiError | None = None, stats: Stats | None = None) -> None:
        """The job is over: its last text, its metrics, then "done" (or its error)."""
        del self.active[act.handle]
        job, stats = act.job, stats or Stats()
        text = self.decoder.target.decode(act.tokens) or ""
        if text.startswith(act.shown) and len(text) > len(act.shown):
            job.put("text", text[len(act.shown):])
        self.metrics.observe_request(stats, len(act.tokens), time.perf_counter() - act.start, reason)
        if error is not None:
            job.put("error", error)
        elif reason == "timeout":
            job.put("error", ApiError(408, "the request ran past the server's --request-timeout", kind="timeout"))
        elif reason != "cancelled":
            job.put("done", {"finish_reason": reason, "completion_tokens": len(act.tokens), "text": text,
                             "prompt_tokens": stats.prompt_tokens, "tau": stats.tau, "rounds": stats.rounds})


def create_app(decoder, model_name: str, max_queue: int = 16, request_timeout: float = 600.0,
               default_max_tokens: int = 256, api_key: str | None = None):
    """(the FastAPI app serving `decoder` (warmed up by the caller) as model `model_name`, its Worker:
    call `worker.serve_forever()` to decode). `api_key`: every /v1 route wants `Authorization: Bearer
    <api_key>` (401 in OpenAI's error format otherwise); /health and /metrics stay open (probes and
    scrapers), as in vLLM."""
    import hmac
    import json

    from fastapi import FastAPI
    from fastapi import Request as HttpRequest
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    app = FastAPI(title="glance-rt", docs_url=None, redoc_url=None)
    metrics = Metrics()
    worker = Worker(decoder, metrics, max_queue)
    target = decoder.target
    created = int(time.time())

    def error(e: ApiError) -> JSONResponse:
        headers = {"Retry-After": "1"} if e.status == 429 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(HTTPException)
    async def _http(_, exc):  # unknown routes, wrong methods: OpenAI's error format too
        return error(ApiError(exc.status_code, str(exc.detail), kind="invalid_request_error"))

    @app.exception_handler(Exception)
    async def _any(_, exc):  # anything unforeseen is a 500 in OpenAI's format, and the server lives on
        return error(ApiError(500, f"internal error: {type(exc).__name__}", kind="server_error"))

    def authorize(http: HttpRequest) -> None:
        if api_key is None:
            return
        scheme, _, given = http.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
            raise ApiError(401, "a valid API key is required: send it as 'Authorization: Bearer <key>' (the openai "
                                "client's api_key)", kind="invalid_request_error", code="invalid_api_key")

    async def body_of(http: HttpRequest) -> dict:
        raw = await http.body()
        if len(raw) > MAX_BODY:
            raise ApiError(413, f"request body over {MAX_BODY >> 20} MiB")
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the body is not valid JSON ({e})") from e

    async def submit(http: HttpRequest, chat: bool):
        authorize(http)
        req = parse(await body_of(http), chat, model_name, target.is_vlm, default_max_tokens)
        try:
            if chat:
                inputs = target.encode_messages(req.messages, req.images)
            else:
                inputs = dict(target.tokenizer(req.prompt, return_tensors="pt"))
        except GlanceError as e:
            raise ApiError(400, str(e), "messages" if chat else "prompt") from e
        prompt_len = inputs["input_ids"].shape[1]
        longest = decoder.max_length - decoder._scratch_rows() - 1  # prompt tokens that leave room for one more
        if prompt_len > longest:
            raise ApiError(400, f"the prompt has {prompt_len} tokens; this server's static cache takes "
                                f"{decoder.max_length} rows, so prompts of at most {longest} tokens (start it "
                                "with a larger --max-length)", "messages" if chat else "prompt",
                           code="context_length_exceeded")
        room = longest + 1 - prompt_len
        req.max_tokens = min(req.max_tokens, room)
        loop = asyncio.get_running_loop()
        job = Job(req, inputs, loop, asyncio.Queue(), time.perf_counter() + request_timeout)
        worker.submit(job)
        metrics.requests.inc()
        return job

    def chunk(job: Job, chat: bool, delta: dict | str | None, finish=None, usage=None) -> str:
        if chat:
            choice = {"index": 0, "delta": delta or {}, "finish_reason": finish, "logprobs": None}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
            obj = "text_completion"
        body = {"id": job.id, "object": obj, "created": int(time.time()), "model": model_name,
                "choices": [choice] if usage is None else []}
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    def usage_of(info: dict) -> dict:
        return {"prompt_tokens": info["prompt_tokens"], "completion_tokens": info["completion_tokens"],
                "total_tokens": info["prompt_tokens"] + info["completion_tokens"]}

    async def respond(http: HttpRequest, chat: bool):
        try:
            job = await submit(http, chat)
        except ApiError as e:
            return error(e)

        async def next_event():
            while True:
                try:
                    return await asyncio.wait_for(job.events.get(), timeout=0.5)
                except TimeoutError:
                    if await http.is_disconnected():
                        job.cancelled.set()
                        return ("cancelled", None)

        if job.request.stream:
            async def events():
                if chat:
                    yield chunk(job, chat, {"role": "assistant", "content": ""})
                try:
                    while True:
                        kind, value = await next_event()
                        if kind == "text":
                            yield chunk(job, chat, {"content": value} if chat else value)
                        elif kind == "done":
                            yield chunk(job, chat, {} if chat else "", finish=value["finish_reason"])
                            if job.request.include_usage:
                                yield chunk(job, chat, None, usage={**usage_of(value), "glance": {
                                    "tau": value["tau"], "rounds": value["rounds"]}})
                            yield "data: [DONE]\n\n"
                            return
                        elif kind == "error":
                            yield f"data: {json.dumps(value.body())}\n\n"
                            return
                        else:
                            return
                finally:
                    job.cancelled.set()  # a client gone mid-stream frees the decoder at the next round

            return StreamingResponse(events(), media_type="text/event-stream")
        while True:
            kind, value = await next_event()
            if kind == "error":
                return error(value)
            if kind in ("done", "cancelled"):
                break
        if kind == "cancelled":
            return error(ApiError(499, "client closed the request"))
        message = ({"message": {"role": "assistant", "content": value["text"]}} if chat else {"text": value["text"]})
        return JSONResponse({
            "id": job.id, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model_name,
            "choices": [{"index": 0, **message, "finish_reason": value["finish_reason"], "logprobs": None}],
            "usage": usage_of(value), "glance": {"tau": value["tau"], "rounds": value["rounds"]},
        })

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest):
        return await respond(http, chat=True)

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        return await respond(http, chat=False)

    @app.get("/v1/models")
    async def models(http: HttpRequest):
        try:
            authorize(http)
        except ApiError as e:
            return error(e)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "glance-rt"}]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "queue_depth": worker.jobs.qsize(),
                "running": len(worker.active), "max_batch": decoder.max_batch}

    @app.get("/metrics")
    async def prometheus():
        from prometheus_client import CONTENT_TYPE_LATEST

        metrics.queue_depth.set(worker.jobs.qsize())
        return PlainTextResponse(metrics.text(), media_type=CONTENT_TYPE_LATEST)

    return app, worker


def loopback(host: str) -> bool:
    """Whether binding to `host` keeps the server to this machine."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve anywhere


def serve(app, worker: Worker, host: str, port: int) -> None:
    """uvicorn in a background thread, the decoder in this (the main) thread, until interrupted."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    server.install_signal_handlers = lambda: None  # signals stay with the main thread
    threading.Thread(target=server.run, name="glance-rt-http", daemon=True).start()
    try:
        worker.serve_forever()
    except KeyboardInterrupt:
        server.should_exit = True
