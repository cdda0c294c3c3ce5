"""Preemption: SIGTERM (Slurm's and Kubernetes' notice) and SIGUSR1 (``sbatch --signal=USR1@90``)
set a flag; the loop finishes the step it is in, all ranks agree, a checkpoint is saved and the
process exits with PREEMPTED_EXIT_CODE so a job script can requeue it."""
from __future__ import annotations

import signal

#: exit status of a run that stopped on SIGTERM/SIGUSR1 after saving a checkpoint
#: (EX_TEMPFAIL from sysexits.h: a temporary failure, try again). slurm/ scripts requeue on it.
PREEMPTED_EXIT_CODE = 75

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionFlag:
    def __init__(self):
        self.signum = None
        self._old = {}

    def install(self) -> "PreemptionFlag":
        for s in SIGNALS:
            self._old[s] = signal.signal(s, self._handler)
        return self

    def _handler(self, signum, frame):
        self.signum = signum

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def uninstall(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}
