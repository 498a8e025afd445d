"""Command-line flags that also read `PAGEFLEET_<FLAG>` from the environment.

Shared by `pagefleet serve` and `pagefleet router`; kept outside `pagefleet_serve` (whose
package import loads torch) so the router can use it in the operator's torch-free image."""

import argparse
import os

ENV_PREFIX = "PAGEFLEET_"


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true/false, got {text!r}")


class EnvFlags:
    """Adds flags whose default comes from PAGEFLEET_<FLAG> when that is set, so the
    command line wins over the environment, which wins over the built-in default."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser

    def __call__(self, flag: str, help: str, *aliases: str, **kwargs) -> None:
        """`aliases`: the flag's other names (vLLM's `-tp`), read from the same variable."""
        env = ENV_PREFIX + flag.removeprefix("--").replace("-", "_").upper()
        text = os.environ.get(env)
        if text is not None:
            kwargs["default"] = self._from_env(env, text, kwargs)
        self.parser.add_argument(flag, *aliases, help=f"{help} [env: {env}]", **kwargs)

    def _from_env(self, env: str, text: str, kwargs: dict):
        try:
            if kwargs.get("action") is argparse.BooleanOptionalAction:
                return parse_bool(text)
            if kwargs.get("nargs") == "+":
                return text.replace(",", " ").split()
            value = kwargs.get("type", str)(text)
        except ValueError as exc:
            self.parser.error(f"{env}={text!r}: {exc}")
        if "choices" in kwargs and value not in kwargs["choices"]:
            self.parser.error(f"{env}={text!r}: choose from {', '.join(kwargs['choices'])}")
        return value
