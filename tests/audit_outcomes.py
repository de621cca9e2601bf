"""How far an audit outcome is from its one-rank reference (shared by the audit tests)."""


def worst_relative(outcome, reference, prefix):
    """The largest error of the outputs named ``prefix...``, relative to the reference's scale."""
    named = [name for name in reference if name.startswith(prefix)]
    assert named, prefix
    return max(outcome.errors[name] / max(float(reference[name].abs().max()), 1e-30) for name in named)
