from tests.invariants import check_invariants_after_every_step

__all__ = ["check_invariants_after_every_step"]
