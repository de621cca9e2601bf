"""The megatron-core release the tests run on, read from its metadata: not imported, since a test
may install Transformer Engine before megatron-core is first imported (tests/megatron_release.py
imports it)."""

import importlib.metadata

from packaging.version import Version

INSTALLED = Version(importlib.metadata.version("megatron-core"))
# why a test module of megatron.training skips: "" when this release ships it
NO_MEGATRON_TRAINING = ("" if INSTALLED.release[:2] >= (0, 19) else
                        "megatron.training ships with megatron-core 0.19 on (0.16.1 has megatron/core only)")
