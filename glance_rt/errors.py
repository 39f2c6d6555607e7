"""The one exception type users see for bad input."""


class GlanceError(ValueError):
    """Bad input to glance-rt: the message says what was wrong and what to do instead.

    Raised for unsupported architectures, drafters built for another target, prompts that do not
    fit the static cache, image/placeholder mismatches, corrupt or missing checkpoints, and
    out-of-range budgets or block sizes.
    """
