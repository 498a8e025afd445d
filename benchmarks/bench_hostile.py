"""A victim's time to first token while hostile clients work the same pod
(`python -m benchmarks.bench_hostile`), issue 42's "within 2x of its control".

One `pagefleet serve` (the built-in model, defaults). For each attack, the victim's TTFT
is measured alone (the control: `--victim-requests` short streamed chat requests one after
the other, the median), then again while `--attackers` clients loop the attack for
`--seconds`, on the same server, in the same run. Attacks, scaled to this machine:

- `compile_queue` (item 5): distinct slow JSON schemas, each abandoned after 1 s; the
  victim's request carries a one-property schema of its own (it must compile in time);
- `expensive_refusals` (item 6): 64 prompts of 60,000 characters, and 20,000 short chat
  messages, each refused for the context length;
- `repetition_penalty` (item 7): n=64 samples of a long prompt (5,670 tokens of the
  built-in model) with repetition_penalty 1.1, and `long_prompt_n64`, the same request
  without a penalty: the pair tells the penalty's own cost from that of the prompt's
  prefill and of 64 rows decoding over it;
- `streaming_tool_calls` (item 8): tool_choice "required" with a schema of an array of
  items, streamed, 256 tokens;
- `fffd_detokenizer` (item 9): `guided_regex` "\\ufffd{1,}", 256 tokens, streamed;
- `float_overflow` (items 10 and 11): temperature 1e300 with a grammar, repetition
  penalties 1e300 and 1e-300 (each a 400 now).

The router's hardening (item 12) is measured by `benchmarks/bench_router.py`'s setting,
not here. Every ratio is this run's attack median over its control median. Prints a table
and writes JSON. Not a test: the numbers depend on the machine and its load.
"""

import argparse
import asyncio
import functools
import itertools
import json
import os
import statistics
import time
from pathlib import Path

import httpx

from benchmarks.bench_serving_overhead import start_server
from benchmarks.side_by_side.common import cpu_info

VICTIM_MESSAGES = [{"role": "user", "content": "Say hello to the team in one sentence."}]
_counter = itertools.count()
MODEL = ["?"]  # the served model's name, read from /v1/models at start


def slow_schema() -> dict:
    """About 10 KB of schema, distinct each call: many objects of many named properties."""
    n = next(_counter)
    return {
        "type": "object",
        "properties": {
            f"p{n}_{i}": {
                "type": "object",
                "properties": {
                    f"q{n}_{i}_{j}": {"type": "string", "maxLength": 7} for j in range(8)
                },
                "required": [f"q{n}_{i}_{j}" for j in range(8)],
            }
            for i in range(24)
        },
        "required": [f"p{n}_{i}" for i in range(24)],
    }


JSON = {"content-type": "application/json"}


@functools.cache
def expensive_bodies() -> tuple[tuple[str, bytes], tuple[str, bytes]]:
    """The two refused bodies, encoded once: 3.8 MB of JSON encoded per request took the
    client's event loop, which also times the victim, 20-40 ms at a time."""
    prompts = {"model": MODEL[0], "prompt": ["x" * 60_000] * 64, "max_tokens": 1}
    messages = {"model": MODEL[0], "messages": [{"role": "user", "content": "hi"}] * 20_000}
    return (
        ("/v1/completions", json.dumps(prompts).encode()),
        ("/v1/chat/completions", json.dumps(messages).encode()),
    )


def victim_body(attack: str) -> dict:
    body = {"model": MODEL[0], "messages": VICTIM_MESSAGES, "max_tokens": 8, "stream": True}
    if attack == "compile_queue":  # a structured victim: its own small schema must compile
        n = next(_counter)
        schema = {"type": "object", "properties": {f"greeting{n}": {"type": "string"}}}
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "greeting", "schema": schema},
        }
    return body


async def ttft(client: httpx.AsyncClient, body: dict) -> float | None:
    """Seconds to the first streamed content, None if the request failed."""
    started = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return None
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            choices = json.loads(line[len("data: ") :]).get("choices") or [{}]
            if choices[0].get("delta", {}).get("content"):  # the first text, not the role
                return time.perf_counter() - started
    return None


async def attack_once(client: httpx.AsyncClient, attack: str, long_prompt: str) -> int:
    """One attacking request; its HTTP status (0 for an abandoned or failed one)."""
    chat = "/v1/chat/completions"
    try:
        if attack == "compile_queue":
            body = {
                "model": MODEL[0],
                "messages": VICTIM_MESSAGES,
                "max_tokens": 4,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "slow", "schema": slow_schema()},
                },
            }
            response = await client.post(chat, json=body, timeout=1.0)
        elif attack == "expensive_refusals":
            path, content = expensive_bodies()[next(_counter) % 2]
            response = await client.post(path, content=content, headers=JSON)
        elif attack in ("repetition_penalty", "long_prompt_n64"):
            body = {
                "model": MODEL[0],
                "prompt": long_prompt,
                "n": 64,
                "max_tokens": 16,
                "repetition_penalty": 1.1 if attack == "repetition_penalty" else 1.0,
            }
            response = await client.post("/v1/completions", json=body)
        elif attack == "streaming_tool_calls":
            tool = {
                "type": "function",
                "function": {
                    "name": "record",
                    "parameters": {
                        "type": "object",
                        "properties": {"items": {"type": "array", "items": {"type": "integer"}}},
                        "required": ["items"],
                    },
                },
            }
            body = {
                "model": MODEL[0],
                "messages": VICTIM_MESSAGES,
                "tools": [tool],
                "tool_choice": "required",
                "max_tokens": 256,
                "stream": True,
            }
            async with client.stream("POST", chat, json=body) as response:
                await response.aread()
        elif attack == "fffd_detokenizer":
            body = {
                "model": MODEL[0],
                "messages": VICTIM_MESSAGES,
                "guided_regex": "\ufffd{1,}",
                "max_tokens": 256,
                "stream": True,
            }
            async with client.stream("POST", chat, json=body) as response:
                await response.aread()
        elif attack == "float_overflow":
            bodies = [
                {"temperature": 1e300, "guided_choice": ["yes", "no"]},
                {"repetition_penalty": 1e300},
                {"repetition_penalty": 1e-300},
            ]
            extra = bodies[next(_counter) % 3]
            body = {"model": MODEL[0], "messages": VICTIM_MESSAGES, "max_tokens": 8, **extra}
            response = await client.post(chat, json=body)
        else:
            raise ValueError(attack)
    except httpx.HTTPError:
        return 0
    return response.status_code


