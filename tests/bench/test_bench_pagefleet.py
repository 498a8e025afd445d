"""`pagefleet bench serve` against a real `pagefleet serve` on loopback, small numbers: the
run completes, prompt lengths are exactly what the server prefilled (its
vllm:prompt_tokens_total), the saved JSON has vLLM's keys, and requests the server refuses
are counted as failures with their errors kept."""

import json
from pathlib import Path

import pytest
from pagefleet_serve.cli import main

from tests.server.server_harness import read_metrics

VLLM_KEYS = {
    "date",
    "backend",
    "model_id",
    "tokenizer_id",
    "num_prompts",
    "request_rate",
    "burstiness",
    "max_concurrency",
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "max_output_tokens_per_s",
    "max_concurrent_requests",
    "errors",
    *(
        f"{s}_{m}_ms"
        for s in ("mean", "median", "std", "p99")
        for m in ("ttft", "tpot", "itl", "e2el")
    ),
}


@pytest.fixture(scope="module")
def server(default_pod):
    """The session's default pod (served name "smol", 8 sequences)."""
    return default_pod


def bench(server, tmp_path: Path, *flags: str) -> tuple[int, dict]:
    code = main(
        [
            "bench",
            "serve",
            "--base-url",
            server.base_url,
            "--disable-tqdm",
            "--result-dir",
            str(tmp_path),
            "--result-filename",
            "result.json",
            "--seed",
            "7",
            *flags,
        ]
    )
    path = tmp_path / "result.json"
    return code, json.loads(path.read_text()) if path.exists() else {}


def test_random_completions_run_with_exact_prompt_lengths(server, tmp_path, capsys):
    before = read_metrics(server.base_url)
    code, result = bench(
        server,
        tmp_path,
        *("--num-prompts", "6", "--random-input-len", "48", "--random-output-len", "8"),
        *("--ignore-eos", "--max-concurrency", "3", "--skip-initial-test", "--save-detailed"),
    )
    after = read_metrics(server.base_url)
    assert code == 0
    assert set(result) >= VLLM_KEYS, VLLM_KEYS - set(result)
    assert (result["completed"], result["failed"]) == (6, 0)
    assert result["model_id"] == "smol"  # the served name
    assert result["tokenizer_id"] == "builtin://smollm2-135m"  # the root /v1/models names
    assert result["total_input_tokens"] == 6 * 48
    prefilled = after["vllm:prompt_tokens_total"] - before.get("vllm:prompt_tokens_total", 0.0)
    assert prefilled == 6 * 48
    assert result["total_output_tokens"] == 6 * 8  # from usage, ignore_eos honoured
    assert result["output_lens"] == [8] * 6
    assert result["max_concurrency"] == 3 and result["max_concurrent_requests"] <= 3
    assert result["request_rate"] == "inf"
    assert all(len(itl) >= 1 for itl in result["itls"])
    assert 0 < result["mean_ttft_ms"] <= result["mean_e2el_ms"]
    assert result["mean_tpot_ms"] > 0 and result["p99_itl_ms"] >= result["median_itl_ms"]
    out = capsys.readouterr().out
    assert "============ Serving Benchmark Result ============" in out
    assert f"{'Successful requests:':<40} {6:<10}" in out


def test_chat_prefix_repetition_counts_the_template_and_hits_the_cache(server, tmp_path):
    before = read_metrics(server.base_url)
    code, result = bench(
        server,
        tmp_path,
        *("--endpoint", "/v1/chat/completions", "--dataset", "prefix-repetition"),
        *("--num-prompts", "4", "--prefix-repetition-num-prefixes", "2"),
        *("--prefix-repetition-prefix-len", "64", "--prefix-repetition-suffix-len", "8"),
        *("--prefix-repetition-output-len", "4", "--max-concurrency", "1", "--ignore-eos"),
        "--skip-initial-test",
    )
    after = read_metrics(server.base_url)
    assert code == 0 and result["completed"] == 4
    prefilled = after["vllm:prompt_tokens_total"] - before.get("vllm:prompt_tokens_total", 0.0)
    assert prefilled == result["total_input_tokens"]
    hits = after["vllm:prefix_cache_hits_total"] - before.get("vllm:prefix_cache_hits_total", 0.0)
    assert hits >= 2 * 64 - 2 * 16  # the second use of each prefix: its full blocks


def test_refused_requests_are_counted_with_their_errors(server, tmp_path, capsys):
    code, result = bench(
        server,
        tmp_path,
        *("--model", "no-such-model", "--tokenizer", "builtin://smollm2-135m"),
        *("--num-prompts", "3", "--random-input-len", "16", "--random-output-len", "2"),
        "--skip-initial-test",
    )
    assert code == 1  # nothing completed
    assert (result["completed"], result["failed"]) == (0, 3)
    assert len(result["errors"]) == 3
    assert all(e.startswith("HTTP 404") and "no-such-model" in e for e in result["errors"])
    assert "3 requests failed" in capsys.readouterr().out


def test_the_initial_test_request_stops_a_misconfigured_run(server, tmp_path, capsys):
    code, result = bench(
        server,
        tmp_path,
        *("--model", "no-such-model", "--tokenizer", "builtin://smollm2-135m"),
        *("--num-prompts", "3", "--random-input-len", "16"),
    )
    assert code == 1 and result == {}
    assert "the test request failed: HTTP 404" in capsys.readouterr().err


def test_unreachable_server_and_bad_flags_exit_with_a_message(capsys):
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1"]) == 1
    assert "cannot list models at http://127.0.0.1:9/v1/models" in capsys.readouterr().err
    assert main(["bench", "serve", "--dataset", "sharegpt"]) == 2
    assert "needs --dataset-path" in capsys.readouterr().err
