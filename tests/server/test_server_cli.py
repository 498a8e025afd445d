"""`pagefleet serve` flags: vLLM's names, each also read from PAGEFLEET_<FLAG>; the command
line wins over the environment, which wins over the built-in default."""

import pytest
from pagefleet_serve.cli import build_parser


def parse(monkeypatch, env: dict[str, str], *argv: str):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return build_parser("serve").parse_args(["serve", *argv])


def test_defaults_serve_the_builtin_model_on_loopback(monkeypatch):
    args = parse(monkeypatch, {})
    assert (args.model, args.host, args.port) == ("builtin://smollm2-135m", "127.0.0.1", 8000)
    assert args.enable_prefix_caching is True and args.kv_cache_memory is None


def test_environment_sets_every_kind_of_flag(monkeypatch):
    args = parse(
        monkeypatch,
        {
            "PAGEFLEET_MAX_NUM_SEQS": "64",
            "PAGEFLEET_KV_CACHE_MEMORY": "2GiB",
            "PAGEFLEET_ENABLE_PREFIX_CACHING": "false",
            "PAGEFLEET_SERVED_MODEL_NAME": "a,b",
            "PAGEFLEET_GPU_MEMORY_UTILIZATION": "0.5",
            "PAGEFLEET_KV_CACHE_DTYPE": "int8",
            "PAGEFLEET_API_KEY": "k",
        },
    )
    assert args.max_num_seqs == 64 and args.kv_cache_memory == 2 * 1024**3
    assert args.enable_prefix_caching is False and args.served_model_name == ["a", "b"]
    assert args.gpu_memory_utilization == 0.5 and args.kv_cache_dtype == "int8"
    assert args.api_key == "k"


def test_command_line_wins_over_environment(monkeypatch):
    args = parse(
        monkeypatch,
        {"PAGEFLEET_PORT": "9000", "PAGEFLEET_ENABLE_PREFIX_CACHING": "0"},
        "--port",
        "9100",
        "--enable-prefix-caching",
    )
    assert args.port == 9100 and args.enable_prefix_caching is True


def test_bad_environment_value_names_the_variable(monkeypatch, capsys):
    with pytest.raises(SystemExit) as exc:
        parse(monkeypatch, {"PAGEFLEET_MAX_NUM_SEQS": "many"})
    assert exc.value.code == 2
    assert "PAGEFLEET_MAX_NUM_SEQS='many'" in capsys.readouterr().err


def test_enforce_eager_defaults_to_the_engine_and_can_be_turned_off(monkeypatch):
    assert parse(monkeypatch, {}).enforce_eager is True
    assert parse(monkeypatch, {}, "--no-enforce-eager").enforce_eager is False
    assert parse(monkeypatch, {"PAGEFLEET_ENFORCE_EAGER": "false"}).enforce_eager is False


def test_max_cpu_loras_reaches_the_engine_config_checked(monkeypatch, caplog):
    from pagefleet_serve.server import serve

    assert parse(monkeypatch, {}).max_cpu_loras is None
    assert parse(monkeypatch, {"PAGEFLEET_MAX_CPU_LORAS": "4"}).max_cpu_loras == 4
    args = parse(monkeypatch, {}, "--enable-lora", "--max-loras", "3", "--max-cpu-loras", "2")
    assert serve.run(args) == 2  # refused before any model loads
    assert "max_cpu_loras (2) must be at least max_loras (3)" in caplog.text
