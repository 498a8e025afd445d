"""lm-evaluation-harness against `pagefleet serve`, scored as it scores the transformers
model itself: a loglikelihood task (multiple choice) through `local-completions` (token
ids in, `echo` + `logprobs` + `max_tokens`, the prompt's logprobs back) and a
`generate_until` task through `local-chat-completions` (the chat template, greedy, stop
strings), each beside the same task on the same checkpoint with lm_eval's `hf` model.
The scores must be equal, and so must every document's loglikelihoods (within 1e-3) and
generated text.

No hub: the checkpoint is a tiny random Llama that transformers writes (with the built-in
model's tokenizer and chat template, logits far from uniform so that greedy choices are
not near-ties), the tasks are YAML files over JSONL datasets written here. lm_eval runs
from its own virtualenv (it pins packages ours does not take):

    python -m venv benchmarks/.peers/lm_eval
    benchmarks/.peers/lm_eval/bin/pip install torch==2.13.0   # the CPU build first
    benchmarks/.peers/lm_eval/bin/pip install "lm_eval[api,hf]"
    python benchmarks/bench_lm_eval.py

Writes benchmarks/results/lm_eval.json; exits 1 when a score or a document differs.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tests.engine.hub_server import save_tiny_llama

ROOT = Path(__file__).resolve().parents[1]
LM_EVAL = ROOT / "benchmarks/.peers/lm_eval/bin/lm_eval"
SERVING_LINE = re.compile(r"serving .* on http://[^\s:]+:(\d+)")
MODEL_NAME = "tiny"

CHOICE_DOCS = [
    {"question": f"Question {i}: which word follows '{w}'?", "choices": c, "answer": i % len(c)}
    for i, (w, c) in enumerate(
        [
            ("red", ["apple", "sky", "stone"]),
            ("cold", ["ice", "fire", "sand"]),
            ("fast", ["car", "snail", "tree", "rock"]),
            ("loud", ["drum", "feather"]),
            ("sweet", ["honey", "salt", "lemon"]),
            ("bright", ["sun", "cave", "night"]),
            ("soft", ["pillow", "brick"]),
            ("wet", ["rain", "desert", "dust"]),
            ("tall", ["tower", "ant", "pebble"]),
            ("old", ["castle", "phone", "app", "chip"]),
            ("green", ["grass", "coal"]),
            ("round", ["ball", "box", "plank"]),
        ]
    )
]
GEN_DOCS = [
    {"question": q, "answer": a}
    for q, a in [
        ("Name a colour.", "Blue"),
        ("What is two plus two?", "4"),
        ("Say hello in French.", "Bonjour"),
        ("Name a fruit.", "Apple"),
        ("What is the capital of Italy?", "Rome"),
        ("Name an animal.", "Cat"),
        ("Count to three.", "1, 2, 3"),
        ("Name a planet.", "Mars"),
    ]
]
CHOICE_TASK = """task: pagefleet_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""
GEN_TASK = """task: pagefleet_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: answer
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 12
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""


def write_checkpoint(path: Path) -> Path:
    # Logits far from uniform (initializer_range 0.2), so that greedy choices are no
    # near-ties two implementations could break differently.
    return save_tiny_llama(
        path,
        hidden_size=64,
        intermediate_size=128,
        max_position_embeddings=1024,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )


def write_tasks(folder: Path) -> Path:
    for name, docs, task in (("choice", CHOICE_DOCS, CHOICE_TASK), ("gen", GEN_DOCS, GEN_TASK)):
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (folder / f"{name}.yaml").write_text(task.format(data=data))
    return folder


def start_server(checkpoint: Path, log: Path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PAGEFLEET_DTYPE": "float32"}
    command = [
        sys.executable, "-m", "pagefleet_serve.cli", "serve", "--model", str(checkpoint),
        "--served-model-name", MODEL_NAME, "--port", "0", "--max-model-len", "1024",
        "--kv-cache-memory", "64MiB",
    ]  # fmt: skip
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited:\n{log.read_text()}")
        found = SERVING_LINE.search(log.read_text(errors="replace"))
        if found:
            base = f"http://127.0.0.1:{found.group(1)}"
            try:
                if httpx.get(f"{base}/ready", timeout=5).status_code == 200:
                    return process, base
            except httpx.TransportError:
                pass
        time.sleep(0.5)
    process.kill()
    raise RuntimeError("the server did not become ready")


def lm_eval(task: str, tasks: Path, out: Path, model: str, model_args: str, *flags) -> dict:
    """One lm_eval run; its results file and its samples (by doc id)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": ""}
    command = [
        str(LM_EVAL), "--model", model, "--model_args", model_args, "--tasks", task,
        "--include_path", str(tasks), "--output_path", str(out), "--log_samples",
        "--batch_size", "1", "--seed", "0", *flags,
    ]  # fmt: skip
    started = time.perf_counter()
    subprocess.run(command, check=True, env=env)
    seconds = time.perf_counter() - started
    [results] = out.rglob("results_*.json")
    [samples] = out.rglob(f"samples_{task}_*.jsonl")
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    return {
        "results": json.loads(results.read_text())["results"][task],
        "samples": {row["doc_id"]: row for row in rows},
        "seconds": round(seconds, 1),
    }


