"""The megatron-core release under test, for the tests of bugs that a later release fixed."""

import pytest
from packaging.version import Version

try:
    import megatron.core as _core

    RELEASE = Version(Version(_core.__version__).base_version)
except ImportError:
    RELEASE = None


def fixed_in(release: str, bug: str):
    """Skip a test that shows ``bug`` on releases from ``release`` on, where it is gone;
    tests/test_audit_known.py checks there that the bug's trigger gives no finding."""
    return pytest.mark.skipif(RELEASE is not None and RELEASE >= Version(release),
                              reason=f"fixed in megatron-core {release}: {bug}")
