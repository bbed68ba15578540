"""A Python ``Lock`` owner as a contender of the nemesis campaign (tests/test_nemesis.py).

    nemesis_lock.py LOG CID JOB IDENTITY LEASE WAIT FORK KEY=VALUE...

Enters ``with singleflight.Lock(JOB, wait_seconds=WAIT, lease_seconds=LEASE)`` and inside
the block does what nemesis_command.py's ``run`` does (same plan, same ``start``/``end``
lines, with ``held.fence`` as the fence), so the checker covers these owners with the same
intervals and fences as the COMMANDs of pearing-run. The start line names this process:
the block ends at the latest when it dies.

FORK=S (S > 0): fork inside the block; the child leaves it after S s with ``sys.exit(0)``,
which unwinds the ``with`` in the child, while the parent stays in its block for the
plan's hold (the lock must stay the parent's until then).

Exit status: 0, 75 when the wait ran out (Busy), 124 when the lease was lost, else the
error's own code.
"""

from __future__ import annotations

import os
import sys
import time

import nemesis_command

from singleflight import Busy, LeaseLost, Lock
from singleflight.core.errors import PearingError


def main(argv: list[str]) -> int:
    log, cid, job, ident, lease, wait, fork = argv[:7]
    plan = nemesis_command.Plan(argv[7:])
    lock = Lock(job, lease_seconds=float(lease), wait_seconds=float(wait), identity=ident)
    try:
        with lock as held:
            # nemesis_command.run takes its fence where a COMMAND finds it.
            os.environ["PEARING_FENCE"] = str(held.fence)
            child = os.fork() if float(fork) > 0 else -1
            if child == 0:
                time.sleep(float(fork))
                sys.exit(0)  # leaves the block in the child only: the lock is the parent's
            rc = nemesis_command.run(log, cid, plan)
            if child > 0:
                os.waitpid(child, 0)
            return rc
    except Busy as exc:
        return int(exc.exit_code)
    except LeaseLost as exc:
        return int(exc.exit_code)
    except PearingError as exc:
        print(f"nemesis_lock: {exc}", file=sys.stderr)
        return int(exc.exit_code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
