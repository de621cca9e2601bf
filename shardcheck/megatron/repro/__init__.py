"""Self-contained torchrun scripts for audit findings: templates, snippets, and the check they run."""
