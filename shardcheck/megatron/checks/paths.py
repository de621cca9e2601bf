"""Source paths as findings show them."""


def megatron_path(path: str | None) -> str:
    """A path from ``megatron/`` on (site-packages prefixes dropped)."""
    text = path or "<unknown>"
    index = text.rfind("/megatron/")
    return text[index + 1:] if index >= 0 else text
