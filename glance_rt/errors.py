"""The one exception type users see for bad input."""


class GlanceError(ValueError):
    """Bad input to glance-rt: the message says what was wrong and what to do instead.

    Raised for unsupported architectures, drafters built for another target, prompts that do not
    fit the static cache, image/placeholder mismatches, corrupt or missing checkpoints, and
    out-of-range budgets or block sizes.
    """


class GlanceWarning(UserWarning):
    """Something works but may not be what the user wants (an engine tuned on another CPU model)."""


def require(extra: str, *modules: str) -> None:
    """Refuse, with the install command, a feature whose optional dependencies are missing."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise GlanceError(f"this needs {' and '.join(missing)}, which glance-rt's {extra!r} extra installs: "
                          f"pip install 'glance-rt[{extra}]'")
