"""OpenAI request bodies -> what one decoding job needs, and OpenAI's error format.

Every refusal is an `ApiError` (HTTP status, OpenAI error type, the parameter, a message saying what
to do); nothing here touches the model.
"""

import base64
import binascii
import io
from dataclasses import dataclass, field

from glance_rt.round.sample import Sampling

SUPPORTED = {  # parameter -> what the server does with it
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop",
    "stream", "stream_options", "n", "user", "top_k", "min_p", "repetition_penalty",
}
REFUSED = {  # accepted by OpenAI's API, not by this server: a 400 names them
    "logprobs": "log-probabilities are not returned", "top_logprobs": "log-probabilities are not returned",
    "tools": "tool calls are not supported", "tool_choice": "tool calls are not supported",
    "functions": "function calls are not supported", "function_call": "function calls are not supported",
    "response_format": "structured output is not supported", "logit_bias": "logit biases are not supported",
    "presence_penalty": "use repetition_penalty (HF semantics) instead",
    "frequency_penalty": "use repetition_penalty (HF semantics) instead",
    "best_of": "one completion per request", "echo": "the prompt is not echoed", "suffix": "no insertion mode",
    "parallel_tool_calls": "tool calls are not supported", "audio": "text output only",
    "modalities": "text output only", "prediction": "predicted outputs are not supported",
}


class ApiError(Exception):
    """An error answered in OpenAI's format: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Request:
    """One request, checked: the conversation (or prompt), its images, sampling, limits, streaming."""

    messages: list[dict] | None
    prompt: str | None
    images: list = field(default_factory=list)
    sampling: Sampling = field(default_factory=Sampling)
    max_tokens: int = 256
    stream: bool = False
    include_usage: bool = False


def _number(body: dict, name: str, kind, lo=None, hi=None, lo_open=False):
    value = body.get(name)
    if value is None:
        return None
    ok = isinstance(value, bool) is False and isinstance(value, (int, float) if kind is float else int)
    if not ok:
        raise ApiError(400, f"'{name}' must be {'a number' if kind is float else 'an integer'}, got {value!r}", name)
    if lo is not None and (value <= lo if lo_open else value < lo) or hi is not None and value > hi:
        bounds = f"{'(' if lo_open else '['}{lo}, {hi if hi is not None else 'inf'}]"
        raise ApiError(400, f"'{name}' must be in {bounds}, got {value}", name)
    return kind(value)


def _image(url: str):
    """A `data:image/...;base64,` URL -> PIL image (remote URLs are never fetched)."""
    from PIL import Image, UnidentifiedImageError

    if not url.startswith("data:"):
        raise ApiError(400, "image_url must be a data: URL with a base64 image (the server fetches no remote "
                            "URLs): data:image/png;base64,...", "messages")
    head, _, data = url.partition(",")
    if ";base64" not in head:
        raise ApiError(400, "image data URLs must be base64-encoded (data:image/png;base64,...)", "messages")
    try:
        return Image.open(io.BytesIO(base64.b64decode(data, validate=True))).convert("RGB")
    except (binascii.Error, ValueError, OSError, UnidentifiedImageError) as e:
        raise ApiError(400, f"could not decode the image in an image_url ({e}): send a PNG or JPEG", "messages") from e


def _messages(raw, vlm: bool) -> tuple[list[dict], list]:
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content}", "messages")
    messages, images = [], []
    for m in raw:
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
            raise ApiError(400, "each message needs a role of system, user, assistant or developer", "messages")
        content = m.get("content")
        role = "system" if m["role"] == "developer" else m["role"]
        if isinstance(content, str):
            messages.append({"role": role, "content": [{"type": "text", "text": content}]})
            continue
        if not isinstance(content, list):
            raise ApiError(400, "message content must be a string or a list of parts", "messages")
        parts = []
        for p in content:
            kind = p.get("type") if isinstance(p, dict) else None
            if kind == "text" and isinstance(p.get("text"), str):
                parts.append({"type": "text", "text": p["text"]})
            elif kind == "image_url":
                if not vlm:
                    raise ApiError(400, "this model is a text model: it takes no images", "messages")
                url = p.get("image_url", {}).get("url") if isinstance(p.get("image_url"), dict) else p.get("image_url")
                if not isinstance(url, str):
                    raise ApiError(400, "image_url parts need image_url.url", "messages")
                images.append(_image(url))
                parts.append({"type": "image"})
            else:
                raise ApiError(400, f"unsupported content part {kind!r}: use text or image_url", "messages")
        messages.append({"role": role, "content": parts})
    return messages, images


def parse(body, chat: bool, model_name: str, vlm: bool, default_max_tokens: int) -> Request:
    """Check a /v1/chat/completions (`chat`) or /v1/completions body; raise ApiError on anything wrong."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name in body:
        if name in REFUSED and body[name] not in (None, False, [], {}):
            raise ApiError(400, f"'{name}' is not supported by glance-rt serve: {REFUSED[name]}", name)
        if name not in SUPPORTED and name not in REFUSED:
            raise ApiError(400, f"unknown parameter '{name}'", name)
    if body.get("model") not in (None, model_name):
        raise ApiError(404, f"model '{body.get('model')}' is not served here; GET /v1/models lists '{model_name}'",
                       "model", "invalid_request_error", "model_not_found")
    if body.get("n") not in (None, 1):
        raise ApiError(400, "'n' must be 1: one completion per request", "n")
    if chat:
        messages, images, prompt = *_messages(body.get("messages"), vlm), None
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise ApiError(400, "'prompt' must be a non-empty string", "prompt")
        messages, images = None, []
    max_tokens = _number(body, "max_completion_tokens", int, 1) or _number(body, "max_tokens", int, 1)
    temperature = _number(body, "temperature", float, 0, 2)
    top_p = _number(body, "top_p", float, 0, 1, lo_open=True)
    seed = _number(body, "seed", int, 0)
    top_k = _number(body, "top_k", int, 0)
    min_p = _number(body, "min_p", float, 0, 1)
    penalty = _number(body, "repetition_penalty", float, 0, None, lo_open=True)
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop
    if stop is not None and (not isinstance(stop, list) or len(stop) > 4 or
                             any(not isinstance(s, str) or not s for s in stop)):
        raise ApiError(400, "'stop' must be a string or a list of at most 4 non-empty strings", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", "stream_options")
    sampled = temperature is not None and temperature > 0  # OpenAI's default temperature is 1; 0 is greedy
    if temperature is None:
        sampled, temperature = True, 1.0
    sampling = Sampling(do_sample=sampled, temperature=temperature if sampled else 1.0,
                        top_k=top_k if top_k is not None else 0, top_p=top_p if top_p is not None else 1.0,
                        min_p=min_p, repetition_penalty=penalty or 1.0, seed=seed or 0, stop=tuple(stop or ()))
    return Request(messages, prompt, images, sampling, max_tokens or default_max_tokens, stream,
                   bool(options.get("include_usage")))
