"""The frames RankBranches keeps (code that branched on the rank): a helper that tests the rank
and returns leaves no frame behind for every op to scan, while a frame still running inside
its branch (or a generator suspended there) keeps its branch. Real frames, real RankNumbers."""

from shardcheck.typecheck.rank_branches import RankBranches, RankNumber


def _is_first(rank: RankNumber) -> bool:
    if rank == 0:
        return True
    return False


def _inside_the_branch(branches: RankBranches, rank: RankNumber, calls: int) -> tuple[int, ...]:
    if rank == 0:
        for _ in range(calls):
            _is_first(rank)  # each call decides again in a new frame, then returns
        return branches.axes_here()
    return ()


def _suspended_in_the_branch(rank: RankNumber):
    if rank == 0:
        yield "inside"
    yield "after"


def _rank(branches: RankBranches) -> RankNumber:
    return RankNumber(0, lambda frame: branches.decided(frame, (1,)), (1,))


def test_returned_helpers_leave_no_frames_and_a_running_frame_keeps_its_branch() -> None:
    branches = RankBranches()
    assert _inside_the_branch(branches, _rank(branches), 10) == (1,)
    assert len(branches.frames) <= 2  # the running frame and the latest helper, not 11 frames


def test_a_suspended_generator_keeps_its_branch() -> None:
    branches = RankBranches()
    rank = _rank(branches)
    generator = _suspended_in_the_branch(rank)
    assert next(generator) == "inside"
    for _ in range(3):
        _is_first(rank)
    assert any(f.f_code is _suspended_in_the_branch.__code__ for f, _ in branches.frames.values())
