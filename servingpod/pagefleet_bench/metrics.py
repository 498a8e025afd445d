"""Per-request records -> the benchmark result: vLLM's JSON keys and its printed block.

As in `vllm bench serve`: throughputs divide by the run's wall time; TPOT of a request is
(latency - TTFT) / (output tokens - 1); ITL pools every gap of every completed request;
failed requests add no tokens and no latencies but are counted, with their errors kept.
Requests cut off by a duration limit are `incomplete`: the tokens they streamed count
toward output throughput, their latencies do not.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from pagefleet_bench.backend import RequestOutput

METRICS = ("ttft", "tpot", "itl", "e2el")
_HEADERS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}
# Per-request lists, saved with --save-detailed; errors are always kept.
DETAIL_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "start_times")


def output_len(output: RequestOutput, count_tokens) -> int:
    """Tokens a request produced: the server's usage, else its text re-tokenized."""
    if output.output_tokens:
        return output.output_tokens
    return count_tokens(output.generated_text) if output.generated_text else 0


def _percentile_key(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def compute_metrics(
    outputs: list[RequestOutput],
    duration: float,
    count_tokens,
    percentiles: tuple[float, ...] = (99.0,),
    selected: tuple[str, ...] = METRICS,
) -> dict:
    """The result dict. `count_tokens(text) -> int` counts tokens of text that came
    without usage; `duration` is the run's wall time in seconds."""
    completed = incomplete = total_input = total_output = 0
    samples: dict[str, list[float]] = {m: [] for m in METRICS}
    output_lens = []
    for output in outputs:
        length = output_len(output, count_tokens) if (output.success or output.incomplete) else 0
        output_lens.append(length if output.success else 0)
        if output.incomplete:
            incomplete += 1
            total_output += length
            continue
        if not output.success:
            continue
        completed += 1
        total_input += output.prompt_len
        total_output += length
        samples["ttft"].append(output.ttft)
        samples["itl"].extend(output.itl)
        samples["e2el"].append(output.latency)
        if length > 1:
            samples["tpot"].append((output.latency - output.ttft) / (length - 1))
    errors = [o.error for o in outputs]
    result = {
        "duration": duration,
        "completed": completed,
        "failed": len(outputs) - completed - incomplete,
        "incomplete": incomplete,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": completed / duration if duration > 0 else 0.0,
        "output_throughput": total_output / duration if duration > 0 else 0.0,
        "total_token_throughput": (total_input + total_output) / duration if duration > 0 else 0.0,
        "max_output_tokens_per_s": _peak_tokens_per_s(outputs),
        "max_concurrent_requests": _peak_concurrency(outputs),
        "error_counts": dict(Counter(e for e in errors if e).most_common()),
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": output_lens,
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": errors,
    }
    for metric in selected:
        values = np.array(samples[metric] or [0.0]) * 1000.0
        result[f"mean_{metric}_ms"] = float(np.mean(values))
        result[f"median_{metric}_ms"] = float(np.median(values))
        result[f"std_{metric}_ms"] = float(np.std(values))
        for p in percentiles:
            result[f"p{_percentile_key(p)}_{metric}_ms"] = float(np.percentile(values, p))
    return result


def _chunk_times(output: RequestOutput) -> list[float]:
    if not output.generated_text:
        return []
    times = [output.start_time + output.ttft]
    for gap in output.itl:
        times.append(times[-1] + gap)
    return times


def _peak_tokens_per_s(outputs: list[RequestOutput]) -> float:
    """Most text chunks (tokens, for servers that stream one per chunk) in any one-second
    bucket of the run, as vLLM counts it."""
    times = [t for o in outputs if o.success or o.incomplete for t in _chunk_times(o)]
    if not times:
        return 0.0
    start = min(o.start_time for o in outputs)
    return float(max(Counter(int(t - start) for t in times).values()))


def _peak_concurrency(outputs: list[RequestOutput]) -> int:
    """Most requests in flight at once (completed ones, sent to last byte)."""
    events = []
    for o in outputs:
        if o.success:
            events += [(o.start_time, 1), (o.start_time + o.latency, -1)]
    peak = running = 0
    for _, step in sorted(events, key=lambda e: (e[0], e[1])):
        running += step
        peak = max(peak, running)
    return peak


def format_result(result: dict) -> str:
    """vLLM's "Serving Benchmark Result" block."""

    def row(label: str, value, fmt: str = "") -> str:
        return f"{label:<40} {value:<10{fmt}}"

    lines = [f"{' Serving Benchmark Result ':=^50}"]
    lines.append(row("Successful requests:", result["completed"]))
    lines.append(row("Failed requests:", result["failed"]))
    if result.get("incomplete"):
        lines.append(row("Incomplete requests (duration limit):", result["incomplete"]))
    if result.get("max_concurrency") is not None:
        lines.append(row("Maximum request concurrency:", result["max_concurrency"]))
    rate = result.get("request_rate")
    if rate is not None and rate != float("inf"):
        lines.append(row("Request rate configured (RPS):", rate, ".2f"))
    lines += [
        row("Benchmark duration (s):", result["duration"], ".2f"),
        row("Total input tokens:", result["total_input_tokens"]),
        row("Total generated tokens:", result["total_output_tokens"]),
        row("Request throughput (req/s):", result["request_throughput"], ".2f"),
        row("Output token throughput (tok/s):", result["output_throughput"], ".2f"),
        row("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"], ".2f"),
        row("Peak concurrent requests:", result["max_concurrent_requests"], ".2f"),
        row("Total Token throughput (tok/s):", result["total_token_throughput"], ".2f"),
    ]
    for metric in METRICS:
        if f"mean_{metric}_ms" not in result:
            continue
        name, header = _HEADERS[metric]
        lines.append(f"{header:-^50}")
        lines.append(row(f"Mean {name} (ms):", result[f"mean_{metric}_ms"], ".2f"))
        lines.append(row(f"Median {name} (ms):", result[f"median_{metric}_ms"], ".2f"))
        for key, value in result.items():
            prefix, _, rest = key.partition("_")
            if prefix.startswith("p") and rest == f"{metric}_ms" and prefix[1:2].isdigit():
                lines.append(row(f"P{prefix[1:]} {name} (ms):", value, ".2f"))
    lines.append("=" * 50)
    return "\n".join(lines)
