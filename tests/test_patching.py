"""The one set-and-restore: every attribute gets back what it held, on exceptions too."""

import types

import pytest

from shardcheck.patching import Patches, patched, patched_attrs


def test_a_patched_attribute_is_restored_when_the_block_raises():
    owner = types.SimpleNamespace(f="original")
    with pytest.raises(RuntimeError), patched(owner, "f", "replacement"):
        assert owner.f == "replacement"
        raise RuntimeError("inside")
    assert owner.f == "original"


def test_a_failing_assignment_restores_the_ones_made_before_it():
    owner = types.SimpleNamespace(a=1)
    frozen = (1, 2)  # a tuple takes no attributes
    with pytest.raises(AttributeError), patched_attrs([(owner, "a", 2), (frozen, "b", 3)]):
        pass
    assert owner.a == 1


def test_an_attribute_that_was_missing_is_deleted_again_and_the_last_set_is_undone_first():
    owner = types.SimpleNamespace(a=1)
    patches = Patches()
    patches.set(owner, "fresh", 1)
    patches.set(owner, "a", 2)
    patches.set(owner, "a", 3)
    assert (owner.fresh, owner.a) == (1, 3)
    patches.restore()
    assert owner.a == 1 and not hasattr(owner, "fresh")
    patches.restore()  # nothing left to put back
    assert owner.a == 1


def test_a_class_gets_back_its_own_entry_as_stored():
    class Step:
        @staticmethod
        def backward(x):
            return x

    with patched(Step, "backward", staticmethod(lambda x: -x)):
        assert Step().backward(2) == -2
    assert isinstance(vars(Step)["backward"], staticmethod) and Step().backward(2) == 2


def test_an_inherited_attribute_is_inherited_again():
    class Base:
        def apply(self):
            return "base"

    class Scaler(Base):
        pass

    with patched(Scaler, "apply", lambda self: "seen"):
        assert Scaler().apply() == "seen"
    assert "apply" not in vars(Scaler) and Scaler().apply() == "base"
