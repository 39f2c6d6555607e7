"""Serving figures: tokens/s through `glance-rt serve` against offline `Decoder.generate` at batch 1
(same method, same prompts, interleaved per prompt), then a bounded load test (concurrent streaming
clients): time to first token and inter-token latency percentiles, 429s. Prints a table and JSON.

    python scripts/serve_bench.py [--target PATH --drafter PATH] [--per-kind 2] [--max-tokens 96]
                                  [--clients 8] [--requests 10] [--json OUT]

Streaming sends one chunk per round (the tokens it committed), so the client-side inter-chunk gap is a
round; the server's per-token figure (round time / tokens committed) comes from its /metrics.

Run it on a quiet machine (it times things). Greedy (temperature 0), the default method (tree 8 +
lookup 3, eager) unless --method-args passes others to `glance-rt serve`.
"""

import argparse
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "glance_rt.cli", "serve", "--port", str(port), "--max-length", str(args.max_length),
           "--max-queue", str(args.clients * 2), *args.method_args.split()]
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target")
    ap.add_argument("--drafter")
    ap.add_argument("--per-kind", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--method-args", default="", help="extra glance-rt serve options, e.g. '--tree-budget 16'")
    ap.add_argument("--json")
    args = ap.parse_args()

    import openai

    import glance_rt
    from glance_rt.tools.suites import suite_rows

    target = glance_rt.load_target(args.target)
    drafter = glance_rt.load_drafter(args.drafter, target)
    dec = glance_rt.Decoder(target, drafter, max_length=args.max_length).warmup()
    rows = suite_rows("all", args.per_kind)
    port = free_port()
    server = start_server(args, port)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "prompts": len(rows), "max_tokens": args.max_tokens}
    try:
        ratios, off_tps, srv_tps, same = [], [], [], 0
        for i, row in enumerate(rows):
            def offline(row=row):
                t = time.perf_counter()
                res = dec.generate(max_new_tokens=args.max_tokens, **target.encode_chat(row["prompt"]))
                return res.text, len(res.token_ids) / (time.perf_counter() - t)

            def served(row=row):
                t = time.perf_counter()
                r = client.chat.completions.create(model=model, temperature=0, max_tokens=args.max_tokens,
                                                   messages=[{"role": "user", "content": row["prompt"]}])
                return r.choices[0].message.content, r.usage.completion_tokens / (time.perf_counter() - t)

            order = (offline, served) if i % 2 == 0 else (served, offline)  # interleaved, alternating first
            results = {f.__name__: f() for f in order}
            (a_text, a), (b_text, b) = results["offline"], results["served"]
            same += a_text == b_text
            off_tps.append(a)
            srv_tps.append(b)
            ratios.append(b / a)
        report["batch1"] = {"offline_tok_s": statistics.median(off_tps), "served_tok_s": statistics.median(srv_tps),
                            "served_over_offline": {"median": statistics.median(ratios), "p25": pct(ratios, 0.25),
                                                    "p75": pct(ratios, 0.75)},
                            "identical_texts": f"{same}/{len(rows)}"}
        print(json.dumps(report["batch1"], indent=2), flush=True)

        ttft, itl, done, limited = [], [], [], []
        lock = threading.Lock()

        def user(k: int):
            c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
            for j in range(args.requests):
                row = rows[(k + j) % len(rows)]
                start = time.perf_counter()
                stamps = []
                try:
                    for chunk in c.chat.completions.create(model=model, temperature=0, max_tokens=args.max_tokens,
                                                           stream=True, messages=[{"role": "user",
                                                                                   "content": row["prompt"]}]):
                        if chunk.choices and chunk.choices[0].delta.content:
                            stamps.append(time.perf_counter())
                except openai.RateLimitError:
                    with lock:
                        limited.append(1)
                    time.sleep(1.0)
                    continue
                with lock:
                    done.append(1)
                    if stamps:
                        ttft.append(stamps[0] - start)
                        itl.extend(b - a for a, b in zip(stamps, stamps[1:], strict=False))

        t = time.perf_counter()
        users = [threading.Thread(target=user, args=(k,)) for k in range(args.clients)]
        for u in users:
            u.start()
        for u in users:
            u.join()
        report["load"] = {"clients": args.clients, "requests_each": args.requests, "completed": len(done),
                          "rejected_429": len(limited), "wall_s": time.perf_counter() - t,
                          "ttft_s": {q: pct(ttft, p) for q, p in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))},
                          "inter_chunk_s": {q: pct(itl, p) for q, p in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))}}
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as r:
            metrics = r.read().decode()
        value = {line.split()[0]: float(line.split()[-1]) for line in metrics.splitlines()
                 if line and not line.startswith("#") and "{" not in line}
        report["load"]["metrics_completion_tokens"] = value["glance_completion_tokens_total"]
        report["load"]["server_mean_s_per_token"] = (value["glance_inter_token_latency_seconds_sum"]
                                                     / max(value["glance_inter_token_latency_seconds_count"], 1))
        print(json.dumps(report["load"], indent=2), flush=True)
    finally:
        server.terminate()
        server.wait(timeout=60)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