def compare(task: str, ours: dict, theirs: dict, metric: str) -> dict:
    """The two runs' scores, and the documents whose responses differ: a loglikelihood by
    1e-3 or more (or its is-greedy flag), a generation by any character."""
    differences, largest, generated = [], 0.0, 0
    for doc_id, row in theirs["samples"].items():
        mine = ours["samples"][doc_id]["filtered_resps"]
        ref = row["filtered_resps"]
        if task == "pagefleet_choice":
            gaps = [abs(float(a[0]) - float(b[0])) for a, b in zip(mine, ref, strict=True)]
            largest = max(largest, *gaps)
            same = max(gaps) < 1e-3 and [a[1] for a in mine] == [b[1] for b in ref]
        else:
            same = mine == ref
            generated += sum(1 for text in ref if text)
        if not same:
            differences.append({"doc_id": doc_id, "pagefleet": mine, "hf": ref})
    detail = (
        {"largest_loglikelihood_difference": largest}
        if task == "pagefleet_choice"
        else {"non_empty_generations": generated}
    )
    return {
        "task": task,
        "metric": metric,
        "pagefleet": ours["results"][f"{metric},none"],
        "hf": theirs["results"][f"{metric},none"],
        "documents": len(theirs["samples"]),
        "documents_differing": differences,
        **detail,
        "seconds": {"pagefleet": ours["seconds"], "hf": theirs["seconds"]},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/lm_eval.json"))
    args = parser.parse_args()
    if not LM_EVAL.exists():
        print(f"{LM_EVAL} is missing: see this script's docstring", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="pagefleet-lm-eval-") as scratch:
        work = Path(scratch)
        checkpoint = write_checkpoint(work / "checkpoint")
        tasks = write_tasks(Path(tempfile.mkdtemp(dir=work)))
        hf_args = f"pretrained={checkpoint},dtype=float32"
        server, base = start_server(checkpoint, work / "serve.log")
        try:
            completions = lm_eval(
                "pagefleet_choice", tasks, work / "pf-choice", "local-completions",
                f"model={MODEL_NAME},base_url={base}/v1/completions,tokenizer={checkpoint},"
                "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1",
            )  # fmt: skip
            chat = lm_eval(
                "pagefleet_gen", tasks, work / "pf-gen", "local-chat-completions",
                f"model={MODEL_NAME},base_url={base}/v1/chat/completions,num_concurrent=1,"
                "max_retries=1",
                "--apply_chat_template",
            )  # fmt: skip
        finally:
            server.kill()
            server.wait()
        hf_choice = lm_eval("pagefleet_choice", tasks, work / "hf-choice", "hf", hf_args)
        hf_gen = lm_eval(
            "pagefleet_gen", tasks, work / "hf-gen", "hf", hf_args, "--apply_chat_template"
        )
    report = {
        "what": "lm_eval (local-completions, local-chat-completions) against pagefleet serve "
        "vs lm_eval hf on the same tiny random Llama (float32, CPU)",
        "lm_eval": subprocess.run(
            [str(LM_EVAL.parent / "python"), "-c", "import lm_eval; print(lm_eval.__version__)"],
            capture_output=True,
            text=True,
        ).stdout.strip(),
        "date": time.strftime("%Y-%m-%d"),
        "tasks": [
            compare("pagefleet_choice", completions, hf_choice, "acc"),
            compare("pagefleet_gen", chat, hf_gen, "exact_match"),
        ],
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    equal = all(t["pagefleet"] == t["hf"] and not t["documents_differing"] for t in report["tasks"])
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
