"""Serving figures: `glance-rt serve` at each --max-batch, the same requests sent one after another and
then all at once by concurrent streaming clients: aggregate tokens/s, time to first token and
inter-chunk latency at p50/p90/p99, the server's per-token time (/metrics); against Hugging Face
`generate` on one padded batch of the same prompts (the offline peer). Prints a table and JSON.

    python scripts/serve_bench.py [--target PATH --drafter PATH] [--suite all|KIND|FILE] [--requests 8]
                                  [--clients 8] [--max-tokens 40] [--batches 1,8] [--json OUT]

Streaming sends one chunk per round (the tokens it committed), so the client-side inter-chunk gap is a
round. Every served text is checked against the same server's sequential answer for that request.
Run it on a quiet machine (it times things). Greedy (temperature 0), the default method (tree 8 +
lookup, eager) unless --method-args passes others to `glance-rt serve`.
"""

import argparse
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, port: int, max_batch: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "glance_rt.cli", "serve", "--port", str(port), "--max-length", str(args.max_length),
           "--max-queue", str(args.requests), "--max-batch", str(max_batch), *args.method_args.split()]
    if args.target:
        cmd += ["--target", args.target]
    if args.drafter:
        cmd += ["--drafter", args.drafter]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                return proc
        except OSError:
            if proc.poll() is not None:
                sys.exit("the server exited while starting")
            time.sleep(0.5)
    proc.kill()
    sys.exit("the server did not come up in 300 s")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def quantiles(xs: list[float]) -> dict:
    return {q: pct(xs, p) for q, p in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))}


def stream(client, model: str, prompt: str, max_tokens: int) -> dict:
    """One streaming request -> its text, completion tokens, time to first token and inter-chunk gaps."""
    start, stamps, text, tokens = time.perf_counter(), [], "", 0
    for chunk in client.chat.completions.create(model=model, temperature=0, max_tokens=max_tokens, stream=True,
                                                stream_options={"include_usage": True},
                                                messages=[{"role": "user", "content": prompt}]):
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return {"text": text, "tokens": tokens, "ttft": stamps[0] - start if stamps else float("nan"),
            "gaps": [b - a for a, b in zip(stamps, stamps[1:], strict=False)]}


def metrics(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as r:
        text = r.read().decode()
    return {line.split()[0]: float(line.split()[-1]) for line in text.splitlines()
            if line and not line.startswith("#") and "{" not in line}


def measure_server(args, prompts: list[str], max_batch: int) -> dict:
    """The requests in turn, then all at once from --clients threads, through one server."""
    import openai

    port = free_port()
    server = start_server(args, port, max_batch)
    try:
        url = f"http://127.0.0.1:{port}/v1"
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=900)
        model = client.models.list().data[0].id
        stream(client, model, prompts[0], 4)  # first-request costs out of the way
        t = time.perf_counter()
        alone = [stream(client, model, p, args.max_tokens) for p in prompts]
        seq_wall = time.perf_counter() - t
        before = metrics(port)
        together: list = [None] * len(prompts)

        def user(k: int):
            c = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=900)
            for i in range(k, len(prompts), args.clients):
                together[i] = stream(c, model, prompts[i], args.max_tokens)

        t = time.perf_counter()
        users = [threading.Thread(target=user, args=(k,)) for k in range(args.clients)]
        for u in users:
            u.start()
        for u in users:
            u.join()
        con_wall = time.perf_counter() - t
        after = metrics(port)
    finally:
        server.terminate()
        server.wait(timeout=60)
    tokens = sum(r["tokens"] for r in alone)
    itl = ((after["glance_inter_token_latency_seconds_sum"] - before["glance_inter_token_latency_seconds_sum"])
           / max(after["glance_inter_token_latency_seconds_count"] - before["glance_inter_token_latency_seconds_count"],
                 1))
    rounds = after["glance_batch_rounds_total"] - before["glance_batch_rounds_total"]
    return {
        "max_batch": max_batch, "requests": len(prompts), "clients": args.clients, "completion_tokens": tokens,
        "sequential": {"wall_s": seq_wall, "tok_s": tokens / seq_wall,
                       "ttft_s": quantiles([r["ttft"] for r in alone])},
        "concurrent": {"wall_s": con_wall, "tok_s": sum(r["tokens"] for r in together) / con_wall,
                       "ttft_s": quantiles([r["ttft"] for r in together]),
                       "inter_chunk_s": quantiles([g for r in together for g in r["gaps"]]),
                       "server_s_per_token": itl,
                       "mean_batch": (after["glance_batch_sequences_total"]
                                      - before["glance_batch_sequences_total"]) / max(rounds, 1)},
        "concurrent_over_sequential": (sum(r["tokens"] for r in together) / con_wall) / (tokens / seq_wall),
        "identical_texts": sum(a["text"] == b["text"] for a, b in zip(alone, together, strict=True)),
    }


