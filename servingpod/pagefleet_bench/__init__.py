"""`pagefleet bench serve`: a load generator for OpenAI-compatible servers, compatible with
`vllm bench serve` (same flags where they overlap, same result block and JSON keys).

datasets.py builds prompts of exact token lengths with the model's own tokenizer,
backend.py streams one request and times its chunks, metrics.py turns the per-request
records into the result, runner.py paces arrivals and bounds concurrency, serve.py is the
command line.
"""
