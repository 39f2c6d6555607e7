"""`glance-rt serve`: an OpenAI-compatible HTTP server over one Decoder (FastAPI + uvicorn).

One worker owns the decoder and serves requests in arrival order from a bounded queue (429 with
Retry-After when it is full). `glance-rt serve` runs the worker in the main thread and uvicorn in a
second one: torch's CPU kernels ran generation about 25% slower from a non-main thread on the
development machine (measured; OpenMP's spinning worker team serves the main thread). A request runs
as the Decoder's rounds; between rounds the worker checks whether the client went away or the request
timed out, and stops it there, so a disconnect frees the decoder within one round. Batch size is 1:
concurrent requests wait their turn.
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


class Worker:
    """The thread that runs the decoder, one job at a time."""

    def __init__(self, decoder, metrics: Metrics, max_queue: int):
        self.decoder, self.metrics = decoder, metrics
        self.jobs: queue.Queue = queue.Queue(maxsize=max_queue)

    def submit(self, job: Job) -> None:
        try:
            self.jobs.put_nowait(job)
        except queue.Full as e:
            self.metrics.rejected += 1
            raise ApiError(429, f"the server is busy ({self.jobs.maxsize} requests queued): retry shortly",
                           kind="rate_limit_error", code="queue_full") from e
        self.metrics.queue_depth = self.jobs.qsize()

    def serve_forever(self) -> None:
        """Decode queued jobs, one at a time, forever (the caller's thread: run it in the main one)."""
        while True:
            job = self.jobs.get()
            self.metrics.queue_depth = self.jobs.qsize()
            try:
                self._run(job)
            except GlanceError as e:
                job.put("error", ApiError(400, str(e)))
            except Exception as e:  # never let one request take the server down
                job.put("error", ApiError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error"))

    def _run(self, job: Job) -> None:
        if job.cancelled.is_set():  # the client left while it waited
            return
        if time.perf_counter() > job.deadline:
            job.put("error", ApiError(408, "the request waited past the server's --request-timeout", kind="timeout"))
            return
        stats, tokens, shown = Stats(), [], ""
        target, start = self.decoder.target, time.perf_counter()
        first = last = None
        reason = "length"
        rounds = self.decoder.rounds(job.request.max_tokens, stats, job.request.sampling, **job.inputs)
        for run in rounds:
            now = time.perf_counter()
            if first is None:
                first = now
                self.metrics.observe_ttft(now - job.enqueued)
            elif run:
                self.metrics.observe_itl((now - last) / len(run), len(run))
            last = now
            tokens += run
            text = target.decode(tokens) or ""
            if not text.endswith("\ufffd") and text.startswith(shown) and len(text) > len(shown):
                job.put("text", text[len(shown):])
                shown = text
            if job.cancelled.is_set() or now > job.deadline:
                rounds.close()
                reason = "cancelled" if job.cancelled.is_set() else "timeout"
                break
        else:
            reason = "stop" if (len(tokens) < job.request.max_tokens or
                                (tokens and tokens[-1] in self.decoder.eos_ids)) else "length"
        text = target.decode(tokens) or ""
        if text.startswith(shown) and len(text) > len(shown):
            job.put("text", text[len(shown):])
        self.metrics.observe_request(stats, len(tokens), time.perf_counter() - start, reason)
        if reason == "timeout":
            job.put("error", ApiError(408, "the request ran past the server's --request-timeout", kind="timeout"))
            return
        job.put("done", {"finish_reason": reason, "completion_tokens": len(tokens), "text": text,
                         "prompt_tokens": stats.prompt_tokens, "tau": stats.tau, "rounds": stats.rounds})


def create_app(decoder, model_name: str, max_queue: int = 16, request_timeout: float = 600.0,
               default_max_tokens: int = 256):
    """(the FastAPI app serving `decoder` (warmed up by the caller) as model `model_name`, its Worker:
    call `worker.serve_forever()` to decode)."""
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

    async def body_of(http: HttpRequest) -> dict:
        raw = await http.body()
        if len(raw) > MAX_BODY:
            raise ApiError(413, f"request body over {MAX_BODY >> 20} MiB")
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the body is not valid JSON ({e})") from e

    async def submit(http: HttpRequest, chat: bool):
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
        metrics.requests += 1
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
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "glance-rt"}]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "queue_depth": worker.jobs.qsize()}

    @app.get("/metrics")
    async def prometheus():
        metrics.queue_depth = worker.jobs.qsize()
        return PlainTextResponse(metrics.text(), media_type="text/plain; version=0.0.4")

    return app, worker


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