async def victim_run(client: httpx.AsyncClient, attack: str, count: int) -> tuple[list, int]:
    times, failures = [], 0
    for _ in range(count):
        seconds = await ttft(client, victim_body(attack))
        if seconds is None:
            failures += 1
        else:
            times.append(seconds)
    return times, failures


async def scenario(base: str, attack: str, args, long_prompt: str) -> dict:
    limits = httpx.Limits(max_connections=args.attackers + 4)
    timeout = httpx.Timeout(120.0)
    # The victim is another client: its own loopback address (the pod's per-client limits
    # key on the peer's address), the attackers are one client with several loops.
    victim_transport = httpx.AsyncHTTPTransport(local_address="127.0.0.2")
    async with (
        httpx.AsyncClient(base_url=base, timeout=timeout, limits=limits) as client,
        httpx.AsyncClient(base_url=base, timeout=timeout, transport=victim_transport) as victim,
    ):
        control, control_failures = await victim_run(victim, attack, args.victim_requests)
        stop = asyncio.Event()
        statuses: dict[int, int] = {}

        async def attacker() -> None:
            while not stop.is_set():
                status = await attack_once(client, attack, long_prompt)
                statuses[status] = statuses.get(status, 0) + 1

        tasks = [asyncio.create_task(attacker()) for _ in range(args.attackers)]
        await asyncio.sleep(args.warm_up_seconds)  # the attack under way first
        deadline = time.monotonic() + args.seconds
        attacked, attacked_failures = [], 0
        while time.monotonic() < deadline:
            times, failures = await victim_run(victim, attack, 1)
            attacked += times
            attacked_failures += failures
        stop.set()
        await asyncio.wait(tasks, timeout=180)
        for task in tasks:
            task.cancel()
    control_s = statistics.median(control) if control else float("nan")
    attack_s = statistics.median(attacked) if attacked else float("nan")
    return {
        "attack": attack,
        "control_ttft_s": control_s,
        "attack_ttft_s": attack_s,
        "ratio": attack_s / control_s,
        # The tail under attack: a median can hide victims that waited out a long step.
        "attack_ttft_p90_s": statistics.quantiles(attacked, n=10)[-1]
        if len(attacked) > 1
        else float("nan"),
        "attack_ttft_max_s": max(attacked, default=float("nan")),
        "victim_requests_under_attack": len(attacked) + attacked_failures,
        "victim_failures": control_failures + attacked_failures,
        "attacker_statuses": {str(k): v for k, v in sorted(statuses.items())},
    }


ATTACKS = (
    "compile_queue",
    "expensive_refusals",
    "repetition_penalty",
    "long_prompt_n64",
    "streaming_tool_calls",
    "fffd_detokenizer",
    "float_overflow",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attacks", nargs="+", choices=ATTACKS, default=list(ATTACKS))
    parser.add_argument("--attackers", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--warm-up-seconds", type=float, default=2.0)
    parser.add_argument("--victim-requests", type=int, default=5)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--serve-flag", action="append", default=[])
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/hostile.json"))
    args = parser.parse_args()
    long_prompt = " ".join(f"word{i % 500}" for i in range(1500))  # 5,670 tokens (SmolLM2)

    process, port, log = start_server(args)
    try:
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()
        MODEL[0] = models["data"][0]["id"]
        rows = []
        print(
            f"{'attack':<22} {'control s':>9} {'attack s':>9} {'ratio':>6} {'p90 s':>6} "
            f"{'max s':>6} {'victim fail':>11}"
        )
        for attack in args.attacks:
            row = asyncio.run(scenario(f"http://127.0.0.1:{port}", attack, args, long_prompt))
            rows.append(row)
            print(
                f"{attack:<22} {row['control_ttft_s']:>9.3f} {row['attack_ttft_s']:>9.3f} "
                f"{row['ratio']:>6.2f} {row['attack_ttft_p90_s']:>6.2f} "
                f"{row['attack_ttft_max_s']:>6.2f} {row['victim_failures']:>11}  "
                f"{row['attacker_statuses']}"
            )
    finally:
        process.terminate()
        process.wait(timeout=60)
        log.unlink(missing_ok=True)
    report = {
        "cpu": cpu_info(),
        "cpu_count": os.cpu_count(),
        "attackers": args.attackers,
        "seconds": args.seconds,
        "rows": rows,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
