"""The hybrid benchmark at a tiny shape: both models' decode steps run at every context
length, with the hybrid's state slot and the dense model's KV blocks, and each recurrent
operator's two forms are timed."""

import json

from benchmarks import bench_hybrid as bench


def test_the_decode_steps_and_operators_run_and_write_their_rows(tmp_path, monkeypatch):
    out = tmp_path / "hybrid.json"
    monkeypatch.setattr(
        "sys.argv",
        ["bench", "--contexts", "40", "100", "--hidden", "64", "--intermediate", "128",
         "--heads", "4", "--kv-heads", "2", "--layers", "3", "--vocab", "256", "--steps", "1",
         "--prefill", "40", "--output", str(out)],
    )  # fmt: skip
    bench.main()
    result = json.loads(out.read_text())
    assert [row["context"] for row in result["decode"]] == [40, 100]
    for row in result["decode"]:
        assert row["hybrid_ms"] > 0 and row["dense_ms"] > 0
    # Two short convolutions of (64, 2) float32 windows: the hybrid's third layer attends.
    assert result["hybrid_state_bytes_per_sequence"] == 2 * 64 * 2 * 4
    assert set(result["prefill_operators"]) == {"causal_conv1d", "ssd", "gated_delta_rule"}
    for rates in result["prefill_operators"].values():
        assert rates["reference"] > 0 and rates["chunked"] > 0
