"""The scheduler faults of `--inject` (debug/faults.py parses them), planted on the driver's scheduler from outside: its
scheduling pass wrapped on the one instance, so that the stall detector (engine/request_story.py) can be shown to name
the request the fault picked.

    sched-strand[:step=S]   from step S on, the oldest waiting request (picked once) is skipped by every scheduling
                            pass although it fits: requests behind it are admitted, it never is
    sched-thrash[:step=S]   from step S on, the oldest running request (picked once) is preempted at the start of
                            every scheduling pass, again and again, until it ends
"""
from __future__ import annotations

import logging

from devharness.fault_spec import FaultSpec

logger = logging.getLogger(__name__)
SCHED_KINDS = ("sched-strand", "sched-thrash")


def install(spec: FaultSpec, scheduler) -> bool:
    """Plant `spec` on `scheduler` if it is a scheduler fault; whether it did."""
    if spec.kind not in SCHED_KINDS:
        return False
    real = scheduler._schedule
    first = spec.step or 1
    picked: list = []   # the request the fault picked, once

    def strand():
        if not picked and scheduler.step_count + 1 >= first and scheduler.waiting:
            picked.append(scheduler.waiting[0])
            logger.warning("planted sched-strand: from step %d the scheduler skips request %s, the oldest waiting",
                           scheduler.step_count + 1, picked[0].req_id)
        req = picked[0] if picked else None
        if req is None or req not in scheduler.waiting:
            return real()
        scheduler.waiting.remove(req)
        try:
            return real()
        finally:
            scheduler.waiting.appendleft(req)

    def thrash():
        if not picked and scheduler.step_count + 1 >= first:
            req = next((r for r in scheduler.running if r.req_id not in scheduler.in_flight), None)
            if req is not None:
                picked.append(req)
                logger.warning("planted sched-thrash: from step %d the scheduler preempts request %s again and again",
                               scheduler.step_count + 1, req.req_id)
        req = picked[0] if picked else None
        if req is not None and req in scheduler.running and req.req_id not in scheduler.in_flight:
            scheduler.running.remove(req)
            scheduler._preempt(req, "planted sched-thrash")
        return real()

    scheduler._schedule = strand if spec.kind == "sched-strand" else thrash
    return True