def measure_hf(args, prompts: list[str]) -> dict:
    """Hugging Face `generate` on one left-padded batch of the prompts (greedy): tokens up to each EOS."""
    import torch

    import glance_rt

    target = glance_rt.load_target(args.target)
    tok = target.tokenizer
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in prompts]
    batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    eos = set(target.eos_token_ids)
    model = target.hf_model
    with torch.inference_mode():
        model.generate(**tok(texts[:1], return_tensors="pt", add_special_tokens=False), max_new_tokens=2,
                       do_sample=False)
        t = time.perf_counter()
        out = model.generate(**batch, max_new_tokens=args.max_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        wall = time.perf_counter() - t
    tokens = 0
    for row in out[:, batch["input_ids"].shape[1]:].tolist():
        n = next((i + 1 for i, x in enumerate(row) if x in eos), len(row))
        tokens += n
    return {"batch": len(prompts), "wall_s": wall, "tok_s": tokens / wall, "completion_tokens": tokens}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target")
    ap.add_argument("--drafter")
    ap.add_argument("--suite", default="all", help="'all', a kind of the built-in suite (chat: short prompts), or a "
                                                   "JSONL file")
    ap.add_argument("--per-kind", type=int, default=2, help="prompts per kind of the suite")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--batches", default="1,8", help="the servers' --max-batch values, in order")
    ap.add_argument("--no-hf", action="store_true", help="skip Hugging Face's padded batch")
    ap.add_argument("--method-args", default="", help="extra glance-rt serve options, e.g. '--tree-budget 16'")
    ap.add_argument("--json")
    args = ap.parse_args()

    from glance_rt.tools.suites import suite_rows

    rows = suite_rows(args.suite, args.per_kind)
    prompts = [rows[i % len(rows)]["prompt"] for i in range(args.requests)]
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "max_tokens": args.max_tokens, "suite": args.suite,
              "method_args": args.method_args, "servers": []}
    for b in (int(x) for x in args.batches.split(",")):
        r = measure_server(args, prompts, b)
        report["servers"].append(r)
        print(json.dumps(r, indent=2), flush=True)
    if not args.no_hf:
        report["hf_padded_batch"] = measure_hf(args, prompts)
        print(json.dumps(report["hf_padded_batch"], indent=2), flush=True)
    base = report["servers"][0]
    print("\n| server | sequential tok/s | concurrent tok/s | x sequential | TTFT p50 / p90 / p99 (s) | "
          "inter-chunk p50 / p90 / p99 (s) | mean batch | same text |")
    print("|---|---|---|---|---|---|---|---|")
    for r in report["servers"]:
        c = r["concurrent"]
        print(f"| --max-batch {r['max_batch']} | {r['sequential']['tok_s']:.1f} | {c['tok_s']:.1f} | "
              f"{r['concurrent_over_sequential']:.2f} | "
              + " / ".join(f"{c['ttft_s'][q]:.2f}" for q in ("p50", "p90", "p99")) + " | "
              + " / ".join(f"{c['inter_chunk_s'][q]:.3f}" for q in ("p50", "p90", "p99"))
              + f" | {c['mean_batch']:.1f} | {r['identical_texts']}/{r['requests']} |")
    if "hf_padded_batch" in report:
        hf = report["hf_padded_batch"]
        print(f"| HF generate, padded batch of {args.requests} | | {hf['tok_s']:.1f} | | | | | |")
    for r in report["servers"][1:]:
        print(f"--max-batch {r['max_batch']} against --max-batch {base['max_batch']} under load: "
              f"{r['concurrent']['tok_s'] / base['concurrent']['tok_s']:.2f}x tokens/s, TTFT p50 "
              f"{base['concurrent']['ttft_s']['p50'] / r['concurrent']['ttft_s']['p50']:.2f}x lower")
    if args.json:
        from glance_rt.files import write_json

        write_json(args.json, report)


if __name__ == "__main__":
    main()
