"""Tokens and generations: numbers drawn from the store's clock, and what a copy's generation tells.

Both are ``max(previous + 1, now in µs)`` on the store's clock: a fencing token keeps increasing
after its key's state expired, and a copy's generation tells when the store issued it, which is
how a copy is known stale after its run was forgotten (:func:`issued_before`) and how a copy
issued in a write the store lost is known live (:func:`issued_in_a_lost_write`).
``stores/lua/lib.lua`` has the same functions under the same names.
"""

from __future__ import annotations

import math

from .records import RunRecord

#: The settled generation of a run none of whose copies may run again: a run replaced in line
#: (``on_full="replace"``) or a waiter settled without a generation (a revoke, an operator's
#: release). No copy carries it (the producer's copy carries 0, issued copies a clock count,
#: Dramatiq's duplicate starts -1), so every copy of the run is stale. ``stores/lua/lib.lua``
#: has it as ``NO_COPY_GENERATION``.
NO_COPY_GENERATION = -2


def micros(now: float) -> int:
    """A store time as whole microseconds: the clock part of tokens and generations."""
    return math.floor(now * 1_000_000)


def issued_before(generation: int, moment: float) -> bool:
    """Whether a library copy of ``generation`` was issued before ``moment`` (0: the producer's copy)."""
    return generation != 0 and generation < micros(moment)


def issued_in_a_lost_write(run: RunRecord, generation: int) -> bool:
    """Whether a copy of ``run`` carries a generation the store issued after it recorded the run,
    in a write it no longer has (an asynchronous failover, an evicted Redis): newer than every
    generation the record knows, and issued after the record was created.

    Such a copy is the only one of its run left (its predecessors were acked when it was
    published): dropped as stale, the run would never run. :func:`singleton_tasks.gate.claim` restores
    it as live::

        t0  worker A: claim(r, G1) -> GATED, deferred as G2; the primary writes live [G1, G2]
        t1  worker A publishes the deferred copy G2 and acks G1: G2 is r's only message now
        t2  the primary dies before t0's write reached its replica; the promoted replica has
            r as before t0: generation G1, live [G1]
        t3  worker B: claim(r, G2): G2 is not live, but G2 > r.generation (newer than anything
            the record knows) and G2 >= micros(r.created_at) (issued during this record's
            life): issued in a lost write -> live [G1, G2], and the claim goes on (admit, gate)

    A run settled and sent again has a new record; a copy of its earlier life fails the second
    test and stays stale::

        t0  copy G1 of run r is issued; then r settles: its record is removed
        t1  r is sent again: a new record, created_at t1 (micros(t1) > G1)
        t2  claim(r, G1): G1 > r.generation (0) but G1 < micros(r.created_at) -> STALE
    """
    return generation > run.generation and generation >= micros(run.created_at)


def next_counter(counter: int, now: float) -> int:
    """The next token or generation: above every earlier one, and at least the clock in µs."""
    return max(counter + 1, micros(now))
