"""The one exception type for bad input. Imports nothing, so every module can raise it.

A `ConfigError` is a configuration (or input path, or checkpoint) the run cannot use. Its
message is one line: the field, the problem, the fix. `train.py` prints it as `error: ...`
on rank 0 and exits with status 2, before any expensive work where the check allows.
"""


class ConfigError(ValueError):
    """A configuration the run cannot use. The message is one line: field, problem, fix."""


class NonFiniteLossError(ConfigError):
    """The loss became nan or inf: the run stops (one line) and saves nothing of that step or
    later. A ConfigError because the fix is in the inputs (learning rate, data, precision)."""


class DivergenceError(ConfigError):
    """The run diverged (a loss far above its level, or a dead model: divergence.py): it
    stops (one line) before anything of it is saved. A ConfigError for the same reason."""


def require(ok: bool, msg: str) -> None:
    """Raise ConfigError(msg) unless `ok`: the config sections' `validate` methods use it."""
    if not ok:
        raise ConfigError(msg)


def one_of(value, allowed: tuple, field_name: str) -> None:
    """`field_name`'s value must be one of `allowed`."""
    require(value in allowed, f"{field_name}={value!r} is not one of {', '.join(allowed)}")


def one_line(exc: BaseException, limit: int = 200) -> str:
    """`Type: first line of the message`, short enough for a one-line ConfigError."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
